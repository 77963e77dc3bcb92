"""Helpers for end-to-end tests on the netns lab.

``running_lab`` brings a lab up under a unique name and always tears it down;
``host_snapshot`` + ``lab_residue`` check that teardown left nothing of a lab
on the host (other tests may run at the same time, so only entries that carry
the lab's names count). ``wait_until`` is :func:`tests.support.waiting.wait_until`
polling at the lab's pace.
"""

from __future__ import annotations

import ipaddress
import json
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import pytest
from flannelpy_lab import Lab
from flannelpy_lab.state import NodeInfo

from tests.support import waiting


def converged_status(
    lab: Lab, keys: tuple[str, ...] = ("matrix", "pod_matrix"), timeout: float = 30.0
) -> dict[str, Any]:
    """``lab.status()`` once every matrix in ``keys`` is present and all-reaching: agents come
    up side by side, so a node may see the last peer's lease a moment after it is ready.
    Fails with the last matrices if they do not converge in ``timeout`` seconds."""
    from flannelpy_lab import status

    last: dict[str, Any] = {}

    def converged() -> bool:
        nonlocal last
        last = lab.status()
        return all(last.get(k) and status.all_reach(last[k]) for k in keys)

    try:
        wait_until(converged, timeout=timeout, interval=1.0, what="every pair reaching")
    except AssertionError as e:
        matrices = {k: last.get(k) for k in keys}
        raise AssertionError(f"{e}: {matrices}\n{node_dataplanes(lab)}") from None
    return last


def node_dataplanes(lab: Lab, log_lines: int = 15) -> str:
    """Each node's routes, neighbours, FDB, addresses and the end of its agent's log: what
    a failed reachability assertion needs beside the matrix."""
    commands = (
        ["ip", "route"],
        ["ip", "-6", "route"],
        ["ip", "neigh"],
        ["bridge", "fdb", "show"],
        ["ip", "addr"],
    )
    out = []
    for node in lab.nodes:
        out.append(f"--- {node.name} ({node.agent_kind})")
        for argv in commands:
            proc = lab.exec(node.name, argv, check=False)
            out.append(f"$ {' '.join(argv)}\n{proc.stdout.strip()}")
        try:
            out.append("$ agent log\n" + agent_log_tail(node, log_lines))
        except OSError as e:
            out.append(f"$ agent log: {e}")
    return "\n".join(out)


def agent_log_tail(node: NodeInfo, lines: int) -> str:
    """The last ``lines`` lines of a lab node's agent log."""
    with open(node.agent_log, encoding="utf-8", errors="replace") as f:
        return "".join(f.readlines()[-lines:])


def segment_ip(lab: Lab, host: int, segment: int = 1) -> str:
    """Host number ``host`` of the lab's underlay segment (a machine on the nodes' link that
    is not a lab node): labs side by side get different segments, so never hard-code one."""
    subnet = ipaddress.IPv4Network(lab.state.segments[segment - 1].subnet)
    return str(subnet.network_address + host)


def backlog_drops() -> int:
    """Packets the kernel has dropped, machine-wide, for a full per-CPU input backlog
    (``/proc/net/softnet_stat``, second column, summed over CPUs). A veth's packet waits
    there for a softirq; with four labs on two cores the softirq waits for CPU, and past
    ``net.core.netdev_max_backlog`` packets arriving are dropped, whoever sent them. A
    loss test reports the count taken over its traffic, so a failure tells the machine's
    drops from the data plane's."""
    with open("/proc/net/softnet_stat") as f:
        return sum(int(line.split()[1], 16) for line in f if line.strip())


def unique_lab_name(prefix: str | None = None) -> str:
    """A lab name (``[a-z0-9]{1,6}``) unlikely to clash with a parallel run: ``prefix``,
    else ``$FLANNELPY_LAB_PREFIX`` (people sharing a machine tell their labs apart by it),
    else "t"; then random hex."""
    return ((prefix or os.environ.get("FLANNELPY_LAB_PREFIX", "t")) + secrets.token_hex(3))[:6]


@contextmanager
def running_lab(nodes: int = 3, backend: str = "vxlan", **kwargs: Any) -> Iterator[Lab]:
    """``Lab.up(...)`` under a unique name (or ``name=``); ``down`` on exit, whatever happens.

    ``Lab.up`` removes a lab it could not finish itself, so only a lab that
    came up needs the ``finally``.
    """
    name = kwargs.pop("name", None) or unique_lab_name()
    lab = Lab.up(name, nodes, backend, **kwargs)
    try:
        yield lab
    finally:
        lab.down()


@contextmanager
def running_dual_stack_lab(
    nodes: int, agent_args: Sequence[str], pods_per_node: int, **kwargs: Any
) -> Iterator[Lab]:
    """A dual-stack vxlan lab whose agents run with ``agent_args``, with ``pods_per_node``
    pods on each node (``kwargs``: :func:`running_lab`'s)."""
    from flannelpy_lab import plan

    extra = plan.ip_family_net_conf("dual")
    with running_lab(nodes, "vxlan", start_agents=False, net_conf_extra=extra, **kwargs) as lab:
        lab.set_agent_args(list(agent_args))
        lab.start_agents()
        for node in lab.nodes:
            for _ in range(pods_per_node):
                lab.add_pod(node.name)
        yield lab


@contextmanager
def running_mixed_lab(backend: str = "vxlan", **kwargs: Any) -> Iterator[Lab]:
    """A 4-node lab whose last two nodes run the real flanneld and flannel CNI plugin (n1, n2
    ours; n3, n4 theirs).

    Fails, never skips, when either was not built: the bootstrap builds them.
    """
    from flannelpy_lab import flanneld
    from flannelpy_lab.errors import LabError

    try:
        flanneld.binary()
        flanneld.cni_plugin_binary()
    except LabError as e:
        pytest.fail(f"the real flanneld and flannel CNI plugin are needed: {e}")
    with running_lab(4, backend, flanneld_nodes=2, **kwargs) as lab:
        assert [n.agent_kind for n in lab.nodes] == ["flannelpy"] * 2 + ["flanneld"] * 2
        yield lab


@contextmanager
def running_real_kube_lab(nodes: int = 3, **kwargs: Any) -> Iterator[Lab]:
    """A vxlan lab in Kubernetes mode against the real control plane (``lab up --kube``:
    kube-apiserver, kube-controller-manager's node IPAM, manifests/ applied), agents
    ready and one pod per node; down on exit. Fails, never skips, when the control plane
    was not built: Lab.up names scripts/build-kube.sh."""
    with running_lab(nodes, "vxlan", kube=True, **kwargs) as lab:
        lab.install_cni()
        for node in lab.nodes:
            lab.add_pod(node.name)
        yield lab


def lab_run_args(lab: str, *command: str, node: str | None = None) -> list[str]:
    """The arguments of ``flannelpy-lab run LAB [--node NODE] -- flannelpy COMMAND...``
    (for ``flannelpy_lab.cli.main``): a flannelpy command with the lab's store settings;
    with ``node``, in its namespace with its agent's settings."""
    where = ["--node", node] if node else []
    return ["run", lab, *where, "--", sys.executable, "-m", "flannelpy", *command]


def lab_run_argv(lab: str, *command: str, node: str | None = None) -> list[str]:
    """:func:`lab_run_args` as a command line to run."""
    return [sys.executable, "-m", "flannelpy_lab", *lab_run_args(lab, *command, node=node)]


# Lab probes mostly run commands in the nodes' namespaces: poll them less often than
# in-process conditions, so waiting does not load the cores the agents run on.
LAB_POLL_INTERVAL = 0.2
wait_until = partial(waiting.wait_until, interval=LAB_POLL_INTERVAL)


@dataclass(frozen=True)
class HostSnapshot:
    """What a lab may add to the host: namespaces, links, routes, processes."""

    namespaces: frozenset[str]
    links: frozenset[str]
    routes: frozenset[str]
    processes: frozenset[str]  # "pid cmdline" of live processes


def _ip_json(*args: str) -> list[dict[str, Any]]:
    out = subprocess.run(["ip", "-j", *args], capture_output=True, text=True, check=True).stdout
    return list(json.loads(out or "[]"))


def _live_processes() -> frozenset[str]:
    found = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
        found.add(f"{pid} {cmdline}")
    return frozenset(found)


def host_snapshot() -> HostSnapshot:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return HostSnapshot(
        namespaces=frozenset(line.split()[0] for line in netns.stdout.splitlines() if line),
        links=frozenset(link["ifname"] for link in _ip_json("link", "show")),
        routes=frozenset(
            json.dumps(r, sort_keys=True) for r in _ip_json("-4", "route", "show", "table", "all")
        ),
        processes=_live_processes(),
    )


def lab_markers(name: str) -> tuple[str, ...]:
    """Strings that only the lab ``name`` puts into names, routes and command lines."""
    return (f"fpl-{name}-", f"fpl{name}h", f"/flannelpy-lab/{name}/", f"fpl-{name}=")


def lab_residue(before: HostSnapshot, after: HostSnapshot, name: str) -> list[str]:
    """Entries new since ``before`` that belong to the lab ``name`` (empty after a clean down)."""
    markers = lab_markers(name)
    residue = []
    for kind in ("namespaces", "links", "routes", "processes"):
        new = getattr(after, kind) - getattr(before, kind)
        residue += [f"{kind}: {item}" for item in sorted(new) if any(m in item for m in markers)]
    return residue


def print_agent_logs_if_failed(request: pytest.FixtureRequest, lab: Lab, lines: int = 30) -> None:
    """For a fixture's teardown: when the test's call failed, print the last ``lines``
    of every node's agent log (pytest shows them with the failure)."""
    report = getattr(request.node, "rep_call", None)
    if report is None or not report.failed:
        return
    for node in lab.nodes:
        tail = agent_log_tail(node, lines)
        print(f"--- {node.name} ({node.agent_kind}) {node.agent_log}:\n{tail}")


def nodes_json(lab: Lab) -> dict[str, dict[str, Any]]:
    """A Kubernetes-mode lab's Node objects by name, as the real kubectl returns them."""
    items = json.loads(lab.kubectl("get", "nodes", "-o", "json").stdout)["items"]
    return {n["metadata"]["name"]: n for n in items}
