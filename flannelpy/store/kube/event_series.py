"""Which Kubernetes Event writes to make, aggregated as client-go's events recorder does.

Pure: no I/O, time passed in. The first occurrence of an event is created; the same
event again (same reason, action and note) becomes a series on that one object: the
second occurrence patches ``series.count`` at once, later ones are counted in memory
and patched at most every ``patch_interval`` seconds (``flush``). A node blocked on the
same change a thousand times thus leaves one Event and a bounded number of writes.

An Event the API server has expired (``--event-ttl``, one hour by default) is
forgotten here too, after ``forget_after`` seconds without a write, so the next
occurrence creates a new one; ``gone`` does the same when a patch finds it deleted.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

API_VERSION = "events.k8s.io/v1"
REPORTING_CONTROLLER = "flannelpy"
NAMESPACE = "default"  # Events about a cluster-scoped object (a Node) live here
PATCH_INTERVAL = 60.0  # seconds between two series patches of one Event
FORGET_AFTER = 3000.0  # seconds: under the API server's default event TTL of one hour
MAX_SERIES = 64  # Events remembered per process; the least recently seen is dropped
# The API server's limits (pkg/apis/core/validation/events.go), in bytes.
NOTE_LIMIT = 1024
FIELD_LIMIT = 128  # reason, action, reportingInstance


@dataclass(frozen=True)
class EventSpec:
    """One occurrence: ``reason`` (UpperCamelCase), ``action`` (what was done or tried),
    ``note`` (the sentence people read), ``type`` Normal or Warning."""

    reason: str
    action: str
    note: str
    type: Literal["Normal", "Warning"] = "Warning"

    def key(self) -> tuple[str, str, str, str]:
        return (self.reason, self.action, _clip(self.note, NOTE_LIMIT), self.type)


@dataclass(frozen=True)
class Write:
    """One request: create a new Event, or patch the series of the one named ``name``."""

    op: Literal["create", "patch"]
    spec: EventSpec
    count: int
    at: float  # unix time of the latest occurrence it reports
    name: str | None = None  # the Event to patch


@dataclass
class _Series:
    spec: EventSpec
    last_seen: float
    count: int = 1
    name: str | None = None  # None until the create succeeded
    sent_count: int = 0
    sent_at: float = 0.0
    not_before: float = 0.0  # a failed patch is retried from then on


class EventSeries:
    def __init__(
        self,
        patch_interval: float = PATCH_INTERVAL,
        forget_after: float = FORGET_AFTER,
        max_series: int = MAX_SERIES,
    ) -> None:
        self._patch_interval = patch_interval
        self._forget_after = forget_after
        self._max = max_series
        self._series: OrderedDict[tuple[str, str, str, str], _Series] = OrderedDict()

    def observe(self, spec: EventSpec, now: float) -> Write | None:
        """Count one occurrence; the write to make now, if any."""
        self._expire(now)
        key = spec.key()
        s = self._series.get(key)
        if s is None:
            s = _Series(spec, last_seen=now)
            self._series[key] = s
            while len(self._series) > self._max:
                self._series.popitem(last=False)
            return Write("create", spec, 1, now)
        s.count += 1
        s.last_seen = now
        self._series.move_to_end(key)
        return self._write_of(s, now)

    def flush(self, now: float) -> list[Write]:
        """Series patches that are due (counts observed since the last write)."""
        self._expire(now)
        writes = [self._write_of(s, now) for s in self._series.values()]
        return [w for w in writes if w is not None]

    def created(self, spec: EventSpec, name: str, now: float) -> None:
        """The create of ``spec`` succeeded: the server named the Event ``name``."""
        s = self._series.get(spec.key())
        if s is not None:
            s.name, s.sent_count, s.sent_at = name, 1, now

    def patched(self, write: Write, now: float) -> None:
        s = self._series.get(write.spec.key())
        if s is not None and s.name == write.name:
            s.sent_count, s.sent_at = max(s.sent_count, write.count), now

    def failed(self, write: Write, now: float) -> None:
        """A patch did not get through: try again after one interval, not at every
        flush (the API server may be down for a while)."""
        s = self._series.get(write.spec.key())
        if s is not None:
            s.not_before = now + self._patch_interval

    def gone(self, spec: EventSpec) -> None:
        """The Event was not created, or the server deleted it: the next occurrence
        creates one."""
        self._series.pop(spec.key(), None)

    def count(self, spec: EventSpec) -> int:
        s = self._series.get(spec.key())
        return s.count if s else 0

    def _write_of(self, s: _Series, now: float) -> Write | None:
        if s.name is None or s.count <= s.sent_count or now < s.not_before:
            return None  # not created yet (its create is pending or failed), up to date,
            # or a failed patch waiting to be retried
        # The first repeat goes out at once (a series starts), later ones are paced.
        if s.sent_count > 1 and now - s.sent_at < self._patch_interval:
            return None
        return Write("patch", s.spec, s.count, s.last_seen, s.name)

    def _expire(self, now: float) -> None:
        stale = [
            k
            for k, s in self._series.items()
            if now - max(s.sent_at, s.last_seen) >= self._forget_after
        ]
        for key in stale:
            del self._series[key]


# -- the request bodies --------------------------------------------------------------------


def micro_time(at: float) -> str:
    """A metav1.MicroTime: RFC 3339 in UTC with microseconds."""
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def create_body(node: str, instance: str, spec: EventSpec, at: float) -> dict[str, Any]:
    """An events.k8s.io/v1 Event about the Node ``node``, reported by ``instance``."""
    return {
        "apiVersion": API_VERSION,
        "kind": "Event",
        "metadata": {"name": event_name(node, spec, at), "namespace": NAMESPACE},
        "eventTime": micro_time(at),
        "reportingController": REPORTING_CONTROLLER,
        "reportingInstance": _clip(instance, FIELD_LIMIT),
        "action": _clip(spec.action, FIELD_LIMIT),
        "reason": _clip(spec.reason, FIELD_LIMIT),
        "regarding": {"apiVersion": "v1", "kind": "Node", "name": node},
        "note": _clip(spec.note, NOTE_LIMIT),
        "type": spec.type,
    }


def event_name(node: str, spec: EventSpec, at: float) -> str:
    """Like client-go's: the object's name and a unique suffix (the time in hex, and a
    digest of the event, so two events in the same microsecond differ)."""
    digest = zlib.crc32(repr(spec.key()).encode()) & 0xFFFF
    return f"{node}.{int(at * 1e6):x}{digest:04x}"[:253]


def series_patch(write: Write) -> dict[str, Any]:
    """The merge patch that records ``write.count`` occurrences on the Event."""
    return {"series": {"count": write.count, "lastObservedTime": micro_time(write.at)}}


def _clip(text: str, limit: int) -> str:
    """At most ``limit`` bytes of UTF-8, cut on a character boundary."""
    raw = text.encode()
    if len(raw) <= limit:
        return text
    return raw[: limit - 3].decode(errors="ignore") + "..."
