"""A rollout's steps (pure): the actions, the one next action for a record and the
nodes' statuses, and how the record changes when the driver performs it.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from ipaddress import ip_network
from typing import Any, Literal

from flannelpy.config.netconf import (
    BackendConfig,
)
from flannelpy.control.policy import (
    DisruptionPolicy,
    decide,
)
from flannelpy.control.records import NodeOverride, NodeStatus
from flannelpy.rollout.backends import backend_config, disruptions, runs, short
from flannelpy.rollout.plan import POLL
from flannelpy.rollout.record import IN_FLIGHT, TERMINAL, NodeEntry, RolloutRecord


@dataclass(frozen=True)
class WriteOverride:
    """Give ``node`` the target: record the step first, then write its override."""

    node: str
    backend: Mapping[str, Any]
    generation: int


@dataclass(frozen=True)
class MarkApplied:
    node: str
    applied_at: float  # the node's AppliedAt (its clock)


@dataclass(frozen=True)
class MarkVerified:
    node: str


@dataclass(frozen=True)
class RollBack:
    """Write ``node``'s previous Backend back (a new generation), after recording why."""

    node: str
    backend: Mapping[str, Any]
    generation: int
    reason: str


@dataclass(frozen=True)
class MarkRolledBack:
    node: str
    delete_override: bool  # the node had no override before: remove the one we wrote


@dataclass(frozen=True)
class Wait:
    what: str  # stable while the same thing is awaited (shown once)
    seconds: float
    detail: str = ""


@dataclass(frozen=True)
class PauseForWindow:
    next_start: datetime
    sentence: str


@dataclass(frozen=True)
class Resume:
    """The window is open again."""


@dataclass(frozen=True)
class Halt:
    """Stop between nodes: a pause or abort request, or a policy that now blocks."""

    state: Literal["paused", "aborted"]
    reason: str


@dataclass(frozen=True)
class Finalize:
    """Write the target into the config and remove the overrides."""


@dataclass(frozen=True)
class Finish:
    note: str | None = None


@dataclass(frozen=True)
class Fail:
    reason: str


@dataclass(frozen=True)
class Done:
    """Nothing for a driver to do: the rollout ended or is paused."""

    state: str


Action = (
    WriteOverride
    | MarkApplied
    | MarkVerified
    | RollBack
    | MarkRolledBack
    | Wait
    | PauseForWindow
    | Resume
    | Halt
    | Finalize
    | Finish
    | Fail
    | Done
)
# The steps that act on one node.
NodeAction = WriteOverride | MarkApplied | MarkVerified | RollBack | MarkRolledBack


def node_of(action: object) -> str | None:
    """The node a step acts on; None for the steps about the whole rollout."""
    return action.node if isinstance(action, NodeAction) else None


def next_action(
    record: RolloutRecord,
    statuses: Mapping[str, NodeStatus],
    policy: DisruptionPolicy,
    now: datetime,
    step_elapsed: float,
    overrides: Mapping[str, NodeOverride] | None = None,
    poll: float = POLL,
    present: Collection[str] | None = None,
) -> Action:
    """The one next thing to do. ``step_elapsed``: monotonic seconds since the current step
    (the node and its state) began; ``overrides``: the nodes' overrides as read now, if
    known (to re-write one a killed driver recorded but never wrote); ``present``: the
    nodes that exist (Kubernetes: the Nodes), None when the store cannot tell."""
    state = record.state
    if state in TERMINAL or state == "paused":
        return Done(state)
    timeout = record.step_timeout
    if state == "rolling-back":
        entry = next((e for e in record.nodes if e.state == "rolling-back"), None)
        if entry is None:
            return Fail(record.reason or "rolled back")
        if present is not None and entry.node not in present:
            return _node_gone(record, entry.node, step_elapsed, poll)
        return _rollback_step(record, entry, statuses, step_elapsed, overrides, poll)
    if state == "finalizing":
        if not record.config_written:
            return Finalize()
        return _vtep_step(record, statuses, step_elapsed, poll)
    entry = record.current()
    if entry is not None:  # a step in flight finishes before any request is honoured
        if present is not None and entry.node not in present:
            return _node_gone(record, entry.node, step_elapsed, poll)
        return _node_step(record, entry, statuses, step_elapsed, overrides, poll)
    if record.request == "abort":
        return Halt("aborted", "aborted on request")
    if record.request == "pause":
        return Halt("paused", "paused on request")
    entry = next((e for e in record.nodes if e.state == "pending"), None)
    if entry is None:
        return Finalize()
    node = entry.node
    status = statuses.get(node)
    if status is None or not status.ready:
        if step_elapsed > timeout:
            what = "reports no status" if status is None else "is not Ready"
            return Halt(
                "paused",
                f"{node} {what} after {timeout:g} s, before it was "
                "switched; fix it (flannelpy doctor), then run flannelpy rollout "
                "resume",
            )
        return Wait(f"{node}: waiting for it to be Ready before switching it", poll)
    target = backend_config(record.target)
    if record.force is None:
        changes = disruptions(status.backend, target)
        if changes:
            decision = decide(policy, now, ", ".join(changes))
            if not decision.allowed:
                sentence = decision.sentence or "blocked by the disruption policy"
                if decision.next_window_start is not None:
                    return PauseForWindow(decision.next_window_start, sentence)
                return Halt("paused", sentence)
    if state == "paused-window":
        return Resume()
    return WriteOverride(node, record.target, next_generation(node, statuses, overrides))


def next_generation(
    node: str,
    statuses: Mapping[str, NodeStatus],
    overrides: Mapping[str, NodeOverride] | None,
    floor: int = 0,
) -> int:
    """One above every generation this node has seen (its override's, the one it applied)."""
    seen = [floor]
    if overrides is not None and node in overrides:
        seen.append(overrides[node].generation)
    status = statuses.get(node)
    if status is not None and status.applied_generation is not None:
        seen.append(status.applied_generation)
    return max(seen) + 1


def _node_gone(record: RolloutRecord, node: str, elapsed: float, poll: float) -> Action:
    """The node in flight was removed from the cluster: nothing can be written to it, not
    even a rollback. A kubelet registers its Node again, so the step waits its time."""
    if elapsed > record.step_timeout:
        return Fail(
            f"{node} was removed from the cluster during its step and did not come back "
            f"within {record.step_timeout:g} s; start a new rollout for the other nodes"
        )
    return Wait(f"{node}: its Node was removed; waiting for it to be registered again", poll)


def _missing_write(
    node: str, generation: int | None, overrides: Mapping[str, NodeOverride] | None
) -> bool:
    """The record says we wrote ``generation`` but the override does not have it yet: a
    driver was killed between recording the step and writing the override."""
    if overrides is None or generation is None:
        return False
    override = overrides.get(node)
    return override is None or override.generation < generation


def _node_step(
    record: RolloutRecord,
    entry: NodeEntry,
    statuses: Mapping[str, NodeStatus],
    elapsed: float,
    overrides: Mapping[str, NodeOverride] | None,
    poll: float,
) -> Action:
    node, generation, timeout = entry.node, entry.generation, record.step_timeout
    assert generation is not None
    status = statuses.get(node)
    target = backend_config(record.target)
    if entry.state == "applying":
        if (
            status is not None
            and status.applied_generation == generation
            and status.ready
            and runs(status.backend, target)
        ):
            return MarkApplied(
                node, status.applied_at if status.applied_at is not None else status.at
            )
        if (
            status is not None
            and status.blocked is not None
            and (status.blocked.generation == generation)
        ):
            return _roll_back(
                record,
                entry,
                statuses,
                overrides,
                f"{node} refused generation {generation}: {status.blocked.sentence}",
            )
        if elapsed > timeout:
            return _roll_back(
                record,
                entry,
                statuses,
                overrides,
                f"{node} did not apply generation {generation} within "
                f"{timeout:g} s ({_shows(status)})",
            )
        if _missing_write(node, generation, overrides):
            return WriteOverride(node, record.target, generation)  # the same generation
        return Wait(f"{node}: waiting for generation {generation} to apply", poll)
    failures = verification_failures(node, generation, entry.applied_at, target, statuses)
    if not failures:
        return MarkVerified(node)
    if elapsed > timeout:
        shown = "; ".join(failures[:8]) + (
            f"; and {len(failures) - 8} more" if len(failures) > 8 else ""
        )
        return _roll_back(
            record,
            entry,
            statuses,
            overrides,
            f"{node} failed verification after {timeout:g} s: {shown}",
        )
    return Wait(
        f"{node}: verifying probes to and from every peer",
        poll,
        f"{len(failures)} pending, e.g. {failures[0]}",
    )


def _shows(status: NodeStatus | None) -> str:
    if status is None:
        return "it reports no status"
    generation = status.applied_generation
    applied = "no override generation" if generation is None else f"generation {generation}"
    return (
        f"it reports {applied}, {'Ready' if status.ready else 'not Ready'}, {short(status.backend)}"
    )


def _rollback_doc(record: RolloutRecord, entry: NodeEntry) -> Mapping[str, Any]:
    if entry.previous is not None and isinstance(entry.previous.get("Backend"), Mapping):
        return entry.previous["Backend"]
    return record.config_backend or {"Type": "vxlan"}


def _roll_back(
    record: RolloutRecord,
    entry: NodeEntry,
    statuses: Mapping[str, NodeStatus],
    overrides: Mapping[str, NodeOverride] | None,
    reason: str,
) -> RollBack:
    """Back to the node's previous Backend. A node that had no override gets one with the
    config's Backend first (vouched for by this rollout, so the policy cannot block the
    way back), removed once applied."""
    generation = next_generation(entry.node, statuses, overrides, floor=entry.generation or 0)
    return RollBack(entry.node, _rollback_doc(record, entry), generation, reason)


def _rollback_step(
    record: RolloutRecord,
    entry: NodeEntry,
    statuses: Mapping[str, NodeStatus],
    elapsed: float,
    overrides: Mapping[str, NodeOverride] | None,
    poll: float,
) -> Action:
    node, generation = entry.node, entry.rollback_generation
    status = statuses.get(node)
    if status is not None and status.applied_generation == generation and status.ready:
        return MarkRolledBack(node, delete_override=entry.previous is None)
    if elapsed > record.step_timeout:
        return Fail(
            f"{record.reason}; rolling {node} back did not take effect within "
            f"{record.step_timeout:g} s either ({_shows(status)}): check it with flannelpy doctor"
        )
    if _missing_write(node, generation, overrides):
        assert generation is not None
        return RollBack(node, _rollback_doc(record, entry), generation, record.reason or "")
    return Wait(f"{node}: waiting for the rollback (generation {generation}) to apply", poll)


def _vtep_step(
    record: RolloutRecord, statuses: Mapping[str, NodeStatus], elapsed: float, poll: float
) -> Action:
    """The transition ends when no node keeps a VTEP it does not need (host-gw: none)."""
    if backend_config(record.target).type == "vxlan":
        return Finish()
    keeping = sorted(name for name, st in statuses.items() if st.vtep)
    if not keeping:
        return Finish()
    if elapsed > record.step_timeout:
        return Finish(
            f"{', '.join(keeping)} still report a VTEP {record.step_timeout:g} s after the "
            "last node switched; traffic is unaffected, check them with flannelpy doctor"
        )
    return Wait("waiting for the nodes to drop VTEPs they no longer need", poll, ", ".join(keeping))


def _subnet(text: str) -> str:
    try:
        return str(ip_network(text, strict=False))
    except ValueError:
        return text


def _family(subnet: str) -> str:
    """What follows a peer's name in a failure: ' (IPv6)' for its IPv6 side."""
    return " (IPv6)" if ":" in subnet else ""


def verification_failures(
    node: str,
    generation: int,
    applied_at: float | None,
    target: BackendConfig,
    statuses: Mapping[str, NodeStatus],
) -> list[str]:
    """What still keeps ``node``'s step from being verified; [] when it is.

    The node must still run the generation; every probe between it and each peer, in
    both directions, must have answered a small and a full-MTU echo in a round that
    ended after the node applied the change, in each family (a dual-stack node lists a
    subnet of each, and each is probed on its own). The records are fixed-size summaries, so
    this reads: the node fails no peer and passed a round to each after AppliedAt;
    every peer names none of the node's subnets among its failing peers and passed a
    round to each of its own peers (the node among them) after AppliedAt. Probe times
    are the prober's node's clock, compared with the switched node's AppliedAt: agents'
    clocks agree (NTP), the rollout's clock plays no part.
    """
    status = statuses.get(node)
    if status is None:
        return [f"{node} reports no status"]
    found = []
    if status.applied_generation != generation:
        found.append(f"{node} no longer reports generation {generation}")
    if not status.ready:
        found.append(f"{node} is not Ready")
    if not runs(status.backend, target):
        found.append(f"{node} runs {short(status.backend)}")
    since = applied_at if applied_at is not None else status.applied_at or 0.0
    owners = {_subnet(s): name for name, st in statuses.items() for s in st.subnets}
    own = {_subnet(s) for s in status.subnets}
    if len(statuses) > 1:
        found.extend(_side(node, status, statuses, since, owners, None))
    for peer, peer_status in sorted(statuses.items()):
        if peer != node:
            found.extend(_side(peer, peer_status, statuses, since, owners, (node, own)))
    return found


def _side(
    name: str,
    status: NodeStatus,
    statuses: Mapping[str, NodeStatus],
    since: float,
    owners: Mapping[str, str],
    towards: tuple[str, set[str]] | None,
) -> list[str]:
    """One node's probes: all of them (``towards`` None: the switched node), or those
    towards the switched node (its name and subnets), as far as its summary tells."""
    summary = status.probes
    expected = sum(len(st.subnets) for other, st in statuses.items() if other != name)
    target = "its peers" if towards is None else towards[0]
    if summary.peers < expected:
        return [f"{name} -> {target}: probe results for {summary.peers} of {expected} peer subnets"]
    wanted = set(owners) if towards is None else towards[1]  # peers without a record
    shown = [  # (flanneld nodes) are not the rollout's to verify, as before
        f"{name} -> {owners[_subnet(f.subnet)]}{_family(f.subnet)}: {f.describe()}"
        for f in summary.failing_peers
        if _subnet(f.subnet) in wanted
    ]
    if shown:
        return shown
    if summary.failing > len(summary.failing_peers):  # more than it names: which, unknown
        return [f"{name} reports {summary.failing} failing peers"]
    if summary.passed_at is None or summary.passed_at <= since:
        return [f"{name} -> {target}: no probe round since the change"]
    return []


# ---------------------------------------------------------------------------
# How the record changes when the driver performs an action
# ---------------------------------------------------------------------------


def record_after(
    record: RolloutRecord,
    action: Action,
    now: datetime,
    previous_override: Mapping[str, Any] | None = None,
) -> RolloutRecord:
    """The record once ``action`` is done (for WriteOverride: before the override is
    written, so a killed driver never writes a second generation for one step).
    ``previous_override``: the node's override document before this rollout touched it."""
    stamp = now.isoformat()
    r = replace(record, updated_at=stamp)
    if isinstance(action, WriteOverride):
        entry = r.entry(action.node)
        if entry.state != "pending":
            return record  # already recorded: only the write is repeated
        return r.with_entry(
            replace(
                entry,
                state="applying",
                previous=previous_override,
                generation=action.generation,
                started_at=stamp,
                applied_at=None,
            )
        )
    if isinstance(action, MarkApplied):
        entry = r.entry(action.node)
        return r.with_entry(replace(entry, state="verifying", applied_at=action.applied_at))
    if isinstance(action, MarkVerified):
        return r.with_entry(replace(r.entry(action.node), state="done", finished_at=stamp))
    if isinstance(action, RollBack):
        entry = r.entry(action.node)
        if entry.state == "rolling-back":
            return record
        r = replace(r, state="rolling-back", reason=action.reason)
        return r.with_entry(
            replace(entry, state="rolling-back", rollback_generation=action.generation)
        )
    if isinstance(action, MarkRolledBack):
        entry = r.entry(action.node)
        return r.with_entry(replace(entry, state="rolled-back", finished_at=stamp))
    if isinstance(action, Fail):
        r = replace(r, state="failed", reason=action.reason, request=None)
        for entry in r.nodes:
            if entry.state in IN_FLIGHT:
                r = r.with_entry(replace(entry, state="failed", finished_at=stamp))
        return r
    if isinstance(action, PauseForWindow):
        nxt = action.next_start.isoformat()
        if record.state == "paused-window" and record.next_window == nxt:
            return record
        return replace(r, state="paused-window", reason=action.sentence, next_window=nxt)
    if isinstance(action, Resume):
        return replace(r, state="running", reason=None, next_window=None)
    if isinstance(action, Halt):
        return replace(r, state=action.state, reason=action.reason, request=None, next_window=None)
    if isinstance(action, Finalize):
        return record if record.state == "finalizing" else replace(r, state="finalizing")
    if isinstance(action, Finish):
        return replace(r, state="done", note=action.note, request=None)
    return record  # Wait, Done: nothing to record
