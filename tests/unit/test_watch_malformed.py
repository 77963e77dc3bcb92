"""A malformed etcd watch event is never applied: it removes no peer and the watch
re-lists (Flannel's PR #2539: its watcher read a malformed event as an empty snapshot
and removed every peer)."""

from __future__ import annotations

import base64
import threading
from collections.abc import Iterator, Mapping
from typing import Any, cast

import pytest

from flannelpy.config.settings import AgentSettings
from flannelpy.errors import MalformedWatchEvent
from flannelpy.store.etcd.config import put_network_config
from flannelpy.store.etcd.kv import FakeStore, WatchBatch, WatchEvent, WatchStream
from flannelpy.store.etcd.manager import EtcdSubnetManager
from flannelpy.store.etcd.watch import EtcdWatch
from flannelpy.subnet.lease import Lease

PREFIX = "/coreos.com/network"
SUBNETS = f"{PREFIX}/subnets/"
PEER_A = "10.244.1.0-24"
PEER_B = "10.244.2.0-24"


def _event(kind: str | None, key: bytes, revision: int = 7, value: bytes = b"{}") -> Any:
    """One event as etcd's watch sends it (PUT is proto3's default: no "type" at all)."""
    kv = {
        "key": base64.b64encode(key).decode(),
        "value": base64.b64encode(value).decode(),
        "mod_revision": str(revision),
    }
    return {"kv": kv} if kind is None else {"type": kind, "kv": kv}


class _Stream:
    """A member's watch stream that says what it is told, then ends."""

    def __init__(self, *messages: dict[str, Any]) -> None:
        self._messages = [{"result": {"created": True}}, *messages]

    def messages(self) -> Iterator[dict[str, Any]]:
        yield from self._messages

    def without_read_timeout(self) -> None:
        pass

    def abort(self) -> None:
        pass

    def close(self) -> None:
        pass


def _batch(*events: Any) -> WatchBatch | None:
    stop = threading.Event()
    watch = EtcdWatch(_Stream({"result": {"events": list(events)}}), SUBNETS, stop, ())
    try:
        return next(iter(watch))
    finally:
        stop.set()


def test_an_event_of_neither_type_is_malformed_not_a_delete() -> None:
    # Before: every event that was not a put became a delete of its key.
    with pytest.raises(MalformedWatchEvent, match="neither a put nor a delete"):
        _batch(_event("COMPACT", (SUBNETS + PEER_A).encode()))


@pytest.mark.parametrize(
    "event",
    [
        _event("DELETE", b"/elsewhere/10.244.1.0-24"),  # outside the watched prefix
        _event("DELETE", (SUBNETS + PEER_A).encode(), revision=0),  # no revision
        _event(None, b"\xff\xfe" + SUBNETS.encode()),  # a key that is no UTF-8
        {"type": "PUT", "kv": {"key": "not base64!", "mod_revision": "7"}},
        {"type": "PUT"},  # no key-value at all
    ],
    ids=["outside-prefix", "no-revision", "not-utf8", "not-base64", "no-kv"],
)
def test_an_event_that_does_not_fit_the_watch_is_malformed(event: Any) -> None:
    with pytest.raises(MalformedWatchEvent, match="re-listing"):
        _batch(event)


def test_well_formed_events_still_decode() -> None:
    batch = _batch(
        _event(None, (SUBNETS + PEER_A).encode(), revision=8, value=b'{"PublicIP":"1.2.3.4"}'),
        _event("DELETE", (SUBNETS + PEER_B).encode(), revision=9),
    )
    assert batch is not None and batch.revision == 9
    assert [(e.kind, e.key[len(SUBNETS) :], e.value) for e in batch.events] == [
        ("put", PEER_A, b'{"PublicIP":"1.2.3.4"}'),
        ("delete", PEER_B, b""),
    ]


class InjectingStore(FakeStore):
    """The first watch delivers ``injected`` batches, then breaks off; later watches
    are the fake's own."""

    def __init__(self) -> None:
        super().__init__()
        self.injected: list[WatchBatch] = []
        self.watches = 0

    def watch_prefix(self, prefix: str, start_revision: int, stop: threading.Event) -> WatchStream:  # type: ignore[override]
        self.watches += 1
        if self.watches > 1 or not self.injected:
            return super().watch_prefix(prefix, start_revision, stop)
        batches = self.injected

        class Scripted:
            def __iter__(self) -> Iterator[WatchBatch]:
                yield from batches

            def cancel(self) -> None:
                return None

        return Scripted()


def _peer(ip: str) -> bytes:
    return f'{{"PublicIP":"{ip}","BackendType":"host-gw"}}'.encode()


def _run_watch(store: InjectingStore, stop_after: int) -> tuple[list[set[str]], list[str]]:
    """Every lease map the watch delivered (as key sets) and the restart reasons."""
    put_network_config(
        store, PREFIX, '{"Network": "10.244.0.0/16", "Backend": {"Type": "host-gw"}}'
    )
    store.put(SUBNETS + PEER_A, _peer("192.168.0.11"))
    store.put(SUBNETS + PEER_B, _peer("192.168.0.12"))
    seen: list[set[str]] = []
    restarts: list[str] = []
    stop = threading.Event()

    def on_leases(leases: Mapping[str, Lease], _revision: int) -> None:
        seen.append(set(leases))
        if len(seen) >= stop_after:
            stop.set()

    manager = EtcdSubnetManager(
        store,
        AgentSettings(etcd_prefix=PREFIX),
        sleep=lambda _stop, _seconds: None,
        on_watch_restart=restarts.append,
    )
    thread = threading.Thread(target=manager.watch_leases, args=(on_leases, stop), daemon=True)
    thread.start()
    try:
        thread.join(timeout=10)
    finally:
        stop.set()
        thread.join(timeout=5)
    assert not thread.is_alive()
    return seen, restarts


@pytest.mark.parametrize(
    "malformed",
    [
        WatchEvent(cast(Any, "compact"), SUBNETS + PEER_A, b"", 100),  # no put, no delete
        WatchEvent("delete", SUBNETS + PEER_A, b"", 0),  # a revision before the list's
        WatchEvent("delete", "/coreos.com/other/" + PEER_A, b"", 100),  # not under subnets/
    ],
    ids=["unknown-kind", "stale-revision", "outside-prefix"],
)
def test_a_malformed_event_removes_no_peer_and_the_watch_re_lists(malformed: WatchEvent) -> None:
    store = InjectingStore()
    # Beside a well-formed delete of B: a batch is applied whole or not at all.
    store.injected = [WatchBatch((WatchEvent("delete", SUBNETS + PEER_B, b"", 99), malformed), 100)]
    seen, restarts = _run_watch(store, stop_after=2)
    # The first list, then the re-list after the malformed batch: both peers each time.
    # Before, the unknown kind was parsed as a put of nothing, and the stale delete
    # applied, each removing peer A (and the batch's delete removed B).
    assert seen == [{PEER_A, PEER_B}, {PEER_A, PEER_B}]
    assert restarts == ["malformed"]


def test_an_eventless_batch_is_no_empty_snapshot() -> None:
    # Flannel's failure itself: an eventless result read as "the store is empty". The
    # watch here keeps its lease map and delivers it whole; this guards that design
    # (it passed before this change too).
    store = InjectingStore()
    store.injected = [WatchBatch((), 50)]
    seen, restarts = _run_watch(store, stop_after=2)
    assert seen == [{PEER_A, PEER_B}, {PEER_A, PEER_B}] and restarts == []
