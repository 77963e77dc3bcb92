"""Store faults the watch loops must outlive: any error is retried with a growing
backoff, and only a watch that delivered resets it (issue 12 §7)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from flannelpy.config.settings import AgentSettings
from flannelpy.control.node_control import ControlSnapshot
from flannelpy.errors import StoreError, StoreUnavailable
from flannelpy.retry import Backoff
from flannelpy.store.etcd.kv import FakeStore, WatchBatch, WatchStream
from flannelpy.store.etcd.manager import EtcdSubnetManager
from flannelpy.store.node_control import EtcdNodeControl
from flannelpy.subnet.keys import config_key, override_key
from flannelpy.subnet.lease import Lease
from tests.support.waiting import wait_until

PREFIX = "/coreos.com/network"


class _CancelledAtOnce:
    """A watch the server cancels right after creating it (etcd's "no leader")."""

    def __iter__(self) -> Iterator[WatchBatch]:
        raise StoreUnavailable("etcdserver: no leader")
        yield  # pragma: no cover - makes this a generator


class LeaderlessStore(FakeStore):
    """Watches are created, then cancelled at once, ``cancels`` times."""

    def __init__(self, cancels: int) -> None:
        super().__init__()
        self.cancels = cancels

    def watch_prefix(self, prefix: str, start_revision: int, stop: threading.Event) -> WatchStream:  # type: ignore[override]
        if self.cancels > 0:
            self.cancels -= 1
            return _CancelledAtOnce()
        return super().watch_prefix(prefix, start_revision, stop)


def test_lease_watch_backoff_grows_while_watches_are_cancelled_at_once() -> None:
    store = LeaderlessStore(cancels=4)
    stop = threading.Event()
    delays: list[float] = []

    def sleep(_: threading.Event, seconds: float) -> None:
        delays.append(seconds)
        if len(delays) == 5:
            stop.set()

    manager = EtcdSubnetManager(
        store,
        AgentSettings(etcd_prefix=PREFIX),
        sleep=sleep,
        backoff=lambda: Backoff(first=1.0, cap=100.0, jitter=0.0),
    )
    delivered: list[int] = []

    def on_leases(leases: dict[str, Lease], revision: int) -> None:
        delivered.append(revision)
        if len(delivered) == 6:  # five lists, then one event: the watch delivered
            store.cancels = 1
            store.set_available(False)

    thread = threading.Thread(target=manager.watch_leases, args=(on_leases, stop), daemon=True)
    thread.start()
    wait_until(lambda: len(delivered) == 5, timeout=5)
    store.put(f"{PREFIX}/subnets/10.244.1.0-24", b"{}")  # not a lease, but an event
    thread.join(timeout=5)
    # Created-then-cancelled watches do not count as success: 1, 2, 4, 8; a delivery
    # then resets it, so the next outage starts again at 1.
    assert delays[:4] == [1.0, 2.0, 4.0, 8.0]
    assert delays[4] == 1.0


class FailingOnceStore(FakeStore):
    """The first watch of ``key`` fails with an error that is not an outage."""

    def __init__(self, key: str) -> None:
        super().__init__()
        self.key = key
        self.failed = False

    def watch_prefix(self, prefix: str, start_revision: int, stop: threading.Event) -> WatchStream:  # type: ignore[override]
        if prefix == self.key and not self.failed:
            self.failed = True
            raise StoreError("etcd watch failed (PERMISSION_DENIED: etcdserver: permission denied)")
        return super().watch_prefix(prefix, start_revision, stop)


@contextmanager
def watching(store: FakeStore) -> Iterator[list[ControlSnapshot]]:
    """node-a's control watch on ``store`` while the block runs: the snapshots it gave."""
    control = EtcdNodeControl(store, PREFIX, "node-a")
    stop = threading.Event()
    seen: list[ControlSnapshot] = []
    thread = threading.Thread(target=control.watch, args=(seen.append, stop), daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(timeout=5)
    assert not thread.is_alive()


def test_control_watch_outlives_an_error_that_is_not_an_outage() -> None:
    key = config_key(PREFIX)
    store = FailingOnceStore(key)
    with watching(store) as seen:
        wait_until(lambda: store.failed and len(seen) >= 1, timeout=5)
        store.put(key, b'{"Network": "10.244.0.0/16"}')
        wait_until(lambda: bool(seen) and seen[-1].config is not None, timeout=5)


class LaggingConfigStore(FakeStore):
    """The config key's watch delivers nothing: its events are late, as a stream's may be."""

    def watch_prefix(self, prefix: str, start_revision: int, stop: threading.Event) -> WatchStream:  # type: ignore[override]
        if prefix == config_key(PREFIX):
            stop.wait()
            return iter(())
        return super().watch_prefix(prefix, start_revision, stop)


def test_a_removed_override_is_never_seen_with_the_config_it_replaced() -> None:
    """A rollout's end: the target config is written, then the override removed. Seen
    through the override's watch first, the node would run the old config a moment."""
    store = LaggingConfigStore()
    store.put(config_key(PREFIX), b'{"Network": "10.244.0.0/16", "Backend": {"Type": "wireguard"}}')
    store.put(override_key(PREFIX, "node-a"), b'{"Generation": 1, "Backend": {"Type": "vxlan"}}')
    final = b'{"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan"}}'
    with watching(store) as seen:
        wait_until(lambda: bool(seen) and seen[-1].override is not None, timeout=5)
        store.put(config_key(PREFIX), final)
        kv = store.get(override_key(PREFIX, "node-a"))
        assert kv is not None
        assert store.delete_if_mod_revision(kv.key, kv.mod_revision)
        wait_until(lambda: seen[-1].override is None, timeout=5)
    assert [s.config for s in seen if s.override is None] == [final]
