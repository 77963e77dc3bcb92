"""Waiting on a condition, never on the clock alone.

A test that sleeps and then asserts can pass because the code was late rather than
right. Every wait here polls a condition, gives up at a deadline and names what it
waited for; "nothing happened" is asserted only after the code has provably handled
the input (see ``agent_events`` for the agent's own counts).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(
    probe: Callable[[], T | None],
    timeout: float = 30.0,
    what: str = "condition",
    *,
    interval: float = 0.02,
) -> T:
    """Poll ``probe`` until it returns something truthy and return that; fail naming
    ``what`` (and the last value seen) after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout:g} s (last: {value!r})")
        time.sleep(interval)
