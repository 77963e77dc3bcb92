"""``flannelpy policy show | set``: read and change the disruption policy in etcd.

The policy is the ``DisruptionPolicy`` key of net-conf.json at ``<prefix>/config``
(see :mod:`flannelpy.ops.policy`). ``set`` rewrites that one key and nothing else,
with a compare-and-swap so an edit made meanwhile by someone else is never lost.
``show`` adds what the agents report: changes blocked on each node (their
``nodes/<node>/status``) and the last changes forced past the policy (``events/``).

The store is found as the agent finds it (``--etcd-*`` flags or ``FLANNELD_ETCD_*``),
or from a netns lab with ``--lab NAME``. In Kubernetes mode the policy lives in the
ConfigMap's net-conf.json; edit it there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from flannelpy.commands.store import add_store_arguments, connected, store_settings
from flannelpy.control.policy import (
    MODES,
    DisruptionPolicy,
    Mode,
    WindowState,
    decide,
    format_policy,
    parse_policy,
    policy_to_doc,
    window_from_flags,
    window_state,
    with_policy,
)
from flannelpy.control.records import events_prefix, node_of_key, nodes_prefix
from flannelpy.errors import ConfigError, FlannelpyError, StoreError
from flannelpy.subnet.etcd.kv import KeyValue, Store

KUBE_REFUSAL = (
    "flannelpy policy talks to etcd only, and FLANNELD_KUBE_SUBNET_MGR selects "
    "Kubernetes mode; edit DisruptionPolicy in the ConfigMap's net-conf.json instead"
)
WRITE_ATTEMPTS = 5  # compare-and-swap rounds before giving up on a busy config key
FORCED_SHOWN = 10  # forced-change records `show` lists, newest last

_KUBE_NOTE = (
    "Talks to etcd only: in Kubernetes mode (--kube-subnet-mgr) the policy is the "
    "DisruptionPolicy key of net-conf.json in the flannelpy ConfigMap; edit it there."
)

Clock = Callable[[], datetime]


def _utc_now() -> datetime:
    return datetime.now(UTC)


def add_policy_parser(subparsers: Any) -> argparse.ArgumentParser:
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
    policy.set_defaults(func=run)
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
    flags = {"--days": args.days, "--start": args.start, "--duration": args.duration,
             "--utc-offset": args.utc_offset}  # fmt: skip
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


# --- reading and writing the store ----------------------------------------------------


def _config_key(prefix: str) -> str:
    from flannelpy.subnet.etcd.client import config_key

    return config_key(prefix)


def _read_config(store: Store, prefix: str) -> KeyValue:
    key = _config_key(prefix)
    kv = store.get(key)
    if kv is None:
        raise ConfigError(
            f"network config not found in etcd at {key}; write net-conf.json there first "
            f"(etcdctl put {key} '{{\"Network\": ...}}'), or check --etcd-prefix"
        )
    return kv


def set_policy(store: Store, prefix: str, policy: DisruptionPolicy) -> str:
    """Write ``policy`` into the config key, retrying when someone else wrote it
    meanwhile (their edit is re-read, never overwritten). Returns the key."""
    key = _config_key(prefix)
    for _ in range(WRITE_ATTEMPTS):
        kv = _read_config(store, prefix)
        try:
            text = with_policy(kv.value, policy)
        except ConfigError as e:
            raise ConfigError(f"{e} (in etcd key {key}; nothing was written)") from e
        if store.put_if_mod_revision(key, text.encode(), kv.mod_revision, kv.lease_id):
            return key
    raise StoreError(
        f"the network config at {key} changed {WRITE_ATTEMPTS} times while the policy was "
        "being written; run the command again"
    )


@dataclass(frozen=True)
class NodeReport:
    node: str
    blocked: Mapping[str, Any] | None  # the status "Blocked" object, as the agent wrote it
    error: str | None = None  # the status could not be read


@dataclass(frozen=True)
class ForcedRecord:
    key: str
    node: str
    change: str
    reason: str
    by: str
    at: str


@dataclass(frozen=True)
class PolicyReport:
    config_key: str
    policy: DisruptionPolicy
    now: datetime
    state: WindowState | None  # the window's, whatever the mode (None: no window)
    nodes: tuple[NodeReport, ...]
    forced: tuple[ForcedRecord, ...]  # the newest FORCED_SHOWN, oldest first
    forced_total: int

    @property
    def allowed_now(self) -> bool:
        return decide(self.policy, self.now, "any").allowed


def gather(store: Store, prefix: str, now: datetime) -> PolicyReport:
    key = _config_key(prefix)
    kv = _read_config(store, prefix)
    try:
        doc = json.loads(kv.value)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"net-conf.json at {key} is not valid JSON ({e}); fix it") from e
    if not isinstance(doc, dict):
        raise ConfigError(f"net-conf.json at {key} is not a JSON object; fix it")
    try:
        policy = parse_policy(doc)
    except ConfigError as e:
        raise ConfigError(f"{e} (read from etcd key {key})") from e
    state = window_state(policy.window, now) if policy.window else None
    statuses, _ = store.get_prefix(nodes_prefix(prefix))
    nodes = []
    for item in statuses:
        where = node_of_key(prefix, item.key)
        if where is not None and where[1] == "status":
            nodes.append(_node_report(where[0], item.value))
    events, _ = store.get_prefix(events_prefix(prefix))
    forced = sorted((_forced(item) for item in events), key=_event_order)
    return PolicyReport(
        config_key=key,
        policy=policy,
        now=now,
        state=state,
        nodes=tuple(sorted(nodes, key=lambda n: n.node)),
        forced=tuple(forced[-FORCED_SHOWN:]),
        forced_total=len(forced),
    )


def _node_report(node: str, value: bytes) -> NodeReport:
    # Only "Blocked" matters here; a status an older or newer agent shaped differently
    # must not hide it, so this reads the one key instead of the whole record.
    try:
        doc = json.loads(value)
    except (ValueError, UnicodeDecodeError):
        return NodeReport(node, None, "its status is not valid JSON")
    if not isinstance(doc, dict):
        return NodeReport(node, None, "its status is not a JSON object")
    blocked = doc.get("Blocked")
    if blocked is not None and not isinstance(blocked, dict):
        return NodeReport(node, None, 'its status "Blocked" is not a JSON object')
    return NodeReport(node, blocked)


def _forced(item: KeyValue) -> ForcedRecord:
    try:
        doc = json.loads(item.value)
    except (ValueError, UnicodeDecodeError):
        doc = None
    if not isinstance(doc, dict):
        doc = {"Change": "(unreadable record)"}
    name = item.key.rsplit("/", 1)[-1]
    return ForcedRecord(
        key=item.key,
        node=str(doc.get("Node") or name.partition("-")[2]),
        change=str(doc.get("Change", "")),
        reason=str(doc.get("Reason", "")),
        by=str(doc.get("By", "")),
        at=str(doc.get("At", "")),
    )


def _event_order(record: ForcedRecord) -> tuple[int, str]:
    # Keys are "<unix-ns>-<node>": order by the number, not the text.
    stamp = record.key.rsplit("/", 1)[-1].partition("-")[0]
    return (int(stamp) if stamp.isdigit() else 0, record.key)


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
