"""Steady-state status-record writes: how often one node rewrites its
``<prefix>/flannelpy/nodes/<node>/status`` record, and how large it is, with 1,000 peers.

One agent (the real writer, status reporter and etcd node control, on the in-memory
store with fakes for the kernel and pods) holds its lease among N fake peer leases.
Its prober is replaced by a fake whose results change only as they do in a quiet
cluster: every peer answers, each round raises its round counter, one round per peer
per probe interval (phases spread over the interval, as the real prober does). Time
is simulated: the status timer fires every 2 s, as in the agent, for ``--minutes``
after a warm-up that covers the start's settling minute. Nothing else changes, so
every write counted is a heartbeat or a write the design should not make.

``--rollout`` measures the same with a rollout record in progress, the one time the
record may follow probe rounds. ``--before DIR`` runs the same harness against
another checkout (an older commit in a throwaway worktree) in a child process and
prints both side by side.

    .venv/bin/python -m bench.status_writes --peers 1000 --minutes 60
    git worktree add --detach /tmp/old <commit>
    .venv/bin/python -m bench.status_writes --before /tmp/old
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

TICK_SECONDS = 2.0  # the agent's status timer
WARM_UP_SECONDS = 120.0  # past the start's settling minute
HERE = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Result:
    tree: str
    peers: int
    minutes: float
    writes: int
    writes_per_hour: float
    largest_record_bytes: int
    bytes_per_hour: float
    wall_seconds: float


def measure(peers: int, minutes: float, tree: str, rollout: bool = False) -> Result:
    """Imports here: the tree to measure is whatever ``flannelpy`` is on sys.path."""
    from bench.common import fake_peers
    from flannelpy.agent.events import TICK_STATUS
    from flannelpy.observe.probe_verdict import ProbeResult
    from flannelpy.store.etcd.kv import FakeStore
    from flannelpy.subnet.keys import rollout_key, status_key, subnets_prefix
    from tests.support.agent_fakes import NODE, PREFIX, AgentHarness, FakeClock, net_conf

    logging.getLogger("flannelpy").setLevel(logging.ERROR)  # 1,000 "no MTU advertised" lines
    clock = FakeClock()
    writes: list[tuple[float, int]] = []
    own_key = status_key(PREFIX, NODE)

    class CountingStore(FakeStore):
        def put(self, key: str, value: bytes, lease_id: int = 0) -> int:
            if key == own_key:
                writes.append((clock(), len(value)))
            return super().put(key, value, lease_id)

    store = CountingStore(clock=clock)
    subnets = list(IPv4Network("10.0.0.0/8").subnets(new_prefix=24))[256:]
    fakes = fake_peers(peers, subnets)
    for p in fakes:
        store.put(subnets_prefix(PREFIX) + p.key, p.lease_json().encode())

    class QuietProber:
        """Every peer answers; a round to peer i completes at phase_i + k * interval."""

        def __init__(self, interval: float) -> None:
            self.interval = interval
            self.current = {
                str(p.subnet): ProbeResult(
                    True, 0.0004, 0.0, True, None, 0, IPv4Address(p.subnet.network_address)
                )
                for p in fakes
            }
            self.phase = {k: i / len(fakes) * interval for i, k in enumerate(self.current)}

        def results(self) -> dict[str, ProbeResult]:
            return dict(self.current)

        def advance(self, h: AgentHarness, start: float, end: float) -> None:
            for key, phase in self.phase.items():
                rounds = int((end - phase) // self.interval) - int((start - phase) // self.interval)
                if rounds > 0:
                    r = self.current[key]
                    self.current[key] = replace(r, probes=r.probes + rounds)
                    h.writer.status.probe_seen(key)  # what the writer does per ProbeReported

    with tempfile.TemporaryDirectory(prefix="status-writes-") as tmp:
        h = AgentHarness(Path(tmp), store=store, clock=clock, config=net_conf(Network="10.0.0.0/8"))
        h.start()
        h.drain()
        h.deliver_leases()
        if rollout:  # an active rollout record: the record may follow probe rounds
            store.put(rollout_key(PREFIX), json.dumps({"id": "b", "state": "running"}).encode())
            h.deliver_control()
        prober = QuietProber(h.settings.probe_interval)
        h.writer.status.prober = prober  # type: ignore[assignment]
        started = time.monotonic()
        steady = clock() + WARM_UP_SECONDS
        end = steady + minutes * 60.0
        while clock() < end:
            before = clock()
            clock.advance(TICK_SECONDS)
            prober.advance(h, before, clock())
            h.tick(TICK_STATUS)
        h.stop()
    counted = [size for at, size in writes if steady <= at < end]
    hours = minutes / 60.0
    return Result(
        tree=tree,
        peers=peers,
        minutes=minutes,
        writes=len(counted),
        writes_per_hour=round(len(counted) / hours, 1),
        largest_record_bytes=max((size for _, size in writes), default=0),
        bytes_per_hour=round(sum(counted) / hours),
        wall_seconds=round(time.monotonic() - started, 1),
    )


def _before(tree: str, peers: int, minutes: float, rollout: bool) -> Result:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    out = subprocess.run(
        [
            sys.executable,
            str(Path(__file__).resolve()),
            "--json",
            "--peers",
            str(peers),
            "--minutes",
            str(minutes),
            "--label",
            tree,
            *(["--rollout"] if rollout else []),
        ],
        cwd=tree,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return Result(**json.loads(out.stdout))


def _cluster_line(r: Result) -> str:
    """Every node of a cluster of ``peers + 1`` nodes writes like the one measured."""
    nodes = r.peers + 1
    mib_s = r.bytes_per_hour * nodes / 3600 / 2**20
    return f"{nodes:,} nodes: {r.writes_per_hour * nodes:,.0f} writes/h, {mib_s:.4f} MiB/s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peers", type=int, default=1000)
    ap.add_argument("--minutes", type=float, default=60.0, help="steady state simulated")
    ap.add_argument("--before", metavar="DIR", help="a checkout of the code to compare with")
    ap.add_argument("--json", action="store_true", help="print one result as JSON")
    ap.add_argument("--rollout", action="store_true", help="with a rollout in progress")
    ap.add_argument("--label", default=str(HERE))
    args = ap.parse_args(argv)
    if args.json:
        print(json.dumps(measure(args.peers, args.minutes, args.label, args.rollout).__dict__))
        return 0
    results = []
    if args.before:
        print(f"measuring {args.before} ...", file=sys.stderr)
        results.append(_before(args.before, args.peers, args.minutes, args.rollout))
    print(f"measuring {HERE} ...", file=sys.stderr)
    results.append(measure(args.peers, args.minutes, str(HERE), args.rollout))
    for r in results:
        print(
            f"{r.tree}: {r.peers} peers, {r.minutes:g} simulated min: "
            f"{r.writes} writes ({r.writes_per_hour:g} per node per hour), largest record "
            f"{r.largest_record_bytes:,} B, {r.bytes_per_hour / 2**20:.3f} MiB/h per node "
            f"[{r.wall_seconds} s]"
        )
        print(f"    the whole cluster of {_cluster_line(r)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.environ.get("PYTHONPATH", str(HERE)).split(os.pathsep)[0])
    raise SystemExit(main())
