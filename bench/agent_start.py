"""Agent start-to-ready with many peers, side by side with ``ip -batch`` in the same run.

    python -m bench.agent_start --peers 1000 5000 [--repeat 3]

For each peer count N:

* **ours**: a 1-node netns lab whose etcd holds N fake vxlan peer leases; the
  node's agent is started and timed from spawn until it writes a fresh
  subnet.env (it does so only after its first full reconcile, see agent.py).
  The kernel is then checked: exactly N routes of protocol 75, N permanent
  neighbours and N FDB entries on flannel.1. The agent is stopped and started
  again with all N entries in place (a restart that finds nothing to do).
  Between repeats flannel.1 is deleted, which removes every entry through it.
* **reference**: in a throwaway namespace with a veth underlay and a vxlan
  device made by ``ip link add ... type vxlan``, the same entries are
  programmed by ``ip -batch`` (N neighbours, N onlink routes) and
  ``bridge -batch`` (N FDB entries), process start included.

Reference and ours alternate within each repeat so both see the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from ipaddress import IPv4Network

from flannelpy_lab import Lab, agents

from bench.common import (
    FakePeer,
    fake_peers,
    first_line_with,
    log_field,
    log_time,
    median,
    put_peers,
    ratio,
    table,
)
from flannelpy.dataplane.state import ROUTE_PROTOCOL
from flannelpy.store.etcd.client import EtcdStore
from flannelpy.store.etcd.config import put_network_config

NETWORK = IPv4Network("10.0.0.0/8")
NET_CONF = '{"Network":"10.0.0.0/8","SubnetLen":24,"Backend":{"Type":"vxlan"}}'
PEER_SUBNETS_FROM = IPv4Network("10.1.0.0/16")  # fake peers take /24s from here on
DEVICE = "flannel.1"
READY_POLL = 0.002  # seconds between subnet.env checks: finer than the lab's 0.1 s
READY_TIMEOUT = 120.0
REF_UNDERLAY = "198.18.0.1/24"  # RFC 2544 benchmarking range, only inside the throwaway netns
REF_GATEWAY = "198.18.0.254"  # the node's default route: an address nothing holds
FAKE_PEERS_RANGE = "172.16.0.0/12"  # bench.common.FAKE_PUBLIC_BASE and the peers after it


# --- the reference: ip -batch / bridge -batch --------------------------------------------


def reference_batches(peers: Sequence[FakePeer]) -> tuple[str, str]:
    """The ``ip -batch`` and ``bridge -batch`` input for the per-peer entries, as vxlan.py orders
    them (neighbour, FDB, route; the FDB goes in its own batch)."""
    ip_lines = [
        f"neigh replace {p.vtep_ip} lladdr {p.vtep_mac} dev {DEVICE} nud permanent" for p in peers
    ]
    ip_lines += [
        f"route replace {p.subnet} via {p.vtep_ip} dev {DEVICE} onlink proto {ROUTE_PROTOCOL}"
        for p in peers
    ]
    fdb_lines = [
        f"fdb append {p.vtep_mac} dev {DEVICE} dst {p.public_ip} self permanent" for p in peers
    ]
    return "\n".join(ip_lines) + "\n", "\n".join(fdb_lines) + "\n"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextmanager
def reference_netns() -> Iterator[str]:
    """A namespace with a veth underlay (both ends inside it) and a default route through
    it; removed on exit."""
    ns = f"fpbref{os.getpid()}{secrets.token_hex(2)}"
    _ip("netns", "add", ns)
    try:
        _ip("-n", ns, "link", "add", "ul0", "type", "veth", "peer", "name", "ul1")
        _ip("-n", ns, "addr", "add", REF_UNDERLAY, "dev", "ul0")
        for dev in ("lo", "ul0", "ul1"):
            _ip("-n", ns, "link", "set", dev, "up")
        # A node has a default route; the agent checks a new peer's route against the
        # routing table with a lookup that finds it. The fake peers' addresses stay
        # unrouted, as before (nothing is sent to them).
        _ip("-n", ns, "route", "add", "default", "via", REF_GATEWAY, "dev", "ul0")
        _ip("-n", ns, "route", "add", "unreachable", FAKE_PEERS_RANGE)
        yield ns
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


def reference_vxlan(ns: str) -> None:
    """(Re-)create flannel.1 as an operator would, which drops every entry through it."""
    subprocess.run(["ip", "-n", ns, "link", "del", DEVICE], check=False, capture_output=True)
    local = REF_UNDERLAY.split("/")[0]
    _ip(
        "-n",
        ns,
        "link",
        "add",
        DEVICE,
        "type",
        "vxlan",
        "id",
        "1",
        "local",
        local,
        "dev",
        "ul0",
        "dstport",
        "8472",
        "nolearning",
    )
    _ip("-n", ns, "link", "set", DEVICE, "up")


def time_reference(ns: str, ip_batch: str, fdb_batch: str) -> float:
    """Seconds for ``ip -batch`` plus ``bridge -batch`` on a fresh flannel.1."""
    reference_vxlan(ns)
    with tempfile.TemporaryDirectory(prefix="fpbench") as tmp:
        ip_file, fdb_file = os.path.join(tmp, "ip.batch"), os.path.join(tmp, "fdb.batch")
        with open(ip_file, "w") as f:
            f.write(ip_batch)
        with open(fdb_file, "w") as f:
            f.write(fdb_batch)
        started = time.monotonic()
        subprocess.run(["ip", "-n", ns, "-batch", ip_file], check=True, capture_output=True)
        subprocess.run(["bridge", "-n", ns, "-batch", fdb_file], check=True, capture_output=True)
        return time.monotonic() - started


# --- kernel checks (both sides) -----------------------------------------------------------


def _json_lines(ns: str, argv: list[str]) -> list[dict[str, object]]:
    out = subprocess.run(
        [argv[0], "-n", ns, "-j", *argv[1:]], check=True, capture_output=True, text=True
    ).stdout
    return list(json.loads(out or "[]"))


def kernel_counts(ns: str) -> tuple[int, int, int]:
    """(routes of protocol 75, permanent neighbours on flannel.1, FDB entries with a dst on it)."""
    routes = _json_lines(ns, ["ip", "-4", "route", "show", "proto", str(ROUTE_PROTOCOL)])
    neigh = _json_lines(ns, ["ip", "-4", "neigh", "show", "dev", DEVICE, "nud", "permanent"])
    fdb = [e for e in _json_lines(ns, ["bridge", "fdb", "show", "dev", DEVICE]) if "dst" in e]
    return len(routes), len(neigh), len(fdb)


def check_counts(where: str, ns: str, n: int, routes_expected: int | None = None) -> None:
    routes, neigh, fdb = kernel_counts(ns)
    want = (n if routes_expected is None else routes_expected, n, n)
    if (routes, neigh, fdb) != want:
        raise SystemExit(
            f"{where}: expected routes/neighbours/FDB = {want}, found {(routes, neigh, fdb)}"
        )


# --- ours: the agent in a lab ---------------------------------------------------------


@dataclass
class AgentRun:
    start_to_ready: float  # spawn → fresh subnet.env
    program_seconds: float  # the start reconcile, from the agent's "agent ready" line
    rss_kib: int
    log_marks: dict[str, float] = field(default_factory=dict)  # event → seconds after spawn


LOG_MARKS = {  # what each mark is → the log text that ends it
    "init": "starting node=",  # imports, config, underlay survey
    "lease": "lease acquired",
    "reconciled": "reconciled reason='start'",
    "ready_log": "agent ready",
}


def _rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def time_agent_start(lab: Lab, node: str) -> AgentRun:
    """Start the node's agent and time it to a fresh subnet.env, polling every READY_POLL."""
    info = lab.node(node)
    log_offset = os.path.getsize(info.agent_log) if os.path.exists(info.agent_log) else 0
    wall0, t0 = time.time(), time.monotonic()
    lab.start_agent(node)
    deadline = t0 + READY_TIMEOUT
    polls = 0
    while True:
        try:
            if os.stat(info.subnet_env).st_mtime >= wall0:
                ready_at = time.monotonic()
                break
        except FileNotFoundError:
            pass
        polls += 1
        if polls % 50 == 0:
            agents.check_ready(info)  # raises, with the log's tail, if the agent exited
            if time.monotonic() > deadline:
                raise agents.not_ready_error([info], READY_TIMEOUT)
        time.sleep(READY_POLL)
    assert info.agent_pid is not None
    rss = _rss_kib(info.agent_pid)
    lab.wait_ready(node)  # exits at once if the agent died; also records the node state
    # The "agent ready" line follows subnet.env (firewall set-up, threads): wait for it.
    lines = _wait_log_line(info.agent_log, log_offset, "agent ready")
    marks = {}
    for mark, needle in LOG_MARKS.items():
        line = first_line_with(lines, needle)
        stamp = log_time(line) if line else None
        if stamp is not None:
            marks[mark] = stamp - wall0
    ready_line = first_line_with(lines, "agent ready") or ""
    program = float(log_field(ready_line, "program_seconds") or "nan")
    return AgentRun(ready_at - t0, program, rss, marks)


def _wait_log_line(path: str, offset: int, needle: str, timeout: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        with open(path, encoding="utf-8", errors="replace") as f:
            f.seek(offset)
            lines = f.read().splitlines()
        if first_line_with(lines, needle) or time.monotonic() > deadline:
            return lines
        time.sleep(0.01)


@contextmanager
def bench_lab(n: int) -> Iterator[tuple[Lab, str, list[FakePeer]]]:
    """A 1-node lab whose etcd holds the config and ``n`` fake peers; removed on exit."""
    name = "ba" + secrets.token_hex(2)
    lab = Lab.up(name, 1, "vxlan", network=str(NETWORK), start_agents=False, overlay_bridge=False)
    try:
        store = EtcdStore([lab.etcd_endpoint], timeout=10.0)
        try:
            put_network_config(store, lab.state.etcd_prefix, NET_CONF)
        finally:
            store.close()
        peers = fake_peers(n, _peer_subnets())
        put_peers(lab.etcd_endpoint, lab.state.etcd_prefix, peers)
        yield lab, lab.nodes[0].name, peers
    finally:
        lab.down()


def _peer_subnets() -> Iterator[IPv4Network]:
    """/24s from 10.1.0.0 upward (the agent's own lease lands elsewhere: the first free one
    from SubnetMin, 10.0.1.0, is far below)."""
    first = int(PEER_SUBNETS_FROM.network_address)
    for i in range((int(NETWORK.broadcast_address) - first + 1) // 256):
        yield IPv4Network((first + 256 * i, 24))


# --- the run --------------------------------------------------------------------------


@dataclass
class Result:
    n: int
    reference: list[float] = field(default_factory=list)
    cold: list[AgentRun] = field(default_factory=list)
    warm: list[AgentRun] = field(default_factory=list)


def run_one(n: int, repeat: int, say: Callable[[str], None]) -> Result:
    result = Result(n)
    with bench_lab(n) as (lab, node, peers), reference_netns() as ref_ns:
        ns = lab.node(node).namespace
        ip_batch, fdb_batch = reference_batches(peers)
        for r in range(repeat):
            result.reference.append(time_reference(ref_ns, ip_batch, fdb_batch))
            check_counts("reference", ref_ns, n)
            if r:  # a cold start again: without the device, every entry is gone
                subprocess.run(["ip", "-n", ns, "link", "del", DEVICE], check=True)
            cold = time_agent_start(lab, node)
            check_counts(f"agent, {n} peers", ns, n)
            lab.kill_agent(node)
            warm = time_agent_start(lab, node)
            check_counts(f"restarted agent, {n} peers", ns, n)
            lab.kill_agent(node)
            result.cold.append(cold)
            result.warm.append(warm)
            say(
                f"N={n} repeat {r + 1}/{repeat}: reference {result.reference[-1]:.3f} s, "
                f"start {cold.start_to_ready:.3f} s (program {cold.program_seconds:.3f} s), "
                f"restart {warm.start_to_ready:.3f} s"
            )
    return result


def report(results: Sequence[Result]) -> str:
    main_rows = []
    detail_rows = []
    for res in results:
        ref = median(res.reference)
        start = median([r.start_to_ready for r in res.cold])
        program = median([r.program_seconds for r in res.cold])
        restart = median([r.start_to_ready for r in res.warm])
        main_rows.append(
            [
                res.n,
                ref,
                start,
                program,
                restart,
                ratio(start, ref),
                ratio(program, ref),
                ratio(restart, ref),
                median([r.rss_kib / 1024 for r in res.cold]),
            ]
        )
        for kind, runs in (("start", res.cold), ("restart", res.warm)):
            for run in runs:
                m = run.log_marks
                detail_rows.append(
                    [
                        res.n,
                        kind,
                        run.start_to_ready,
                        m.get("init", float("nan")),
                        m.get("lease", float("nan")),
                        m.get("reconciled", float("nan")),
                        m.get("ready_log", float("nan")),
                        run.program_seconds,
                        run.rss_kib / 1024,
                    ]
                )
    return "\n\n".join(
        [
            "medians over repeats; seconds; ratio = ours / reference (goal: <= 2)",
            table(
                [
                    "N",
                    "ref ip+bridge -batch",
                    "start-to-ready",
                    "program",
                    "restart",
                    "start/ref",
                    "program/ref",
                    "restart/ref",
                    "RSS MiB",
                ],
                main_rows,
            ),
            "every run; log marks are seconds after spawn, from the agent log (ms resolution)",
            table(
                [
                    "N",
                    "run",
                    "to ready",
                    "init done",
                    "lease",
                    "reconciled",
                    "ready logged",
                    "program",
                    "RSS MiB",
                ],
                detail_rows,
            ),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.agent_start",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--peers", type=int, nargs="+", default=[1000, 5000])
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.agent_start needs root (network namespaces)", file=sys.stderr)
        return 2
    if any(not 1 <= n <= 60000 for n in args.peers):
        print("--peers must be between 1 and 60000", file=sys.stderr)
        return 2

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        results = [run_one(n, args.repeat, say) for n in args.peers]
    except KeyboardInterrupt:  # the labs and the reference namespace are gone already
        return 130
    print(report(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
