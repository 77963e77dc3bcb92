"""Lease snapshots that say which keys changed: made by the etcd watch, widened by the
writer over the snapshots it skips, and followed by the planner's peer split, which then
looks at those keys alone and must answer exactly what looking at every key answers."""

from __future__ import annotations

import queue
import random
import threading
from collections.abc import Mapping
from pathlib import Path

from flannelpy.agent.events import LeasesChanged, Tick
from flannelpy.backend.base import node_bounds
from flannelpy.config.settings import AgentSettings
from flannelpy.store.etcd.config import put_network_config
from flannelpy.store.etcd.kv import FakeStore
from flannelpy.store.etcd.manager import EtcdSubnetManager
from flannelpy.subnet.lease import Lease
from flannelpy.subnet.memo import LeaseSnapshot
from flannelpy.subnet.validate import PeerSplit, split_peers
from tests.support.agent_fakes import AgentHarness
from tests.support.fakes import context
from tests.unit.test_incremental_planning import own_lease, steps

PREFIX = "/coreos.com/network"
SUBNETS = f"{PREFIX}/subnets/"


def _changed_keys(now: Mapping[str, Lease], before: Mapping[str, Lease]) -> frozenset[str]:
    return frozenset(k for k in now.keys() | before.keys() if now.get(k) is not before.get(k))


def test_a_split_fed_snapshots_answers_what_split_peers_does_and_follows_the_changed_keys() -> None:
    rnd = random.Random(7)
    ctx = context("vxlan")
    split = PeerSplit()
    last: LeaseSnapshot | None = None
    skipped: list[LeaseSnapshot] = []
    followed = 0
    for i, numbered in enumerate(steps(rnd, False, 80)):
        own = [own_lease(rnd.choice([1, 1, 1, 1, 70]), False, ctx)]
        by_key = {lease.key: lease for lease in (*numbered.values(), *own)}
        before: Mapping[str, Lease] = last if last is not None else {}
        snapshot = LeaseSnapshot(by_key, _changed_keys(by_key, before), last)
        last = snapshot
        if i % 11 == 5:  # the writer skips this one: the next takes its keys in
            skipped.append(snapshot)
            continue
        for earlier in reversed(skipped):
            snapshot.absorb(earlier)
        skipped.clear()
        delivered: Mapping[str, Lease] = dict(snapshot) if i % 17 == 9 else snapshot
        own_keys = [lease.key for lease in own]
        bounds = node_bounds(ctx, own, [])
        listed, rejected = split.split(delivered, own_keys, bounds)
        fresh_peers, fresh_rejected = split_peers(by_key, own_keys, bounds)
        assert (listed, rejected) == (list(fresh_peers.values()), fresh_rejected), f"step {i}"
        followed += listed.follows is not None
    assert followed >= 50, followed


def test_a_split_trusts_the_changed_keys_so_it_looks_at_no_other() -> None:
    ctx = context("vxlan")
    own = [own_lease(1, False, ctx)]
    numbered = steps(random.Random(3), False, 1)[0]
    bounds = node_bounds(ctx, own, [])
    every = {lease.key: lease for lease in (*numbered.values(), *own)}
    peers, _ = PeerSplit().split(every, [own[0].key], bounds)
    # The peers that pass alone: no rejected lease, whose list is made key by key.
    first = LeaseSnapshot({lease.key: lease for lease in (*peers, *own)})
    split = PeerSplit()
    assert split.split(first, [own[0].key], bounds)[1] == {}
    gone = peers[0].key
    quiet = LeaseSnapshot({k: v for k, v in first.items() if k != gone}, frozenset(), first)
    listed, _ = split.split(quiet, [own[0].key], bounds)
    # Told nothing changed, it finds nothing gone; the same map as a plain dict, compared
    # key by key, has the lease gone.
    assert listed.follows is not None and not listed.added and not listed.dropped
    compared = PeerSplit()
    compared.split(first, [own[0].key], bounds)
    listed, _ = compared.split(dict(quiet), [own[0].key], bounds)
    assert [lease.key for lease in listed.dropped] == [gone]


def test_absorb_widens_over_a_chain_and_forgets_a_break() -> None:
    a = LeaseSnapshot({})
    b = LeaseSnapshot({}, frozenset({"x"}), a)
    c = LeaseSnapshot({}, frozenset({"y"}), b)
    c.absorb(b)
    assert (c.changed, c.follows) == (frozenset({"x", "y"}), a.token)
    assert a.changed is None  # a list: what changed is unknown
    unrelated = LeaseSnapshot({}, frozenset({"z"}), LeaseSnapshot({}))
    unrelated.absorb(b)  # not the snapshot it follows
    assert unrelated.changed is None


def test_the_writer_keeps_the_newest_snapshot_widened_over_those_it_skips(
    tmp_path: Path,
) -> None:
    writer = AgentHarness(tmp_path).agent.writer
    a = LeaseSnapshot({})
    b = LeaseSnapshot({}, frozenset({"x"}), a)
    c = LeaseSnapshot({}, frozenset({"y"}), b)
    tick = Tick("status")
    writer.queue = queue.Queue()
    for event in (LeasesChanged(c, 3), tick):
        writer.queue.put(event)
    kept = writer.take_queued(LeasesChanged(b, 2))
    assert kept == [LeasesChanged(c, 3), tick]
    assert (c.changed, c.follows) == (frozenset({"x", "y"}), a.token)
    d = LeaseSnapshot({}, frozenset({"w"}), c)
    writer.queue.put(LeasesChanged(d, 5))
    writer.take_queued(LeasesChanged({}, 4))
    assert d.changed is None  # a plain map in between: what changed is unknown


def test_the_etcd_watch_delivers_snapshots_naming_each_batchs_keys() -> None:
    store = FakeStore()
    put_network_config(
        store, PREFIX, '{"Network": "10.244.0.0/16", "Backend": {"Type": "host-gw"}}'
    )
    peer = '{"PublicIP":"192.168.0.%d","BackendType":"host-gw"}'
    store.put(SUBNETS + "10.244.1.0-24", (peer % 11).encode())
    seen: queue.Queue[LeaseSnapshot] = queue.Queue()
    stop = threading.Event()

    def on_leases(leases: Mapping[str, Lease], _revision: int) -> None:
        assert isinstance(leases, LeaseSnapshot)
        seen.put(leases)

    manager = EtcdSubnetManager(store, AgentSettings(etcd_prefix=PREFIX))
    thread = threading.Thread(target=manager.watch_leases, args=(on_leases, stop), daemon=True)
    thread.start()
    try:
        listed = seen.get(timeout=10)
        store.put(SUBNETS + "10.244.2.0-24", (peer % 12).encode())
        added = seen.get(timeout=10)  # each write waited for: a batch each
        held = store.get(SUBNETS + "10.244.1.0-24")
        assert held is not None
        assert store.delete_if_mod_revision(SUBNETS + "10.244.1.0-24", held.mod_revision)
        deleted = seen.get(timeout=10)
    finally:
        stop.set()
        thread.join(timeout=5)
    assert not thread.is_alive()
    assert listed.changed is None and set(listed) == {"10.244.1.0-24"}
    assert (added.follows, added.changed) == (listed.token, frozenset({"10.244.2.0-24"}))
    assert (deleted.follows, deleted.changed) == (added.token, frozenset({"10.244.1.0-24"}))
    assert set(deleted) == {"10.244.2.0-24"}
