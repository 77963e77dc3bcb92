"""Reconnect delays shared by the store watchers: exponential, capped, reset on success."""

from __future__ import annotations

BACKOFF_FIRST = 0.2  # seconds; doubles on each failure up to BACKOFF_MAX
BACKOFF_MAX = 10.0


class Backoff:
    def __init__(self, first: float = BACKOFF_FIRST, cap: float = BACKOFF_MAX) -> None:
        self._first = first
        self._cap = cap
        self._next = first

    def reset(self) -> None:
        self._next = self._first

    def next(self) -> float:
        delay = self._next
        self._next = min(self._next * 2, self._cap)
        return delay
