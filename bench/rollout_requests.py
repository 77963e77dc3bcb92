"""What a backend rollout costs the API server when the cluster is large.

    python -m bench.rollout_requests [--nodes 1000] [--idle-seconds 30] [--before TREE]

A 3-node ``--kube`` lab (the real kube-apiserver; vxlan, agents probing every second as
``tests/e2e/test_kube_rollout.py`` runs them), plus ``--nodes`` Node objects created as
``bench.kube_scale`` creates them (a podCIDR from the lab network, no kubelet), but
without Flannel's annotations: Nodes whose agent has not started, so the agents route
nothing to them and the rollout has nothing to do with them, except that they are in
every list of Nodes. Then, reading the API server's own ``/metrics`` before and after
each window (``apiserver_request_total`` by verb and resource, ``apiserver_response_sizes``
summed, the server's ``process_cpu_seconds_total``):

* **idle**: ``--idle-seconds`` with no rollout (the agents' own requests);
* **per driver**: ``flannelpy rollout start --backend host-gw``, then back to vxlan, as an
  operator runs it (the admin kubeconfig, from the host): **rollouts**, each from the
  driver's start until it exits, and **steps**, from the driver's "rollout ... started"
  (its plan read) until it exits: what its looks cost while it waits for each node.
  ``--before TREE`` names a source tree (a ``git worktree`` of the commit to compare
  with) whose ``flannelpy`` package drives the first pair of rollouts; this tree drives
  the second, on the same lab and Nodes.

Requests per second are over each window's wall time; watches count when they end (the
server's metric), so a driver's own watches show once it exits. The fake Nodes' public
IPs (from 172.16.0.1) are never sent to: lab nodes have no default route.
"""

from __future__ import annotations

import argparse
import functools
import os
import re
import resource
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flannelpy_lab import Lab
from flannelpy_lab import kube as control_plane

from bench.common import fake_peers, lacks_root, say, table
from bench.kube_scale import NETWORK, Api, fake_name, free_subnets
from bench.propagation import LAB_TIMEOUT

REPO = Path(__file__).resolve().parents[1]
AGENT_ARGS = ["--probe-interval", "1", "--status-publish-interval", "2"]
BACKENDS = ("host-gw", "vxlan")  # there and back
ROLLOUT_TIMEOUT = 600.0
SETTLE = 10.0

Key = tuple[str, str]  # (verb, resource[/subresource])
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class Scrape:
    at: float  # monotonic
    requests: Mapping[Key, float]
    response_bytes: Mapping[Key, float]
    cpu: float  # the API server's process CPU seconds


def parse_metrics(text: str, at: float) -> Scrape:
    """The counters this bench reads from the API server's Prometheus text."""
    requests: dict[Key, float] = {}
    sizes: dict[Key, float] = {}
    cpu = 0.0
    for line in text.splitlines():
        found = _SAMPLE.match(line)
        if not found:
            continue
        name, raw_labels, value = found.groups()
        if name == "process_cpu_seconds_total":
            cpu = float(value)
            continue
        if name not in ("apiserver_request_total", "apiserver_response_sizes_sum"):
            continue
        labels = dict(_LABEL.findall(raw_labels or ""))
        resource_name = labels.get("resource", "")
        if labels.get("subresource"):
            resource_name += "/" + labels["subresource"]
        key = (labels.get("verb", ""), resource_name)
        into = requests if name == "apiserver_request_total" else sizes
        into[key] = into.get(key, 0.0) + float(value)
    return Scrape(at, requests, sizes, cpu)


@dataclass
class Window:
    label: str
    seconds: float = 0.0
    requests: dict[Key, float] = field(default_factory=dict)  # counts in the window
    response_bytes: float = 0.0
    server_cpu: float = 0.0
    driver_cpu: float = 0.0
    rollouts: list[float] = field(default_factory=list)  # seconds each

    def add(self, before: Scrape, after: Scrape) -> None:
        self.seconds += after.at - before.at
        for key, count in after.requests.items():
            delta = count - before.requests.get(key, 0.0)
            if delta > 0:
                self.requests[key] = self.requests.get(key, 0.0) + delta
        self.response_bytes += sum(after.response_bytes.values()) - sum(
            before.response_bytes.values()
        )
        self.server_cpu += after.cpu - before.cpu

    def rate(self, key: Key) -> float:
        return self.requests.get(key, 0.0) / self.seconds if self.seconds else 0.0


class Metrics:
    def __init__(self, api: Api) -> None:
        self.api = api

    def scrape(self) -> Scrape:
        return parse_metrics(self.api.get_text("/metrics"), time.monotonic())


def plain_node(subnet: str, public_ip: str, name: str) -> dict[str, Any]:
    """A Node as its kubelet registers it, its podCIDR allocated, no agent yet."""
    doc = control_plane.node_manifest(name, public_ip)
    doc["spec"] = {"podCIDR": subnet, "podCIDRs": [subnet]}
    return doc


def rollout(
    lab: Lab, tree: Path, backend: str, on_started: Callable[[], None]
) -> tuple[float, float]:
    """Drive one rollout to ``backend`` with ``tree``'s flannelpy, calling ``on_started``
    when the driver says the rollout started (its plan read, the steps begin);
    (seconds, the driver's CPU)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLANNELD_")}
    env.update(
        PYTHONPATH=str(tree),
        FLANNELD_KUBE_SUBNET_MGR="true",
        FLANNELD_KUBECONFIG_FILE=control_plane.admin_kubeconfig(lab.state),
    )
    usage0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "flannelpy", "rollout", "start", "--backend", backend],
        cwd=tree,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    watchdog = threading.Timer(ROLLOUT_TIMEOUT, proc.kill)
    watchdog.start()
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("rollout ") and line.rstrip().endswith(" started"):
                on_started()
        proc.wait()
    finally:
        watchdog.cancel()
    took = time.monotonic() - t0
    usage1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0 or not lines or "done" not in lines[-1]:
        raise SystemExit(f"rollout to {backend} failed:\n{''.join(lines)}")
    cpu = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    return took, cpu


def take(metrics: Metrics, into: list[Scrape]) -> None:
    into.append(metrics.scrape())


def measure(
    lab: Lab,
    metrics: Metrics,
    drivers: Sequence[tuple[str, Path]],
    idle: float,
    say: Callable[[str], None],
) -> list[Window]:
    """The idle window, then per driver its rollouts whole and their steps alone (from
    the driver's "started" to its exit: what every look while waiting costs)."""
    windows = [Window("idle (agents only)")]
    say(f"idle for {idle:g} s")
    first = metrics.scrape()
    time.sleep(idle)
    windows[0].add(first, metrics.scrape())
    for label, tree in drivers:
        whole, steps = Window(f"{label}: rollouts"), Window(f"{label}: steps")
        for backend in BACKENDS:
            say(f"{label}: rollout to {backend}")
            scrapes = [metrics.scrape()]
            took, cpu = rollout(lab, tree, backend, functools.partial(take, metrics, scrapes))
            time.sleep(1.0)  # the driver's watches end with it: let the server count them
            last = metrics.scrape()
            whole.add(scrapes[0], last)
            steps.add(scrapes[-1], last)
            whole.rollouts.append(took)
            whole.driver_cpu += cpu
            say(f"{label}: rollout to {backend} done in {took:.1f} s")
        windows += [whole, steps]
    return windows


def run(
    name: str,
    nodes: int,
    idle: float,
    drivers: Sequence[tuple[str, Path]],
    say: Callable[[str], None],
) -> tuple[list[Window], int]:
    say(f"bringing up lab {name}: 3 nodes, Kubernetes mode, {NETWORK}")
    lab = Lab.up(
        name, 3, "vxlan", network=NETWORK, kube=True, start_agents=False,
        timeout=LAB_TIMEOUT, progress=say,
    )  # fmt: skip
    try:
        lab.set_agent_args(AGENT_ARGS)
        lab.start_agents()
        api = Api(lab)
        try:
            say(f"creating {nodes} Nodes")
            for peer in fake_peers(nodes, free_subnets(lab, nodes)):
                doc = plain_node(str(peer.subnet), str(peer.public_ip), fake_name(peer))
                api.send("POST", "/api/v1/nodes", doc, "application/json")
            time.sleep(SETTLE)
            listed = api.get_text("/api/v1/nodes")
            return measure(lab, Metrics(api), drivers, idle, say), len(listed.encode())
        finally:
            api.close()
    finally:
        lab.down()


def report(windows: Sequence[Window], nodes: int, list_bytes: int) -> str:
    keys = sorted({k for w in windows for k in w.requests}, key=lambda k: (k[1], k[0]))
    rows: list[list[object]] = []
    for key in keys:
        rates = [w.rate(key) for w in windows]
        if max(rates) >= 0.005:
            rows.append([f"{key[0]} {key[1]}", *(f"{r:.2f}" for r in rates)])
    rows.append(["all requests", *(f"{sum(w.requests.values()) / w.seconds:.2f}" for w in windows)])
    rows.append(
        ["response bytes per second", *(f"{w.response_bytes / w.seconds:,.0f}" for w in windows)]
    )
    rows.append(["API server CPU (s per s)", *(f"{w.server_cpu / w.seconds:.3f}" for w in windows)])
    rows.append(
        [
            "driver CPU (s, both rollouts)",
            "",
            *(f"{w.driver_cpu:.1f}" if w.rollouts else "" for w in windows[1:]),
        ]
    )
    rows.append(
        ["rollouts (s)", "", *(" + ".join(f"{s:.0f}" for s in w.rollouts) for w in windows[1:])]
    )
    return "\n".join([
        f"requests per second at the API server, {nodes} fake Nodes + 3 lab nodes "
        f"(a list of every Node: {list_bytes / 1e6:.2f} MB)",
        table(["", *(w.label for w in windows)], rows),
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.rollout_requests",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nodes", type=int, default=1000, help="fake Node objects created")
    parser.add_argument("--idle-seconds", type=float, default=30.0)
    parser.add_argument("--before", type=Path, help="a source tree whose driver runs first")
    parser.add_argument("--name", default="rq" + secrets.token_hex(2), help="the lab's name")
    args = parser.parse_args(argv)
    if lacks_root("bench.rollout_requests"):
        return 2
    if not 1 <= args.nodes <= 8000:
        print("--nodes must be between 1 and 8000", file=sys.stderr)
        return 2
    drivers = [("this tree", REPO)]
    if args.before is not None:
        if not (args.before / "flannelpy" / "rollout" / "driver.py").is_file():
            print(f"--before {args.before}: no flannelpy source tree there", file=sys.stderr)
            return 2
        drivers.insert(0, (f"before ({args.before.name})", args.before.resolve()))
    try:
        windows, list_bytes = run(args.name, args.nodes, args.idle_seconds, drivers, say)
    except KeyboardInterrupt:  # the lab is gone already
        return 130
    print(report(windows, args.nodes, list_bytes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
