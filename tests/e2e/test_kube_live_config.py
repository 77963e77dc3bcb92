"""Live config in Kubernetes mode against the real control plane (``lab up --kube``).

The network config is the ConfigMap, changed with the real kubectl; the lab's projector
keeps each node's net-conf.json in step as the kubelet keeps a ConfigMap volume (the
``..data`` symlink swap), and the agents follow the file. This node's override is the
Node annotation ``flannelpy.io/override`` (``kubectl annotate``). Blocked and forced
changes are events.k8s.io Events on the Node, written through the ServiceAccount, so the
ClusterRole in manifests/ is what allows them. The etcd-mode twin is
tests/e2e/test_live_config.py.

The tests run in file order on one lab: a change blocked on every node, the same block
again (one Event, its series counts two), a forced override on n2, the policy opened so
the change lands everywhere, then an agent restarted under an override. Each writes the
config it needs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flannelpy_lab import Lab, agents, plan
from flannelpy_lab import kube as control_plane

from flannelpy.store.kube.manager import OVERRIDE_ANNOTATION
from tests.e2e.test_observability import scrape
from tests.support.agent_events import processed_mark, wait_until_processed
from tests.support.lab_util import running_real_kube_lab, wait_until

pytestmark = [pytest.mark.lab, pytest.mark.netns]

PREFIX = "flannel.alpha.coreos.com"
NODES = ("n1", "n2", "n3")
REASON = "incident 4711: vxlan offload bug on n2"
CHANGE = "backend vxlan -> host-gw, MTU 1450 -> 1500"  # no VXLAN header on host-gw
# The agents poll the file every 2 s, the projector watches the ConfigMap: a change
# shows within a few seconds; generous for a loaded CI machine.
REACT = 30


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with running_real_kube_lab() as lab:
        yield lab


@pytest.fixture(autouse=True)
def agent_logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """A failed test prints the tail of every agent's log (pytest shows it)."""
    yield
    report = getattr(request.node, "rep_call", None)
    if report is None or not report.failed or "lab" not in request.fixturenames:
        return
    lab = request.getfixturevalue("lab")
    for node in lab.nodes:
        tail = "".join(agent_log(lab, node.name).splitlines(keepends=True)[-40:])
        print(f"--- last lines of {node.name}'s agent log:\n{tail}")


# --- the ConfigMap, the Node, the Events, with the real kubectl -------------------------


def net_conf(lab: Lab, backend: str, policy: str) -> str:
    doc = json.loads(plan.net_conf_json(lab.state.network, "vxlan", False))
    doc["Backend"] = {"Type": backend}
    doc["DisruptionPolicy"] = {"Mode": policy}
    return json.dumps(doc)


def patch_configmap(lab: Lab, backend: str, policy: str) -> None:
    """``kubectl patch configmap``, as an operator edits net-conf.json; returns once the
    projection shows it (the agents read it from there)."""
    body = {"data": {control_plane.NET_CONF_KEY: net_conf(lab, backend, policy)}}
    lab.kubectl(
        "patch",
        "configmap",
        control_plane.CONFIG_MAP,
        "-n",
        control_plane.NAMESPACE,
        "--type",
        "merge",
        "-p",
        json.dumps(body),
    )
    assert json.loads(lab.sync_kube_net_conf())["Backend"] == {"Type": backend}


def apply_configmap(lab: Lab, backend: str, policy: str) -> None:
    """``kubectl apply`` of the whole ConfigMap, as a GitOps pipeline does."""
    cm = json.loads(
        lab.kubectl(
            "get",
            "configmap",
            control_plane.CONFIG_MAP,
            "-n",
            control_plane.NAMESPACE,
            "-o",
            "json",
        ).stdout
    )
    doc = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": control_plane.CONFIG_MAP, "namespace": control_plane.NAMESPACE},
        "data": {**cm["data"], control_plane.NET_CONF_KEY: net_conf(lab, backend, policy)},
    }
    lab.kubectl("apply", "-f", "-", stdin=json.dumps(doc))
    assert json.loads(lab.sync_kube_net_conf())["Backend"] == {"Type": backend}


def annotate(lab: Lab, node: str, value: str | None) -> None:
    """``kubectl annotate node <node> flannelpy.io/override=<value>`` (None: ``...-``)."""
    arg = f"{OVERRIDE_ANNOTATION}-" if value is None else f"{OVERRIDE_ANNOTATION}={value}"
    lab.kubectl("annotate", "node", node, arg, "--overwrite")


def node_annotation(lab: Lab, node: str, key: str) -> str | None:
    doc = json.loads(lab.kubectl("get", "node", node, "-o", "json").stdout)
    value: str | None = doc["metadata"].get("annotations", {}).get(key)
    return value


def events(lab: Lab, reason: str, node: str | None = None) -> list[dict[str, Any]]:
    """events.k8s.io Events of ``reason`` about a Node (``node``: that one)."""
    items = json.loads(
        lab.kubectl("get", "events.events.k8s.io", "-n", "default", "-o", "json").stdout
    )["items"]
    return [
        e
        for e in items
        if e.get("reason") == reason
        and e["regarding"].get("kind") == "Node"
        and (node is None or e["regarding"].get("name") == node)
    ]


# --- what the agents and the kernel show -------------------------------------------------


def status_json(lab: Lab, node: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(Path(lab.node(node).run_dir, "status.json").read_text())
    return doc


def routes(lab: Lab, node: str) -> dict[str, str]:
    out = lab.exec(node, ["ip", "-j", "route", "show", "proto", "75"]).stdout
    return {r["dst"]: r["dev"] for r in json.loads(out or "[]")}


def vxlan_links(lab: Lab, node: str) -> str:
    return lab.exec(node, ["ip", "-br", "link", "show", "type", "vxlan"]).stdout.strip()


def all_pods_reach_each_other(lab: Lab) -> bool:
    doc = lab.status()
    return bool(doc["ok"] and doc["pod_matrix"])


def blocked_count(lab: Lab, node: str) -> float:
    _, samples = scrape(lab, node)
    key = ("flannelpy_blocked_operations_total", frozenset({("kind", "backend_change")}))
    return samples.get(key, 0.0)


def agent_log(lab: Lab, node: str) -> str:
    return Path(lab.node(node).agent_log).read_text(encoding="utf-8", errors="replace")


def wait_blocked(lab: Lab, node: str) -> dict[str, Any]:
    doc: dict[str, Any] = wait_until(
        lambda: (d := status_json(lab, node))["blocked"] and d,
        REACT,
        what=f"{node} to report the blocked change",
    )
    return doc


# --- the tests ------------------------------------------------------------------------------


def test_the_net_conf_file_is_a_projected_configmap(lab: Lab) -> None:
    path = Path(agents.kube_net_conf_path(lab.state))
    assert path.is_symlink() and str(path.readlink()) == "..data/net-conf.json"
    data = path.parent / "..data"
    assert data.is_symlink() and str(data.readlink()).startswith("..")
    cm = json.loads(
        lab.kubectl(
            "get",
            "configmap",
            control_plane.CONFIG_MAP,
            "-n",
            control_plane.NAMESPACE,
            "-o",
            "json",
        ).stdout
    )
    assert path.read_text() == cm["data"]["net-conf.json"]
    assert (path.parent / "cni-conf.json").read_text() == cm["data"]["cni-conf.json"]


def test_configmap_change_under_block_is_blocked_everywhere_and_shows_in_events(
    lab: Lab,
) -> None:
    assert {status_json(lab, n)["backend"] for n in NODES} == {"vxlan"}
    before = {node: blocked_count(lab, node) for node in NODES}
    routes_before = {node: routes(lab, node) for node in NODES}
    started = time.monotonic()
    patch_configmap(lab, "host-gw", "Block")
    projected = time.monotonic() - started
    for node in NODES:
        (blocked,) = wait_blocked(lab, node)["blocked"]
        assert blocked["change"] == CHANGE, blocked
        assert blocked["sentence"].startswith(
            f"disruptive change ({CHANGE}) blocked by DisruptionPolicy Block; "
        ), blocked
        doc = status_json(lab, node)
        assert doc["backend"] == "vxlan" and doc["vtep"] is True
        assert blocked_count(lab, node) == before[node] + 1
        assert node_annotation(lab, node, f"{PREFIX}/backend-type") == "vxlan"
        (event,) = wait_until(
            lambda n=node: events(lab, "ConfigChangeBlocked", n),
            REACT,
            what=f"the ConfigChangeBlocked Event on {node}",
        )
        assert event["type"] == "Warning" and event["note"] == blocked["sentence"]
        assert event["reportingController"] == "flannelpy"
        assert event["reportingInstance"] == f"flannelpy-{node}"
        assert event["action"] == "BlockConfigChange" and "series" not in event
        assert event["metadata"]["namespace"] == "default"
    print(
        f"kubectl patch to the file: {projected:.2f} s; to every node blocked and its "
        f"Event listed: {time.monotonic() - started:.2f} s"
    )
    assert {node: routes(lab, node) for node in NODES} == routes_before
    assert all(dev == "flannel.1" for node in NODES for dev in routes(lab, node).values())
    assert all_pods_reach_each_other(lab)
    # What an operator sees: `kubectl get events` lists one per Node.
    table = lab.kubectl("get", "events", "-n", "default").stdout
    assert sum("ConfigChangeBlocked" in line for line in table.splitlines()) == 3, table
    for node in NODES:
        assert f"node/{node}" in table, table


def test_the_same_block_again_counts_in_the_event_series(lab: Lab) -> None:
    patch_configmap(lab, "host-gw", "Block")  # as the previous test left it
    for node in NODES:
        wait_blocked(lab, node)
    patch_configmap(lab, "vxlan", "Block")  # what the nodes run: nothing blocked
    for node in NODES:
        wait_until(
            lambda n=node: status_json(lab, n)["blocked"] == [],
            REACT,
            what=f"{node} to drop the blocked change",
        )
    patch_configmap(lab, "host-gw", "Block")
    for node in NODES:
        wait_blocked(lab, node)
        # Still one Event per Node; its series counts both occurrences.
        (event,) = wait_until(
            lambda n=node: [
                e
                for e in events(lab, "ConfigChangeBlocked", n)
                if (e.get("series") or {}).get("count") == 2
            ],
            REACT,
            what=f"{node}'s Event series to count 2",
        )
        assert event["series"]["lastObservedTime"] >= event["eventTime"]
        assert len(events(lab, "ConfigChangeBlocked", node)) == 1
    assert all(dev == "flannel.1" for node in NODES for dev in routes(lab, node).values())


def test_forced_override_switches_one_node_and_leaves_an_event(lab: Lab) -> None:
    patch_configmap(lab, "host-gw", "Block")
    override = {
        "Backend": {"Type": "host-gw"},
        "Generation": 1,
        "Force": {"Reason": REASON, "By": "tester@lab", "At": "2026-11-30T00:00:00Z"},
    }
    annotate(lab, "n2", json.dumps(override))
    doc = wait_until(
        lambda: (d := status_json(lab, "n2"))["applied_generation"] == 1 and d,
        REACT,
        what="n2 to apply the forced override",
    )
    assert doc["backend"] == "host-gw" and doc["blocked"] == []
    wait_until(
        lambda: node_annotation(lab, "n2", f"{PREFIX}/backend-type") == "host-gw",
        10,
        what="n2's Node to advertise host-gw",
    )
    (event,) = wait_until(
        lambda: events(lab, "OverrideForced", "n2"), REACT, what="the OverrideForced Event on n2"
    )
    assert event["type"] == "Warning" and event["action"] == "ApplyConfigChange"
    assert REASON in event["note"] and "vxlan -> host-gw" in event["note"]
    assert "tester@lab" in event["note"]
    log = agent_log(lab, "n2")
    assert "disruptive change forced past the disruption policy" in log and REASON in log
    assert "could not record" not in log
    # n1 and n3 stay blocked on vxlan and reach n2 directly on the shared segment.
    n2_cidr = json.loads(lab.kubectl("get", "node", "n2", "-o", "json").stdout)["spec"]["podCIDR"]
    for node in ("n1", "n3"):
        peer = status_json(lab, node)
        assert peer["backend"] == "vxlan" and peer["blocked"], peer
        wait_until(
            lambda n=node: routes(lab, n).get(n2_cidr) == "eth0",
            10,
            what=f"{node}'s route to n2 to go direct",
        )
        assert not events(lab, "OverrideForced", node)
    assert set(routes(lab, "n2").values()) == {"eth0"}
    assert all_pods_reach_each_other(lab)


def test_policy_allow_applies_the_change_everywhere(lab: Lab) -> None:
    patch_configmap(lab, "host-gw", "Block")
    for node in ("n1", "n3"):
        wait_blocked(lab, node)
    forced = len(events(lab, "OverrideForced"))
    started = time.monotonic()
    apply_configmap(lab, "host-gw", "Allow")
    for node in NODES:
        wait_until(
            lambda n=node: status_json(lab, n)["backend"] == "host-gw",
            REACT,
            what=f"{node} on host-gw",
        )
        wait_until(
            lambda n=node: node_annotation(lab, n, f"{PREFIX}/backend-type") == "host-gw",
            10,
            what=f"{node}'s Node to advertise host-gw",
        )
    # In effect on the kernel: no VTEP left, every peer route direct on the underlay.
    for node in NODES:
        wait_until(lambda n=node: not vxlan_links(lab, n), REACT, what=f"{node}'s VTEP to go")
        doc = status_json(lab, node)
        assert doc["blocked"] == [] and doc["vtep"] is False, doc
        assert routes(lab, node) and set(routes(lab, node).values()) == {"eth0"}
        assert node_annotation(lab, node, f"{PREFIX}/backend-data") == "null"
    wait_until(lambda: all_pods_reach_each_other(lab), 15, what="every pod pair on host-gw")
    print(
        f"kubectl apply to every node on host-gw, VTEPs gone and every pod pair "
        f"reaching: {time.monotonic() - started:.2f} s"
    )
    for a in NODES:
        for b in NODES:
            if a != b:
                assert lab.ping(a, b, attempts=3), (a, b)
    assert len(events(lab, "OverrideForced")) == forced  # an allowed change is no override

    annotate(lab, "n2", None)  # back to the config's Backend: host-gw, nothing to do
    wait_until(
        lambda: status_json(lab, "n2")["applied_generation"] is None,
        REACT,
        what="n2 to drop the removed override",
    )
    assert status_json(lab, "n2")["backend"] == "host-gw"
    assert len(events(lab, "OverrideForced")) == forced


def test_restart_keeps_the_backend_the_annotation_asks_for(lab: Lab) -> None:
    """The override on the Node at start-up counts from the first decision: an agent
    must not fall back to the config's Backend until its node watch happens to send it
    a MODIFIED event of its own Node."""
    patch_configmap(lab, "host-gw", "Allow")
    annotate(lab, "n2", json.dumps({"Backend": {"Type": "vxlan"}, "Generation": 2}))
    wait_until(
        lambda: (
            (d := status_json(lab, "n2"))["applied_generation"] == 2 and d["backend"] == "vxlan"
        ),
        REACT,
        what="n2 to apply the override",
    )
    lab.kill_agent("n2")
    log_size = len(agent_log(lab, "n2"))
    restarted_at = time.time()
    lab.start_agent("n2")
    lab.wait_ready("n2")
    n2 = lab.node("n2")
    # The new agent's first decision is made and acted on, and its timers ran after it:
    # a wrong first decision would show by now.
    doc = wait_until_processed(n2, "control", after=0, timeout=REACT, since=restarted_at)
    assert doc["applied_generation"] == 2, doc
    wait_until_processed(n2, "tick", after=processed_mark(n2, "tick"), timeout=REACT)
    since_restart = agent_log(lab, "n2")[log_size:]
    assert "backend changed" not in since_restart, since_restart
    assert status_json(lab, "n2")["backend"] == "vxlan"
    assert node_annotation(lab, "n2", f"{PREFIX}/backend-type") == "vxlan"
    wait_until(lambda: all_pods_reach_each_other(lab), 15, what="every pod pair")
