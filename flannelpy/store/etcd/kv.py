"""The small key-value store the etcd subnet manager needs, and an in-memory fake.

:class:`Store` is the subset of etcd v3 the manager uses: ranged reads with the
store revision, create-if-absent and compare-and-swap writes that attach a TTL
lease, deletes guarded by a mod revision, leases, and a prefix watch that
resumes from a revision. :class:`flannelpy.store.etcd.EtcdStore` implements it
over etcd; :class:`FakeStore` implements it in memory with the same revision
semantics and the same error types, so one contract test suite covers both
(``tests/integration/test_etcd_manager.py``).

Errors: ``KeyExists`` (create lost a race), ``RevisionCompacted`` (a watch asked
for history that is gone), ``StoreUnavailable`` (no endpoint answered), and
``StoreError`` for anything else. Compare-and-swap misses are not errors: they
return None / False, because the caller always has a plan for them.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Literal, Protocol

from flannelpy.errors import KeyExists, RevisionCompacted, StoreError, StoreUnavailable
from flannelpy.subnet.keys import KeyValue

WATCH_POLL = 0.1  # seconds: how often a blocked watch looks at its stop event


@dataclass(frozen=True)
class WatchEvent:
    """A put or a delete. Lease expiry arrives as a delete. ``value`` is empty on delete."""

    kind: Literal["put", "delete"]
    key: str
    value: bytes
    mod_revision: int
    lease_id: int = 0


@dataclass(frozen=True)
class WatchBatch:
    """Events delivered together; ``revision`` is the newest event's (resume after it)."""

    events: tuple[WatchEvent, ...]
    revision: int


@dataclass(frozen=True)
class GrantedLease:
    id: int
    ttl: int  # seconds, as granted (etcd may raise a tiny TTL to its minimum)


class WatchStream(Protocol):
    """An open prefix watch. Iterate for batches; iteration ends when ``stop`` is set.

    Iteration raises RevisionCompacted (re-list) or StoreUnavailable (reconnect).
    """

    def __iter__(self) -> Iterator[WatchBatch]: ...

    def cancel(self) -> None: ...


class Store(Protocol):
    def get(self, key: str) -> KeyValue | None: ...

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """Keys under ``prefix`` sorted by key, and the store revision they reflect."""
        ...

    def put(self, key: str, value: bytes, lease_id: int = 0) -> int:
        """Unconditional write; returns the new revision."""
        ...

    def create(self, key: str, value: bytes, lease_id: int = 0) -> int:
        """Write only if ``key`` does not exist; returns the new revision. Raises KeyExists."""
        ...

    def put_if_mod_revision(
        self, key: str, value: bytes, mod_revision: int, lease_id: int = 0
    ) -> int | None:
        """Write only if ``key`` exists with ``mod_revision``; the new revision, or None."""
        ...

    def delete_if_mod_revision(self, key: str, mod_revision: int) -> bool:
        """Delete only if ``key`` exists with ``mod_revision``; True if deleted."""
        ...

    def grant_lease(self, ttl: int) -> GrantedLease: ...

    def refresh_lease(self, lease_id: int) -> int:
        """Restart the lease's TTL; returns it. Raises StoreError if the lease is gone."""
        ...

    def revoke_lease(self, lease_id: int) -> None:
        """Drop the lease and every key attached to it; a missing lease is success."""
        ...

    def lease_remaining(self, lease_id: int) -> int | None:
        """Seconds the lease has left (etcd's LeaseTimeToLive), None when it is gone."""
        ...

    def watch_prefix(self, prefix: str, start_revision: int, stop: threading.Event) -> WatchStream:
        """Open a watch delivering every change under ``prefix`` from ``start_revision``.
        Raises StoreUnavailable if it cannot be opened."""
        ...

    def compact(self, revision: int) -> None:
        """Drop history before ``revision`` (watches from older revisions fail)."""
        ...

    def close(self) -> None: ...


# ---------------------------------------------------------------------------
# In-memory fake
# ---------------------------------------------------------------------------


@dataclass
class _FakeLease:
    ttl: int
    expires_at: float
    keys: set[str]


class FakeStore:
    """An in-memory :class:`Store` for tests: thread-safe, with etcd's revision rules.

    Revisions start at 1 and every write (one per lease expiry) adds one. TTL
    expiry follows the injected ``clock`` and is applied lazily on every call and
    by open watches. ``set_available(False)`` makes every call (and every open
    watch) raise StoreUnavailable, to test reconnect logic.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._revision = 1
        self._compacted = 0
        self._kv: dict[str, KeyValue] = {}
        self._history: list[WatchEvent] = []
        self._leases: dict[int, _FakeLease] = {}
        self._next_lease = 1000
        self._available = True
        self._outages = 0  # bumped on every outage so open watches notice even brief ones
        self.closed = False

    # -- test controls -------------------------------------------------------

    def set_available(self, available: bool) -> None:
        with self._cond:
            self._available = available
            if not available:
                self._outages += 1
            self._cond.notify_all()

    @property
    def revision(self) -> int:
        with self._cond:
            return self._revision

    # -- Store ---------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        with self._cond:
            self._begin()
            return self._kv.get(key)

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        with self._cond:
            self._begin()
            items = [kv for key, kv in sorted(self._kv.items()) if key.startswith(prefix)]
            return items, self._revision

    def put(self, key: str, value: bytes, lease_id: int = 0) -> int:
        with self._cond:
            self._begin()
            return self._write(key, value, lease_id)

    def create(self, key: str, value: bytes, lease_id: int = 0) -> int:
        with self._cond:
            self._begin()
            if key in self._kv:
                raise KeyExists(f"key {key} exists already")
            return self._write(key, value, lease_id)

    def put_if_mod_revision(
        self, key: str, value: bytes, mod_revision: int, lease_id: int = 0
    ) -> int | None:
        with self._cond:
            self._begin()
            current = self._kv.get(key)
            if current is None or current.mod_revision != mod_revision:
                return None
            return self._write(key, value, lease_id)

    def delete_if_mod_revision(self, key: str, mod_revision: int) -> bool:
        with self._cond:
            self._begin()
            current = self._kv.get(key)
            if current is None or current.mod_revision != mod_revision:
                return False
            self._revision += 1
            self._delete(key)
            self._cond.notify_all()
            return True

    def grant_lease(self, ttl: int) -> GrantedLease:
        with self._cond:
            self._begin()
            ttl = max(ttl, 1)
            self._next_lease += 1
            self._leases[self._next_lease] = _FakeLease(ttl, self._clock() + ttl, set())
            return GrantedLease(self._next_lease, ttl)

    def refresh_lease(self, lease_id: int) -> int:
        with self._cond:
            self._begin()
            lease = self._leases.get(lease_id)
            if lease is None:
                raise StoreError(f"etcd lease {lease_id:x} not found; it expired or was revoked")
            lease.expires_at = self._clock() + lease.ttl
            return lease.ttl

    def revoke_lease(self, lease_id: int) -> None:
        with self._cond:
            self._begin()
            self._drop_lease(lease_id)

    def lease_remaining(self, lease_id: int) -> int | None:
        with self._cond:
            self._begin()
            lease = self._leases.get(lease_id)
            return None if lease is None else max(int(lease.expires_at - self._clock()), 0)

    def watch_prefix(self, prefix: str, start_revision: int, stop: threading.Event) -> _FakeWatch:
        with self._cond:
            self._begin()
            return _FakeWatch(self, prefix, start_revision, stop, self._outages)

    def compact(self, revision: int) -> None:
        with self._cond:
            self._begin()
            if revision <= self._compacted:
                raise StoreError(f"revision {revision} has been compacted already")
            if revision > self._revision:
                raise StoreError(f"revision {revision} is in the future")
            self._compacted = revision
            self._history = [e for e in self._history if e.mod_revision >= revision]

    def close(self) -> None:
        self.closed = True

    # -- internals (call with the lock held) ---------------------------------

    def _begin(self) -> None:
        if not self._available:
            raise StoreUnavailable("fake store is unavailable (set_available(False))")
        self._expire()

    def _expire(self) -> None:
        now = self._clock()
        for lease_id in [i for i, lease in self._leases.items() if lease.expires_at <= now]:
            self._drop_lease(lease_id)

    def _drop_lease(self, lease_id: int) -> None:
        lease = self._leases.pop(lease_id, None)
        if lease is None or not lease.keys:
            return
        # etcd deletes all keys of a lease in one revision.
        self._revision += 1
        for key in sorted(lease.keys):
            self._delete(key)
        self._cond.notify_all()

    def _write(self, key: str, value: bytes, lease_id: int) -> int:
        if lease_id and lease_id not in self._leases:
            raise StoreError(f"etcd lease {lease_id:x} not found; it expired or was revoked")
        self._revision += 1
        previous = self._kv.get(key)
        if previous is not None and previous.lease_id in self._leases:
            self._leases[previous.lease_id].keys.discard(key)
        if lease_id:
            self._leases[lease_id].keys.add(key)
        create = previous.create_revision if previous else self._revision
        self._kv[key] = KeyValue(key, value, self._revision, create, lease_id)
        self._history.append(WatchEvent("put", key, value, self._revision, lease_id))
        self._cond.notify_all()
        return self._revision

    def _delete(self, key: str) -> None:
        previous = self._kv.pop(key)
        if previous.lease_id in self._leases:
            self._leases[previous.lease_id].keys.discard(key)
        self._history.append(WatchEvent("delete", key, b"", self._revision))

    def _next_batch(
        self, prefix: str, next_revision: int, done: Callable[[], bool], outages: int
    ) -> WatchBatch | None:
        """Block until events at or after ``next_revision`` exist; None once ``done()``."""
        with self._cond:
            while not done():
                if not self._available or self._outages != outages:
                    raise StoreUnavailable("fake store became unavailable during a watch")
                self._expire()
                if next_revision < self._compacted:
                    raise RevisionCompacted(
                        f"watch from revision {next_revision} is older than the compacted "
                        f"revision {self._compacted}; re-list",
                        self._compacted,
                    )
                events = tuple(
                    e
                    for e in self._history
                    if e.mod_revision >= next_revision and e.key.startswith(prefix)
                )
                if events:
                    return WatchBatch(events, events[-1].mod_revision)
                self._cond.wait(WATCH_POLL)
            return None


class _FakeWatch:
    def __init__(
        self,
        store: FakeStore,
        prefix: str,
        start_revision: int,
        stop: threading.Event,
        outages: int,
    ) -> None:
        self._store = store
        self._prefix = prefix
        self._next = start_revision
        self._stop = stop
        self._outages = outages
        self._cancelled = threading.Event()

    def __iter__(self) -> Iterator[WatchBatch]:
        while not self._done():
            batch = self._store._next_batch(self._prefix, self._next, self._done, self._outages)
            if batch is None:
                return
            self._next = batch.revision + 1
            yield batch

    def _done(self) -> bool:
        return self._stop.is_set() or self._cancelled.is_set()

    def cancel(self) -> None:
        self._cancelled.set()
