"""Backoff: doubles to a cap, jittered within bounds, reset to the first delay."""

from __future__ import annotations

import random

import pytest

from flannelpy.retry import BACKOFF_FIRST, BACKOFF_MAX, JITTER, Backoff


def test_without_jitter_doubles_up_to_the_cap() -> None:
    backoff = Backoff(first=1.0, cap=5.0, rand=lambda: 0.0)
    assert [backoff.next() for _ in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_full_jitter_draw_takes_off_at_most_the_jitter_fraction() -> None:
    backoff = Backoff(first=1.0, cap=8.0, jitter=0.25, rand=lambda: 1.0)
    assert [backoff.next() for _ in range(4)] == [0.75, 1.5, 3.0, 6.0]


@pytest.mark.parametrize("seed", range(5))
def test_every_delay_lies_within_the_jitter_bounds(seed: int) -> None:
    rng = random.Random(seed)
    backoff = Backoff(rand=rng.random)
    nominal = BACKOFF_FIRST
    for _ in range(20):
        delay = backoff.next()
        assert nominal * (1 - JITTER) <= delay <= nominal
        nominal = min(nominal * 2, BACKOFF_MAX)


def test_jitter_spreads_agents_that_fail_together() -> None:
    delays = {Backoff(rand=random.Random(n).random).next() for n in range(20)}
    assert len(delays) > 1


def test_reset_starts_again_from_the_first_delay() -> None:
    backoff = Backoff(first=0.5, cap=10.0, rand=lambda: 0.0)
    for _ in range(6):
        backoff.next()
    assert backoff.next() == 10.0
    backoff.reset()
    assert [backoff.next() for _ in range(3)] == [0.5, 1.0, 2.0]
