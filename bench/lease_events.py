"""One peer's lease coming and going among many: the time to its route and the CPU it
costs, ours beside flanneld (v0.28.9) in one run.

    python -m bench.lease_events [--peers 1050] [--events 60] [--rounds 1]

Part 1 of :mod:`bench.versus_flanneld`'s node (a throwaway namespace with a default route,
an etcd on loopback holding the network config and ``--peers`` fake peer leases). Each
implementation is started in turn (ours, flanneld; the order alternates per round) and,
once ready and settled, ``--events`` fake leases are written one at a time, each deleted
again before the next: from the etcd write to the route's appearance (a netlink
route-event socket opened before the write stamps it) and from the delete to its
removal. CPU: utime + stime of the implementation's process tree over the whole
sequence, divided by the number of events (an add and a delete are two), with the
sequence's wall time beside it for the idle share.

Why: ``versus_flanneld``'s part 2 times lease events in a lab of 20 leases, where a
plan is small whatever it costs per peer; with a thousand peers, work that follows the
cluster's size rather than the change shows here (it did: 30 ms of CPU per event).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from ipaddress import IPv4Network

from bench.agent_start import _peer_subnets, reference_netns
from bench.common import (
    FakePeer,
    compile_agent,
    fake_peers,
    lab_etcd,
    load_average,
    median,
    percentile,
    put_peers,
    say,
    table,
)
from bench.versus_flanneld import (
    IMPLS,
    PREFIX,
    RouteAdds,
    bench_node,
    cpu_seconds,
    stop,
    time_start,
)
from flannelpy.subnet.keys import subnets_prefix

SETTLE_SECONDS = 3.0  # after ready: the start's follow-ups (status, first probe rounds)
GAP_SECONDS = 0.05  # between one event's route and the next write
GIVE_UP_SECONDS = 10.0


def wait_for(seen: dict[IPv4Network, float], dst: IPv4Network) -> float:
    """When ``dst`` appeared in ``seen`` (a RouteAdds map), waiting for it."""
    deadline = time.monotonic() + GIVE_UP_SECONDS
    while dst not in seen:
        if time.monotonic() > deadline:
            raise SystemExit(f"no route event for {dst} within {GIVE_UP_SECONDS:.0f} s")
        time.sleep(0.0005)
    return seen[dst]


@dataclass
class Run:
    impl: str
    peers: int
    add_ms: list[float]
    delete_ms: list[float]
    cpu_ms_per_event: float
    idle_cpu_ms_per_second: float
    wall_seconds: float


def events_inside(peers: int, events: int, rounds: int, floor: bool) -> list[Run]:
    subnets = list(_peer_subnets())
    base = fake_peers(peers, subnets)
    extra = fake_peers(events, subnets[peers:], first_index=peers + 1000)
    keys = {p.key for p in base} | {p.key for p in extra}
    runs = []
    with bench_node([]) as node:
        put_peers(node.endpoint, PREFIX, base)
        for r in range(rounds):
            impls = (*IMPLS, "floor") if floor else IMPLS
            for impl in impls if r % 2 == 0 else impls[::-1]:
                _, running = time_start(impl, node, base, keys)
                try:
                    time.sleep(SETTLE_SECONDS)
                    pid = running.proc.pid
                    idle0, t_idle = cpu_seconds(pid), time.monotonic()
                    time.sleep(2.0)
                    idle = (cpu_seconds(pid) - idle0) / (time.monotonic() - t_idle)
                    runs.append(one_sequence(impl, peers, node.endpoint, extra, pid, idle))
                    say(f"{impl}, round {r + 1}: {median(runs[-1].add_ms):.1f} ms to a route")
                finally:
                    stop(running)
    return runs


def one_sequence(
    impl: str, peers: int, endpoint: str, extra: Sequence[FakePeer], pid: int, idle: float
) -> Run:
    base = subnets_prefix(PREFIX)
    changes = RouteAdds()
    adds, deletes = [], []
    try:
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        with lab_etcd.client(endpoint, timeout=10.0) as c:
            for p in extra:
                sent = time.monotonic()
                c.put(base + p.key, p.lease_json())
                adds.append((wait_for(changes.seen, p.subnet) - sent) * 1000)
                time.sleep(GAP_SECONDS)
                sent = time.monotonic()
                c.delete(base + p.key)
                deletes.append((wait_for(changes.removed, p.subnet) - sent) * 1000)
                time.sleep(GAP_SECONDS)
        cpu, wall = cpu_seconds(pid) - cpu0, time.monotonic() - t0
    finally:
        changes.close()
    return Run(impl, peers, adds, deletes, cpu * 1000 / (2 * len(extra)), idle * 1000, wall)


def idle_share(run: Run) -> float:
    """What the process spent per event at its idle rate (before the sequence)."""
    return run.idle_cpu_ms_per_second * run.wall_seconds / (2 * len(run.add_ms))


def report(runs: Sequence[Run]) -> str:
    floor = any(r.impl == "floor" for r in runs)
    rows = []
    for what, pick in (
        ("new lease -> route, p50 (ms)", lambda r: median(r.add_ms)),
        ("new lease -> route, p95 (ms)", lambda r: percentile(r.add_ms, 95)),
        ("deleted lease -> no route, p50 (ms)", lambda r: median(r.delete_ms)),
        ("deleted lease -> no route, p95 (ms)", lambda r: percentile(r.delete_ms, 95)),
        ("CPU per event (ms)", lambda r: r.cpu_ms_per_event),
        ("of it the idle rate's share (ms)", idle_share),
        ("CPU per event above idle (ms)", lambda r: r.cpu_ms_per_event - idle_share(r)),
    ):
        figure = {
            impl: median([pick(r) for r in runs if r.impl == impl])
            for impl in ("ours", "flanneld", "floor")
            if any(r.impl == impl for r in runs)
        }
        ours, theirs = figure["ours"], figure["flanneld"]
        row = [what, f"{ours:.2f}", f"{theirs:.2f}", f"{ours / theirs:.2f}" if theirs else "-"]
        if floor:
            least = figure["floor"]
            row += [f"{least:.2f}", f"{least / theirs:.2f}" if theirs else "-"]
        rows.append(row)
    head = ["ratio = ours / flanneld", "ours", "flanneld", "ratio"]
    return table(head + (["floor", "floor / flanneld"] if floor else []), rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.lease_events",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--peers", type=int, default=1050)
    parser.add_argument("--events", type=int, default=60, help="leases added and deleted")
    parser.add_argument("--rounds", type=int, default=1, help="starts per implementation")
    parser.add_argument(
        "--floor", action="store_true", help="bench.event_floor too: the least a Python agent does"
    )
    parser.add_argument("--inside-netns", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.lease_events needs root (network namespaces)", file=sys.stderr)
        return 2
    if args.inside_netns:
        runs = events_inside(args.peers, args.events, args.rounds, args.floor)
        print(json.dumps([asdict(r) for r in runs]))
        return 0
    compile_agent()
    load = load_average()
    with reference_netns() as ns:
        child = [
            sys.executable, "-m", "bench.lease_events", "--inside-netns",
            "--peers", str(args.peers), "--events", str(args.events), "--rounds", str(args.rounds),
            *(["--floor"] if args.floor else []),
        ]  # fmt: skip
        proc = subprocess.run(
            ["ip", "netns", "exec", ns, *child], stdout=subprocess.PIPE, text=True, check=False
        )
    if proc.returncode != 0:
        raise SystemExit(f"the run failed (exit {proc.returncode}); see above")
    runs = [Run(**r) for r in json.loads(proc.stdout)]
    print(f"{args.peers} peers, {args.events} leases added and deleted one at a time")
    print(report(runs))
    print(f"machine: load average {load} -> {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
