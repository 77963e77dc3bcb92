"""Propagation of a new peer lease to every node's routing table, and of its removal.

    python -m bench.propagation [--nodes 10] [--leases 50]

A vxlan lab with one agent per node. One netlink socket per node, opened in
that node's namespace and subscribed to IPv4 route changes, timestamps the
moment the route for a subnet appears or disappears there. Then, one at a
time, a fake peer lease (a public IP nobody uses, its own VTEP MAC) is written
to etcd from this process, and we wait until its route (protocol 75) exists on
every node; then the lease is deleted and we wait until the route is gone
everywhere. Writer and watcher share one process, so both read the same
monotonic clock.

One thread waits on all the sockets (epoll) rather than one thread per node:
ten Python threads woken at once would queue for the GIL and add their wait
to the timestamps; one epoll wake-up stamps every socket that is ready.

The goal is p99 < 500 ms. ``bench.versus_flanneld`` runs the same trials in a
lab with flanneld nodes, for the reference.
"""

from __future__ import annotations

import argparse
import os
import secrets
import selectors
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from ipaddress import IPv4Network

from flannelpy_lab import Lab
from flannelpy_lab import etcd as lab_etcd

from bench.common import (
    FakePeer,
    RouteEvent,
    fake_peers,
    parse_route_events,
    route_event_socket,
    summary,
    table,
)
from flannelpy.dataplane.netns import run_in_netns
from flannelpy.dataplane.state import ROUTE_PROTOCOL
from flannelpy.subnet.keys import subnets_prefix

GOAL_P99 = 0.5  # seconds
WAIT_TIMEOUT = 10.0  # seconds for a route to reach every node before we call it missing
SETTLE = 0.1  # seconds between steps: let the agents' follow-up passes finish
LAB_TIMEOUT = 120.0
OURS = frozenset({ROUTE_PROTOCOL})
FAKE_INDEX_BASE = 60000  # fake public IPs from 172.16.234.97 up: nothing in the lab uses them


class RouteWatch:
    """First-seen times (monotonic) of route additions and removals, per node and subnet."""

    def __init__(
        self, sockets: dict[str, socket.socket], protocols: frozenset[int] | None = OURS
    ) -> None:
        self._protocols = protocols  # None: a route of any protocol (flanneld's are boot)
        self._selector = selectors.DefaultSelector()
        for node, sock in sockets.items():
            sock.setblocking(False)
            self._selector.register(sock, selectors.EVENT_READ, node)
        self._cond = threading.Condition()
        self._seen: dict[tuple[str, IPv4Network, bool], float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="route-watch", daemon=True)
        self.overflows = 0

    def __enter__(self) -> RouteWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(2.0)
        self._selector.close()

    def _loop(self) -> None:
        while not self._stop.is_set():
            ready = self._selector.select(0.2)
            now = time.monotonic()
            found = []
            for key, _ in ready:
                found += [(key.data, e) for e in self._drain(key.fileobj)]  # type: ignore[arg-type]
            if not found:
                continue
            with self._cond:
                for node, event in found:
                    if self._protocols is None or event.protocol in self._protocols:
                        self._seen.setdefault((node, event.dst, event.added), now)
                self._cond.notify_all()

    def _drain(self, sock: socket.socket) -> list[RouteEvent]:
        events: list[RouteEvent] = []
        while True:
            try:
                events += parse_route_events(sock.recv(1 << 20))
            except BlockingIOError:
                return events
            except OSError:  # ENOBUFS: we lost events; the wait will time out and say so
                self.overflows += 1
                return events

    def wait_all(
        self, nodes: Sequence[str], subnet: IPv4Network, added: bool, timeout: float
    ) -> dict[str, float]:
        """Times at which each node saw the change; nodes that did not are left out."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                times = {n: t for n in nodes if (t := self._seen.get((n, subnet, added)))}
                remaining = deadline - time.monotonic()
                if len(times) == len(nodes) or remaining <= 0:
                    return times
                self._cond.wait(remaining)


@dataclass
class Trial:
    subnet: IPv4Network
    add: dict[str, float] = field(default_factory=dict)  # node → seconds after the write
    remove: dict[str, float] = field(default_factory=dict)


def free_subnets(lab: Lab, count: int) -> list[IPv4Network]:
    """``count`` /24s of the lab network that no lease holds, from the top down."""
    taken = {
        IPv4Network(doc["subnet"])
        for doc in lab_etcd.read_leases(lab.etcd_endpoint, lab.state.etcd_prefix)
        if doc["subnet"]
    }
    candidates = reversed(list(IPv4Network(lab.state.network).subnets(new_prefix=24)))
    free = [s for s in candidates if not any(s.overlaps(t) for t in taken)]
    if len(free) < count:
        raise SystemExit(f"only {len(free)} free /24s in {lab.state.network} for {count} leases")
    return free[:count]


@contextmanager
def node_sockets(lab: Lab) -> Iterator[dict[str, socket.socket]]:
    with ExitStack() as stack:
        sockets = {}
        for info in lab.nodes:
            sock = run_in_netns(info.namespace, route_event_socket)
            stack.callback(sock.close)
            sockets[info.name] = sock
        yield sockets


def run_trials(
    lab: Lab,
    peers: Sequence[FakePeer],
    say: Callable[[str], None],
    protocols: frozenset[int] | None = OURS,
) -> list[Trial]:
    nodes = [n.name for n in lab.nodes]
    base = subnets_prefix(lab.state.etcd_prefix)
    trials = []
    with node_sockets(lab) as sockets, RouteWatch(sockets, protocols) as watch:
        with lab_etcd.client(lab.etcd_endpoint) as c:
            c.get(base)  # connect before the first timed write
            for i, peer in enumerate(peers):
                trial = Trial(peer.subnet)
                t0 = time.monotonic()
                c.put(base + peer.key, peer.lease_json())
                seen = watch.wait_all(nodes, peer.subnet, True, WAIT_TIMEOUT)
                trial.add = {n: t - t0 for n, t in seen.items()}
                time.sleep(SETTLE)
                t1 = time.monotonic()
                c.delete(base + peer.key)
                seen = watch.wait_all(nodes, peer.subnet, False, WAIT_TIMEOUT)
                trial.remove = {n: t - t1 for n, t in seen.items()}
                time.sleep(SETTLE)
                trials.append(trial)
                if (i + 1) % 10 == 0:
                    say(f"{i + 1}/{len(peers)} leases")
        if watch.overflows:
            say(f"warning: {watch.overflows} netlink receive overflows")
    return trials


def report(trials: Sequence[Trial], nodes: Sequence[str]) -> tuple[str, bool]:
    lines = [f"{len(trials)} leases, {len(nodes)} nodes; seconds from the etcd write (or delete)"]
    ok = True
    rows = []
    for label, attr in (("add", "add"), ("remove", "remove")):
        complete = [t for t in trials if len(getattr(t, attr)) == len(nodes)]
        missing = len(trials) - len(complete)
        if missing:
            ok = False
            lines.append(f"{label}: {missing} leases did not reach every node in {WAIT_TIMEOUT} s")
        if complete:
            s = summary([max(getattr(t, attr).values()) for t in complete])
            rows.append([f"{label}, all nodes", s["p50"], s["p90"], s["p99"], s["max"]])
            ok = ok and s["p99"] < GOAL_P99
    lines.append(table(["", "p50", "p90", "p99", "max"], rows))
    per_node = []
    for node in nodes:
        row: list[object] = [node]
        for attr in ("add", "remove"):
            values = [getattr(t, attr)[node] for t in trials if node in getattr(t, attr)]
            row += [summary(values)["p50"], summary(values)["p99"]] if values else ["-", "-"]
        per_node.append(row)
    lines.append(table(["node", "add p50", "add p99", "remove p50", "remove p99"], per_node))
    lines.append(
        f"goal: p99 < {GOAL_P99 * 1000:.0f} ms for all nodes: {'met' if ok else 'NOT met'} "
        "(no external reference: nothing else here does this)"
    )
    return "\n\n".join(lines), ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.propagation",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nodes", type=int, default=10)
    parser.add_argument("--leases", type=int, default=50)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.propagation needs root (network namespaces)", file=sys.stderr)
        return 2

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    name = "bp" + secrets.token_hex(2)
    say(f"bringing up lab {name} with {args.nodes} nodes")
    lab = Lab.up(name, args.nodes, "vxlan", timeout=LAB_TIMEOUT, progress=say)
    try:
        subnets = free_subnets(lab, args.leases)
        peers = fake_peers(args.leases, subnets, first_index=FAKE_INDEX_BASE)
        trials = run_trials(lab, peers, say)
    except KeyboardInterrupt:
        return 130
    finally:
        lab.down()
    text, ok = report(trials, [n.name for n in lab.nodes])
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
