"""An open etcd watch as the :class:`~flannelpy.store.etcd.kv.Store` hands it out: an
iterator of event batches that ends on stop, or raises when the history it needs was
compacted or the stream broke.

The stream is a member's answer to one ``/watch`` create request (:mod:`.member`), read
on the caller's thread: no hop through another thread between etcd's event and the
caller.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any, Literal

from flannelpy.errors import MalformedWatchEvent, RevisionCompacted, StoreUnavailable
from flannelpy.store.etcd.kv import WatchBatch, WatchEvent
from flannelpy.store.etcd.member import MemberError, MessageStream, number, unb64
from flannelpy.store.etcd.rpc_errors import details

# The client's logger: these lines are the etcd adapter's, as before the split.
log = logging.getLogger("flannelpy.store.etcd.client")

# Seconds: how often an open watch looks at its stop event (a thread beside the stream
# does, and wakes the read blocked on it). Kept well above a watch's own latency (an
# event wakes the reader at once) and well below the agent's shutdown grace
# (THREAD_GRACE_SECONDS).
WATCH_POLL = 1.0


class EtcdWatch:
    """An open etcd watch on ``prefix``: a member's stream, read as it comes.
    ``broken`` are the transport's errors that end a stream."""

    def __init__(
        self,
        stream: MessageStream,
        prefix: str,
        stop: threading.Event,
        broken: tuple[type[BaseException], ...],
    ) -> None:
        self._stream = stream
        self._prefix = prefix
        self._stop = stop
        self._broken: tuple[type[BaseException], ...] = (MemberError, *broken)
        self._cancelled = threading.Event()
        self._messages = stream.messages()
        self._opened()
        stream.without_read_timeout()
        threading.Thread(target=self._stop_on_request, name="etcd-watch-stop", daemon=True).start()

    def _opened(self) -> None:
        """Read the answer to the create request; raises if etcd refused it."""
        try:
            first = next(self._messages, None)
        except self._broken as e:
            self._stream.close()
            raise StoreUnavailable(
                f"etcd watch on {self._prefix} did not open ({details(e)})"
            ) from e
        if first is None:
            self._stream.close()
            raise StoreUnavailable(f"etcd watch on {self._prefix} closed before it opened")
        try:
            result = self._result(first)
        except BaseException:
            self._stream.close()
            raise
        if not result.get("created"):
            self._stream.close()
            raise StoreUnavailable(
                f"etcd watch on {self._prefix}: the member answered the create request with "
                "something else; re-opening"
            )
        self._pending = self._batch(result)  # compaction may already be reported

    def _stop_on_request(self) -> None:
        while not self._cancelled.wait(WATCH_POLL):
            if self._stop.is_set():
                self.cancel()

    def __iter__(self) -> Iterator[WatchBatch]:
        try:
            if self._pending is not None:
                yield self._pending
            for message in self._messages:
                if self._stop.is_set() or self._cancelled.is_set():
                    return
                batch = self._batch(self._result(message))
                if batch is not None:
                    yield batch
            if not (self._stop.is_set() or self._cancelled.is_set()):
                raise StoreUnavailable(f"etcd watch on {self._prefix} broke (stream closed)")
        except self._broken as e:
            if not (self._stop.is_set() or self._cancelled.is_set()):
                raise StoreUnavailable(f"etcd watch on {self._prefix} broke ({details(e)})") from e
        finally:
            self.cancel()
            self._stream.close()

    def _result(self, message: dict[str, Any]) -> dict[str, Any]:
        result = message.get("result")
        if not isinstance(result, dict):
            raise MalformedWatchEvent(
                f"etcd watch on {self._prefix} sent a message without a result; re-listing"
            )
        return result

    def _batch(self, result: dict[str, Any]) -> WatchBatch | None:
        compacted = number(result, "compact_revision")
        if compacted:
            raise RevisionCompacted(
                f"etcd watch on {self._prefix}: history before revision {compacted} was "
                "compacted; re-list",
                compacted,
            )
        if result.get("canceled"):
            reason = result.get("cancel_reason") or "no reason given"
            raise StoreUnavailable(f"etcd watch on {self._prefix} was cancelled ({reason})")
        raw = result.get("events") or []
        if not isinstance(raw, list):
            raise MalformedWatchEvent(
                f"etcd watch on {self._prefix} sent events that are not a list; re-listing"
            )
        events = tuple(_event(e, self._prefix) for e in raw)
        # Messages without events are the created answer and progress notifications.
        return WatchBatch(events, max(e.mod_revision for e in events)) if events else None

    def cancel(self) -> None:
        """End the watch (from any thread): the read blocked on it wakes, and the
        connection closes, which ends the watch on etcd's side."""
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        self._stream.abort()
        log.debug("etcd watch on %s cancelled", self._prefix)


def _event(e: Any, prefix: str) -> WatchEvent:
    """One event of a watch message, or MalformedWatchEvent: an event of another type, a
    key that is no UTF-8 or outside ``prefix``, or no revision. Flannel once turned such
    an event into an eventless result that its watcher read as an empty snapshot,
    removing every peer (its PR #2539): here it is never applied, and the watcher
    re-lists."""
    kind_name = e.get("type", "PUT") if isinstance(e, dict) else None
    if kind_name == "PUT":
        kind: Literal["put", "delete"] = "put"
    elif kind_name == "DELETE":
        kind = "delete"
    else:
        raise MalformedWatchEvent(
            f"etcd watch on {prefix} sent an event that is neither a put nor a delete "
            f"({str(kind_name)[:40]}); re-listing"
        )
    kv = e.get("kv")
    try:
        if not isinstance(kv, dict):
            raise TypeError("the event has no key-value")
        key = unb64(kv.get("key")).decode("utf-8")
        revision = number(kv, "mod_revision")
        value = unb64(kv.get("value")) if kind == "put" else b""
        lease_id = number(kv, "lease") if kind == "put" else 0
    except (TypeError, ValueError) as err:
        raise MalformedWatchEvent(
            f"etcd watch on {prefix} sent an event that does not decode ({err}); re-listing"
        ) from err
    if not key.startswith(prefix) or revision <= 0:
        raise MalformedWatchEvent(
            f"etcd watch on {prefix} sent an event for key {key[:200]!r} at revision "
            f"{revision}, outside what it watches; re-listing"
        )
    return WatchEvent(kind=kind, key=key, value=value, mod_revision=revision, lease_id=lease_id)
