"""One kind of object kept by a list and a watch, as client-go's reflector keeps it.

List (pages of raw JSON, one consistent snapshot), then watch from the list's
resourceVersion with bookmarks; 410 Gone lists again (the new list replaces the old one
whole); a broken connection resumes from the last resourceVersion after a backoff, reset
by a watch that served. What the objects become is the sink's business
(:class:`ObjectSink`): NetworkPolicy's inputs (:mod:`.policy_watch`) and the rollout's
Nodes and status Leases (:mod:`.mirror`) use it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from flannelpy.errors import RevisionCompacted, StoreError, StoreUnavailable
from flannelpy.retry import Backoff
from flannelpy.store.kube.api import Forbidden
from flannelpy.store.kube.client import KubeClient, Query, Stream
from flannelpy.store.kube.watch import HEALTHY_WATCH, StreamCloser, decoded_events

WATCH_TIMEOUT_SECONDS = 300
WATCH_READ_SLACK = 30.0
REQUEST_TIMEOUT = (5.0, 15.0)
LIST_PAGE_SIZE = 500

ListPage = Callable[[str | None], dict[str, Any]]  # continue token -> one page
OpenWatch = Callable[[str, threading.Event], Iterator[Any]]  # rv, stop -> events


@dataclass(frozen=True)
class Resource:
    kind: str
    list_page: ListPage
    open_watch: OpenWatch


class ObjectSink(Protocol):
    """Where a kind's objects go: a whole list, then one change at a time (True when it
    changed what the sink holds)."""

    def replace_all(self, kind: str, objects: Iterable[Any]) -> None: ...
    def put(self, kind: str, obj: Any) -> bool: ...
    def delete(self, kind: str, obj: Any) -> bool: ...


def _wait(stop: threading.Event, seconds: float) -> None:
    stop.wait(seconds)


class KindWatch:
    """One kind's list and watch into the sink, until ``stop``. ``forbidden_hint`` ends the
    logged sentence of a refused call (which manifest grants the permission); ``on_open``
    runs each time ``open_watch`` returns (the real one requests the watch at once)."""

    def __init__(
        self,
        resource: Resource,
        cache: ObjectSink,
        on_change: Callable[[], None],
        sleep: Callable[[threading.Event, float], None] = lambda stop, s: _wait(stop, s),
        on_restart: Callable[[str], None] | None = None,
        log: logging.Logger | None = None,
        forbidden_hint: str = "",
        on_open: Callable[[], None] | None = None,
    ) -> None:
        self.resource = resource
        self.cache = cache
        self.on_change = on_change
        self.sleep = sleep
        self.on_restart = on_restart
        self.log = log or logging.getLogger("flannelpy.store.kube.watch")
        self.forbidden_hint = forbidden_hint
        self.on_open = on_open  # the server accepted a watch
        self.rv: str | None = None  # None: list before watching
        self.last_error: str | None = None  # why the last list or watch failed

    def run(self, stop: threading.Event) -> None:
        backoff = Backoff()
        kind, log = self.resource.kind, self.log
        while not stop.is_set():
            opened = time.monotonic()
            served = False
            try:
                if self.rv is None:
                    self.list_all(stop)
                served = self._watch(stop) > 0
            except RevisionCompacted as e:
                log.warning("%s list or watch too old (410 Gone); re-listing error=%s", kind, e)
                self.rv = None
                self._restarted("compacted")
                continue
            except StoreError as e:
                if stop.is_set():
                    return
                if isinstance(e, Forbidden) and self.forbidden_hint:
                    e = StoreError(f"{e}; {self.forbidden_hint}")
                self.last_error = str(e)
                self._restarted("unavailable")
                log.warning("%s watch failed; retrying after a delay error=%s", kind, e)
            except Exception as e:  # a bug or an input no parser foresaw: never the end
                log.exception("%s watch failed; re-listing after a delay", kind)
                self.last_error = f"{type(e).__name__}: {e}"
                self.rv = None
                self._restarted("error")
            if served or time.monotonic() - opened >= HEALTHY_WATCH:
                backoff.reset()
                continue
            self.sleep(stop, backoff.next())

    def _restarted(self, reason: str) -> None:
        if self.on_restart is not None:
            self.on_restart(reason)

    def list_all(self, stop: threading.Event) -> None:
        """List every object (all pages) into the sink; the watch goes on from here."""
        items: list[Any] = []
        rv: str | None = None
        token: str | None = None
        while True:
            if stop.is_set():
                raise StoreError(f"{self.resource.kind} list interrupted: stopping")
            doc = self.resource.list_page(token)
            meta = doc.get("metadata") or {}
            rv = rv or (str(meta["resourceVersion"]) if meta.get("resourceVersion") else None)
            items += [i for i in doc.get("items") or [] if isinstance(i, dict)]
            token = meta.get("continue") or None
            if token is None:
                break
        if rv is None:
            raise StoreUnavailable(f"list {self.resource.kind}: the answer has no resourceVersion")
        self.cache.replace_all(self.resource.kind, items)
        self.rv = rv
        self.log.info(
            "%s listed objects=%d resource_version=%s", self.resource.kind, len(items), rv
        )
        self.on_change()

    def _watch(self, stop: threading.Event) -> int:
        assert self.rv is not None
        count = 0
        events = self.resource.open_watch(self.rv, stop)
        if self.on_open is not None:
            self.on_open()
        for event in events:
            count += 1
            if self._apply(event if isinstance(event, dict) else {}):
                self.on_change()
        return count

    def _apply(self, event: dict[str, Any]) -> bool:
        kind, obj = event.get("type"), event.get("object")
        obj = obj if isinstance(obj, dict) else {}
        if kind == "ERROR":
            message = obj.get("message") or obj.get("reason") or "no message"
            if obj.get("code") == 410:
                raise RevisionCompacted(f"{self.resource.kind} watch: {message} (410 Gone)", 0)
            raise StoreUnavailable(f"{self.resource.kind} watch error {obj.get('code')}: {message}")
        if kind not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
            raise StoreUnavailable(f"{self.resource.kind} watch sent the event type {kind!r}")
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        changed = False
        if kind in ("ADDED", "MODIFIED"):
            changed = self.cache.put(self.resource.kind, obj)
        elif kind == "DELETED":
            changed = self.cache.delete(self.resource.kind, obj)
        self.rv = str(rv) if rv else self.rv
        return changed


def list_and_watch(
    client: KubeClient, what: str, url: str, query: Query | None = None
) -> tuple[ListPage, OpenWatch]:
    """The list and watch calls of one collection (``/api/v1/nodes``, or a namespace's
    Leases with a label selector in ``query``). The watch is requested at once; its
    events come as the result is iterated."""

    def list_page(token: str | None) -> dict[str, Any]:
        page = {**(query or {}), "limit": LIST_PAGE_SIZE, "continue": token}
        return client.get(f"list {what}", url, page, timeout=REQUEST_TIMEOUT)

    def open_watch(rv: str, stop: threading.Event) -> Iterator[Any]:
        stream = client.watch(
            f"watch {what}",
            url,
            {
                **(query or {}),
                "resourceVersion": rv,
                "allowWatchBookmarks": True,
                "timeoutSeconds": WATCH_TIMEOUT_SECONDS,
            },
            timeout=(REQUEST_TIMEOUT[0], WATCH_TIMEOUT_SECONDS + WATCH_READ_SLACK),
        )
        return _events(stream, stop, what)

    return list_page, open_watch


def _events(stream: Stream, stop: threading.Event, what: str) -> Iterator[Any]:
    with StreamCloser(stop) as closer:
        closer.attach(stream)
        try:
            yield from decoded_events(stream, stop, f"{what} watch")
        finally:
            closer.detach()
            stream.close()
