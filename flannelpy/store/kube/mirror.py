"""A kind of object mirrored from the API server: listed once, then watched.

What the rollout reads every second while it waits (every Node, every status Lease)
costs the API server a watch event per change this way, not a list of the whole cluster
per look: a step of a 5,000-node rollout costs what one of a 5-node rollout does.

:class:`ObjectMirror` is the pure part: objects by name, as a list and then watch events
make them (a later event never loses to an earlier one, and an object this process
wrote is taken from the answer to the write at once, so the next look reads what it
wrote). :class:`Mirrored` is the side effect: the first read lists in the caller (its
errors are the caller's), then a thread watches (:class:`~.kind_watch.KindWatch`:
bookmarks, 410 Gone lists again, a broken connection resumes from the last
resourceVersion). While that watch is down, a read raises StoreUnavailable rather than
answer with what may be stale.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Mapping
from typing import Any

from flannelpy.errors import StoreUnavailable
from flannelpy.store.kube.api import rv_number
from flannelpy.store.kube.kind_watch import KindWatch, Resource

log = logging.getLogger("flannelpy.store.kube.mirror")

STOP_JOIN = 2.0  # seconds to wait for the watch thread at close


def _name(obj: Mapping[str, Any]) -> str | None:
    meta = obj.get("metadata")
    name = meta.get("name") if isinstance(meta, Mapping) else None
    return name if isinstance(name, str) and name else None


def _rv(obj: Mapping[str, Any]) -> int:
    meta = obj.get("metadata")
    return rv_number(str(meta.get("resourceVersion") or "")) if isinstance(meta, Mapping) else 0


class ObjectMirror:
    """Objects of one kind by name (an :class:`~.kind_watch.ObjectSink`). Callers get the
    dict of the moment; objects are never changed in place, only replaced."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._objects: dict[str, dict[str, Any]] = {}
        self.listed = False

    def replace_all(self, kind: str, objects: Iterable[Any]) -> None:
        found = {}
        for obj in objects:
            name = _name(obj) if isinstance(obj, dict) else None
            if name is not None:
                found[name] = obj
        with self._lock:
            self._objects = found
            self.listed = True

    def put(self, kind: str, obj: Any) -> bool:
        """Keep ``obj`` unless the mirror holds a later version of it (one this process
        wrote, taken from the write's answer before the watch brought it)."""
        name = _name(obj) if isinstance(obj, dict) else None
        if name is None:
            return False
        with self._lock:
            held = self._objects.get(name)
            if held is not None and (held is obj or _rv(held) > _rv(obj)):
                return False
            self._objects = {**self._objects, name: obj}
            return True

    def delete(self, kind: str, obj: Any) -> bool:
        name = _name(obj) if isinstance(obj, dict) else None
        with self._lock:
            if name not in self._objects:
                return False
            self._objects = {k: v for k, v in self._objects.items() if k != name}
            return True

    def objects(self) -> Mapping[str, dict[str, Any]]:
        with self._lock:
            return self._objects


class Mirrored:
    """One kind, listed at the first read and watched from then on until :meth:`close`."""

    def __init__(self, resource: Resource, forbidden_hint: str = "") -> None:
        self.mirror = ObjectMirror()
        self._stop = threading.Event()
        self._down = False  # the watch failed and has not been opened again
        self._watch = KindWatch(
            resource,
            self.mirror,
            self._up,
            on_restart=self._restarted,
            log=log,
            forbidden_hint=forbidden_hint,
            on_open=self._up,
        )
        self._thread: threading.Thread | None = None

    @property
    def kind(self) -> str:
        return self._watch.resource.kind

    def _up(self) -> None:
        """A list, a change, or a watch the server accepted: the mirror is live."""
        self._down = False

    def _restarted(self, reason: str) -> None:
        if reason != "compacted":  # a 410 lists again at once; the mirror is only older
            self._down = True

    def objects(self) -> Mapping[str, dict[str, Any]]:
        """Every object by name, as of the last event. Raises StoreUnavailable while the
        watch is down (and the first list's errors)."""
        if self._thread is None:
            self._watch.list_all(self._stop)
            self._thread = threading.Thread(
                target=self._watch.run, args=(self._stop,), name=f"watch-{self.kind}", daemon=True
            )
            self._thread.start()
        if self._down:
            raise StoreUnavailable(
                f"the {self.kind} watch is down ({self._watch.last_error}); retrying"
            )
        return self.mirror.objects()

    def wrote(self, obj: Mapping[str, Any]) -> None:
        """The API server's answer to a write of ours: read it from now on."""
        self.mirror.put(self.kind, dict(obj))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(STOP_JOIN)
