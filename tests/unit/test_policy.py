"""The disruption policy: parsing, window arithmetic across days, midnight, the week
boundary and UTC offsets, decisions and their sentences, disruptive differences."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from flannelpy.config.netconf import BackendConfig
from flannelpy.control.policy import (
    ALLOW,
    DisruptionPolicy,
    MaintenanceWindow,
    decide,
    disruptive_changes,
    format_policy,
    parse_policy,
    policy_to_doc,
    window_from_flags,
    window_state,
    with_policy,
)
from flannelpy.errors import ConfigError

MON, TUE, WED, THU, FRI, SAT, SUN = range(7)
H = timedelta(hours=1)
M = timedelta(minutes=1)


def window(
    days: set[int], start: str, duration: timedelta, offset: timedelta = timedelta(0)
) -> MaintenanceWindow:
    hours, minutes = start.split(":")
    return MaintenanceWindow(frozenset(days), int(hours) * 60 + int(minutes), duration, offset)


def at(text: str) -> datetime:
    """An aware datetime from ISO text with its offset."""
    when = datetime.fromisoformat(text)
    assert when.utcoffset() is not None
    return when


def assert_one_sentence(message: str) -> None:
    assert "\n" not in message
    assert not re.search(r"\.\s+[A-Z]", message), message  # no second sentence
    assert not message.endswith(".")


# 2026-12-07 is a Monday.
assert datetime(2026, 12, 7).weekday() == MON

# --- parsing ---------------------------------------------------------------------------


def doc_with(policy: Any) -> dict[str, Any]:
    return {"Network": "10.244.0.0/16", "DisruptionPolicy": policy}


WEEKEND = window({SAT, SUN}, "02:00", 4 * H, 2 * H)


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        ({"Network": "10.244.0.0/16"}, ALLOW),
        (doc_with(None), ALLOW),  # JSON null is "not set"
        (doc_with({"Mode": "Allow"}), ALLOW),
        (doc_with({"Mode": "block"}), DisruptionPolicy("Block")),
        ({"disruptionpolicy": {"mode": "BLOCK"}}, DisruptionPolicy("Block")),
        (
            doc_with(
                {
                    "Mode": "AllowDuringMaintenanceWindow",
                    "Window": {
                        "Days": ["Sat", "Sun"],
                        "Start": "02:00",
                        "Duration": "4h",
                        "UTCOffset": "+02:00",
                    },
                }
            ),
            DisruptionPolicy("AllowDuringMaintenanceWindow", WEEKEND),
        ),
        (  # every key in any case, full day names in any case
            {
                "DISRUPTIONPOLICY": {
                    "mode": "allowduringmaintenancewindow",
                    "window": {
                        "days": ["SATURDAY", "sunday"],
                        "start": "2:00",
                        "duration": "240m",
                        "utcoffset": "+0200",
                    },
                }
            },
            DisruptionPolicy("AllowDuringMaintenanceWindow", WEEKEND),
        ),
        (  # a range, minutes and hours, a negative half-hour offset
            doc_with(
                {
                    "Mode": "AllowDuringMaintenanceWindow",
                    "Window": {
                        "Days": ["Mon-Fri"],
                        "Start": "23:30",
                        "Duration": "1h30m",
                        "UTCOffset": "-05:30",
                    },
                }
            ),
            DisruptionPolicy(
                "AllowDuringMaintenanceWindow",
                window({MON, TUE, WED, THU, FRI}, "23:30", 90 * M, -(5 * H + 30 * M)),
            ),
        ),
        (  # a range across the week boundary; no offset is UTC; Z is UTC
            doc_with(
                {
                    "Mode": "AllowDuringMaintenanceWindow",
                    "Window": {"Days": ["Sat-Mon"], "Start": "00:00", "Duration": "1h"},
                }
            ),
            DisruptionPolicy("AllowDuringMaintenanceWindow", window({SAT, SUN, MON}, "00:00", H)),
        ),
        (
            doc_with(
                {
                    "Mode": "AllowDuringMaintenanceWindow",
                    "Window": {
                        "Days": ["wed"],
                        "Start": "12:05",
                        "Duration": "0h45m",
                        "UTCOffset": "Z",
                    },
                }
            ),
            DisruptionPolicy("AllowDuringMaintenanceWindow", window({WED}, "12:05", 45 * M)),
        ),
        (  # a Window kept with Block: validated, unused
            doc_with(
                {
                    "Mode": "Block",
                    "Window": {
                        "Days": ["Sat", "Sun"],
                        "Start": "02:00",
                        "Duration": "4h",
                        "UTCOffset": "UTC+02:00",
                    },
                }
            ),
            DisruptionPolicy("Block", WEEKEND),
        ),
    ],
)
def test_parse_policy(doc: dict[str, Any], expected: DisruptionPolicy) -> None:
    assert parse_policy(doc) == expected


def win(**window: Any) -> dict[str, Any]:
    base = {"Days": ["Sat"], "Start": "02:00", "Duration": "4h", "UTCOffset": "+02:00"}
    base.update(window)
    return doc_with(
        {
            "Mode": "AllowDuringMaintenanceWindow",
            "Window": {k: v for k, v in base.items() if v is not ...},
        }
    )


@pytest.mark.parametrize(
    ("doc", "names"),
    [
        (doc_with("Block"), ['"DisruptionPolicy"', '{"Mode": "Block"}']),
        (doc_with({}), ['"Mode" is missing', '"Mode": "Block"']),
        (
            doc_with({"Mode": "Sometimes"}),
            ['"Sometimes" is not a mode', "AllowDuringMaintenanceWindow"],
        ),
        (doc_with({"Mode": 1}), ['"Mode" 1 is not a mode']),
        (doc_with({"Mode": "Block", "Windows": {}}), ['unknown key "Windows"', '"Window"']),
        (
            doc_with({"Mode": "AllowDuringMaintenanceWindow"}),
            ['needs a "Window"', '"Days": ["Sat", "Sun"]'],
        ),
        (
            doc_with({"Mode": "AllowDuringMaintenanceWindow", "Window": "Sat 02:00"}),
            ['"Window" must be a JSON object', '"Start": "02:00"'],
        ),
        (win(Days=...), ['"Days" is missing', '"Days": ["Sat", "Sun"]']),
        (win(Start=...), ['"Start" is missing', '"Start": "02:00"']),
        (win(Duration=...), ['"Duration" is missing', '"Duration": "4h"']),
        (win(Days="Sat"), ['"Days" "Sat" is not a list', '"Days": ["Sat", "Sun"]']),
        (win(Days=[]), ['"Days" [] is empty', '"Days": ["Sat", "Sun"]']),
        (win(Days=["Funday"]), ['"Funday"', "not a day name", '"Days": ["Sat", "Sun"]']),
        (win(Days=[6]), ['"Days" [6]', "no name"]),
        (win(Start="24:00"), ['"Start" "24:00" is not a time of day', '"Start": "02:00"']),
        (win(Start="02:60"), ['"Start" "02:60"', '"Start": "02:00"']),
        (win(Start="2am"), ['"Start" "2am"', '"Start": "02:00"']),
        (win(Start=120), ['"Start" 120 is not a string', '"Start": "02:00"']),
        (win(Duration="4"), ['"Duration" "4" is not a duration', '"Duration": "4h"']),
        (win(Duration="1d"), ['"Duration" "1d"', '"Duration": "4h"']),
        (win(Duration="0m"), ["duration must be", "more than 0", "4h"]),
        (win(Duration="168h"), ["less than 7 days", "4h"]),
        (win(UTCOffset="+2"), ['"UTCOffset" "+2" is not a UTC offset', '"UTCOffset": "+02:00"']),
        (win(UTCOffset="+14:30"), ['"UTCOffset" "+14:30"', "beyond 14 hours"]),
        (win(UTCOffset="+02:75"), ['"UTCOffset" "+02:75"', '"UTCOffset": "+02:00"']),
        (win(Timezone="CET"), ['unknown key "Timezone"', '"UTCOffset"']),
        (win(Days=["Mon-Sun"], Duration="24h"), ['"Window" is always open', "Allow"]),
        (win(Days=["Sat", "Sun"], Duration="150h"), ["always open", "shorten the duration"]),
        (
            {"DisruptionPolicy": {"Mode": "Allow"}, "disruptionPolicy": {"Mode": "Block"}},
            ['"DisruptionPolicy" and "disruptionPolicy" differ only in case'],
        ),
        (doc_with({"Mode": "Block", "mode": "Allow"}), ['"Mode" and "mode" differ only']),
    ],
)
def test_parse_errors_are_one_sentence_naming_the_key_and_an_example(
    doc: dict[str, Any], names: list[str]
) -> None:
    with pytest.raises(ConfigError) as err:
        parse_policy(doc)
    message = str(err.value)
    assert message.startswith("net-conf.json: ")
    for name in names:
        assert name in message
    assert_one_sentence(message)
    assert err.value.exit_code == 2


def test_a_window_never_shorter_than_the_gap_is_accepted() -> None:
    # Sat and Sun for 143h: Sun + 143 h ends 1 h before Sat, so the week has a gap.
    policy = parse_policy(win(Days=["Sat", "Sun"], Duration="143h"))
    assert policy.window is not None and policy.window.duration == 143 * H


@pytest.mark.parametrize(
    ("days", "start_minute", "duration", "offset", "needle"),
    [
        (set(), 0, H, timedelta(0), "needs days"),
        ({7}, 0, H, timedelta(0), "needs days"),
        ({MON}, 1440, H, timedelta(0), "start must be"),
        ({MON}, 0, timedelta(0), timedelta(0), "duration must be"),
        ({MON}, 0, timedelta(days=7), timedelta(0), "less than 7 days"),
        ({MON}, 0, H + timedelta(seconds=1), timedelta(0), "whole minutes"),
        ({MON}, 0, H, timedelta(hours=15), "UTC offset must be"),
        ({MON, WED, FRI}, 0, timedelta(days=3), timedelta(0), "always open"),
    ],
)
def test_windows_built_in_code_are_checked_too(
    days: set[int], start_minute: int, duration: timedelta, offset: timedelta, needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle) as err:
        MaintenanceWindow(frozenset(days), start_minute, duration, offset)
    assert_one_sentence(str(err.value))


def test_window_mode_needs_a_window_in_code_too() -> None:
    with pytest.raises(ConfigError, match="needs a window"):
        DisruptionPolicy("AllowDuringMaintenanceWindow", None)


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (("Sat,Sun", "02:00", "4h", "+02:00"), WEEKEND),
        (("sat, SUNDAY", "2:00", "240m", "UTC+02:00"), WEEKEND),
        (("Mon-Fri", "22:00", "1h30m", None), window({MON, TUE, WED, THU, FRI}, "22:00", 90 * M)),
        (("Sun", "23:00", "3h", "-05:30"), window({SUN}, "23:00", 3 * H, -(5 * H + 30 * M))),
    ],
)
def test_window_from_flags(
    flags: tuple[str, str, str, str | None], expected: MaintenanceWindow
) -> None:
    assert window_from_flags(*flags) == expected


@pytest.mark.parametrize(
    ("flags", "names"),
    [
        ((None, None, None, None), ["needs --days, --start and --duration", "--days Sat,Sun"]),
        (("Sat", None, "4h", None), ["needs --start;", "--start 02:00"]),
        (("Sat,Funday", "02:00", "4h", None), ["--days 'Sat,Funday'", "--days Sat,Sun"]),
        (("Sat", "25:00", "4h", None), ["--start '25:00'", "--start 02:00"]),
        (("Sat", "02:00", "4 hours", None), ["--duration '4 hours'", "--duration 4h"]),
        (("Sat", "02:00", "4h", "CET"), ["--utc-offset 'CET'", "--utc-offset +02:00"]),
        (("Mon-Sun", "02:00", "24h", None), ["the window is always open"]),
    ],
)
def test_flag_errors_name_the_flag(
    flags: tuple[str | None, str | None, str | None, str | None], names: list[str]
) -> None:
    with pytest.raises(ConfigError) as err:
        window_from_flags(*flags)
    for name in names:
        assert name in str(err.value)
    assert_one_sentence(str(err.value))


# --- writing back ------------------------------------------------------------------------

windows = st.builds(
    MaintenanceWindow,
    days=st.frozensets(st.integers(0, 6), min_size=1),
    start_minute=st.integers(0, 24 * 60 - 1),
    duration=st.integers(1, 7 * 24 * 60 - 1).map(lambda m: timedelta(minutes=m)),
    utc_offset=st.integers(-14 * 60, 14 * 60).map(lambda m: timedelta(minutes=m)),
)


def valid_windows() -> st.SearchStrategy[MaintenanceWindow]:
    # Always-open combinations raise at construction: skip those draws.
    @st.composite
    def draw(data: st.DrawFn) -> MaintenanceWindow:
        try:
            return data(windows)
        except ConfigError:
            assume(False)
            raise

    return draw()


policies = st.one_of(
    st.just(ALLOW),
    st.just(DisruptionPolicy("Block")),
    valid_windows().map(lambda w: DisruptionPolicy("AllowDuringMaintenanceWindow", w)),
    valid_windows().map(lambda w: DisruptionPolicy("Block", w)),
)


@given(policies)
def test_policy_round_trips_through_its_json(policy: DisruptionPolicy) -> None:
    text = json.dumps({"Network": "10.244.0.0/16", "DisruptionPolicy": policy_to_doc(policy)})
    assert parse_policy(json.loads(text)) == policy


@pytest.mark.parametrize(
    ("policy", "line"),
    [
        (ALLOW, "Allow"),
        (DisruptionPolicy("Block"), "Block"),
        (
            DisruptionPolicy("AllowDuringMaintenanceWindow", WEEKEND),
            "AllowDuringMaintenanceWindow: Sat,Sun 02:00 for 4h (UTC+02:00)",
        ),
        (
            DisruptionPolicy(
                "AllowDuringMaintenanceWindow",
                window({SUN, MON}, "23:30", 90 * M, -(5 * H + 30 * M)),
            ),
            "AllowDuringMaintenanceWindow: Mon,Sun 23:30 for 1h30m (UTC-05:30)",
        ),
        (
            DisruptionPolicy("AllowDuringMaintenanceWindow", window({WED}, "00:05", 45 * M)),
            "AllowDuringMaintenanceWindow: Wed 00:05 for 45m (UTC+00:00)",
        ),
        (
            DisruptionPolicy("Block", WEEKEND),
            "Block (its Window Sat,Sun 02:00 for 4h (UTC+02:00) is unused)",
        ),
    ],
)
def test_format_policy(policy: DisruptionPolicy, line: str) -> None:
    assert format_policy(policy) == line


def test_policy_to_doc_writes_the_documented_form() -> None:
    assert policy_to_doc(DisruptionPolicy("AllowDuringMaintenanceWindow", WEEKEND)) == {
        "Mode": "AllowDuringMaintenanceWindow",
        "Window": {
            "Days": ["Sat", "Sun"],
            "Start": "02:00",
            "Duration": "4h",
            "UTCOffset": "+02:00",
        },
    }
    assert policy_to_doc(ALLOW) == {"Mode": "Allow"}


def test_with_policy_changes_only_its_key_and_keeps_order_and_spelling() -> None:
    raw = (
        '{"network": "10.244.0.0/16", "disruptionPolicy": {"Mode": "Allow"}, '
        '"Backend": {"Type": "vxlan", "VNI": 4, "Custom": [1, 2.5, "é"]}, "Extra": null}'
    )
    out = with_policy(raw, DisruptionPolicy("Block"))
    assert "\n" not in out  # a one-line document stays one line
    doc = json.loads(out)
    assert list(doc) == ["network", "disruptionPolicy", "Backend", "Extra"]
    assert doc["disruptionPolicy"] == {"Mode": "Block"}
    before = json.loads(raw)
    assert {k: v for k, v in doc.items() if k != "disruptionPolicy"} == {
        k: v for k, v in before.items() if k != "disruptionPolicy"
    }


def test_with_policy_adds_the_key_and_keeps_indentation() -> None:
    raw = '{\n  "Network": "10.244.0.0/16",\n  "Backend": {"Type": "host-gw"}\n}\n'
    out = with_policy(raw, DisruptionPolicy("AllowDuringMaintenanceWindow", WEEKEND))
    assert out.startswith('{\n  "Network"') and out.endswith("}\n")
    doc = json.loads(out)
    assert list(doc) == ["Network", "Backend", "DisruptionPolicy"]
    assert parse_policy(doc).window == WEEKEND


def test_with_policy_drops_a_second_spelling_of_the_key() -> None:
    raw = '{"Network": "10.244.0.0/16", "DisruptionPolicy": {}, "DISRUPTIONPOLICY": 1}'
    doc = json.loads(with_policy(raw, ALLOW))
    assert doc == {"Network": "10.244.0.0/16", "DisruptionPolicy": {"Mode": "Allow"}}


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ('{"Backend": {"Type": "vxlan"}}', '"Network" is required'),
        ('{"Network": "10.244.0.0/16", "Backend": {"Type": "udp"}}', "udp"),
        ('{"Network": ', "not valid JSON"),
        ("[1]", "must be a JSON object"),
    ],
)
def test_with_policy_refuses_a_document_that_is_wrong_elsewhere(raw: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)):
        with_policy(raw, ALLOW)


# --- the window at a given time ----------------------------------------------------------

SUN_LATE = window({SUN}, "23:00", 3 * H)  # crosses midnight and the week boundary
FRI_NIGHT = window({FRI}, "22:00", 4 * H)  # crosses midnight
IST = 5 * H + 30 * M
MON_IST = window({MON}, "00:00", H, IST)  # positive half-hour offset
MON_EST = window({MON}, "22:00", 4 * H, -5 * H)  # negative offset, crosses midnight
LONG = window({MON, TUE}, "00:00", 30 * H)  # overlapping occurrences
TOUCHING = window({MON, TUE}, "00:00", 24 * H)  # contiguous occurrences


@pytest.mark.parametrize(
    ("w", "now", "inside", "end", "next_start"),
    [
        # Sat,Sun 02:00 for 4h at +02:00; 2026-12-12 is a Saturday.
        (WEEKEND, "2026-12-12T01:59:59+02:00", False, None, "2026-12-12T02:00:00+02:00"),
        (
            WEEKEND,
            "2026-12-12T02:00:00+02:00",
            True,
            "2026-12-12T06:00:00+02:00",
            "2026-12-13T02:00:00+02:00",
        ),  # exactly at the start: inside
        (
            WEEKEND,
            "2026-12-12T00:00:00+00:00",
            True,
            "2026-12-12T06:00:00+02:00",
            "2026-12-13T02:00:00+02:00",
        ),  # now in UTC, 02:00 local
        (
            WEEKEND,
            "2026-12-12T05:59:59+02:00",
            True,
            "2026-12-12T06:00:00+02:00",
            "2026-12-13T02:00:00+02:00",
        ),
        (
            WEEKEND,
            "2026-12-12T06:00:00+02:00",
            False,
            None,
            "2026-12-13T02:00:00+02:00",
        ),  # exactly at the end: outside
        (WEEKEND, "2026-12-13T06:00:00+02:00", False, None, "2026-12-19T02:00:00+02:00"),
        (WEEKEND, "2026-12-09T12:00:00+02:00", False, None, "2026-12-12T02:00:00+02:00"),
        # Sunday 23:00 for 3h (UTC): inside on Monday 01:00, across the week boundary.
        (
            SUN_LATE,
            "2026-12-07T01:00:00+00:00",
            True,
            "2026-12-07T02:00:00+00:00",
            "2026-12-13T23:00:00+00:00",
        ),
        (
            SUN_LATE,
            "2026-12-06T23:00:00+00:00",
            True,
            "2026-12-07T02:00:00+00:00",
            "2026-12-13T23:00:00+00:00",
        ),
        (SUN_LATE, "2026-12-06T22:59:00+00:00", False, None, "2026-12-06T23:00:00+00:00"),
        (SUN_LATE, "2026-12-07T02:00:00+00:00", False, None, "2026-12-13T23:00:00+00:00"),
        # Friday 22:00 for 4h: Saturday 01:00 is inside.
        (
            FRI_NIGHT,
            "2026-12-12T01:00:00+00:00",
            True,
            "2026-12-12T02:00:00+00:00",
            "2026-12-18T22:00:00+00:00",
        ),
        (FRI_NIGHT, "2026-12-12T02:00:00+00:00", False, None, "2026-12-18T22:00:00+00:00"),
        # Monday 00:00 local at +05:30 is Sunday 18:30 UTC.
        (
            MON_IST,
            "2026-12-06T18:30:00+00:00",
            True,
            "2026-12-07T01:00:00+05:30",
            "2026-12-14T00:00:00+05:30",
        ),
        (MON_IST, "2026-12-06T18:29:00+00:00", False, None, "2026-12-07T00:00:00+05:30"),
        (MON_IST, "2026-12-07T00:30:00+00:00", False, None, "2026-12-14T00:00:00+05:30"),
        # Monday 22:00 at -05:00 is Tuesday 03:00 UTC; Tuesday 04:00 UTC is inside.
        (
            MON_EST,
            "2026-12-08T04:00:00+00:00",
            True,
            "2026-12-08T02:00:00-05:00",
            "2026-12-14T22:00:00-05:00",
        ),
        (MON_EST, "2026-12-08T02:59:00+00:00", False, None, "2026-12-07T22:00:00-05:00"),
        (MON_EST, "2026-12-08T07:00:00+00:00", False, None, "2026-12-14T22:00:00-05:00"),
        # Overlapping and touching occurrences are one window.
        (
            LONG,
            "2026-12-07T12:00:00+00:00",
            True,
            "2026-12-09T06:00:00+00:00",
            "2026-12-14T00:00:00+00:00",
        ),
        (LONG, "2026-12-09T06:00:00+00:00", False, None, "2026-12-14T00:00:00+00:00"),
        (
            TOUCHING,
            "2026-12-07T23:59:00+00:00",
            True,
            "2026-12-09T00:00:00+00:00",
            "2026-12-14T00:00:00+00:00",
        ),
    ],
)
def test_window_state(
    w: MaintenanceWindow, now: str, inside: bool, end: str | None, next_start: str
) -> None:
    state = window_state(w, at(now))
    assert state.inside is inside
    assert state.current_end == (at(end) if end else None)
    assert state.next_start == at(next_start)
    # Times come in the window's own offset, so they print as the operator wrote them.
    assert state.next_start.utcoffset() == w.utc_offset
    if state.current_end is not None:
        assert state.current_end.utcoffset() == w.utc_offset


def test_window_state_refuses_a_naive_time() -> None:
    with pytest.raises(ValueError, match="aware"):
        window_state(WEEKEND, datetime(2026, 12, 12, 3))


def _oracle_inside(w: MaintenanceWindow, t: datetime) -> bool:
    """Inside by modular arithmetic on the time of week: independent of window_state."""
    pos = _week_position(w, t)
    week = timedelta(days=7)
    return any((pos - _start_of(w, d)) % week < w.duration for d in w.days)


def _oracle_next_start(w: MaintenanceWindow, t: datetime) -> datetime:
    """The first occurrence start strictly after ``t``."""
    pos = _week_position(w, t)
    week = timedelta(days=7)
    waits = [((_start_of(w, d) - pos) % week) or week for d in w.days]
    return t + min(waits)


def _week_position(w: MaintenanceWindow, t: datetime) -> timedelta:
    local = t.astimezone(timezone(w.utc_offset))
    midnight = local.replace(hour=0, minute=0, second=0, microsecond=0)
    return timedelta(days=local.weekday()) + (local - midnight)


def _start_of(w: MaintenanceWindow, day: int) -> timedelta:
    return timedelta(days=day, minutes=w.start_minute)


instants = st.datetimes(
    min_value=datetime(2000, 1, 1), max_value=datetime(2100, 1, 1), timezones=st.just(UTC)
)
EPSILON = timedelta(microseconds=1)


@given(valid_windows(), instants)
def test_window_state_agrees_with_arithmetic_on_the_week(
    w: MaintenanceWindow, now: datetime
) -> None:
    state = window_state(w, now)
    assert state.inside is _oracle_inside(w, now)
    assert state.next_start > now
    assert _oracle_inside(w, state.next_start)
    assert not _oracle_inside(w, state.next_start - EPSILON)  # a real start, not a middle
    if state.inside:
        assert state.current_end is not None and state.current_end > now
        assert not _oracle_inside(w, state.current_end)
        assert _oracle_inside(w, state.current_end - EPSILON)
        assert state.next_start == _oracle_next_start(w, state.current_end)
        assert window_state(w, state.current_end - EPSILON).current_end == state.current_end
    else:
        assert state.current_end is None
        assert state.next_start == _oracle_next_start(w, now)
    later = window_state(w, state.next_start)
    assert later.inside and later.current_end is not None


# --- decisions ------------------------------------------------------------------------------

CHANGE = "backend vxlan -> host-gw"


def test_allow_allows() -> None:
    decision = decide(ALLOW, at("2026-12-09T12:00:00+00:00"), CHANGE)
    assert decision.allowed and decision.sentence is None


def test_block_blocks_with_the_sentence() -> None:
    decision = decide(DisruptionPolicy("Block", WEEKEND), at("2026-12-12T03:00:00+02:00"), CHANGE)
    assert not decision.allowed
    assert decision.sentence == (
        "disruptive change (backend vxlan -> host-gw) blocked by DisruptionPolicy Block; set "
        "the policy to Allow or AllowDuringMaintenanceWindow (flannelpy policy set ...), or "
        'pass --force --reason "..." for an emergency'
    )
    assert_one_sentence(decision.sentence)
    assert decision.window_end is None and decision.next_window_start is None


def test_window_allows_inside_and_says_when_it_closes() -> None:
    policy = DisruptionPolicy("AllowDuringMaintenanceWindow", WEEKEND)
    decision = decide(policy, at("2026-12-12T01:30:00+00:00"), CHANGE)
    assert decision.allowed and decision.sentence is None
    assert decision.window_end == at("2026-12-12T06:00:00+02:00")
    assert decision.next_window_start == at("2026-12-13T02:00:00+02:00")


def test_window_blocks_outside_naming_the_next_start_with_its_offset() -> None:
    policy = DisruptionPolicy("AllowDuringMaintenanceWindow", WEEKEND)
    decision = decide(policy, at("2026-12-04T23:00:00+00:00"), "VNI 1 -> 2, MTU 1450 -> 1500")
    assert not decision.allowed
    assert decision.sentence == (
        "disruptive change (VNI 1 -> 2, MTU 1450 -> 1500) blocked by DisruptionPolicy "
        "AllowDuringMaintenanceWindow: outside the window; the next window starts "
        "2026-12-05T02:00:00+02:00"
    )
    assert_one_sentence(decision.sentence)
    assert decision.window_end is None
    assert decision.next_window_start == at("2026-12-05T02:00:00+02:00")


# --- disruptive differences ------------------------------------------------------------------

VX = BackendConfig("vxlan")


@pytest.mark.parametrize(
    ("old", "new", "old_mtu", "new_mtu", "phrases"),
    [
        (VX, VX, 1450, 1450, []),
        (VX, BackendConfig("vxlan", direct_routing=True), 1450, 1450, []),  # applied live
        (VX, BackendConfig("vxlan", port=8472), 1450, 1450, []),  # 0 is the kernel's 8472
        (
            VX,
            BackendConfig("host-gw"),
            1450,
            1500,
            ["backend vxlan -> host-gw", "MTU 1450 -> 1500"],
        ),
        (VX, BackendConfig("vxlan", vni=2), 1450, 1450, ["VNI 1 -> 2"]),
        (VX, BackendConfig("vxlan", port=4789), 1450, 1450, ["VXLAN port 8472 -> 4789"]),
        (VX, VX, 1450, 1400, ["MTU 1450 -> 1400"]),
        (VX, BackendConfig("vxlan", gbp=True), 1450, 1450, ["GBP off -> on"]),
        (BackendConfig("vxlan", learning=True), VX, 1450, 1450, ["learning on -> off"]),
        (
            BackendConfig("host-gw"),
            BackendConfig("vxlan", vni=3, port=4789, gbp=True, learning=True, direct_routing=True),
            1500,
            1450,
            [
                "backend host-gw -> vxlan",
                "VNI 1 -> 3",
                "VXLAN port 8472 -> 4789",
                "MTU 1500 -> 1450",
                "GBP off -> on",
                "learning off -> on",
            ],
        ),
    ],
)
def test_disruptive_changes(
    old: BackendConfig, new: BackendConfig, old_mtu: int, new_mtu: int, phrases: list[str]
) -> None:
    assert disruptive_changes(old, new, old_mtu, new_mtu) == phrases
    # The reverse change is just as disruptive.
    assert len(disruptive_changes(new, old, new_mtu, old_mtu)) == len(phrases)
