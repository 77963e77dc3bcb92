"""The node watch's helpers: ending a blocked read on stop, and the node → lease map
the watch keeps and delivers from.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator
from typing import Any

from flannelpy.errors import StoreUnavailable
from flannelpy.store.http import Stream
from flannelpy.store.kube import node as kn
from flannelpy.store.kube.api import UNREACHABLE, rv_number
from flannelpy.subnet.lease import Lease
from flannelpy.subnet.manager import LeasesCallback

# The manager's logger: these lines are the node watch's, as before the split.
log = logging.getLogger("flannelpy.store.kube.manager")

STOP_POLL = 0.1  # seconds: how often a blocked watch looks at its stop event
HEALTHY_WATCH = 1.0  # seconds: a watch open this long (or bringing events) was healthy


def decoded_events(stream: Stream, stop: threading.Event, what: str) -> Iterator[Any]:
    """A watch's decoded events; transport failures become StoreUnavailable (raised
    here, so that exceptions from the caller's loop body pass untouched)."""
    try:
        for line in stream.lines():
            if stop.is_set():
                return
            if line.strip():
                yield json.loads(line)
    except UNREACHABLE as e:
        if stop.is_set():
            return
        raise StoreUnavailable(f"{what} broke ({e})") from e
    except ValueError as e:
        raise StoreUnavailable(f"{what} sent a line that is not JSON ({e})") from e


class StreamCloser:
    """Ends a blocked watch read within STOP_POLL of ``stop``: shutting the socket
    down wakes the reading thread, which closing the response would not."""

    def __init__(self, stop: threading.Event) -> None:
        self._stop = stop
        self._lock = threading.Lock()
        self._stream: Stream | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kube-watch-stop", daemon=True)

    def __enter__(self) -> StreamCloser:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(1.0)

    def _run(self) -> None:
        while not self._done.is_set():
            if self._stop.wait(STOP_POLL):
                self.abort()
                return

    def attach(self, stream: Stream) -> None:
        with self._lock:
            self._stream = stream
        if self._stop.is_set():
            self.abort()

    def detach(self) -> None:
        with self._lock:
            self._stream = None

    def abort(self) -> None:
        with self._lock:
            stream = self._stream
        if stream is not None:
            stream.abort()


class LeaseMap:
    """Node name → lease, the resourceVersion it reflects, and what was last delivered.

    The map by lease key that is delivered is kept up to date event by event: a watch
    event costs what it changes, not a pass over every node (at thousands of nodes a
    burst of new ones would otherwise cost each a sort of every name). Two nodes
    claiming one podCIDR keep one as :func:`~flannelpy.store.kube.node.leases_by_key`
    does: our own node, else the first name in order."""

    def __init__(self, own_node: str) -> None:
        self.own_node = own_node
        self.by_node: dict[str, Lease] = {}
        self.rv: str | None = None  # None: list before watching
        self._by_key: dict[str, Lease] = {}  # what is delivered
        self._claims: dict[str, set[str]] = {}  # lease key -> the nodes claiming it
        self._contested: set[str] = set()  # lease keys more than one node claims
        self._delivered: dict[str, Lease] | None = None
        self._dirty = False
        self._duplicates: list[str] = []
        self._watch_opened: float | None = None  # monotonic time; None: no watch open
        self._watch_events = 0

    def watch_opened(self, now: float) -> None:
        self._watch_opened = now
        self._watch_events = 0

    def watch_event(self) -> None:
        self._watch_events += 1

    def take_watch_health(self, now: float) -> bool:
        """Was the watch opened last healthy (it brought events or stayed open
        HEALTHY_WATCH seconds)? Then whatever ended it starts a fresh backoff: a watch
        that served for hours and then broke (an API server restart) is resumed at once,
        not after the delays its last outage reached. Forgets that watch."""
        opened, self._watch_opened = self._watch_opened, None
        if opened is None:
            return False
        return self._watch_events > 0 or now - opened >= HEALTHY_WATCH

    def replace_all(self, by_node: dict[str, Lease], rv: str) -> None:
        self.by_node = by_node
        self.rv = rv
        self._by_key = kn.leases_by_key(by_node, self.own_node)
        self._claims = {}
        for name, lease in by_node.items():
            self._claims.setdefault(lease.key, set()).add(name)
        self._contested = {key for key, names in self._claims.items() if len(names) > 1}
        self._dirty = True

    def put(self, name: str, lease: Lease | None) -> None:
        old = self.by_node.get(name)
        if old is lease or (old is not None and lease is not None and old == lease):
            return
        if lease is None:
            self.by_node.pop(name, None)
        else:
            self.by_node[name] = lease
        for key in {x.key for x in (old, lease) if x is not None}:
            self._claim(key, name, lease is not None and lease.key == key)
        self._dirty = True

    def _claim(self, key: str, name: str, claims: bool) -> None:
        """``name`` claims ``key`` now (or no longer): the key's lease is its winner's."""
        names = self._claims.setdefault(key, set())
        if claims:
            names.add(name)
        else:
            names.discard(name)
        if len(names) > 1:
            self._contested.add(key)
        else:
            self._contested.discard(key)
        if not names:
            del self._claims[key]
            self._by_key.pop(key, None)
            return
        winner = self.own_node if self.own_node in names else min(names)
        self._by_key[key] = self.by_node[winner]

    def duplicates(self) -> list[str]:
        """Names of nodes whose lease lost a podCIDR collision."""
        return sorted(
            name
            for key in self._contested
            for name in self._claims[key]
            if self._by_key[key] is not self.by_node[name]
        )

    def deliver(self, on_leases: LeasesCallback, always: bool = False) -> None:
        if not (self._dirty or always):
            return
        self._dirty = False
        duplicates = self.duplicates()
        if duplicates != self._duplicates:
            self._duplicates = duplicates
            if duplicates:
                log.warning(
                    "nodes claim a pod cidr another node holds; ignoring them nodes=%s",
                    ",".join(duplicates),
                )
        leases = self._by_key
        if always or leases != self._delivered:
            # One snapshot, kept and delivered: neither side changes it.
            self._delivered = delivered = dict(leases)
            on_leases(delivered, rv_number(self.rv))
