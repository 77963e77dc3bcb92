"""The rollout driver and the operations behind ``flannelpy rollout``.

The driver walks the nodes one step at a time, in the foreground of whoever runs it
(the ``rollout start`` and ``resume`` commands), reporting each event through a display
callback. Everything it knows is in the rollout record in the store, so a killed driver
loses nothing: a new one claims the record (its ``driver`` field, compare-and-swapped)
and continues; a driver that finds another's claim stops. Pause and abort only change
the record; a driver polling it stops after the current step.

The decisions are :mod:`flannelpy.rollout.plan` (pure); this module reads and writes the
record and the overrides through a :class:`RolloutStorage`, with injected clocks.

In Kubernetes mode (and unless the record says otherwise) a node is cordoned and out
of external load balancers from just before its override is written until it is
verified or rolled back (:mod:`flannelpy.rollout.cordon`); a node whose rollback
failed stays cordoned for the operator.
"""

from __future__ import annotations

import getpass
import json
import os
import secrets
import socket
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any, Literal

from flannelpy.config.netconf import BackendConfig
from flannelpy.control.policy import parse_policy
from flannelpy.control.records import ForceRecord, NodeOverride, NodeStatus
from flannelpy.errors import ConfigError, StoreError, StoreUnavailable
from flannelpy.rollout.backends import backend_config, target_backend
from flannelpy.rollout.flanneld import flanneld_nodes, flanneld_problems
from flannelpy.rollout.plan import DEFAULT_STEP_TIMEOUT, POLL, RolloutPlan, plan_rollout
from flannelpy.rollout.record import TERMINAL, RolloutRecord, new_record
from flannelpy.rollout.show import describe_state
from flannelpy.rollout.steps import (
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
    Wait,
    WriteOverride,
    next_action,
    node_of,
    record_after,
)
from flannelpy.rollout.storage import RolloutStorage

MAX_FORCE_REASON = 500  # characters of a rollback's reason kept in its force record

WINDOW_POLL = 30.0  # seconds between looks at the record while waiting for a window
CAS_RETRIES = 20  # record writes racing pause/abort requests: read again and retry

WallClock = Callable[[], datetime]
Display = Callable[[str], None]


def drive(
    store: RolloutStorage,
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
    driver = _Driver(
        store,
        record_id,
        wall_clock,
        sleep,
        display,
        wait_for_window,
        monotonic,
        poll,
        driver_id or _driver_token(),
    )
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
        store: RolloutStorage,
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
                f"rollout {self.record_id} is no longer in the store (another rollout replaced it)"
            )
        self.record = record
        if record.driver != self.token:
            self.say(f"another driver ({record.driver}) took over rollout {record.id}; stopping")
            return record
        current = record.current() or next((e for e in record.nodes if e.state == "pending"), None)
        key = (record.state, current.node if current else None, current.state if current else None)
        if key != self.step_key:
            self.step_key, self.step_since = key, self.monotonic()
        now = self.wall_clock()
        action = next_action(
            record,
            nodes.statuses,
            parse_policy(config.config.raw),
            now,
            self.monotonic() - self.step_since,
            nodes.overrides,
            self.poll,
            nodes.present,
        )
        if _switches_more(record, action):
            # A flanneld node may have joined since the plan: none may be cut off.
            problems = cut_off_flanneld(store, record, config.config.backend, nodes.statuses)
            if problems:
                action = Halt("paused", f"{problems[0]}; then run flannelpy rollout resume")
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
        node = node_of(action)
        # Returned before the record says so: a driver killed in between finds the step
        # still open, does it again and finds nothing left to undo.
        returning = record.cordon and isinstance(action, MarkVerified | MarkRolledBack)
        if returning and node and store.uncordon(node):
            self.say("uncordoned (schedulable, back in external load balancers)", node)
        if updated != record:
            if store.put_record(updated, revision) is None:
                return None  # the record changed meanwhile (a request, or another driver)
            self.record = updated
        # After the record names the step (so a resumed driver finishes it), before the
        # override: the node is out for the whole change.
        taking_out = updated.cordon and isinstance(action, WriteOverride)
        if taking_out and node and store.cordon(node, updated.id):
            self.say("cordoned (unschedulable, out of external load balancers)", node)
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
        node = node_of(action)
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


def _switches_more(record: RolloutRecord, action: Any) -> bool:
    """The action moves another node, or the config, to the target."""
    if isinstance(action, WriteOverride):
        return record.entry(action.node).state == "pending"
    return isinstance(action, Finalize) and not record.config_written


def cut_off_flanneld(
    store: RolloutStorage,
    record: RolloutRecord,
    current: BackendConfig,
    statuses: Mapping[str, NodeStatus],
) -> list[str]:
    """The sentence naming flanneld nodes the rollout's target would cut off, as the
    leases say now (one more read of the store), or nothing."""
    nodes = flanneld_nodes(store.read_leases(), statuses)
    return flanneld_problems(nodes, current, backend_config(record.target)) if nodes else []


def _record_timeout(record: RolloutRecord | None) -> float:
    return record.step_timeout if record is not None else DEFAULT_STEP_TIMEOUT


def _override_doc(override: NodeOverride) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(override.to_json())
    return doc


def _perform(
    store: RolloutStorage,
    before: RolloutRecord,
    record: RolloutRecord,
    action: Any,
    overrides: Mapping[str, NodeOverride],
    now: datetime,
) -> None:
    """The side effect of an action, once the record says it is being done."""
    if isinstance(action, WriteOverride | RollBack):
        store.write_override(action.node, override_for(record, action, now))
    elif isinstance(action, MarkRolledBack) and action.delete_override:
        store.delete_override(action.node, record.entry(action.node).rollback_generation)
    elif isinstance(action, Finalize):
        store.write_config_backend(record.target)
        for node in sorted(set(overrides) | set(record.order)):
            store.delete_override(node)
        _update(
            store, record.id, lambda r: replace(r, config_written=True, updated_at=now.isoformat())
        )


def override_for(
    record: RolloutRecord, action: WriteOverride | RollBack, now: datetime
) -> NodeOverride:
    """The override a step writes. A step forward carries the rollout's own force record,
    if any; a rollback always carries one: the node may check the disruption policy
    itself (Kubernetes mode), and a window that closed since the step began must never
    keep it on the backend that failed. A forced override always applies, and the node
    records it (an event in etcd, an Event on the Node), as an operator's would."""
    force = record.force
    if isinstance(action, RollBack):
        force = ForceRecord(
            reason=f"rollback by rollout {record.id}: {action.reason}"[:MAX_FORCE_REASON],
            by=operator(),
            at=now.isoformat(),
        )
    return NodeOverride(dict(action.backend), action.generation, rollout=record.id, force=force)


def _event(before: RolloutRecord, record: RolloutRecord, action: Any, took: str) -> str | None:
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
        return (
            "every node switched: the target Backend goes into the network config; "
            "removing the overrides"
        )
    if isinstance(action, Finish):
        return "done" + (f" ({action.note})" if action.note else "")
    if isinstance(action, Fail):
        return f"failed: {action.reason}"
    return None


def operator() -> str:
    """``user@host``: who drives or forces a rollout, as records show it."""
    return f"{_user()}@{socket.gethostname()}"


def _driver_token() -> str:
    return f"{operator()}/{os.getpid()}/{secrets.token_hex(3)}"


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())


def _update(
    store: RolloutStorage, record_id: str, change: Callable[[RolloutRecord], RolloutRecord]
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


def _claim(store: RolloutStorage, record_id: str, token: str, now: datetime) -> RolloutRecord:
    """Make this process the record's driver (a previous one, if alive, stops)."""
    return _update(
        store,
        record_id,
        lambda r: (
            r if r.state in TERMINAL else replace(r, driver=token, updated_at=now.isoformat())
        ),
    )


# ---------------------------------------------------------------------------
# The commands' operations, as functions over a RolloutStorage
# ---------------------------------------------------------------------------


def make_plan(
    store: RolloutStorage,
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
    flanneld = flanneld_nodes(store.read_leases(), nodes.statuses)
    plan = plan_rollout(
        nodes.statuses, config, target, parse_policy(config.raw), now, order, force_reason, flanneld
    )
    unreadable = [
        f"{key} cannot be read: {why}"
        for key, why in sorted(nodes.errors.items())
        if key.endswith("/status")
    ]
    return replace(plan, problems=plan.problems + tuple(unreadable))


def start(
    store: RolloutStorage,
    plan: RolloutPlan,
    now: datetime,
    step_timeout: float = DEFAULT_STEP_TIMEOUT,
    force: ForceRecord | None = None,
    cordon: bool = True,
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
    record = new_record(
        plan, rollout_id, config.raw.get(key) if key else None, now, step_timeout, force, cordon
    )
    if store.put_record(record, revision) is None:
        raise ConfigError(
            "another rollout was started at the same moment; check flannelpy rollout status"
        )
    return record


def request_stop(
    store: RolloutStorage, what: Literal["pause", "abort"], now: datetime
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
            return replace(
                r,
                state="aborted",
                reason="aborted on request",
                request=None,
                next_window=None,
                updated_at=stamp,
            )
        if what == "pause" and idle:
            return replace(
                r, state="paused", reason="paused on request", next_window=None, updated_at=stamp
            )
        return replace(r, request=what, updated_at=stamp)

    return _update(store, record.id, change)


def prepare_resume(
    store: RolloutStorage, now: datetime, step_timeout: float | None
) -> RolloutRecord:
    """Make a paused rollout runnable again (a pause request is withdrawn; an abort
    request stands). Raises ConfigError when there is nothing to resume."""
    record, _ = store.read_record()
    if record is None:
        raise ConfigError("there is no rollout to resume; start one with flannelpy rollout start")
    if record.state in TERMINAL:
        raise ConfigError(
            f"rollout {record.id} has ended ({record.state}); start a new one to continue"
        )
    if record.state != "rolling-back" and not record.config_written:
        problems = cut_off_flanneld(
            store, record, store.read_config().config.backend, store.read_nodes().statuses
        )
        if problems:
            raise ConfigError(problems[0])

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
