"""``flannelpy rollout plan|start|status|pause|resume|abort``, and the driver.

The driver is the CLI process: ``start`` and ``resume`` walk the nodes in the
foreground, one line per event, and end with a summary. Everything the driver
knows is in the rollout record in the store, so a killed driver loses nothing:
``resume`` claims the record (its ``driver`` field, compare-and-swapped) and
continues; a driver that finds another's claim stops. ``pause`` and ``abort``
only change the record; a driver polling it stops after the current step.

``--lab NAME`` takes the etcd endpoint and prefix from the netns lab's state;
otherwise the agent's ``--etcd-*`` flags (and FLANNELD_* variables) apply.
Heavy imports happen in :func:`run`, not when the ``flannelpy`` parser is built.
"""

from __future__ import annotations

import argparse
import getpass
import os
import secrets
import socket
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from flannelpy.commands.store import connected, store_parent, store_settings
from flannelpy.control.policy import parse_policy
from flannelpy.control.records import ForceRecord, NodeOverride
from flannelpy.errors import ConfigError, FlannelpyError, StoreError, StoreUnavailable
from flannelpy.rollout.plan import (
    DEFAULT_STEP_TIMEOUT,
    POLL,
    TERMINAL,
    Done,
    Fail,
    Finalize,
    Finish,
    Halt,
    MarkApplied,
    MarkRolledBack,
    MarkVerified,
    PauseForWindow,
    Resume,
    RollBack,
    RolloutPlan,
    RolloutRecord,
    Wait,
    WriteOverride,
    describe_state,
    how_to_go_back,
    new_record,
    next_action,
    plan_rollout,
    record_after,
    status_rows,
    summary,
    target_backend,
)
from flannelpy.rollout.store import RolloutStore

KUBE_REFUSAL = (
    "rollout works in etcd mode only (unset FLANNELD_KUBE_SUBNET_MGR); in Kubernetes mode "
    "annotate nodes with flannelpy.io/override one at a time"
)
WINDOW_POLL = 30.0  # seconds between looks at the record while waiting for a window
CAS_RETRIES = 20  # record writes racing pause/abort requests: read again and retry

WallClock = Callable[[], datetime]
Display = Callable[[str], None]


# ---------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------


def drive(
    store: RolloutStore,
    record_id: str,
    wall_clock: WallClock,
    sleep: Callable[[float], None],
    display: Display,
    *,
    wait_for_window: bool = False,
    monotonic: Callable[[], float] = time.monotonic,
    poll: float = POLL,
    driver_id: str | None = None,
) -> RolloutRecord:
    """Walk the rollout ``record_id`` until it is done, failed, aborted or paused (or,
    without ``wait_for_window``, outside the window). Returns the record as left.

    A store that stops answering is retried for as long as a step may take; then
    StoreError propagates, and the record keeps the state for ``resume``. Every
    write is safe to repeat after such a failure: the record is written first.
    """
    driver = _Driver(store, record_id, wall_clock, sleep, display, wait_for_window,
                     monotonic, poll, driver_id or _driver_token())  # fmt: skip
    outage_since: float | None = None
    while True:
        try:
            ended = driver.step()
        except StoreUnavailable as e:
            outage_since = outage_since if outage_since is not None else monotonic()
            if monotonic() - outage_since > _record_timeout(driver.record):
                raise
            driver.say_once("store", f"the store does not answer ({e}); retrying")
            sleep(poll)
            continue
        outage_since = None
        driver.shown.discard("store")
        if ended is not None:
            return ended


class _Driver:
    def __init__(
        self,
        store: RolloutStore,
        record_id: str,
        wall_clock: WallClock,
        sleep: Callable[[float], None],
        display: Display,
        wait_for_window: bool,
        monotonic: Callable[[], float],
        poll: float,
        token: str,
    ) -> None:
        self.store, self.record_id, self.token = store, record_id, token
        self.wall_clock, self.sleep, self.display = wall_clock, sleep, display
        self.wait_for_window, self.monotonic, self.poll = wait_for_window, monotonic, poll
        self.record: RolloutRecord | None = _claim(store, record_id, token, wall_clock())
        self.began = monotonic()
        self.step_key: tuple[Any, ...] = ()
        self.step_since = self.began
        self.node_since: dict[str, float] = {}
        self.shown: set[str] = set()

    def say(self, text: str, node: str | None = None) -> None:
        where = f"{node}: " if node else ""
        self.display(f"[{self.monotonic() - self.began:7.1f}s] {where}{text}")

    def say_once(self, key: str, text: str, node: str | None = None) -> None:
        if key not in self.shown:
            self.shown.add(key)
            self.say(text, node)

    def step(self) -> RolloutRecord | None:
        """One look at the store and at most one action; the record once driving ends."""
        store = self.store
        record, revision = store.read_record()
        config = store.read_config()
        nodes = store.read_nodes()
        if record is None or record.id != self.record_id:
            raise StoreError(
                f"rollout {self.record_id} is no longer in the store (another rollout "
                "replaced it)"
            )
        self.record = record
        if record.driver != self.token:
            self.say(f"another driver ({record.driver}) took over rollout {record.id}; stopping")
            return record
        current = record.current() or next((e for e in record.nodes if e.state == "pending"),
                                           None)  # fmt: skip
        key = (record.state, current.node if current else None,
               current.state if current else None)  # fmt: skip
        if key != self.step_key:
            self.step_key, self.step_since = key, self.monotonic()
        now = self.wall_clock()
        action = next_action(
            record, nodes.statuses, parse_policy(config.config.raw), now,
            self.monotonic() - self.step_since, nodes.overrides, self.poll,
        )  # fmt: skip
        if isinstance(action, Done):
            return record
        if isinstance(action, Wait):
            detail = f" ({action.detail})" if action.detail else ""
            self.say_once(action.what, action.what + detail)
            self.sleep(action.seconds)
            return None
        previous = None
        if isinstance(action, WriteOverride) and record.entry(action.node).state == "pending":
            override = nodes.overrides.get(action.node)
            previous = _override_doc(override) if override is not None else None
        updated = record_after(record, action, now, previous)
        if updated != record:
            if store.put_record(updated, revision) is None:
                return None  # the record changed meanwhile (a request, or another driver)
            self.record = updated
        _perform(store, record, updated, action, nodes.overrides, now)
        self._show(record, updated, action)
        if isinstance(action, Fail | Finish | Halt):
            return updated
        if isinstance(action, PauseForWindow):
            if not self.wait_for_window:
                return updated
            remaining = (action.next_start - self.wall_clock()).total_seconds()
            self.sleep(max(min(remaining, WINDOW_POLL), self.poll))
        return None

    def _show(self, before: RolloutRecord, record: RolloutRecord, action: Any) -> None:
        node = getattr(action, "node", None)
        if isinstance(action, WriteOverride) and node not in self.node_since:
            self.node_since[action.node] = self.monotonic()
        took = ""
        if node in self.node_since:
            took = f" in {self.monotonic() - self.node_since[node]:.1f} s"
        text = _event(before, record, action, took)
        if text is None:
            return
        if isinstance(action, PauseForWindow):  # repeated while waiting: once is enough
            self.say_once(text, text)
        else:
            self.say(text, node)


def _record_timeout(record: RolloutRecord | None) -> float:
    return record.step_timeout if record is not None else DEFAULT_STEP_TIMEOUT


def _override_doc(override: NodeOverride) -> dict[str, Any]:
    import json

    doc: dict[str, Any] = json.loads(override.to_json())
    return doc


def _perform(
    store: RolloutStore,
    before: RolloutRecord,
    record: RolloutRecord,
    action: Any,
    overrides: Mapping[str, NodeOverride],
    now: datetime,
) -> None:
    """The side effect of an action, once the record says it is being done."""
    if isinstance(action, WriteOverride | RollBack):
        store.write_override(
            action.node,
            NodeOverride(dict(action.backend), action.generation, rollout=record.id,
                         force=record.force),
        )  # fmt: skip
    elif isinstance(action, MarkRolledBack) and action.delete_override:
        store.delete_override(action.node, record.entry(action.node).rollback_generation)
    elif isinstance(action, Finalize):
        store.write_config_backend(record.target)
        for node in sorted(set(overrides) | set(record.order)):
            store.delete_override(node)
        _update(store, record.id, lambda r: replace(r, config_written=True,
                                                    updated_at=now.isoformat()))  # fmt: skip


def _event(
    before: RolloutRecord, record: RolloutRecord, action: Any, took: str
) -> str | None:
    """The progress line for an action just performed."""
    if isinstance(action, WriteOverride):
        entry = record.entry(action.node)
        if before.entry(action.node).state != "pending":
            return f"re-writing generation {action.generation} (a previous driver stopped)"
        return f"switching {entry.transition} (generation {action.generation})"
    if isinstance(action, MarkApplied):
        return f"applied generation {record.entry(action.node).generation}"
    if isinstance(action, MarkVerified):
        return f"verified{took}"
    if isinstance(action, RollBack):
        return f"FAILED: {action.reason}; rolling back (generation {action.generation})"
    if isinstance(action, MarkRolledBack):
        return "rolled back"
    if isinstance(action, PauseForWindow):
        return f"paused: {action.sentence}"
    if isinstance(action, Resume):
        return "the maintenance window is open: continuing"
    if isinstance(action, Halt):
        return f"{action.state}: {action.reason}"
    if isinstance(action, Finalize):
        return ("every node switched: the target Backend goes into the network config; "
                "removing the overrides")  # fmt: skip
    if isinstance(action, Finish):
        return "done" + (f" ({action.note})" if action.note else "")
    if isinstance(action, Fail):
        return f"failed: {action.reason}"
    return None


def _driver_token() -> str:
    return f"{_user()}@{socket.gethostname()}/{os.getpid()}/{secrets.token_hex(3)}"


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def _update(
    store: RolloutStore, record_id: str, change: Callable[[RolloutRecord], RolloutRecord]
) -> RolloutRecord:
    """Read, change and compare-and-swap the record, again on a race."""
    for _ in range(CAS_RETRIES):
        record, revision = store.read_record()
        if record is None or record.id != record_id:
            raise StoreError(
                f"rollout {record_id} is no longer in the store (another rollout replaced it)"
            )
        updated = change(record)
        if updated == record or store.put_record(updated, revision) is not None:
            return updated
    raise StoreError(f"the rollout record at {store.record_key} keeps changing; try again")


def _claim(store: RolloutStore, record_id: str, token: str, now: datetime) -> RolloutRecord:
    """Make this process the record's driver (a previous one, if alive, stops)."""
    return _update(store, record_id, lambda r: r if r.state in TERMINAL else
                   replace(r, driver=token, updated_at=now.isoformat()))  # fmt: skip


# ---------------------------------------------------------------------------
# Commands, as functions over a RolloutStore (tests call them in-process)
# ---------------------------------------------------------------------------


def make_plan(
    store: RolloutStore,
    backend_type: str,
    now: datetime,
    direct_routing: bool = False,
    vni: int | None = None,
    port: int | None = None,
    mtu: int | None = None,
    order: list[str] | None = None,
    force_reason: str | None = None,
) -> RolloutPlan:
    config = store.read_config().config
    nodes = store.read_nodes()
    target = target_backend(config, backend_type, direct_routing, vni, port, mtu)
    plan = plan_rollout(nodes.statuses, config, target, parse_policy(config.raw), now, order,
                        force_reason)  # fmt: skip
    unreadable = [f"{key} cannot be read: {why}" for key, why in sorted(nodes.errors.items())
                  if key.endswith("/status")]  # fmt: skip
    return replace(plan, problems=plan.problems + tuple(unreadable))


def start(
    store: RolloutStore,
    plan: RolloutPlan,
    now: datetime,
    step_timeout: float = DEFAULT_STEP_TIMEOUT,
    force: ForceRecord | None = None,
) -> RolloutRecord:
    """Record a new rollout of ``plan`` (state running). Raises ConfigError when the plan
    has problems, the policy blocks it, or another rollout is not finished."""
    if plan.problems:
        raise ConfigError(plan.problems[0])
    if plan.blocked is not None and force is None:
        raise ConfigError(plan.blocked)
    existing, revision = store.read_record()
    if existing is not None and existing.state not in TERMINAL:
        raise ConfigError(
            f"rollout {existing.id} is {describe_state(existing)}; resume it, or abort it "
            "(flannelpy rollout abort) before starting another"
        )
    config = store.read_config().config
    key = next((k for k in config.raw if k.lower() == "backend"), None)
    rollout_id = f"{now.astimezone(UTC):%Y%m%dT%H%M%SZ}-{secrets.token_hex(2)}"
    record = new_record(plan, rollout_id, config.raw.get(key) if key else None, now,
                        step_timeout, force)  # fmt: skip
    if store.put_record(record, revision) is None:
        raise ConfigError("another rollout was started at the same moment; check "
                          "flannelpy rollout status")  # fmt: skip
    return record


def request_stop(
    store: RolloutStore, what: Literal["pause", "abort"], now: datetime
) -> RolloutRecord:
    """``pause`` or ``abort``: at once when no step is in flight, else after it."""
    record, _ = store.read_record()
    if record is None:
        raise ConfigError("there is no rollout to " + what)
    if record.state in TERMINAL:
        raise ConfigError(f"rollout {record.id} has ended ({record.state}); nothing to {what}")

    def change(r: RolloutRecord) -> RolloutRecord:
        stamp = now.isoformat()
        if r.state in TERMINAL:
            return r
        idle = r.state in ("paused", "paused-window")
        if what == "abort" and idle:
            return replace(r, state="aborted", reason="aborted on request", request=None,
                           next_window=None, updated_at=stamp)  # fmt: skip
        if what == "pause" and idle:
            return replace(r, state="paused", reason="paused on request", next_window=None,
                           updated_at=stamp)  # fmt: skip
        return replace(r, request=what, updated_at=stamp)

    return _update(store, record.id, change)


def prepare_resume(store: RolloutStore, now: datetime, step_timeout: float | None) -> RolloutRecord:
    """Make a paused rollout runnable again (a pause request is withdrawn; an abort
    request stands). Raises ConfigError when there is nothing to resume."""
    record, _ = store.read_record()
    if record is None:
        raise ConfigError("there is no rollout to resume; start one with flannelpy rollout start")
    if record.state in TERMINAL:
        raise ConfigError(
            f"rollout {record.id} has ended ({record.state}); start a new one to continue"
        )

    def change(r: RolloutRecord) -> RolloutRecord:
        if r.state in TERMINAL:
            return r
        r = replace(r, updated_at=now.isoformat())
        if step_timeout is not None:
            r = replace(r, step_timeout=step_timeout)
        if r.request == "pause":
            r = replace(r, request=None)
        if r.state == "paused":
            r = replace(r, state="running", reason=None)
        return r

    return _update(store, record.id, change)


# ---------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------


def add_rollout_parser(subparsers: Any) -> argparse.ArgumentParser:
    common = store_parent()

    target = argparse.ArgumentParser(add_help=False)
    target.add_argument("--backend", required=True, metavar="TYPE", help="vxlan or host-gw")
    target.add_argument("--direct-routing", action="store_true",
                        help="vxlan: route peers on the same L2 segment directly")
    target.add_argument("--vni", type=int, help="VXLAN ID (default: the config's)")
    target.add_argument("--port", type=int, help="VXLAN UDP port (default: the config's)")
    target.add_argument("--mtu", type=int, help="underlay MTU to assume (default: the config's)")
    target.add_argument("--nodes", metavar="N1,N2,...",
                        help="the order to switch nodes in (default: by name)")
    force = argparse.ArgumentParser(add_help=False)
    force.add_argument("--force", action="store_true",
                       help="skip the disruption policy (an emergency; recorded)")
    force.add_argument("--reason", help="why the policy is skipped (with --force)")

    driving = argparse.ArgumentParser(add_help=False)
    driving.add_argument("--wait", action="store_true",
                         help="outside the maintenance window, wait for it instead of exiting")
    driving.add_argument("--step-timeout", type=float, metavar="SECONDS",
                         help=f"seconds each step may take (default {DEFAULT_STEP_TIMEOUT:g})")
    # For tests of maintenance windows: the rollout's clock starts at this instant.
    driving.add_argument("--clock-start", metavar="ISO8601", help=argparse.SUPPRESS)

    rollout = subparsers.add_parser(
        "rollout",
        help="switch the backend node by node, verified, under the disruption policy",
        description="Switch the cluster's backend one node at a time: set the node's target, "
        "wait until it applied and is Ready, verify that it and every peer reach each other "
        "(full-MTU probes included), then the next node. A failed step rolls that node "
        "back and stops. The state lives in etcd, so a killed rollout resumes.",
    )
    actions = rollout.add_subparsers(dest="rollout_command", required=True)
    actions.add_parser("plan", parents=[target, force, common],
                       help="show the plan and what would stop it; change nothing")
    actions.add_parser("start", parents=[target, force, driving, common],
                       help="start a rollout and drive it")
    status = actions.add_parser("status", parents=[common], help="show the rollout and nodes")
    status.add_argument("--json", action="store_true", help="print the record as JSON")
    actions.add_parser("pause", parents=[common], help="stop after the current step")
    actions.add_parser("resume", parents=[driving, common], help="continue driving a rollout")
    actions.add_parser("abort", parents=[common],
                       help="stop after the current step for good (switched nodes stay)")
    rollout.set_defaults(func=run)
    return rollout


def run(args: argparse.Namespace) -> int:
    try:
        settings = store_settings(args, os.environ, KUBE_REFUSAL)
        with connected(settings) as etcd:
            return _command(args, RolloutStore(etcd, settings.etcd_prefix))
    except FlannelpyError as e:
        print(f"flannelpy rollout: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("flannelpy rollout: interrupted; the rollout record keeps its state: run "
              "flannelpy rollout resume to continue", file=sys.stderr)  # fmt: skip
        return 130


def _wall_clock(args: argparse.Namespace) -> WallClock:
    text = getattr(args, "clock_start", None)
    if not text:
        return lambda: datetime.now(UTC)
    try:
        start_at = datetime.fromisoformat(text)
    except ValueError as e:
        raise ConfigError(f"--clock-start {text!r} is not an ISO-8601 time: {e}") from e
    if start_at.tzinfo is None:
        raise ConfigError(f"--clock-start {text!r} needs a UTC offset, like +00:00")
    began = time.monotonic()
    return lambda: start_at + timedelta(seconds=time.monotonic() - began)


def _print(text: str) -> None:
    print(text, flush=True)


def _command(args: argparse.Namespace, store: RolloutStore) -> int:
    clock = _wall_clock(args)
    command = args.rollout_command
    if command in ("plan", "start"):
        if args.reason is not None and not args.force:
            raise ConfigError("--reason goes with --force; add --force or drop --reason")
        if args.force and not (args.reason or "").strip():
            raise ConfigError('--force needs --reason "..." saying why the policy is skipped')
        order = [n.strip() for n in args.nodes.split(",") if n.strip()] if args.nodes else None
        plan = make_plan(store, args.backend, clock(), args.direct_routing, args.vni,
                         args.port, args.mtu, order,
                         args.reason if args.force else None)  # fmt: skip
        for line in plan.lines():
            _print(line)
        refusal = list(plan.problems) or ([plan.blocked] if plan.blocked and not args.force
                                          else [])  # fmt: skip
        if refusal:
            for sentence in refusal:
                print(f"flannelpy rollout: {sentence}", file=sys.stderr)
            return 2
        if command == "plan":
            return 0
        force = None
        if args.force:
            force = ForceRecord(args.reason.strip(), f"{_user()}@{socket.gethostname()}",
                                clock().astimezone(UTC).isoformat())  # fmt: skip
            print(f"flannelpy rollout: WARNING: the disruption policy is skipped (--force): "
                  f"{force.reason}; every override and an event per node record it",
                  file=sys.stderr)  # fmt: skip
        record = start(store, plan, clock(), args.step_timeout or DEFAULT_STEP_TIMEOUT, force)
        _print(f"rollout {record.id} started")
        return _drive(args, store, record.id, clock)
    if command == "resume":
        record = prepare_resume(store, clock(), args.step_timeout)
        _print(f"resuming rollout {record.id} ({describe_state(record)})")
        return _drive(args, store, record.id, clock)
    if command in ("pause", "abort"):
        record = request_stop(store, command, clock())
        if record.request is not None:
            entry = record.current()
            at = f" ({entry.node} {entry.state})" if entry else ""
            _print(f"rollout {record.id}: {command} requested; the driver stops after the "
                   f"current step{at}")  # fmt: skip
        else:
            _print(f"rollout {record.id} {record.state}")
        if command == "abort":
            back = how_to_go_back(record)
            if back:
                _print(back)
        return 0
    return _status(args, store)


def _drive(args: argparse.Namespace, store: RolloutStore, record_id: str,
           clock: WallClock) -> int:  # fmt: skip
    record = drive(store, record_id, clock, time.sleep, _print, wait_for_window=args.wait)
    _print(summary(record))
    if record.state == "paused-window":
        _print(f"the next window opens {record.next_window}; run flannelpy rollout resume "
               "then (or resume --wait to wait for it)")  # fmt: skip
    elif record.state == "paused":
        _print("run flannelpy rollout resume to continue")
    elif record.state in ("aborted", "failed"):
        back = how_to_go_back(record)
        if back:
            _print(back)
    return 1 if record.state in ("failed", "aborted") else 0


def _status(args: argparse.Namespace, store: RolloutStore) -> int:
    record, _ = store.read_record()
    nodes = store.read_nodes()
    if args.json:
        _print(record.to_json() if record else "null")
        return 0
    if record is None:
        _print("no rollout recorded")
    else:
        _print(summary(record))
        _print(f"started {record.created_at}, last change {record.updated_at}, "
               f"step timeout {record.step_timeout:g} s, driver {record.driver or '-'}")
        if record.force is not None:
            _print(f"forced past the policy by {record.force.by} at {record.force.at}: "
                   f"{record.force.reason}")  # fmt: skip
    rows = status_rows(record, nodes.statuses)
    header = ("node", "rollout", "backend", "generation", "ready", "blocked")
    table = [header] + [
        (r.node, r.rollout_state, r.backend,
         "-" if r.applied_generation is None else str(r.applied_generation),
         "-" if r.ready is None else ("yes" if r.ready else "no"), r.blocked or "-")
        for r in rows
    ]  # fmt: skip
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    for row in table:
        _print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False))
               + "  " + row[-1])  # fmt: skip
    for key, why in sorted(nodes.errors.items()):
        _print(f"{key}: {why}")
    return 0
