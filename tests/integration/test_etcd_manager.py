"""The etcd subnet manager against a real etcd, and the Store contract.

The contract tests run once against FakeStore and once against EtcdStore on a
private etcd, so the fake the unit tests rely on behaves like the real thing.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from ipaddress import IPv4Address, IPv4Network
from typing import Any, cast

import pytest

from flannelpy.config.settings import AgentSettings
from flannelpy.errors import (
    ConfigError,
    KeyExists,
    PoolExhausted,
    RevisionCompacted,
    StoreError,
    StoreUnavailable,
)
from flannelpy.retry import Backoff
from flannelpy.store.etcd.client import EtcdStore, connect_etcd
from flannelpy.store.etcd.config import put_network_config
from flannelpy.store.etcd.kv import FakeStore, Store, WatchBatch, WatchStream
from flannelpy.store.etcd.manager import EtcdSubnetManager
from flannelpy.store.etcd.member import Member
from flannelpy.store.etcd.watch import WATCH_POLL
from flannelpy.subnet.lease import Lease, LeaseAttrs
from tests.support.etcd_server import EtcdServer, free_port, make_tls_files
from tests.support.waiting import wait_until

NETCONF = '{"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan"}}'
FLANNELD_VALUE = (
    '{"PublicIP":"192.168.64.3","PublicIPv6":null,"BackendType":"vxlan",'
    '"BackendData":{"VNI":1,"VtepMAC":"c6:d2:32:6f:8f:44"}}'
)


# =============================================================================
# Store contract: FakeStore and EtcdStore behave the same
# =============================================================================


class ManualClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Kv:
    store: Store
    prefix: str
    advance: Callable[[float], None]  # let TTLs run out (fake: move the clock)
    go_down: Callable[[], None]  # make the store unreachable


@pytest.fixture(params=["fake", "gateway", "grpc"])
def kv(request: pytest.FixtureRequest, etcd_factory: Callable[..., EtcdServer]) -> Iterator[Kv]:
    """The contract runs on the fake and on a real etcd over both transports."""
    if request.param == "fake":
        clock = ManualClock()
        fake = FakeStore(clock=clock)

        def advance(seconds: float) -> None:
            clock.now += seconds

        yield Kv(fake, "/contract/", advance, lambda: fake.set_available(False))
        return
    server = etcd_factory()
    store = EtcdStore([server.endpoint], timeout=2.0, transport=request.param)
    try:
        yield Kv(store, "/contract/", time.sleep, server.kill)
    finally:
        store.close()


def test_contract_get_put_and_revisions(kv: Kv) -> None:
    s, p = kv.store, kv.prefix
    assert s.get(p + "a") is None
    r1 = s.put(p + "a", b"one")
    r2 = s.put(p + "a", b"two")
    assert r2 == r1 + 1
    got = s.get(p + "a")
    assert got is not None
    assert (got.key, got.value, got.mod_revision, got.create_revision, got.lease_id) == (
        p + "a",
        b"two",
        r2,
        r1,
        0,
    )


def test_contract_get_prefix_is_sorted_scoped_and_carries_the_revision(kv: Kv) -> None:
    s, p = kv.store, kv.prefix
    s.put(p + "sub/b", b"2")
    s.put(p + "sub/a", b"1")
    last = s.put(p + "sub-sibling", b"x")  # shares the string prefix "sub" but not "sub/"
    items, revision = s.get_prefix(p + "sub/")
    assert [(kv.key, kv.value) for kv in items] == [(p + "sub/a", b"1"), (p + "sub/b", b"2")]
    assert revision == last
    assert s.get_prefix(p + "nothing/") == ([], revision)


def test_contract_create_only_if_absent(kv: Kv) -> None:
    s, p = kv.store, kv.prefix
    revision = s.create(p + "k", b"first")
    with pytest.raises(KeyExists):
        s.create(p + "k", b"second")
    got = s.get(p + "k")
    assert got is not None and (got.value, got.mod_revision) == (b"first", revision)


def test_contract_compare_and_swap_on_mod_revision(kv: Kv) -> None:
    s, p = kv.store, kv.prefix
    r1 = s.put(p + "k", b"v1")
    r2 = s.put(p + "k", b"v2")
    assert s.put_if_mod_revision(p + "k", b"stale", r1) is None
    assert s.put_if_mod_revision(p + "absent", b"x", r1) is None
    assert s.get(p + "absent") is None
    r3 = s.put_if_mod_revision(p + "k", b"v3", r2)
    assert r3 == r2 + 1
    got = s.get(p + "k")
    assert got is not None and got.value == b"v3"
    assert s.delete_if_mod_revision(p + "k", r2) is False
    assert s.get(p + "k") is not None
    assert s.delete_if_mod_revision(p + "k", r3) is True
    assert s.get(p + "k") is None
    assert s.delete_if_mod_revision(p + "k", r3) is False


def test_contract_key_on_a_lease_expires_and_the_watch_sees_a_delete(kv: Kv) -> None:
    s, p = kv.store, kv.prefix
    granted = s.grant_lease(1)
    assert granted.ttl >= 1
    created = s.create(p + "ttl", b"v", granted.id)
    got = s.get(p + "ttl")
    assert got is not None and got.lease_id == granted.id
    stop = threading.Event()
    stream = s.watch_prefix(p, created + 1, stop)
    kv.advance(granted.ttl + 0.1)
    batch = next(iter(stream))
    assert [(e.kind, e.key) for e in batch.events] == [("delete", p + "ttl")]
    assert batch.revision == batch.events[-1].mod_revision > created
    assert s.get(p + "ttl") is None
    stop.set()
    with pytest.raises(StoreError):
        s.refresh_lease(granted.id)


def test_contract_revoke_deletes_attached_keys_and_refresh_keeps_a_lease(kv: Kv) -> None:
    s, p = kv.store, kv.prefix
    granted = s.grant_lease(30)
    s.put(p + "a", b"1", granted.id)
    s.put(p + "b", b"2", granted.id)
    assert s.refresh_lease(granted.id) >= 29
    s.revoke_lease(granted.id)
    assert s.get_prefix(p)[0] == []
    s.revoke_lease(granted.id)  # already gone: still fine


def test_contract_lease_remaining_counts_down_and_is_none_once_gone(kv: Kv) -> None:
    granted = kv.store.grant_lease(30)
    remaining = kv.store.lease_remaining(granted.id)
    assert remaining is not None and 25 <= remaining <= 30
    kv.store.revoke_lease(granted.id)
    assert kv.store.lease_remaining(granted.id) is None


def test_contract_write_with_an_unknown_lease_is_a_store_error_not_key_exists(kv: Kv) -> None:
    with pytest.raises(StoreError) as err:
        kv.store.create(kv.prefix + "k", b"v", lease_id=0x7EADBEEF)
    assert not isinstance(err.value, KeyExists | StoreUnavailable)


def test_contract_a_list_larger_than_grpcs_default_message_limit(kv: Kv) -> None:
    """gRPC refuses answers over 4 MiB unless told otherwise: about 13,000 leases."""
    value = b"v" * 5000
    for i in range(1000):
        kv.store.put(f"{kv.prefix}big/{i:04d}", value)
    listed, _ = kv.store.get_prefix(kv.prefix + "big/")
    assert [x.key for x in listed] == [f"{kv.prefix}big/{i:04d}" for i in range(1000)]
    assert all(x.value == value for x in listed)


def test_contract_watch_replays_from_a_past_revision_in_order(kv: Kv) -> None:
    s, p = kv.store, kv.prefix
    first = s.put(p + "a", b"1")
    s.put(p + "b", b"2")
    s.put("/elsewhere/x", b"not watched")
    s.delete_if_mod_revision(p + "a", first)
    stop = threading.Event()
    stream = s.watch_prefix(p, first, stop)
    seen: list[tuple[str, str, bytes]] = []
    batches: list[WatchBatch] = []
    for batch in stream:
        batches.append(batch)
        seen += [(e.kind, e.key, e.value) for e in batch.events]
        if len(seen) >= 3:
            break
    stop.set()
    assert seen == [("put", p + "a", b"1"), ("put", p + "b", b"2"), ("delete", p + "a", b"")]
    assert all(b.revision == b.events[-1].mod_revision for b in batches)


def test_contract_watch_from_a_compacted_revision_raises(kv: Kv) -> None:
    s, p = kv.store, kv.prefix
    early = s.put(p + "k", b"1")
    s.put(p + "k", b"2")
    current = s.put(p + "k", b"3")
    s.compact(current)
    stop = threading.Event()
    with pytest.raises(RevisionCompacted) as err:
        next(iter(s.watch_prefix(p, early, stop)))
    assert err.value.compacted_revision == current
    # Watching from the compaction point itself is still possible.
    stream = s.watch_prefix(p, current, stop)
    batch = next(iter(stream))
    assert [e.value for e in batch.events] == [b"3"]
    stop.set()


def test_contract_watch_ends_soon_after_stop(kv: Kv) -> None:
    stop = threading.Event()
    stream = kv.store.watch_prefix(kv.prefix, 1, stop)
    done = threading.Event()
    seen: list[object] = []

    def drain() -> None:
        for item in stream:
            seen.append(item)
        done.set()

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    kv.store.put(kv.prefix + "a", b"1")
    wait_until(lambda: seen, 5.0, "the watch to deliver a write")  # it is open and waiting
    started = time.monotonic()
    stop.set()
    # A blocked watch looks at its stop event every WATCH_POLL (an idle watch's wake-ups
    # are traded against this), well within the agent's shutdown grace.
    assert done.wait(WATCH_POLL + 2.0)
    assert time.monotonic() - started < WATCH_POLL + 0.5


def test_contract_outage_raises_store_unavailable_for_calls_and_open_watches(kv: Kv) -> None:
    s, p = kv.store, kv.prefix
    revision = s.put(p + "k", b"v")
    stop = threading.Event()
    stream = s.watch_prefix(p, revision + 1, stop)
    kv.go_down()
    started = time.monotonic()
    with pytest.raises(StoreUnavailable):
        next(iter(stream))
    with pytest.raises(StoreUnavailable):
        s.get(p + "k")
    with pytest.raises(StoreUnavailable):
        s.watch_prefix(p, revision + 1, stop)
    assert time.monotonic() - started < 10
    stop.set()


# =============================================================================
# EtcdSubnetManager against a real etcd
# =============================================================================


def settings_for(endpoints: list[str], prefix: str, **overrides: Any) -> AgentSettings:
    return AgentSettings(
        etcd_endpoints=tuple(endpoints), etcd_prefix=prefix, **{"subnet_lease_ttl": 60, **overrides}
    )


def attrs(ip: str, node: str | None = None) -> LeaseAttrs:
    return LeaseAttrs(
        public_ip=IPv4Address(ip),
        backend_type="vxlan",
        backend_data={"VNI": 1, "VtepMAC": "c6:d2:32:6f:8f:44"},
        node_name=node,
    )


@pytest.fixture
def raw_store(etcd_server: EtcdServer) -> Iterator[EtcdStore]:
    """A store for the test itself, to write and inspect keys behind the managers' backs."""
    store = EtcdStore([etcd_server.endpoint])
    try:
        yield store
    finally:
        store.close()


@pytest.fixture
def managers(
    etcd_server: EtcdServer, etcd_prefix: str, raw_store: EtcdStore
) -> Iterator[Callable[..., EtcdSubnetManager]]:
    """``managers()`` gives a manager (own connection) on the shared etcd and test prefix,
    with net-conf.json written there; every one is closed at the end."""
    put_network_config(raw_store, etcd_prefix, NETCONF)
    made: list[EtcdSubnetManager] = []

    def make(
        store: Store | None = None, clock: Callable[[], float] = time.time, **overrides: Any
    ) -> EtcdSubnetManager:
        settings = settings_for([etcd_server.endpoint], etcd_prefix, **overrides)
        manager = EtcdSubnetManager(store or connect_etcd(settings), settings, clock=clock)
        made.append(manager)
        return manager

    try:
        yield make
    finally:
        for manager in made:
            manager.close()


class Recorder:
    """Collects the snapshots watch_leases reports."""

    def __init__(self) -> None:
        self.snapshots: list[tuple[dict[str, Lease], int]] = []
        self._cond = threading.Condition()

    def __call__(self, leases: Mapping[str, Lease], revision: int) -> None:
        with self._cond:
            self.snapshots.append((dict(leases), revision))
            self._cond.notify_all()

    def wait_for(
        self, predicate: Callable[[dict[str, Lease]], bool], timeout: float
    ) -> dict[str, Lease]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if self.snapshots and predicate(self.snapshots[-1][0]):
                    return self.snapshots[-1][0]
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    last = self.snapshots[-1][0] if self.snapshots else None
                    raise AssertionError(f"no matching snapshot in {timeout} s; last: {last}")
                self._cond.wait(remaining)


@contextmanager
def watching(manager: EtcdSubnetManager) -> Iterator[Recorder]:
    recorder = Recorder()
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            manager.watch_leases(recorder, stop)
        except BaseException as e:  # surfaced in the test below
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        yield recorder
        assert thread.is_alive(), f"watch_leases returned early: {errors}"
    finally:
        stopped_at = time.monotonic()
        stop.set()
        thread.join(5)
    assert not thread.is_alive(), "watch_leases did not return after stop"
    assert time.monotonic() - stopped_at < WATCH_POLL + 1.0  # its watch looks once a poll
    assert errors == []


def test_missing_config_is_a_config_error_with_the_fix(etcd_server: EtcdServer) -> None:
    settings = settings_for([etcd_server.endpoint], "/coreos.com/network")
    manager = EtcdSubnetManager(connect_etcd(settings), settings)
    try:
        with pytest.raises(ConfigError) as err:
            manager.get_network_config()
    finally:
        manager.close()
    assert str(err.value) == (
        "network config not found in etcd at /coreos.com/network/config; write net-conf.json "
        "there (etcdctl put /coreos.com/network/config '{\"Network\": ...}')"
    )


def test_config_is_read_from_etcd(managers: Callable[..., EtcdSubnetManager]) -> None:
    config = managers().get_network_config()
    assert (str(config.network), config.subnet_len, config.backend.type) == (
        "10.244.0.0/16",
        24,
        "vxlan",
    )


def test_invalid_config_in_etcd_names_the_key(
    managers: Callable[..., EtcdSubnetManager], raw_store: EtcdStore, etcd_prefix: str
) -> None:
    raw_store.put(f"{etcd_prefix}/config", b'{"Network": "not-a-cidr"}')
    with pytest.raises(ConfigError, match=f"read from etcd key {etcd_prefix}/config"):
        managers().get_network_config()


def test_acquire_writes_flannels_key_and_json_on_a_ttl_lease(
    managers: Callable[..., EtcdSubnetManager], raw_store: EtcdStore, etcd_prefix: str
) -> None:
    before = time.time()
    lease = managers().acquire_lease(attrs("192.168.64.3"), None)
    assert lease.expiration is not None and before + 59 <= lease.expiration <= time.time() + 61
    kv = raw_store.get(f"{etcd_prefix}/subnets/{lease.key}")
    assert kv is not None
    assert kv.value.decode() == FLANNELD_VALUE  # byte-identical to what flanneld writes
    assert kv.lease_id == lease.store_lease_id and kv.lease_id != 0
    assert kv.mod_revision == lease.revision
    assert 55 <= raw_store.refresh_lease(kv.lease_id) <= 60


def test_renew_rewrites_the_key_on_a_new_etcd_lease(
    managers: Callable[..., EtcdSubnetManager], raw_store: EtcdStore, etcd_prefix: str
) -> None:
    clock = ManualClock()
    manager = managers(clock=clock)
    lease = manager.acquire_lease(attrs("192.168.64.3"), None)
    assert lease.expiration is not None
    clock.now += 5  # the renewal comes later
    renewed = manager.renew_lease(lease)
    assert renewed.key == lease.key and renewed.subnet == lease.subnet
    assert renewed.expiration is not None and renewed.expiration > lease.expiration
    assert renewed.revision > lease.revision
    assert renewed.store_lease_id != lease.store_lease_id
    kv = raw_store.get(f"{etcd_prefix}/subnets/{lease.key}")
    assert kv is not None and kv.lease_id == renewed.store_lease_id
    assert lease.store_lease_id is not None
    with pytest.raises(StoreError):  # the old etcd lease was revoked
        raw_store.refresh_lease(lease.store_lease_id)


def test_restarted_node_gets_the_same_subnet_back_by_public_ip(
    managers: Callable[..., EtcdSubnetManager],
) -> None:
    first = managers().acquire_lease(attrs("192.168.64.3"), None)
    managers().acquire_lease(attrs("192.168.64.4"), None)
    again = managers().acquire_lease(attrs("192.168.64.3"), None)  # a new process
    assert again.subnet == first.subnet


def test_our_lease_outside_the_config_is_deleted_and_replaced(
    managers: Callable[..., EtcdSubnetManager], raw_store: EtcdStore, etcd_prefix: str
) -> None:
    stale_key = f"{etcd_prefix}/subnets/10.5.7.0-24"  # written under an older Network
    raw_store.put(stale_key, FLANNELD_VALUE.encode())
    lease = managers().acquire_lease(attrs("192.168.64.3"), None)
    assert lease.subnet.subnet_of(IPv4Network("10.244.0.0/16"))
    assert raw_store.get(stale_key) is None


def test_previous_subnet_from_subnet_env_is_reused(
    managers: Callable[..., EtcdSubnetManager],
) -> None:
    lease = managers().acquire_lease(attrs("192.168.64.9"), IPv4Network("10.244.77.0/24"))
    assert lease.subnet == IPv4Network("10.244.77.0/24")


def test_recreated_node_takes_over_its_lease_by_node_name(
    managers: Callable[..., EtcdSubnetManager], raw_store: EtcdStore, etcd_prefix: str
) -> None:
    # A short TTL: the old holder's renewal point (TTL - margin) passes in seconds.
    short = {"subnet_lease_ttl": 12, "subnet_lease_renew_margin": 1}  # margin: min(60 s, TTL)
    old = managers(**short).acquire_lease(attrs("192.168.64.3", node="node-a"), None)
    time.sleep(7)  # 5 s left: below the renewal point (12 s) less the grace (6 s)
    new = managers(**short).acquire_lease(attrs("192.168.64.30", node="node-a"), None)
    assert new.subnet == old.subnet
    items, _ = raw_store.get_prefix(f"{etcd_prefix}/subnets/")
    assert [(kv.key.rsplit("/", 1)[1], json.loads(kv.value)["PublicIP"]) for kv in items] == [
        (old.key, "192.168.64.30")
    ]


def test_two_live_nodes_with_one_name_the_second_refuses_to_start(
    managers: Callable[..., EtcdSubnetManager], raw_store: EtcdStore, etcd_prefix: str
) -> None:
    # Before: the second took the first's lease by name, and the first took it back.
    first = managers()
    held = first.acquire_lease(attrs("192.168.64.3", node="same-host"), None)
    with pytest.raises(ConfigError, match=r"live node at 192\.168\.64\.3.*refuses to start"):
        managers().acquire_lease(attrs("192.168.64.4", node="same-host"), None)
    assert first.renew_lease(held).subnet == held.subnet
    items, _ = raw_store.get_prefix(f"{etcd_prefix}/subnets/")
    assert [json.loads(kv.value)["PublicIP"] for kv in items] == ["192.168.64.3"]


def test_recreated_node_takes_over_its_lease_once_the_old_heartbeat_stopped(
    managers: Callable[..., EtcdSubnetManager], raw_store: EtcdStore, etcd_prefix: str
) -> None:
    """The old holder's etcd lease has a day left; its status record, written by its
    agent's control channel as every heartbeat is, last came 3 x 300 s + 2 min ago."""
    from flannelpy.control.records import BackendSummary, NodeStatus
    from flannelpy.store.node_control import EtcdNodeControl

    day = {"subnet_lease_ttl": 24 * 3600}  # Flannel's TTL: renewed an hour before it ends
    old = managers(**day).acquire_lease(attrs("192.168.64.3", node="node-a"), None)
    record = NodeStatus(
        node="node-a",
        at=time.time(),
        ready=True,
        public_ip="192.168.64.3",
        underlay_networks=("192.168.64.0/24",),
        backend=BackendSummary(type="vxlan", vni=1, port=0, direct_routing=False, mtu=1450),
        vtep=True,
        applied_generation=None,
        heartbeat_seconds=300.0,
    )
    control = EtcdNodeControl(raw_store, etcd_prefix, "node-a")
    control.publish_status(record)  # alive: the second node with its name is refused
    with pytest.raises(ConfigError, match=r"start this node again after .* or delete "):
        managers(**day).acquire_lease(attrs("192.168.64.30", node="node-a"), None)
    control.publish_status(replace(record, at=time.time() - 3 * 300 - 121))  # silent since
    new = managers(**day).acquire_lease(attrs("192.168.64.30", node="node-a"), None)
    assert new.subnet == old.subnet
    assert old.store_lease_id is not None
    remaining = raw_store.lease_remaining(old.store_lease_id)
    assert remaining is None or remaining > 23 * 3600  # before: refused for that long
    items, _ = raw_store.get_prefix(f"{etcd_prefix}/subnets/")
    assert [json.loads(kv.value)["PublicIP"] for kv in items] == ["192.168.64.30"]


def test_reservation_without_etcd_lease_is_reused_and_stays_permanent(
    managers: Callable[..., EtcdSubnetManager], raw_store: EtcdStore, etcd_prefix: str
) -> None:
    key = f"{etcd_prefix}/subnets/10.244.5.0-24"
    raw_store.put(key, FLANNELD_VALUE.encode())
    lease = managers().acquire_lease(attrs("192.168.64.3", node="n"), None)
    assert (str(lease.subnet), lease.expiration, lease.store_lease_id) == (
        "10.244.5.0/24",
        None,
        None,
    )
    kv = raw_store.get(key)
    assert (
        kv is not None and kv.lease_id == 0 and json.loads(kv.value)["Flannelpy"]["NodeName"] == "n"
    )


def test_twenty_nodes_acquiring_at_once_get_distinct_subnets(
    managers: Callable[..., EtcdSubnetManager], raw_store: EtcdStore, etcd_prefix: str
) -> None:
    nodes = [managers() for _ in range(20)]
    barrier = threading.Barrier(len(nodes))
    results: dict[int, Lease] = {}
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            barrier.wait(5)
            results[i] = nodes[i].acquire_lease(attrs(f"192.168.65.{i + 1}"), None)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(nodes))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert len({lease.subnet for lease in results.values()}) == 20
    items, _ = raw_store.get_prefix(f"{etcd_prefix}/subnets/")
    owners = {kv.key.rsplit("/", 1)[1]: json.loads(kv.value)["PublicIP"] for kv in items}
    assert owners == {lease.key: str(lease.attrs.public_ip) for lease in results.values()}


def test_full_pool_raises_pool_exhausted(
    managers: Callable[..., EtcdSubnetManager], raw_store: EtcdStore, etcd_prefix: str
) -> None:
    put_network_config(raw_store, etcd_prefix, '{"Network": "10.10.0.0/22"}')  # 3 subnets
    for i in range(3):
        managers().acquire_lease(attrs(f"192.168.66.{i + 1}"), None)
    with pytest.raises(PoolExhausted) as err:
        managers().acquire_lease(attrs("192.168.66.9"), None)
    assert str(err.value) == (
        "no free subnet in 10.10.0.0/22: all 3 subnets of length /24 between 10.10.1.0 and "
        "10.10.3.0 are leased; free some leases or enlarge Network"
    )


def test_renew_recreates_our_lease_if_it_vanished_and_refuses_if_taken(
    managers: Callable[..., EtcdSubnetManager], raw_store: EtcdStore, etcd_prefix: str
) -> None:
    manager = managers()
    lease = manager.acquire_lease(attrs("192.168.64.3"), None)
    key = f"{etcd_prefix}/subnets/{lease.key}"
    assert raw_store.delete_if_mod_revision(key, lease.revision)
    renewed = manager.renew_lease(lease)  # gone: re-created on the same subnet
    kv = raw_store.get(key)
    assert kv is not None and kv.mod_revision == renewed.revision
    raw_store.put(key, attrs("192.168.64.99").to_json().encode())  # someone else's now
    with pytest.raises(StoreError, match=re.escape("is now held by PublicIP 192.168.64.99")):
        manager.renew_lease(renewed)


def test_release_deletes_the_key(
    managers: Callable[..., EtcdSubnetManager], raw_store: EtcdStore, etcd_prefix: str
) -> None:
    manager = managers()
    lease = manager.acquire_lease(attrs("192.168.64.3"), None)
    assert manager.release_lease(lease) is True
    assert raw_store.get(f"{etcd_prefix}/subnets/{lease.key}") is None


def test_watch_reports_all_leases_then_puts_and_deletes_within_a_second(
    managers: Callable[..., EtcdSubnetManager], raw_store: EtcdStore, etcd_prefix: str
) -> None:
    me = managers()
    mine = me.acquire_lease(attrs("192.168.64.1"), None)
    raw_store.put(f"{etcd_prefix}/subnets/10.244.200.0-24", FLANNELD_VALUE.encode())
    with watching(me) as seen:
        first = seen.wait_for(lambda m: len(m) == 2, 2.0)
        assert set(first) == {mine.key, "10.244.200.0-24"}  # our own lease included
        assert first["10.244.200.0-24"].attrs.vtep_mac == "c6:d2:32:6f:8f:44"

        started = time.monotonic()
        peer = managers().acquire_lease(attrs("192.168.64.2"), None)
        seen.wait_for(lambda m: peer.key in m, 1.0)
        assert time.monotonic() - started < 1.0

        started = time.monotonic()
        managers().release_lease(peer)
        seen.wait_for(lambda m: peer.key not in m and len(m) == 2, 1.0)
        assert time.monotonic() - started < 1.0


class _ListCounter:
    """A store that counts the lists of ``subnets/`` and, once, writes ``then_put``
    right after a list (another node's write between our list and our own)."""

    def __init__(self, store: EtcdStore, subnets: str) -> None:
        self.store, self.subnets, self.lists = store, subnets, 0
        self.then_put: tuple[str, bytes] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def get_prefix(self, prefix: str) -> tuple[list[Any], int]:
        listed = self.store.get_prefix(prefix)
        if prefix == self.subnets:
            self.lists += 1
            if self.then_put is not None:
                self.store.put(*self.then_put)
                self.then_put = None
        return listed


@pytest.mark.parametrize("write_between", [False, True], ids=["alone", "a-write-between"])
def test_the_lease_watch_starts_from_the_starts_list_when_it_is_the_store_then(
    managers: Callable[..., EtcdSubnetManager],
    etcd_server: EtcdServer,
    raw_store: EtcdStore,
    etcd_prefix: str,
    write_between: bool,
) -> None:
    """At 5,000 leases a list is a tenth of a second of etcd's and our work: a starting
    node lists once, unless another write came between its list and its lease."""
    raw_store.put(f"{etcd_prefix}/subnets/10.244.200.0-24", FLANNELD_VALUE.encode())
    store = _ListCounter(EtcdStore([etcd_server.endpoint]), f"{etcd_prefix}/subnets/")
    if write_between:
        store.then_put = (f"{etcd_prefix}/subnets/10.244.201.0-24", FLANNELD_VALUE.encode())
    me = managers(store=cast(Store, store))
    mine = me.acquire_lease(attrs("192.168.64.1"), None)
    want = {mine.key, "10.244.200.0-24", *(["10.244.201.0-24"] if write_between else [])}
    with watching(me) as seen:
        first = seen.wait_for(lambda m: set(m) == want, 2.0)
        assert store.lists == (2 if write_between else 1)
        # Exactly what a list says now, revisions and lease ids included.
        listed = me.list_leases()[0]
        assert first == listed
        assert {k: (v.revision, v.store_lease_id) for k, v in first.items()} == {
            k: (v.revision, v.store_lease_id) for k, v in listed.items()
        }
        peer = managers().acquire_lease(attrs("192.168.64.2"), None)
        seen.wait_for(lambda m: peer.key in m, 2.0)  # and the watch goes on from there


def test_watch_ignores_keys_that_are_not_leases_and_warns_once(
    managers: Callable[..., EtcdSubnetManager],
    raw_store: EtcdStore,
    etcd_prefix: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    subnets = f"{etcd_prefix}/subnets/"
    raw_store.put(subnets + "garbage", b"{}")
    raw_store.put(subnets + "10.244.3.0-24", b"not json")
    caplog.set_level(logging.WARNING, logger="flannelpy.store.etcd.manager")
    with watching(managers()) as seen:
        seen.wait_for(lambda m: True, 2.0)
        raw_store.put(subnets + "garbage", b"{}")  # seen again through the watch
        raw_store.put(subnets + "10.244.4.0-24", FLANNELD_VALUE.encode())
        assert set(seen.wait_for(lambda m: len(m) == 1, 2.0)) == {"10.244.4.0-24"}
    warnings = [r.getMessage() for r in caplog.records if "not a lease" in r.getMessage()]
    assert len(warnings) == 2
    assert any("garbage" in w for w in warnings) and any("10.244.3.0-24" in w for w in warnings)


class GatedStore:
    """Delegates to a real store, but the first watch waits for ``gate``: a watcher
    that is disconnected while others write and etcd compacts."""

    def __init__(self, inner: EtcdStore) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.watch_starts: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def watch_prefix(self, prefix: str, start_revision: int, stop: threading.Event) -> WatchStream:
        self.watch_starts.append(start_revision)
        if len(self.watch_starts) == 1:
            assert self.gate.wait(10)
        return self.inner.watch_prefix(prefix, start_revision, stop)


def test_watch_relists_after_compaction_without_losing_state(
    etcd_factory: Callable[..., EtcdServer], etcd_prefix: str
) -> None:
    server = etcd_factory()
    settings = settings_for([server.endpoint], etcd_prefix)
    admin = EtcdStore([server.endpoint])
    put_network_config(admin, etcd_prefix, NETCONF)
    writer = EtcdSubnetManager(EtcdStore([server.endpoint]), settings)
    gated = GatedStore(EtcdStore([server.endpoint]))
    watcher = EtcdSubnetManager(cast(Store, gated), settings)
    try:
        gone = writer.acquire_lease(attrs("192.168.64.1"), None)
        with watching(watcher) as seen:
            seen.wait_for(lambda m: set(m) == {gone.key}, 2.0)
            listed_at = seen.snapshots[0][1]
            # While the watcher is "disconnected": one lease added, one removed, history gone.
            added = writer.acquire_lease(attrs("192.168.64.2"), None)
            writer.release_lease(gone)
            _, now = admin.get_prefix(etcd_prefix)
            admin.compact(now)
            gated.gate.set()
            seen.wait_for(lambda m: set(m) == {added.key}, 3.0)
            assert gated.watch_starts[0] == listed_at + 1
            assert gated.watch_starts[1] > now  # re-listed, then watched from the new revision
            later = writer.acquire_lease(attrs("192.168.64.3"), None)
            seen.wait_for(lambda m: set(m) == {added.key, later.key}, 2.0)
    finally:
        for closable in (writer, watcher, admin):
            closable.close()


def test_watch_survives_etcd_restart_and_delivers_later_changes(
    etcd_factory: Callable[..., EtcdServer], etcd_prefix: str
) -> None:
    server = etcd_factory()
    settings = settings_for([server.endpoint], etcd_prefix)
    admin = EtcdStore([server.endpoint])
    put_network_config(admin, etcd_prefix, NETCONF)
    writer = EtcdSubnetManager(EtcdStore([server.endpoint]), settings)
    restarts: list[str] = []
    watcher = EtcdSubnetManager(connect_etcd(settings), settings, on_watch_restart=restarts.append)
    try:
        first = writer.acquire_lease(attrs("192.168.64.1"), None)
        with watching(watcher) as seen:
            seen.wait_for(lambda m: set(m) == {first.key}, 2.0)
            server.kill()
            # The watch fails and backs off (twice: a retry failed too) before etcd returns.
            wait_until(lambda: restarts.count("unavailable") >= 2, 10.0, "two failed watches")
            server.start()
            later = wait_until(
                lambda: _try(lambda: writer.acquire_lease(attrs("192.168.64.2"), None)),
                10.0,
                "etcd to accept writes again",
            )
            seen.wait_for(lambda m: set(m) == {first.key, later.key}, 5.0)
    finally:
        for closable in (writer, watcher, admin):
            closable.close()


def _try(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except StoreUnavailable:
        return None


def test_watch_backs_off_while_the_store_is_down_and_resets_after() -> None:
    fake = FakeStore()
    settings = AgentSettings(etcd_prefix="/p")
    put_network_config(fake, "/p", NETCONF)
    delays: list[float] = []

    def sleep(stop: threading.Event, seconds: float) -> None:
        delays.append(seconds)
        stop.wait(0.01)

    # Without jitter, so the nominal sequence is exact (test_retry covers the jitter).
    manager = EtcdSubnetManager(fake, settings, sleep=sleep, backoff=lambda: Backoff(jitter=0.0))
    with watching(manager) as seen:
        seen.wait_for(lambda m: True, 2.0)
        fake.set_available(False)
        wait_until(lambda: len(delays) >= 9, 5.0, "nine reconnect attempts")
        fake.set_available(True)
        count = len(delays)
        lease = EtcdSubnetManager(fake, settings).acquire_lease(attrs("192.168.64.1"), None)
        seen.wait_for(lambda m: lease.key in m, 2.0)
        fake.set_available(False)
        wait_until(lambda: len(delays) > count, 5.0, "a reconnect attempt after the reset")
        fake.set_available(True)
    assert delays[:9] == [0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10.0, 10.0, 10.0]
    assert delays[count] == 0.2


def test_unreachable_endpoints_fail_fast_with_a_clear_message() -> None:
    dead = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    store = connect_etcd(AgentSettings(etcd_endpoints=tuple(dead)))
    started = time.monotonic()
    try:
        with pytest.raises(StoreUnavailable) as err:
            store.get_prefix("/coreos.com/network/subnets/")
    finally:
        store.close()
    assert time.monotonic() - started < 10
    message = str(err.value)
    assert dead[0] in message and dead[1] in message
    assert "no endpoint answered" in message and "--etcd-endpoints" in message


def test_fails_over_to_the_second_endpoint_when_the_first_is_dead(
    etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    settings = settings_for([dead, etcd_server.endpoint], etcd_prefix)
    store = connect_etcd(settings)
    manager = EtcdSubnetManager(store, settings)
    try:
        put_network_config(store, etcd_prefix, NETCONF)
        lease = manager.acquire_lease(attrs("192.168.64.1"), None)
        time.sleep(2.5)  # the token expires: the store must authenticate again
        assert set(manager.list_leases()[0]) == {lease.key}
        leases, _ = manager.list_leases()
        assert set(leases) == {lease.key}
    finally:
        manager.close()


@pytest.mark.parametrize(
    "bad",
    ["127.0.0.1:2379:x", "ftp://127.0.0.1:2379", "http://:2379", ""],
)
def test_bad_endpoint_urls_are_config_errors(bad: str) -> None:
    with pytest.raises(ConfigError, match="--etcd-endpoints"):
        EtcdStore([bad] if bad else [])


def test_tls_etcd_with_client_certificates(
    etcd_factory: Callable[..., EtcdServer], etcd_prefix: str, tmp_path: Any
) -> None:
    tls = make_tls_files(str(tmp_path))
    server = etcd_factory(tls=tls)
    assert server.endpoint.startswith("https://")
    settings = settings_for(
        [server.endpoint],
        etcd_prefix,
        etcd_cafile=tls.ca,
        etcd_certfile=tls.client_cert,
        etcd_keyfile=tls.client_key,
    )
    store = connect_etcd(settings)
    assert store.transport == "grpc"  # the certificate's name reaches etcd only over gRPC
    manager = EtcdSubnetManager(store, settings)
    without_cert = EtcdStore([server.endpoint], cafile=tls.ca, timeout=2.0)
    assert without_cert.transport == "gateway"
    try:
        put_network_config(connect_etcd(settings), etcd_prefix, NETCONF)
        lease = manager.acquire_lease(attrs("192.168.64.1"), None)
        time.sleep(2.5)  # the token expires: the store must authenticate again
        assert set(manager.list_leases()[0]) == {lease.key}
        assert set(manager.list_leases()[0]) == {lease.key}
        with pytest.raises(StoreUnavailable):  # the server insists on a client certificate
            without_cert.get(f"{etcd_prefix}/config")
    finally:
        manager.close()
        without_cert.close()


class _ServerAuthOnly(EtcdServer):
    """etcd over TLS that asks no client certificate: neither --client-cert-auth nor
    --trusted-ca-file, which turns it on by itself."""

    def _argv(self) -> list[str]:
        argv = super()._argv()
        at = argv.index("--trusted-ca-file")
        del argv[at : at + 2]
        return [arg for arg in argv if arg != "--client-cert-auth"]


def test_tls_without_a_client_certificate_goes_through_the_gateway(
    etcd_prefix: str, tmp_path: Any
) -> None:
    tls = make_tls_files(str(tmp_path))
    (tmp_path / "other").mkdir()
    other = make_tls_files(str(tmp_path / "other"))
    server = _ServerAuthOnly(tls=tls).start()
    store = EtcdStore([server.endpoint], cafile=tls.ca, timeout=2.0)
    stranger = EtcdStore([server.endpoint], cafile=other.ca, timeout=2.0)
    stop = threading.Event()
    try:
        assert store.transport == "gateway"
        revision = store.put(f"{etcd_prefix}/k", b"1")
        kv = store.get(f"{etcd_prefix}/k")
        assert kv is not None and kv.value == b"1"
        watch = store.watch_prefix(f"{etcd_prefix}/", revision + 1, stop)
        store.put(f"{etcd_prefix}/k", b"2")
        batch = next(iter(watch))
        assert [(e.key, e.value) for e in batch.events] == [(f"{etcd_prefix}/k", b"2")]
        with pytest.raises(StoreUnavailable):  # a CA that did not sign etcd's certificate
            stranger.get(f"{etcd_prefix}/k")
    finally:
        stop.set()
        store.close()
        stranger.close()
        server.stop()


def test_username_and_password(etcd_factory: Callable[..., EtcdServer], etcd_prefix: str) -> None:
    server = etcd_factory(extra_args=["--auth-token-ttl", "1"])  # tokens expire after 1 s
    admin = EtcdStore([server.endpoint])
    put_network_config(admin, etcd_prefix, NETCONF)

    def enable_auth(member: Member) -> None:
        member.call("/auth/user/add", {"name": "root", "password": "s3cret"})
        member.call("/auth/user/grant", {"user": "root", "role": "root"})
        member.call("/auth/enable", {})

    admin._call("enable auth", enable_auth)
    admin.close()
    good = settings_for(
        [server.endpoint], etcd_prefix, etcd_username="root", etcd_password="s3cret"
    )
    bad = settings_for([server.endpoint], etcd_prefix, etcd_username="root", etcd_password="nope")
    manager = EtcdSubnetManager(connect_etcd(good), good)
    anonymous = EtcdStore([server.endpoint])
    wrong = connect_etcd(bad)
    try:
        lease = manager.acquire_lease(attrs("192.168.64.1"), None)
        time.sleep(2.5)  # the token expires: the store must authenticate again
        assert set(manager.list_leases()[0]) == {lease.key}
        # A restart forgets etcd's auth tokens: the store must authenticate again.
        server.kill()
        server.start()
        leases = wait_until(lambda: _try(manager.list_leases), 10.0, "etcd back")
        assert set(leases[0]) == {lease.key}
        with pytest.raises(StoreError, match="--etcd-username"):
            wrong.get(f"{etcd_prefix}/config")
        with pytest.raises(StoreError, match="set --etcd-username and --etcd-password") as err:
            anonymous.get(f"{etcd_prefix}/config")
        assert not isinstance(err.value, StoreUnavailable)
    finally:
        manager.close()
        anonymous.close()
        wrong.close()


# =============================================================================
# etcd as a distributed system (issue 12 §7)
# =============================================================================


def test_watch_from_a_compacted_revision_at_creation_is_our_error(kv: Kv) -> None:
    """However etcd reports it (in the created reply or after), compaction is ours."""
    s, p = kv.store, kv.prefix
    early = s.put(p + "k", b"1")
    current = s.put(p + "k", b"2")
    s.compact(current)
    with pytest.raises(RevisionCompacted):
        for _ in s.watch_prefix(p, early, threading.Event()):
            break


def test_tls_flags_with_only_http_endpoints_are_an_error_naming_both(tmp_path: Any) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_bytes(b"")
    with pytest.raises(ConfigError) as err:
        EtcdStore(["http://127.0.0.1:2379", "http://10.0.0.2:2379"], cafile=str(ca))
    message = str(err.value)
    assert "--etcd-cafile" in message and "--etcd-endpoints" in message
    assert "http://10.0.0.2:2379" in message and "https://" in message
    # One https endpoint among them is enough.
    EtcdStore(["http://127.0.0.1:2379", "https://10.0.0.2:2379"], cafile=str(ca)).close()


def test_tls_certificates_are_reread_when_their_files_change(
    etcd_factory: Callable[..., EtcdServer], etcd_prefix: str, tmp_path: Any
) -> None:
    """Rotation without restart: a new CA and client pair written over the old files."""

    (tmp_path / "old").mkdir()
    (tmp_path / "new").mkdir()
    old = make_tls_files(str(tmp_path / "old"))
    new = make_tls_files(str(tmp_path / "new"))
    files = {
        "ca": str(tmp_path / "ca.pem"),
        "cert": str(tmp_path / "c.pem"),
        "key": str(tmp_path / "k.pem"),
    }

    def install(tls: Any) -> None:
        for src, dst in (
            (tls.ca, files["ca"]),
            (tls.client_cert, files["cert"]),
            (tls.client_key, files["key"]),
        ):
            shutil.copyfile(src, dst + ".tmp")
            os.replace(dst + ".tmp", dst)  # atomic, as a rotation tool writes

    install(old)
    server = etcd_factory(tls=old)
    store = EtcdStore(
        [server.endpoint],
        cafile=files["ca"],
        certfile=files["cert"],
        keyfile=files["key"],
        timeout=2.0,
    )
    try:
        store.put(f"{etcd_prefix}/k", b"1")
        # The server moves to the new CA; then the files are rotated under the agent.
        server.kill()
        server.tls = new
        server.start()
        with pytest.raises(StoreUnavailable):
            store.get(f"{etcd_prefix}/k")  # old credentials: refused
        install(new)
        value = wait_until(lambda: _try(lambda: store.get(f"{etcd_prefix}/k")), 10.0, "rotated")
        assert value.value == b"1"
    finally:
        store.close()


NOBODY = 65534  # the cut-off member runs as this user, so iptables can tell its packets


class _Member(EtcdServer):
    """A member of a local cluster; ``as_nobody`` runs it as uid NOBODY."""

    def __init__(self, index: int, as_nobody: bool = False) -> None:
        super().__init__()
        self.name = f"m{index}"
        self.as_nobody = as_nobody
        if as_nobody:
            os.chown(self.data_dir, NOBODY, NOBODY)

    def _argv(self) -> list[str]:
        argv = super()._argv()
        if self.as_nobody:
            return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]
        return argv


def _start_cluster(size: int) -> list[_Member]:
    """``size`` members on 127.0.0.1; member 0 runs as NOBODY (see _partition)."""
    members = [_Member(i, as_nobody=i == 0) for i in range(size)]
    peers = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in members)
    for member in members:
        member.extra_args = (
            "--initial-cluster",
            peers,
            "--initial-cluster-token",
            f"t{os.getpid()}-{members[0].peer_port}",
        )
    threads = [threading.Thread(target=m.start) for m in members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if not all(m.running for m in members):
        for member in members:
            member.stop()
        raise RuntimeError(f"the etcd cluster did not start: {members[0].log_tail()}")
    return members


def _partition_rules(lonely: _Member, others: Sequence[_Member]) -> list[list[str]]:
    """iptables rules cutting member 0's peer traffic both ways (clients still reach it)."""
    ports = ",".join(str(o.peer_port) for o in others)
    return [
        ["INPUT", "-p", "tcp", "--dport", str(lonely.peer_port), "-j", "DROP"],
        [
            "OUTPUT",
            "-p",
            "tcp",
            "-m",
            "owner",
            "--uid-owner",
            str(NOBODY),
            "-m",
            "multiport",
            "--dports",
            ports,
            "-j",
            "DROP",
        ],
    ]


def _iptables(action: str, rule: list[str]) -> None:
    subprocess.run(["iptables", "-w", action, *rule], check=True, capture_output=True)


def test_watch_on_a_partitioned_minority_member_moves_to_another_endpoint(
    etcd_prefix: str,
) -> None:
    """The member the agent watches is cut off from the other two: its watch is
    cancelled ("no leader"), the agent moves on, and sees what the majority writes."""
    members = _start_cluster(3)
    lonely, others = members[0], members[1:]
    rules = _partition_rules(lonely, others)
    admin = EtcdStore([o.endpoint for o in others])
    settings = settings_for([m.endpoint for m in members], etcd_prefix)
    store = connect_etcd(settings)
    manager = EtcdSubnetManager(store, settings)
    try:
        put_network_config(admin, etcd_prefix, NETCONF)
        with watching(manager) as seen:
            seen.wait_for(lambda m: True, 5.0)
            assert store.endpoints[0] == lonely.endpoint  # the watch starts on member 0
            for rule in rules:
                _iptables("-A", rule)
            try:
                time.sleep(1.0)  # member 0 notices it has lost the leader
                lease = EtcdSubnetManager(admin, settings).acquire_lease(
                    attrs("192.168.64.9"), None
                )
                seen.wait_for(lambda m: lease.key in m, 30.0)
            finally:
                for rule in rules:
                    _iptables("-D", rule)
    finally:
        manager.close()
        admin.close()
        for member in members:
            member.stop()
