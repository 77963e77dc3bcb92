"""``flannelpy policy show | set``: read and change the disruption policy in etcd.

The policy is the ``DisruptionPolicy`` key of net-conf.json at ``<prefix>/config``
(see :mod:`flannelpy.control.policy`). ``set`` rewrites that one key and nothing else,
with a compare-and-swap so an edit made meanwhile by someone else is never lost.
``show`` adds what the agents report: changes blocked on each node (their
``nodes/<node>/status``) and the last changes forced past the policy (``events/``).
The reads and writes are :mod:`flannelpy.store.policy_records`; this module parses
the arguments and prints.

The store is found as the agent finds it (``--etcd-*`` flags or ``FLANNELD_ETCD_*``).
In Kubernetes mode the policy lives in the ConfigMap's net-conf.json; edit it there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from flannelpy.commands.store import add_store_arguments, connected, store_settings
from flannelpy.control.policy import (
    MODES,
    DisruptionPolicy,
    Mode,
    format_policy,
    policy_to_doc,
    window_from_flags,
    window_state,
)
from flannelpy.errors import ConfigError, FlannelpyError
from flannelpy.store.policy_records import FORCED_SHOWN, PolicyReport, gather, set_policy

KUBE_REFUSAL = (
    "flannelpy policy talks to etcd only, and FLANNELD_KUBE_SUBNET_MGR selects "
    "Kubernetes mode; edit DisruptionPolicy in the ConfigMap's net-conf.json instead"
)

_KUBE_NOTE = (
    "Talks to etcd only: in Kubernetes mode (--kube-subnet-mgr) the policy is the "
    "DisruptionPolicy key of net-conf.json in the flannelpy ConfigMap; edit it there."
)

Clock = Callable[[], datetime]


def _utc_now() -> datetime:
    return datetime.now(UTC)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``policy show`` and ``policy set``."""
    policy = subparsers.add_parser(
        "policy",
        help="show or set the disruption policy (Allow, Block, AllowDuringMaintenanceWindow)",
        description="The disruption policy gates disruptive changes (backend type, VNI, "
        "VXLAN port, MTU, GBP, learning): Allow lets them proceed, Block refuses them, "
        "AllowDuringMaintenanceWindow lets them proceed only inside a weekly window. " + _KUBE_NOTE,
    )
    verbs = policy.add_subparsers(dest="policy_command", required=True, metavar="show|set")
    show = verbs.add_parser(
        "show",
        help="the policy, the window now, blocked changes per node, recent forced changes",
        description="Print the policy from <prefix>/config, whether now is inside the "
        "window and when the next one starts, the change each node reports as blocked, "
        f"and the last {FORCED_SHOWN} changes forced past the policy. " + _KUBE_NOTE,
    )
    show.add_argument("--json", action="store_true", help="print the report as JSON")
    show.add_argument(
        "--at",
        metavar="TIME",
        help="judge the window at TIME instead of now (ISO 8601 with an offset, "
        "e.g. 2026-12-05T03:00+02:00)",
    )
    add_store_arguments(show)
    set_ = verbs.add_parser(
        "set",
        help="set the policy (rewrites only the DisruptionPolicy key of the config)",
        description="Set the DisruptionPolicy key of <prefix>/config; every other key stays "
        "as written. AllowDuringMaintenanceWindow needs --days, --start and --duration "
        "(and --utc-offset unless the window is in UTC). " + _KUBE_NOTE,
    )
    set_.add_argument("mode", metavar="MODE", help=f"one of {', '.join(MODES)} (any case)")
    window = set_.add_argument_group("window", "for AllowDuringMaintenanceWindow only")
    window.add_argument("--days", help="days of the week, e.g. Sat,Sun or Mon-Fri")
    window.add_argument("--start", help="local start time HH:MM, e.g. 02:00")
    window.add_argument("--duration", help="e.g. 4h, 90m or 1h30m (under 7 days)")
    window.add_argument(
        "--utc-offset",
        help="the window's local time as an offset from UTC, e.g. +02:00, UTC-05:30 or "
        "--utc-offset=-05:30 (default: UTC)",
    )
    add_store_arguments(set_)
    policy.set_defaults(run=run)
    return policy


def run(args: argparse.Namespace, clock: Clock = _utc_now) -> int:
    try:
        settings = store_settings(args, os.environ, KUBE_REFUSAL)
        with connected(settings) as store:
            if args.policy_command == "show":
                now = parse_at(args.at) if args.at else clock()
                report = gather(store, settings.etcd_prefix, now)
                sys.stdout.write(render_json(report) if args.json else render_text(report))
            else:
                policy = policy_from_args(args)
                key = set_policy(store, settings.etcd_prefix, policy)
                sys.stdout.write(render_set(key, policy, clock()))
    except FlannelpyError as e:
        print(f"flannelpy: {e}", file=sys.stderr)
        return e.exit_code
    return 0


def parse_at(text: str) -> datetime:
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        when = None
    if when is None or when.utcoffset() is None:
        raise ConfigError(
            f"--at {text!r} is not a time with an offset; write it like "
            "--at 2026-12-05T03:00+02:00 or --at 2026-12-05T01:00Z"
        )
    return when


def policy_from_args(args: argparse.Namespace) -> DisruptionPolicy:
    mode = _mode(args.mode)
    flags = {
        "--days": args.days,
        "--start": args.start,
        "--duration": args.duration,
        "--utc-offset": args.utc_offset,
    }
    if mode != "AllowDuringMaintenanceWindow":
        given = [flag for flag, value in flags.items() if value is not None]
        if given:
            them = "them" if len(given) > 1 else "it"
            raise ConfigError(
                f"{', '.join(given)} {'apply' if len(given) > 1 else 'applies'} only to "
                f"AllowDuringMaintenanceWindow; leave {them} out for {mode}"
            )
        return DisruptionPolicy(mode)
    window = window_from_flags(args.days, args.start, args.duration, args.utc_offset)
    return DisruptionPolicy(mode, window)


def _mode(text: str) -> Mode:
    for mode in MODES:
        if mode.lower() == text.strip().lower():
            return mode
    raise ConfigError(f"{text!r} is not a policy mode; use one of {', '.join(MODES)}")


# --- rendering ------------------------------------------------------------------------


def _iso(when: datetime | None) -> str | None:
    return None if when is None else when.isoformat()


def _since(seconds: Any) -> str:
    try:
        return datetime.fromtimestamp(float(seconds), UTC).isoformat(timespec="seconds")
    except (TypeError, ValueError, OverflowError, OSError):
        return str(seconds)


def now_line(report: PolicyReport) -> str:
    """What the policy does with a disruptive change at ``report.now``."""
    at = f"at {report.now.isoformat(timespec='seconds')}"
    mode = report.policy.mode
    if mode == "Allow":
        return f"{at}: disruptive changes proceed"
    if mode == "Block":
        return f"{at}: disruptive changes are blocked (set the policy, or force one)"
    state = report.state
    assert state is not None
    if state.inside:
        return (
            f"{at}: inside the window until {_iso(state.current_end)}, disruptive changes "
            f"proceed; the window after starts {_iso(state.next_start)}"
        )
    return (
        f"{at}: outside the window, disruptive changes wait; the next window starts "
        f"{_iso(state.next_start)}"
    )


def render_text(report: PolicyReport) -> str:
    lines = [f"policy: {format_policy(report.policy)} (etcd key {report.config_key})"]
    lines.append(now_line(report))
    blocked = [n for n in report.nodes if n.blocked is not None]
    unreadable = [n for n in report.nodes if n.error is not None]
    if blocked:
        lines.append(f"blocked changes ({len(blocked)} of {len(report.nodes)} nodes):")
        for n in blocked:
            assert n.blocked is not None
            generation = n.blocked.get("Generation")
            which = f" (override generation {generation})" if generation is not None else ""
            lines.append(
                f"  {n.node}: {n.blocked.get('Change', '?')}{which}, since "
                f"{_since(n.blocked.get('Since'))}: {n.blocked.get('Sentence', '')}"
            )
    else:
        lines.append(f"blocked changes: none ({len(report.nodes)} nodes report a status)")
    for n in unreadable:
        lines.append(f"  {n.node}: {n.error}")
    if report.forced:
        of = f" of {report.forced_total}" if report.forced_total > len(report.forced) else ""
        lines.append(f"forced changes (last {len(report.forced)}{of}):")
        for f in report.forced:
            lines.append(f"  {f.at} {f.node}: {f.change} by {f.by}: {json.dumps(f.reason)}")
    else:
        lines.append("forced changes: none")
    return "\n".join(lines) + "\n"


def render_json(report: PolicyReport) -> str:
    state = report.state
    doc = {
        "config_key": report.config_key,
        "policy": policy_to_doc(report.policy),
        "summary": format_policy(report.policy),
        "at": report.now.isoformat(),
        "allowed_now": report.allowed_now,
        "window": None
        if state is None
        else {
            "inside": state.inside,
            "current_end": _iso(state.current_end),
            "next_start": _iso(state.next_start),
        },
        "nodes": [
            {
                "node": n.node,
                "blocked": None
                if n.blocked is None
                else {
                    "generation": n.blocked.get("Generation"),
                    "change": n.blocked.get("Change"),
                    "sentence": n.blocked.get("Sentence"),
                    "since": n.blocked.get("Since"),
                },
                "error": n.error,
            }
            for n in report.nodes
        ],
        "forced": [
            {
                "key": f.key,
                "node": f.node,
                "change": f.change,
                "reason": f.reason,
                "by": f.by,
                "at": f.at,
            }
            for f in report.forced
        ],
        "forced_total": report.forced_total,
    }
    return json.dumps(doc, indent=1) + "\n"


def render_set(key: str, policy: DisruptionPolicy, now: datetime) -> str:
    report = PolicyReport(
        key, policy, now, window_state(policy.window, now) if policy.window else None, (), (), 0
    )
    return f"DisruptionPolicy set to {format_policy(policy)} in {key}\n{now_line(report)}\n"
