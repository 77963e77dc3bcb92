"""One real Prometheus on the lab's host side, scraping every node's agent.

``flannelpy-lab up --prometheus``: each agent of ours serves /metrics on its node's
lab address (``--metrics-addr <underlay address>:9403``), and Debian's ``prometheus``
listens on the host's lab address, scraping every node with the ``node`` label the
ServiceMonitor gives in a cluster. Its rules are those of
``manifests/prometheusrule.yaml``, taken out of the PrometheusRule object into a
plain rules file with the same expressions and two changes so that a lab test sees
an alert fire *and* resolve within seconds, not hours:

- every ``for:`` is shortened to at most :data:`LAB_FOR`;
- every range selector (``[5m]``, ``[1h]``, ...) becomes :data:`LAB_RANGE`, and
  ``increase``/``rate`` over it see the same faults (their thresholds are per second
  or "more than zero") but forget them 30 s after they stop.

Scrapes and rule evaluation run every :data:`INTERVAL`. Files, TSDB and log live in
``<lab dir>/prometheus``; ``down`` stops it with the lab.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
import urllib.error
import urllib.parse
import urllib.request
from ipaddress import IPv4Interface
from typing import Any

import yaml

from flannelpy_lab import procs
from flannelpy_lab.errors import LabError
from flannelpy_lab.state import LabState

STATE_KEY = "prometheus"  # in LabState.extra: {"url", "pid", "start_ticks"}
PORT = 9090
AGENT_METRICS_PORT = 9403
INTERVAL = "2s"  # scrape and evaluation interval
LAB_FOR = "10s"
LAB_RANGE = "30s"
READY_TIMEOUT = 30.0
MANIFEST = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "manifests",
    "prometheusrule.yaml",
)

_RANGE = re.compile(r"\[(\d+[smhdwy])(:\d*[smhdwy]?)?\]")
_DURATION = re.compile(r"^(\d+)([smhdwy])$")
_UNIT_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 604800, "y": 31536000}


def seconds(duration: str) -> int:
    """A Prometheus duration of one unit ("5m") in seconds; ValueError otherwise."""
    match = _DURATION.match(duration.strip())
    if not match:
        raise ValueError(f"duration {duration!r} is not of the form <number><s|m|h|d|w|y>")
    return int(match.group(1)) * _UNIT_SECONDS[match.group(2)]


def lab_expr(expr: str, window: str = LAB_RANGE) -> str:
    """``expr`` with every range selector replaced by ``window`` (subqueries keep their
    resolution)."""
    return _RANGE.sub(lambda m: f"[{window}{m.group(2) or ''}]", expr)


def rules_file(
    manifest: dict[str, Any], for_max: str = LAB_FOR, window: str = LAB_RANGE
) -> dict[str, Any]:
    """The plain rules file (``groups:``) of a PrometheusRule object, shortened for the lab.

    Raises ValueError naming what is wrong when ``manifest`` is not a PrometheusRule."""
    if not isinstance(manifest, dict) or manifest.get("kind") != "PrometheusRule":
        raise ValueError("the manifest is not a PrometheusRule; give manifests/prometheusrule.yaml")
    groups = (manifest.get("spec") or {}).get("groups")
    if not isinstance(groups, list) or not groups:
        raise ValueError("the PrometheusRule has no spec.groups")
    limit = seconds(for_max)
    out = []
    for group in groups:
        rules = []
        for rule in group.get("rules") or []:
            copy = dict(rule)
            copy["expr"] = lab_expr(str(rule["expr"]), window)
            if "for" in copy and seconds(str(copy["for"])) > limit:
                copy["for"] = for_max
            rules.append(copy)
        out.append({"name": group["name"], "interval": INTERVAL, "rules": rules})
    return {"groups": out}


def load_manifest(path: str = MANIFEST) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    if not isinstance(doc, dict):
        raise LabError(f"{path} holds no PrometheusRule; restore it from the repository")
    return doc


def scrape_config(state: LabState, rules_path: str) -> dict[str, Any]:
    """prometheus.yml: one static target per node running our agent, labelled ``node``."""
    static = [
        {"targets": [f"{n.ip}:{AGENT_METRICS_PORT}"], "labels": {"node": n.name}}
        for n in state.nodes
        if not n.runs_flanneld
    ]
    return {
        "global": {
            "scrape_interval": INTERVAL,
            "evaluation_interval": INTERVAL,
            "scrape_timeout": "1s",
        },
        "rule_files": [rules_path],
        "scrape_configs": [{"job_name": "flannelpy", "static_configs": static}],
    }


def metrics_addr(state: LabState, node_ip: str) -> list[str]:
    """The agent flags of a lab with Prometheus: /metrics on the node's lab address."""
    return [f"--metrics-addr={node_ip}:{AGENT_METRICS_PORT}"] if STATE_KEY in state.extra else []


def directory(state: LabState) -> str:
    return os.path.join(state.lab_dir, "prometheus")


def url(state: LabState) -> str | None:
    doc = state.extra.get(STATE_KEY)
    return str(doc["url"]) if doc and doc.get("url") else None


def record(state: LabState) -> None:
    """Mark the lab as one with Prometheus (before agents start: they bind accordingly)."""
    host = IPv4Interface(state.host_address).ip
    state.extra[STATE_KEY] = {"url": f"http://{host}:{PORT}", "pid": None, "start_ticks": None}


def start(state: LabState) -> procs.ProcessRef:
    """Write the config and rules, start Prometheus on the host and wait until it is ready."""
    binary = shutil.which("prometheus")
    if binary is None:
        raise LabError("prometheus is not installed; run scripts/bootstrap.sh")
    if STATE_KEY not in state.extra:
        record(state)
    folder = directory(state)
    os.makedirs(os.path.join(folder, "data"), exist_ok=True)
    rules_path = os.path.join(folder, "rules.yml")
    with open(rules_path, "w", encoding="utf-8") as f:
        yaml.safe_dump(rules_file(load_manifest()), f, sort_keys=False)
    config_path = os.path.join(folder, "prometheus.yml")
    with open(config_path, "w", encoding="utf-8") as f:
        yaml.safe_dump(scrape_config(state, rules_path), f, sort_keys=False)
    address = state.extra[STATE_KEY]["url"].removeprefix("http://")
    argv = [
        binary,
        f"--config.file={config_path}",
        f"--storage.tsdb.path={folder}/data",
        f"--web.listen-address={address}",
        "--storage.tsdb.retention.time=2h",
        "--log.level=warn",
    ]
    ref = procs.spawn_detached(argv, os.path.join(folder, "prometheus.log"))
    state.extra[STATE_KEY].update(pid=ref.pid, start_ticks=ref.start_ticks)
    wait_ready(state, ref)
    return ref


def wait_ready(state: LabState, ref: procs.ProcessRef, timeout: float = READY_TIMEOUT) -> None:
    base = url(state)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.URLError):
            pass
        log = os.path.join(directory(state), "prometheus.log")
        if not procs.alive(ref):
            raise LabError(
                f"prometheus exited at start; last lines of {log}:\n{procs.log_tail(log)}"
            )
        if time.monotonic() > deadline:
            raise LabError(
                f"prometheus did not get ready at {base} within {timeout:g} s; see {log}"
            )
        time.sleep(0.2)


def ref(state: LabState) -> procs.ProcessRef | None:
    doc = state.extra.get(STATE_KEY) or {}
    return procs.ref_of(doc.get("pid"), doc.get("start_ticks"))


def stop(state: LabState) -> None:
    found = ref(state)
    if found is not None:
        procs.stop([found])
    if STATE_KEY in state.extra:
        state.extra[STATE_KEY].update(pid=None, start_ticks=None)


def api(state: LabState, path: str, **params: str) -> Any:
    """GET ``/api/v1/<path>`` and return its ``data``; LabError on an error answer."""
    base = url(state)
    if base is None:
        raise LabError(f"lab {state.name} runs no Prometheus; start it with `up --prometheus`")
    query = f"?{urllib.parse.urlencode(params)}" if params else ""
    try:
        with urllib.request.urlopen(f"{base}/api/v1/{path}{query}", timeout=10) as r:
            doc = json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise LabError(f"prometheus refused {path}: {e.read().decode()[:300]}") from e
    except OSError as e:
        raise LabError(f"prometheus at {base} does not answer ({e}); is it running?") from e
    if doc.get("status") != "success":
        raise LabError(f"prometheus answered {path} with {doc.get('error')}")
    return doc["data"]


def query(state: LabState, expr: str) -> list[dict[str, Any]]:
    """An instant query's vector result."""
    data = api(state, "query", query=expr)
    result: list[dict[str, Any]] = data.get("result", [])
    return result


def alerts(state: LabState) -> list[dict[str, Any]]:
    """Every pending and firing alert (``/api/v1/alerts``)."""
    found: list[dict[str, Any]] = api(state, "alerts").get("alerts", [])
    return found


def targets_up(state: LabState) -> dict[str, bool]:
    """node -> whether its agent's last scrape succeeded."""
    return {
        r["metric"].get("node", "?"): r["value"][1] == "1"
        for r in query(state, 'up{job="flannelpy"}')
    }
