"""One kind of object as the API server lists and watches it, for a KindWatch in a thread.

Objects carry their resourceVersion; every change is kept in a history, so a watch from
a resourceVersion replays what came after it and then waits for more, as the real one
does. A test makes changes (:meth:`FakeKind.commit`), sends raw events (a BOOKMARK, an
ERROR, garbage), breaks the open watch, holds its events back, makes the server
unreachable, or compacts (a watch from before answers 410), and waits with
:meth:`FakeKind.settled` until the watcher has taken everything.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Iterator
from typing import Any

from flannelpy.errors import StoreUnavailable
from flannelpy.store.kube.kind_watch import Resource

Json = dict[str, Any]
POLL = 0.02  # seconds between looks at the stop event while no event comes


def _rv(obj: Json) -> int:
    return int(obj["metadata"]["resourceVersion"])


class FakeKind:
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self.objects: dict[str, Json] = {}
        self.rv = 0  # the last change's
        self.compacted = 0
        self.lists = 0
        self.watched_from: list[str] = []
        self._history: list[tuple[int, Json]] = []  # (rv, event), in order
        self._cond = threading.Condition()
        self._epoch = 0  # bumped to end the open watch with a break
        self._waiting_at: int | None = None  # the open watch waits for events after this
        self.unreachable = False  # lists and new watches fail (StoreUnavailable)
        self.held = False  # the open watch delivers nothing until released

    @property
    def resource(self) -> Resource:
        return Resource(self.kind, self.list_page, self.open_watch)

    # -- what a test does ---------------------------------------------------------------

    def commit(self, kind: str, obj: Json) -> None:
        """ADDED, MODIFIED (``obj`` carries its new resourceVersion) or DELETED."""
        with self._cond:
            obj = copy.deepcopy(obj)
            name = obj["metadata"]["name"]
            self.rv = max(self.rv, _rv(obj))
            if kind == "DELETED":
                self.objects.pop(name, None)
            else:
                self.objects[name] = obj
            self._history.append((_rv(obj), {"type": kind, "object": obj}))
            self._cond.notify_all()

    def send(self, event: Any, rv: int | None = None) -> None:
        """A raw event on the open watch (and on any watch from before ``rv``)."""
        with self._cond:
            self.rv = max(self.rv, rv or self.rv)
            self._history.append((rv or self.rv, event))
            self._cond.notify_all()

    def compact(self) -> None:
        with self._cond:
            self.compacted = self.rv

    def break_watch(self) -> None:
        """The open watch's connection breaks (StoreUnavailable from its iterator)."""
        with self._cond:
            self._epoch += 1
            self._waiting_at = None  # settled() waits for the watch that follows
            self._cond.notify_all()

    def settled(self, timeout: float = 5.0) -> None:
        """Wait until a watch has taken (and the watcher applied) every event so far."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._waiting_at is None or self._waiting_at < len(self._history):
                left = deadline - time.monotonic()
                assert left > 0, f"the {self.kind} watch did not take every event"
                self._cond.wait(left)

    # -- what the KindWatch calls ----------------------------------------------------------

    def _answer(self) -> None:
        if self.unreachable:
            raise StoreUnavailable(f"{self.kind}: cannot reach the API server (the test)")

    def list_page(self, token: str | None) -> Json:
        with self._cond:
            self._answer()
            self.lists += 1
            items = [copy.deepcopy(self.objects[n]) for n in sorted(self.objects)]
            return {"metadata": {"resourceVersion": str(self.rv)}, "items": items}

    def open_watch(self, rv: str, stop: threading.Event) -> Iterator[Any]:
        with self._cond:
            self._answer()
            self.watched_from.append(rv)
            start = int(rv)
            if start < self.compacted:
                gone = {"code": 410, "message": f"too old resource version: {start}"}
                return iter([{"type": "ERROR", "object": gone}])
            position = next((i for i, (r, _) in enumerate(self._history) if r > start), None)
            return self._events(len(self._history) if position is None else position, stop)

    def _events(self, position: int, stop: threading.Event) -> Iterator[Any]:
        epoch = self._epoch
        while not stop.is_set():
            with self._cond:
                if self._epoch != epoch:
                    self._waiting_at = None
                    raise StoreUnavailable(f"{self.kind} watch broke (the test broke it)")
                if position < len(self._history) and not self.held:
                    event = copy.deepcopy(self._history[position][1])
                    position += 1
                else:
                    self._waiting_at = None if self.held else position  # all before applied
                    self._cond.notify_all()
                    self._cond.wait(POLL)
                    continue
            self._waiting_at = None
            yield event
