"""The Event series decisions (flannelpy.store.kube.event_series): pure, time given."""

from __future__ import annotations

from flannelpy.store.kube.event_series import (
    NOTE_LIMIT,
    EventSeries,
    EventSpec,
    Write,
    create_body,
    event_name,
    series_patch,
)

BLOCKED = EventSpec("ConfigChangeBlocked", "BlockConfigChange", "backend vxlan -> host-gw blocked")
FORCED = EventSpec("OverrideForced", "ApplyConfigChange", "forced: incident 1")


def created(series: EventSeries, spec: EventSpec, now: float, name: str = "n1.a") -> None:
    write = series.observe(spec, now)
    assert write == Write("create", spec, 1, now)
    series.created(spec, name, now)


def test_first_creates_second_patches_at_once_later_ones_at_most_every_interval() -> None:
    series = EventSeries(patch_interval=60)
    created(series, BLOCKED, 100.0)
    assert series.observe(BLOCKED, 101.0) == Write("patch", BLOCKED, 2, 101.0, "n1.a")
    series.patched(Write("patch", BLOCKED, 2, 101.0, "n1.a"), 101.0)
    # A thousand more within the interval: no write, only the count.
    assert all(series.observe(BLOCKED, 102.0 + i * 0.01) is None for i in range(1000))
    assert series.count(BLOCKED) == 1002
    assert series.flush(150.0) == []
    (due,) = series.flush(161.0)
    assert (due.op, due.count, due.name) == ("patch", 1002, "n1.a")
    series.patched(due, 161.0)
    assert series.flush(500.0) == []  # nothing new since


def test_distinct_events_are_distinct_objects() -> None:
    series = EventSeries()
    created(series, BLOCKED, 1.0, "n1.a")
    created(series, FORCED, 2.0, "n1.b")
    other = EventSpec(BLOCKED.reason, BLOCKED.action, "backend vxlan -> wireguard blocked")
    assert series.observe(other, 3.0) == Write("create", other, 1, 3.0)


def test_a_failed_create_is_retried_by_the_next_occurrence() -> None:
    series = EventSeries()
    assert series.observe(BLOCKED, 1.0) is not None
    series.gone(BLOCKED)  # the create failed
    assert series.observe(BLOCKED, 2.0) == Write("create", BLOCKED, 1, 2.0)


def test_a_repeat_before_the_create_answered_waits_for_it() -> None:
    series = EventSeries()
    assert series.observe(BLOCKED, 1.0) is not None
    assert series.observe(BLOCKED, 1.5) is None  # no name to patch yet
    series.created(BLOCKED, "n1.a", 2.0)
    (due,) = series.flush(2.0)  # the second occurrence goes out as soon as it can
    assert due == Write("patch", BLOCKED, 2, 1.5, "n1.a")


def test_an_event_the_server_expired_is_created_again() -> None:
    series = EventSeries(forget_after=3000)
    created(series, BLOCKED, 0.0)
    assert series.observe(BLOCKED, 3001.0) == Write("create", BLOCKED, 1, 3001.0)


def test_memory_is_bounded() -> None:
    series = EventSeries(max_series=4)
    specs = [
        EventSpec("ConfigChangeBlocked", "BlockConfigChange", f"change {i}") for i in range(10)
    ]
    for i, spec in enumerate(specs):
        created(series, spec, float(i), f"n1.{i}")
    assert [series.count(s) for s in specs] == [0] * 6 + [1] * 4


def test_the_bodies_pass_the_api_server_s_checks() -> None:
    long = EventSpec("OverrideForced", "ApplyConfigChange", "é" * 2000)
    body = create_body("n1", "flannelpy-n1", long, 1764640800.25)
    assert body["apiVersion"] == "events.k8s.io/v1" and body["kind"] == "Event"
    assert body["metadata"]["namespace"] == "default"  # a Node is cluster-scoped
    assert body["metadata"]["name"] == event_name("n1", long, 1764640800.25)
    assert body["metadata"]["name"].startswith("n1.")
    assert body["eventTime"] == "2025-12-02T02:00:00.250000Z"
    assert body["reportingController"] == "flannelpy"
    assert body["regarding"] == {"apiVersion": "v1", "kind": "Node", "name": "n1"}
    assert len(body["note"].encode()) <= NOTE_LIMIT and body["note"].endswith("...")
    assert "series" not in body and "count" not in body  # a series starts at 2
    patch = series_patch(Write("patch", long, 3, 1764640801.0, "n1.x"))
    assert patch == {"series": {"count": 3, "lastObservedTime": "2025-12-02T02:00:01.000000Z"}}
    # Two events in the same microsecond get different names.
    assert event_name("n1", BLOCKED, 5.0) != event_name("n1", FORCED, 5.0)


def test_a_failed_patch_waits_one_interval_before_the_retry() -> None:
    series = EventSeries(patch_interval=60)
    created(series, BLOCKED, 0.0)
    first = series.observe(BLOCKED, 1.0)
    assert first is not None and first.op == "patch"
    series.failed(first, 1.0)  # the API server is down
    assert series.flush(2.0) == [] and series.flush(60.0) == []
    (retry,) = series.flush(61.0)
    assert (retry.count, retry.name) == (2, "n1.a")
