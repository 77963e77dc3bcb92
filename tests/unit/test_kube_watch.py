"""The node watch's health rule (``LeaseMap.take_watch_health``): what makes a broken watch
start a fresh backoff."""

from __future__ import annotations

from flannelpy.store.kube.watch import HEALTHY_WATCH, LeaseMap


def test_no_watch_opened_is_not_healthy() -> None:
    assert not LeaseMap("a").take_watch_health(100.0)


def test_a_watch_that_ends_at_once_without_events_is_not_healthy() -> None:
    state = LeaseMap("a")
    state.watch_opened(100.0)
    assert not state.take_watch_health(100.0 + HEALTHY_WATCH / 2)


def test_a_watch_open_long_enough_is_healthy_even_without_events() -> None:
    state = LeaseMap("a")
    state.watch_opened(100.0)
    assert state.take_watch_health(100.0 + HEALTHY_WATCH)


def test_a_watch_that_brought_an_event_is_healthy_however_short() -> None:
    state = LeaseMap("a")
    state.watch_opened(100.0)
    state.watch_event()
    assert state.take_watch_health(100.01)


def test_health_is_taken_once_and_each_watch_counts_its_own_events() -> None:
    state = LeaseMap("a")
    state.watch_opened(100.0)
    state.watch_event()
    assert state.take_watch_health(100.1)
    assert not state.take_watch_health(200.0)  # a failed list after it: no watch opened
    state.watch_opened(300.0)  # a new watch starts with no events
    assert not state.take_watch_health(300.1)
