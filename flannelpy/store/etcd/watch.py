"""An open etcd watch as the :class:`~flannelpy.store.etcd.kv.Store` hands it out: an
iterator of event batches that ends on stop, or raises when the history it needs was
compacted or the stream broke.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator
from typing import Any, Literal

import grpc
import pyetcd
from pyetcd import exceptions as etcd_exc
from pyetcd.events import DeleteEvent, PutEvent
from pyetcd.watch import WatchResponse

from flannelpy.errors import MalformedWatchEvent, RevisionCompacted, StoreUnavailable
from flannelpy.store.etcd.kv import WatchBatch, WatchEvent
from flannelpy.store.etcd.rpc_errors import rpc_details

# The client's logger: these lines are the etcd adapter's, as before the split.
log = logging.getLogger("flannelpy.store.etcd.client")

# Seconds: how often a blocked watch looks at its stop event. Each open watch (the
# leases, each control key) wakes this often while nothing happens, so it is kept well
# above a watch's own latency (a response wakes it at once) and well below the agent's
# shutdown grace (THREAD_GRACE_SECONDS).
WATCH_POLL = 1.0

# gRPC's blocking stream iterators (pyetcd's watch thread reads one) wait on their call's
# condition in slices of ``grpc._common.MAXIMUM_WAIT_TIMEOUT``, 0.1 s, only so that a
# *main* thread blocked in one runs its signal handlers soon (grpc issue 19464). A
# response, an error or a cancel notifies the condition, so the slice changes nothing
# but how often an idle stream's thread wakes: 10 times a second. Our streams are read on
# threads of their own, so 1 s, as WATCH_POLL. (A private constant: left alone when a
# gRPC version lacks it.)
GRPC_WAIT_SLICE = 1.0


def _longer_grpc_wait_slice() -> None:
    common = getattr(grpc, "_common", None)
    current = getattr(common, "MAXIMUM_WAIT_TIMEOUT", None)
    if isinstance(current, float) and current < GRPC_WAIT_SLICE:
        common.MAXIMUM_WAIT_TIMEOUT = GRPC_WAIT_SLICE  # type: ignore[union-attr]


_longer_grpc_wait_slice()


class EtcdWatch:
    """An open etcd watch; pyetcd's callback thread feeds ``responses``."""

    def __init__(
        self,
        client: pyetcd.MultiEndpointEtcd3Client,
        watch_id: int,
        responses: queue.Queue[Any],
        prefix: str,
        stop: threading.Event,
    ) -> None:
        self._client = client
        self._watch_id = watch_id
        self._responses = responses
        self._prefix = prefix
        self._stop = stop
        self._cancelled = threading.Event()

    def __iter__(self) -> Iterator[WatchBatch]:
        try:
            while not (self._stop.is_set() or self._cancelled.is_set()):
                try:
                    item = self._responses.get(timeout=WATCH_POLL)
                except queue.Empty:
                    continue
                batch = self._batch(item)
                if batch is not None:
                    yield batch
        finally:
            self.cancel()

    def _batch(self, item: Any) -> WatchBatch | None:
        if isinstance(item, WatchResponse):
            events = tuple(_event(e, self._prefix) for e in item.events)
            # Empty responses are progress notifications: nothing to report.
            return WatchBatch(events, max(e.mod_revision for e in events)) if events else None
        if isinstance(item, etcd_exc.RevisionCompactedError):
            raise RevisionCompacted(
                f"etcd watch on {self._prefix}: history before revision "
                f"{item.compacted_revision} was compacted; re-list",
                int(item.compacted_revision),
            )
        # pyetcd hands the stream's gRPC error (or None when the stream just ended).
        details = rpc_details(item) if isinstance(item, BaseException) else "stream closed"
        raise StoreUnavailable(f"etcd watch on {self._prefix} broke ({details})")

    def cancel(self) -> None:
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        try:
            self._client.cancel_watch(self._watch_id)
        except (grpc.RpcError, etcd_exc.Etcd3Exception, ValueError) as e:
            log.debug("cancelling a watch failed error=%s", rpc_details(e))


def _event(e: Any, prefix: str) -> WatchEvent:
    """One event of a watch response, or MalformedWatchEvent: an event of another type
    (pyetcd's base ``Event``), a key that is no UTF-8 or outside ``prefix``, or no
    revision. Flannel once turned such an event into an eventless result that its
    watcher read as an empty snapshot, removing every peer (its PR #2539): here it is
    never applied, and the watcher re-lists."""
    if isinstance(e, PutEvent):
        kind: Literal["put", "delete"] = "put"
    elif isinstance(e, DeleteEvent):
        kind = "delete"
    else:
        raise MalformedWatchEvent(
            f"etcd watch on {prefix} sent an event that is neither a put nor a delete "
            f"({type(e).__name__}); re-listing"
        )
    try:
        key = bytes(e.key).decode("utf-8")
        revision = int(e.mod_revision)
        value = bytes(e.value) if kind == "put" else b""
        lease_id = int(e.lease) if kind == "put" else 0
    except (TypeError, ValueError, AttributeError) as err:
        raise MalformedWatchEvent(
            f"etcd watch on {prefix} sent an event that does not decode ({err}); re-listing"
        ) from err
    if not key.startswith(prefix) or revision <= 0:
        raise MalformedWatchEvent(
            f"etcd watch on {prefix} sent an event for key {key[:200]!r} at revision "
            f"{revision}, outside what it watches; re-listing"
        )
    return WatchEvent(kind=kind, key=key, value=value, mod_revision=revision, lease_id=lease_id)
