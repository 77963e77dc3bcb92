"""The disruption policy (field-notes §4): pure parsing, window arithmetic and decisions.

A key of net-conf.json that Flannel ignores::

    "DisruptionPolicy": {"Mode": "AllowDuringMaintenanceWindow",
                         "Window": {"Days": ["Sat", "Sun"], "Start": "02:00",
                                    "Duration": "4h", "UTCOffset": "+02:00"}}

``Allow`` (also when the key is absent: today's behaviour) lets disruptive
changes proceed, ``Block`` refuses them, ``AllowDuringMaintenanceWindow`` lets
them proceed only inside the recurring window. Keys are matched
case-insensitively, as Flannel matches its own. Nothing here reads a clock:
callers pass ``now`` (an aware datetime), so tests can stand anywhere in the week.

A window's days and start are in its own local time (UTC + ``UTCOffset``, a
fixed offset: no daylight saving). Occurrences that overlap or touch form one
window, so "the window ends" always means the moment the change stops being
allowed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, time, timedelta, timezone
from typing import Any, Literal, get_args

from flannelpy.config.netconf import BackendConfig, fold_keys, parse_network_config
from flannelpy.errors import ConfigError

Mode = Literal["Allow", "Block", "AllowDuringMaintenanceWindow"]
MODES: tuple[Mode, ...] = get_args(Mode)
KEY = "DisruptionPolicy"

WEEK = timedelta(days=7)
MAX_OFFSET = timedelta(hours=14)  # the widest offset in use on Earth (UTC+14, Kiribati)
DAY_NAMES = ("Mon", "Tue", "Wed", "Thu", "Fri", "Sat", "Sun")
_FULL_DAY_NAMES = ("monday", "tuesday", "wednesday", "thursday", "friday", "saturday", "sunday")
_DAYS = {name.lower(): i for i, name in enumerate(DAY_NAMES)} | {
    name: i for i, name in enumerate(_FULL_DAY_NAMES)
}

_START_RE = re.compile(r"(\d{1,2}):(\d{2})")
_DURATION_RE = re.compile(r"(?:(\d+)h)?(?:(\d+)m)?", re.IGNORECASE)
_OFFSET_RE = re.compile(r"([+-])(\d{2})(?::?(\d{2}))?")

_WHERE = "net-conf.json"
_POLICY_KEYS = ("Mode", "Window")
_WINDOW_KEYS = ("Days", "Start", "Duration", "UTCOffset")


@dataclass(frozen=True)
class MaintenanceWindow:
    """A weekly window: on each of ``days`` (0 = Monday) from ``start_minute`` (minutes
    after local midnight) for ``duration``, in local time = UTC + ``utc_offset``."""

    days: frozenset[int]
    start_minute: int
    duration: timedelta
    utc_offset: timedelta

    def __post_init__(self) -> None:
        problem = _window_problem(self.days, self.start_minute, self.duration, self.utc_offset)
        if problem is not None:
            raise ConfigError(f"the maintenance window {problem}")

    @property
    def tz(self) -> timezone:
        return timezone(self.utc_offset)


@dataclass(frozen=True)
class DisruptionPolicy:
    """The mode and, for AllowDuringMaintenanceWindow, its window.

    A window given with Allow or Block is kept (so a hand edit that switches the
    mode for a while loses nothing) but plays no part in decisions.
    """

    mode: Mode
    window: MaintenanceWindow | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"DisruptionPolicy mode {self.mode!r} is not one of {_modes()}")
        if self.mode == "AllowDuringMaintenanceWindow" and self.window is None:
            raise ConfigError(
                "DisruptionPolicy AllowDuringMaintenanceWindow needs a window; give days, "
                "start, duration and UTC offset"
            )


ALLOW = DisruptionPolicy("Allow", None)


@dataclass(frozen=True)
class WindowState:
    """Where ``now`` stands: inside a window (until ``current_end``) or not, and the
    start of the next window (after the current one when inside). Times are in the
    window's own offset."""

    inside: bool
    current_end: datetime | None
    next_start: datetime


@dataclass(frozen=True)
class Decision:
    """Whether a disruptive change may proceed now; ``sentence`` says why not."""

    allowed: bool
    sentence: str | None
    window_end: datetime | None  # inside a window: when it closes
    next_window_start: datetime | None  # window mode: the next window's start


# ---------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------


def parse_policy(doc: Mapping[str, Any]) -> DisruptionPolicy:
    """The DisruptionPolicy of a whole net-conf.json document; absent or null → ALLOW.

    Raises ConfigError with one sentence naming the key and an example value.
    """
    value = fold_keys(doc, "")[1].get(KEY.lower())
    if value is None:  # JSON null is "not set", as elsewhere in net-conf.json
        return ALLOW
    label = f'{_WHERE}: "{KEY}"'
    if not isinstance(value, dict):
        raise ConfigError(
            f"{label} must be a JSON object, not {_show(value)}; write it like "
            f'"{KEY}": {{"Mode": "Block"}}'
        )
    policy = _known(value, f'"{KEY}"', _POLICY_KEYS)
    mode = _parse_mode(policy.get("mode"))
    raw_window = policy.get("window")
    window = None
    if raw_window is not None:
        window = _parse_window(raw_window)
    elif mode == "AllowDuringMaintenanceWindow":
        raise ConfigError(
            f'{_WHERE}: "{KEY}" Mode AllowDuringMaintenanceWindow needs a "Window"; add one '
            f"like {_WINDOW_EXAMPLE}"
        )
    return DisruptionPolicy(mode, window)


_WINDOW_EXAMPLE = (
    '"Window": {"Days": ["Sat", "Sun"], "Start": "02:00", "Duration": "4h", "UTCOffset": "+02:00"}'
)


def _parse_mode(value: Any) -> Mode:
    label = f'{_WHERE}: "{KEY}" "Mode"'
    if value is None:
        raise ConfigError(f'{label} is missing; add it like "Mode": "Block" (one of {_modes()})')
    if isinstance(value, str):
        for mode in MODES:
            if mode.lower() == value.strip().lower():
                return mode
    raise ConfigError(f"{label} {_show(value)} is not a mode; use {_modes()}")


def _parse_window(value: Any) -> MaintenanceWindow:
    label = f'{_WHERE}: "{KEY}" "Window"'
    if not isinstance(value, dict):
        raise ConfigError(
            f"{label} must be a JSON object, not {_show(value)}; write it like {_WINDOW_EXAMPLE}"
        )
    keys = _known(value, f'"{KEY}" "Window"', _WINDOW_KEYS)
    for name in ("Days", "Start", "Duration"):
        if keys.get(name.lower()) is None:
            raise ConfigError(
                f'{label} "{name}" is missing; add it like "{name}": {_JSON_EXAMPLES[name]}'
            )

    def value_of(name: str, parse: Any) -> Any:
        raw = keys[name.lower()]
        try:
            if name == "Days":
                if not isinstance(raw, list):
                    raise ValueError("not a list of day names")
                return parse(raw)
            if not isinstance(raw, str):
                raise ValueError("not a string")
            return parse(raw)
        except ValueError as e:
            raise ConfigError(
                f'{label} "{name}" {_show(raw)} is {e}; write it like '
                f'"{name}": {_JSON_EXAMPLES[name]}'
            ) from None

    days = value_of("Days", parse_days)
    start = value_of("Start", parse_start)
    duration = value_of("Duration", parse_duration)
    offset = timedelta(0) if keys.get("utcoffset") is None else value_of("UTCOffset", parse_offset)
    problem = _window_problem(days, start, duration, offset)
    if problem is not None:
        raise ConfigError(f"{label} {problem}")
    return MaintenanceWindow(days, start, duration, offset)


_JSON_EXAMPLES = {
    "Days": '["Sat", "Sun"]',
    "Start": '"02:00"',
    "Duration": '"4h"',
    "UTCOffset": '"+02:00"',
}


def window_from_flags(
    days: str | None, start: str | None, duration: str | None, utc_offset: str | None
) -> MaintenanceWindow:
    """A window from command-line text (``--days Sat,Sun --start 02:00 --duration 4h
    --utc-offset +02:00``); the offset defaults to UTC. Errors name the flag."""
    given = {"--days": days, "--start": start, "--duration": duration}
    missing = [flag for flag, value in given.items() if value is None]
    if missing:
        raise ConfigError(
            f"AllowDuringMaintenanceWindow needs {_and(missing)}; give a window like "
            f"{_FLAG_EXAMPLE}"
        )
    assert days is not None and start is not None and duration is not None

    def flag(name: str, text: str, parse: Any, example: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise ConfigError(f"{name} {text!r} is {e}; write it like {name} {example}") from None

    parsed_days = flag("--days", days, lambda t: parse_days(t.split(",")), "Sat,Sun")
    parsed_start = flag("--start", start, parse_start, "02:00")
    parsed_duration = flag("--duration", duration, parse_duration, "4h")
    offset = (
        timedelta(0)
        if utc_offset is None
        else flag("--utc-offset", utc_offset, parse_offset, "+02:00")
    )
    problem = _window_problem(parsed_days, parsed_start, parsed_duration, offset)
    if problem is not None:
        raise ConfigError(f"the window {problem}")
    return MaintenanceWindow(parsed_days, parsed_start, parsed_duration, offset)


_FLAG_EXAMPLE = "--days Sat,Sun --start 02:00 --duration 4h --utc-offset +02:00"


def parse_days(items: list[Any]) -> frozenset[int]:
    """Day names ("Sat", "saturday") or ranges ("Mon-Fri", wrapping: "Fri-Mon")."""
    days: set[int] = set()
    for item in items:
        if not isinstance(item, str):
            raise ValueError(f"not a list of day names ({_show(item)} is no name)")
        token = item.strip().lower()
        first, dash, last = token.partition("-")
        if dash:
            a, b = _day(first, item), _day(last, item)
            days.update((a + i) % 7 for i in range((b - a) % 7 + 1))
        else:
            days.add(_day(token, item))
    if not days:
        raise ValueError("empty")
    return frozenset(days)


def _day(token: str, item: str) -> int:
    try:
        return _DAYS[token.strip()]
    except KeyError:
        raise ValueError(f"not a day name ({item.strip()!r} is not Mon..Sun)") from None


def parse_start(text: str) -> int:
    """``"HH:MM"`` (24-hour) → minutes after midnight."""
    match = _START_RE.fullmatch(text.strip())
    if not match or int(match[1]) > 23 or int(match[2]) > 59:
        raise ValueError("not a time of day (HH:MM, 00:00 to 23:59)")
    return int(match[1]) * 60 + int(match[2])


def parse_duration(text: str) -> timedelta:
    """``"4h"``, ``"90m"``, ``"1h30m"`` → timedelta."""
    stripped = text.strip()
    match = _DURATION_RE.fullmatch(stripped)
    if not stripped or not match:
        raise ValueError("not a duration (hours and minutes like 4h, 90m or 1h30m)")
    return timedelta(hours=int(match[1] or 0), minutes=int(match[2] or 0))


def parse_offset(text: str) -> timedelta:
    """``"+02:00"``, ``"-05:30"``, ``"+0200"``, ``"+02"``, ``"Z"`` → timedelta. A "UTC"
    prefix is allowed (``"UTC-05:30"``, as format_policy prints it), which also spares
    a command line the leading "-" that argparse takes for an option."""
    stripped = text.strip()
    if stripped[:3].upper() == "UTC":
        stripped = stripped[3:] or "Z"
    if stripped.upper() == "Z":
        return timedelta(0)
    match = _OFFSET_RE.fullmatch(stripped)
    if not match or int(match[3] or 0) > 59:
        raise ValueError("not a UTC offset (+HH:MM, -HH:MM, UTC-HH:MM or Z)")
    offset = timedelta(hours=int(match[2]), minutes=int(match[3] or 0))
    if offset > MAX_OFFSET:
        raise ValueError("not a UTC offset (it is beyond 14 hours)")
    return -offset if match[1] == "-" else offset


def _window_problem(
    days: frozenset[int], start_minute: int, duration: timedelta, utc_offset: timedelta
) -> str | None:
    """What is wrong with a window, as the end of a sentence, or None."""
    if not days or not days <= frozenset(range(7)):
        return "needs days of the week (0 = Monday .. 6 = Sunday); name at least one day"
    if not 0 <= start_minute < 24 * 60:
        return "start must be a time of day between 00:00 and 23:59; use one like 02:00"
    if duration % timedelta(minutes=1) or not timedelta(0) < duration < WEEK:
        return (
            "duration must be whole minutes, more than 0 and less than 7 days; use one "
            "like 4h or 1h30m"
        )
    if abs(utc_offset) > MAX_OFFSET or utc_offset % timedelta(minutes=1):
        return "UTC offset must be whole minutes within 14 hours of UTC; use one like +02:00"
    ordered = sorted(days)
    gaps = [(b - a) % 7 or 7 for a, b in zip(ordered, ordered[1:] + ordered[:1], strict=True)]
    if duration >= timedelta(days=max(gaps)):
        return (
            f"is always open ({format_duration(duration)} on {_day_list(days)} leaves no "
            "time outside it); shorten the duration, or use the mode Allow"
        )
    return None


def _known(obj: Mapping[str, Any], where: str, names: tuple[str, ...]) -> dict[str, Any]:
    """``obj``'s values by folded key; refuses keys we do not know (a misspelt
    "UTCOfset" must not silently mean UTC) and keys that differ only in case."""
    spelled, values = fold_keys(obj, f"{where} ")
    allowed = {n.lower() for n in names}
    for folded, key in spelled.items():
        if folded not in allowed:
            choices = ", ".join(f'"{n}"' for n in names)
            raise ConfigError(f'{_WHERE}: {where} has an unknown key "{key}"; use only {choices}')
    return values


def _show(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _modes() -> str:
    return ", ".join(MODES[:-1]) + f" or {MODES[-1]}"


def _and(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + f" and {items[-1]}"


# ---------------------------------------------------------------------------
# Writing and showing
# ---------------------------------------------------------------------------


def policy_to_doc(policy: DisruptionPolicy) -> dict[str, Any]:
    """The value of the DisruptionPolicy key; ``parse_policy`` reads it back unchanged."""
    doc: dict[str, Any] = {"Mode": policy.mode}
    if policy.window is not None:
        w = policy.window
        doc["Window"] = {
            "Days": [DAY_NAMES[d] for d in sorted(w.days)],
            "Start": format_start(w.start_minute),
            "Duration": format_duration(w.duration),
            "UTCOffset": format_offset(w.utc_offset),
        }
    return doc


def with_policy(raw: str | bytes, policy: DisruptionPolicy) -> str:
    """net-conf.json ``raw`` with its DisruptionPolicy replaced by ``policy``.

    Every other key keeps its spelling, value and place; an existing DisruptionPolicy
    key keeps its spelling too (and a second spelling of it, which Flannel would
    refuse, is dropped). Multi-line documents stay indented. The result is checked
    as a whole: a ConfigError names what is wrong with it.
    """
    try:
        doc = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"{_WHERE}: not valid JSON ({e}); fix the document first") from e
    if not isinstance(doc, dict):
        raise ConfigError(f"{_WHERE}: the document must be a JSON object; fix it first")
    spellings = [key for key in doc if key.lower() == KEY.lower()]
    for extra in spellings[1:]:
        del doc[extra]
    doc[spellings[0] if spellings else KEY] = policy_to_doc(policy)
    text = raw.decode() if isinstance(raw, bytes) else raw
    if "\n" in text.strip():
        out = json.dumps(doc, indent=2, ensure_ascii=False) + "\n"
    else:
        out = json.dumps(doc, ensure_ascii=False)
    parse_network_config(out)
    if parse_policy(doc) != policy:  # our own round trip; a failure here is a bug
        raise AssertionError(f"DisruptionPolicy did not round-trip: {out}")
    return out


def format_policy(policy: DisruptionPolicy) -> str:
    """One line: ``AllowDuringMaintenanceWindow: Sat,Sun 02:00 for 4h (UTC+02:00)``."""
    if policy.window is None:
        return policy.mode
    window = format_window(policy.window)
    if policy.mode == "AllowDuringMaintenanceWindow":
        return f"{policy.mode}: {window}"
    return f"{policy.mode} (its Window {window} is unused)"


def format_window(window: MaintenanceWindow) -> str:
    return (
        f"{_day_list(window.days)} {format_start(window.start_minute)} for "
        f"{format_duration(window.duration)} (UTC{format_offset(window.utc_offset)})"
    )


def format_start(minute: int) -> str:
    return f"{minute // 60:02d}:{minute % 60:02d}"


def format_duration(duration: timedelta) -> str:
    minutes = int(duration // timedelta(minutes=1))
    hours, rest = divmod(minutes, 60)
    return (f"{hours}h" if hours else "") + (f"{rest}m" if rest or not hours else "")


def format_offset(offset: timedelta) -> str:
    minutes = int(offset // timedelta(minutes=1))
    sign = "-" if minutes < 0 else "+"
    hours, rest = divmod(abs(minutes), 60)
    return f"{sign}{hours:02d}:{rest:02d}"


def _day_list(days: frozenset[int]) -> str:
    return ",".join(DAY_NAMES[d] for d in sorted(days))


# ---------------------------------------------------------------------------
# Window arithmetic and decisions
# ---------------------------------------------------------------------------


def window_state(window: MaintenanceWindow, now: datetime) -> WindowState:
    """Whether ``now`` (aware) is inside ``window``: the start is inside, the end is not."""
    if now.tzinfo is None or now.utcoffset() is None:
        raise ValueError("window_state needs an aware datetime (a clock in UTC)")
    tz = window.tz
    local = now.astimezone(tz)
    monday = datetime.combine(local.date() - timedelta(days=local.weekday()), time(0), tz)
    # Merged occurrences from two weeks back to three ahead. Windows are never always
    # open (checked at construction), so a merged window lasts under 7 days: the one
    # holding ``now`` starts after now - 7 d, and the next one starts before now + 14 d.
    starts = sorted(
        monday + timedelta(days=7 * week + day, minutes=window.start_minute)
        for week in range(-2, 4)
        for day in window.days
    )
    merged: list[list[datetime]] = []
    for start in starts:
        end = start + window.duration
        if merged and start <= merged[-1][1]:  # touching occurrences are one window
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    for i, (start, end) in enumerate(merged):
        if start <= now < end:
            return WindowState(True, end, merged[i + 1][0])
        if start > now:
            return WindowState(False, None, start)
    raise AssertionError("unreachable: the next window starts within two weeks")


ETCD_REMEDY = (
    "set the policy to Allow or AllowDuringMaintenanceWindow (flannelpy policy set ...), or "
    'pass --force --reason "..." for an emergency'
)
KUBE_REMEDY = (
    "set DisruptionPolicy to Allow or AllowDuringMaintenanceWindow in the ConfigMap's "
    "net-conf.json, or for an emergency annotate the node flannelpy.io/override with a "
    '"Force" record'
)


def decide(
    policy: DisruptionPolicy, now: datetime, change: str, remedy: str = ETCD_REMEDY
) -> Decision:
    """May the disruptive ``change`` proceed at ``now``?

    ``change`` is only the phrase(s) of what changes, e.g. "backend vxlan -> host-gw"
    or ", ".join(disruptive_changes(...)): the sentence wraps it as
    "disruptive change (<change>) blocked by DisruptionPolicy ...". ``remedy`` is what
    to do under Block, in the words of where the policy lives.
    """
    if policy.mode == "Allow":
        return Decision(True, None, None, None)
    if policy.mode == "Block":
        return Decision(
            False,
            f"disruptive change ({change}) blocked by DisruptionPolicy Block; {remedy}",
            None,
            None,
        )
    assert policy.window is not None  # DisruptionPolicy guarantees it
    state = window_state(policy.window, now)
    if state.inside:
        return Decision(True, None, state.current_end, state.next_start)
    return Decision(
        False,
        f"disruptive change ({change}) blocked by DisruptionPolicy "
        f"AllowDuringMaintenanceWindow: outside the window; the next window starts "
        f"{state.next_start.isoformat()}",
        None,
        state.next_start,
    )


def disruptive_changes(
    old: BackendConfig, new: BackendConfig, old_mtu: int, new_mtu: int
) -> list[str]:
    """One phrase per disruptive difference ("VNI 1 -> 2"); [] when none.

    DirectRouting and every other option apply live, so they are not listed. MTUs
    are the overlay MTUs the caller derived from each config.
    """
    changes = []
    if old.type != new.type:
        changes.append(f"backend {old.type} -> {new.type}")
    if old.vni != new.vni:
        changes.append(f"VNI {old.vni} -> {new.vni}")
    if old.effective_port != new.effective_port:  # 0 and 8472 are the same port
        changes.append(f"VXLAN port {old.effective_port} -> {new.effective_port}")
    if old_mtu != new_mtu:
        changes.append(f"MTU {old_mtu} -> {new_mtu}")
    if old.gbp != new.gbp:
        changes.append(f"GBP {_on(old.gbp)} -> {_on(new.gbp)}")
    if old.learning != new.learning:
        changes.append(f"learning {_on(old.learning)} -> {_on(new.learning)}")
    return changes


def _on(flag: bool) -> str:
    return "on" if flag else "off"
