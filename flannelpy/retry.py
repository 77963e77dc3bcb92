"""Retry delays: exponential, capped, with jitter, reset only once work succeeded.

Jitter spreads the retries of many agents that lost the same store at the same
moment (a cluster-wide restart, an etcd leader change), so they do not return
in lock-step and knock it over again.
"""

from __future__ import annotations

import random
from collections.abc import Callable

BACKOFF_FIRST = 0.2  # seconds; doubles on each failure up to BACKOFF_MAX
BACKOFF_MAX = 10.0
JITTER = 0.2  # each delay is drawn from [d * (1 - JITTER), d]


class Backoff:
    def __init__(
        self,
        first: float = BACKOFF_FIRST,
        cap: float = BACKOFF_MAX,
        jitter: float = JITTER,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self._first = first
        self._cap = cap
        self._jitter = jitter
        self._rand = rand
        self._next = first

    def reset(self) -> None:
        self._next = self._first

    def next(self) -> float:
        delay = self._next
        self._next = min(self._next * 2, self._cap)
        return delay * (1.0 - self._jitter * self._rand())
