"""A backend rollout, node by node (pure): the plan, the record and the next step.

``flannelpy rollout`` switches the cluster's backend one node at a time while
every pod keeps reaching every pod (field notes §4). For each node it writes the
node's override (the target Backend, a new generation, the rollout's id), waits
until the node's status says it applied that generation, then waits until every
probe between that node and each peer, in both directions, answered a small and
a full-MTU echo after the change. A step that does not complete in time rolls
that node back and stops the rollout. After the last node the target Backend is
written into the network config and the overrides are removed.

Nothing here does I/O or reads a clock. :func:`plan_rollout` decides whether a
target can work before anything changes; :func:`next_action` looks at the
rollout record (what the rollout did so far, kept in the store so a killed driver
can resume) and the nodes' statuses and returns the one next thing to do;
:func:`record_after` is how the record changes when the driver does it. The
driver (:mod:`flannelpy.ops.rollout_cli`) performs actions and sleeps.

Times: the rollout's wall clock (``now``) only meets the disruption policy.
Step timeouts use elapsed time from a monotonic clock the driver keeps. Times
written by agents (``AppliedAt``, probe ``At``) are compared only with each
other, never with the rollout's clock, which may be another machine's (or a
test's fake).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from functools import lru_cache
from ipaddress import IPv4Address, IPv4Network, ip_network
from typing import Any, Literal

from flannelpy.backend.paths import NodeView, pairs_without_path
from flannelpy.config.netconf import (
    VXLAN_ENCAP_OVERHEAD,
    BackendConfig,
    NetworkConfig,
    parse_network_config,
)
from flannelpy.control.policy import (
    Decision,
    DisruptionPolicy,
    decide,
    disruptive_changes,
    format_policy,
)
from flannelpy.control.records import BackendSummary, ForceRecord, NodeOverride, NodeStatus

RecordState = Literal[
    "running", "paused", "paused-window", "rolling-back", "failed", "aborted", "finalizing",
    "done",
]  # fmt: skip
NodeState = Literal[
    "pending", "applying", "verifying", "done", "rolling-back", "rolled-back", "failed"
]
TERMINAL: frozenset[str] = frozenset({"failed", "aborted", "done"})
IN_FLIGHT: frozenset[str] = frozenset({"applying", "verifying", "rolling-back"})

DEFAULT_STEP_TIMEOUT = 120.0  # seconds per step (apply, verify, roll back, drop VTEPs)
POLL = 1.0  # seconds between looks at the store while waiting


# ---------------------------------------------------------------------------
# Backends: the target document, what a node runs, what it will run
# ---------------------------------------------------------------------------


def _backend_key(doc: Mapping[str, Any]) -> str | None:
    """The spelling of the Backend key in a net-conf.json document (keys are case-blind)."""
    return next((key for key in doc if key.lower() == "backend"), None)


def with_backend(doc: Mapping[str, Any], backend: Mapping[str, Any]) -> dict[str, Any]:
    """``doc`` with its Backend replaced by ``backend``; every other key stays as written,
    in its place, and the Backend key keeps its spelling."""
    key = _backend_key(doc)
    if key is None:
        return {**doc, "Backend": dict(backend)}
    return {
        k: (dict(backend) if k == key else v)
        for k, v in doc.items()
        if k == key or k.lower() != "backend"
    }


def _set(doc: dict[str, Any], name: str, value: Any) -> None:
    """Set a Backend option, replacing it under whatever case it was written in."""
    for key in [k for k in doc if k.lower() == name.lower()]:
        del doc[key]
    doc[name] = value


def target_backend(
    config: NetworkConfig,
    backend_type: str,
    direct_routing: bool = False,
    vni: int | None = None,
    port: int | None = None,
    mtu: int | None = None,
) -> dict[str, Any]:
    """The config's Backend with the given options replaced (DirectRouting always)."""
    key = _backend_key(config.raw)
    base = config.raw.get(key) if key else None
    doc: dict[str, Any] = dict(base) if isinstance(base, Mapping) else {}
    _set(doc, "Type", backend_type)
    _set(doc, "DirectRouting", direct_routing)
    for name, value in (("VNI", vni), ("Port", port), ("MTU", mtu)):
        if value is not None:
            _set(doc, name, value)
    return doc


def parse_target(config: NetworkConfig, target: Mapping[str, Any]) -> BackendConfig:
    """Check ``target`` with net-conf.json's own parser, in the config it will be part of.
    Raises ConfigError."""
    return parse_network_config(json.dumps(with_backend(config.raw, target))).backend


# A Network for parsing a Backend document alone; only the Backend part is used.
_ANY_NETWORK = "10.0.0.0/8"


@lru_cache(maxsize=64)
def _parse_backend_json(text: str) -> BackendConfig:
    return parse_network_config(f'{{"Network": "{_ANY_NETWORK}", "Backend": {text}}}').backend


def backend_config(doc: Mapping[str, Any]) -> BackendConfig:
    """A Backend document (as in net-conf.json or an override) parsed. Raises ConfigError."""
    return _parse_backend_json(json.dumps(doc, sort_keys=True))


def _overhead(backend_type: str) -> int:
    return VXLAN_ENCAP_OVERHEAD if backend_type == "vxlan" else 0


def expected_summary(current: BackendSummary, target: BackendConfig) -> BackendSummary:
    """What a node will report once it runs ``target``. Its underlay MTU is inferred from
    what it runs now (overlay MTU plus encapsulation) unless the target sets one."""
    underlay = target.mtu or current.mtu + _overhead(current.type)
    return BackendSummary(
        type=target.type,
        vni=target.vni,
        port=target.effective_port,
        direct_routing=target.direct_routing,
        mtu=underlay - _overhead(target.type),
    )


def runs(summary: BackendSummary, target: BackendConfig) -> bool:
    """Whether a node reporting ``summary`` runs ``target``. The MTU counts only when the
    target sets one: otherwise it follows the node's interface, which we cannot see."""
    if summary.type != target.type:
        return False
    if target.type == "vxlan" and (
        summary.vni != target.vni
        or summary.port != target.effective_port
        or summary.direct_routing != target.direct_routing
    ):
        return False
    return not target.mtu or summary.mtu == target.mtu - _overhead(target.type)


def running_backend(summary: BackendSummary) -> BackendConfig:
    return BackendConfig(
        type=summary.type, vni=summary.vni, port=summary.port,
        direct_routing=summary.direct_routing,
    )  # fmt: skip


def short(summary: BackendSummary, detail: bool = False) -> str:
    """``vxlan (MTU 1450)``, ``vxlan+DirectRouting (MTU 1450)``, ``host-gw (MTU 1500)``;
    with ``detail``, a vxlan backend's VNI and port too."""
    name = backend_name(running_backend(summary))
    vxlan = detail and summary.type == "vxlan"
    extra = f"VNI {summary.vni}, port {summary.port}, " if vxlan else ""
    return f"{name} ({extra}MTU {summary.mtu})"


def backend_name(backend: BackendConfig) -> str:
    dr = backend.type == "vxlan" and backend.direct_routing
    return backend.type + ("+DirectRouting" if dr else "")


def describe_transition(current: BackendSummary, target: BackendSummary) -> str:
    detail = current.type == target.type == "vxlan" and (
        current.vni != target.vni or current.port != target.port
    )
    return f"{short(current, detail)} -> {short(target, detail)}"


def _changes(current: BackendSummary, target: BackendConfig) -> list[str]:
    """The disruptive differences (policy's words) between what a node runs and the target."""
    expected = expected_summary(current, target)
    return disruptive_changes(
        running_backend(current), replace(target, port=target.effective_port),
        current.mtu, expected.mtu,
    )  # fmt: skip


# ---------------------------------------------------------------------------
# The plan
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeStep:
    node: str
    current: BackendSummary  # what its status says it runs
    expected: BackendSummary  # what it will report on the target
    changes: tuple[str, ...] = ()  # disruptive differences; () for a live change
    skip: bool = False  # already runs the target

    @property
    def transition(self) -> str:
        if self.skip:
            return f"{short(self.current)}: already the target"
        return describe_transition(self.current, self.expected)


@dataclass(frozen=True)
class RolloutPlan:
    target: Mapping[str, Any]  # the Backend document the nodes get
    target_backend: BackendConfig
    steps: tuple[NodeStep, ...]  # every node, in rollout order
    policy_line: str
    decision: Decision | None  # None: nothing disruptive, or forced
    problems: tuple[str, ...]
    forced: bool = False

    @property
    def to_switch(self) -> tuple[NodeStep, ...]:
        return tuple(step for step in self.steps if not step.skip)

    @property
    def blocked(self) -> str | None:
        """The policy's sentence when it refuses the rollout outright (Block)."""
        d = self.decision
        if d is None or d.allowed or d.next_window_start is not None:
            return None
        return d.sentence

    def lines(self) -> list[str]:
        """The plan as a person reads it (``problems`` apart: they are the refusal)."""
        out = [f"target Backend: {json.dumps(dict(self.target), sort_keys=True)}"]
        out.append("order:")
        for i, step in enumerate(self.steps, 1):
            out.append(f"  {i}. {step.node}: {step.transition}")
        out.extend(_mtu_lines(self.to_switch))
        out.append(f"policy: {self.policy_line}")
        then = "then: the target Backend goes into the network config and the overrides are removed"
        if self.target_backend.type == "host-gw":
            then += "; the nodes drop the VTEPs they kept for the transition"
        out.append(then)
        return out


def _mtu_lines(steps: Sequence[NodeStep]) -> list[str]:
    by_change: dict[tuple[int, int], list[str]] = {}
    for step in steps:
        if step.current.mtu != step.expected.mtu:
            by_change.setdefault((step.current.mtu, step.expected.mtu), []).append(step.node)
    if not by_change:
        return ["MTU: unchanged"]
    return [
        f"MTU: {', '.join(nodes)}: {old} -> {new}; pods that exist keep MTU {old} until they "
        f"are re-created (new pods get {new})"
        for (old, new), nodes in sorted(by_change.items())
    ]


def plan_rollout(
    statuses: Mapping[str, NodeStatus],
    config: NetworkConfig,
    target: Mapping[str, Any],
    policy: DisruptionPolicy,
    now: datetime,
    order: Sequence[str] | None = None,
    force_reason: str | None = None,
) -> RolloutPlan:
    """The plan for moving every node to ``target``; ``problems`` say why it cannot run.

    Raises ConfigError when ``target`` is not a valid Backend for ``config``.
    """
    target_cfg = parse_target(config, target)
    names, problems = _order(statuses, order)
    if not statuses:
        problems.append(
            "no node reports a status under the store's flannelpy/nodes/ keys; start the "
            "agents (a flannelpy version that publishes node status) first"
        )
    steps = []
    for name in names:
        status = statuses[name]
        expected = expected_summary(status.backend, target_cfg)
        skip = runs(status.backend, target_cfg)
        node_changes = () if skip else tuple(_changes(status.backend, target_cfg))
        steps.append(NodeStep(name, status.backend, expected, node_changes, skip))
        if not status.ready:
            problems.append(f"node {name} is not Ready; fix it (flannelpy doctor) first")
    if order is not None:
        left_out = [s.node for s in steps if s.node not in order and not s.skip]
        if left_out:
            problems.append(
                f"--nodes leaves out {', '.join(left_out)}, which do not run the target yet; "
                "every node must switch before the config does: add them"
            )
    problems.extend(_path_problems(statuses, steps, target_cfg))
    changes = sorted({change for step in steps for change in step.changes})
    decision = None
    if force_reason is not None:
        policy_line = f"not checked: --force (reason: {force_reason})"
    elif not changes:
        policy_line = f"{policy.mode}: does not apply (no disruptive change)"
    else:
        decision = decide(policy, now, ", ".join(changes))
        policy_line = _policy_line(policy, decision)
    return RolloutPlan(
        target=dict(target),
        target_backend=target_cfg,
        steps=tuple(steps),
        policy_line=policy_line,
        decision=decision,
        problems=tuple(problems),
        forced=force_reason is not None,
    )


def _order(
    statuses: Mapping[str, NodeStatus], order: Sequence[str] | None
) -> tuple[list[str], list[str]]:
    """Nodes in rollout order (by name unless given; the rest follow) and order problems."""
    problems: list[str] = []
    if order is None:
        return sorted(statuses), problems
    seen: set[str] = set()
    names = []
    for name in order:
        if name in seen:
            problems.append(f"--nodes names {name} twice; name each node once")
        elif name not in statuses:
            problems.append(
                f"node {name} reports no status in the store; start its agent, or leave it "
                "out of --nodes"
            )
        else:
            names.append(name)
        seen.add(name)
    return names + sorted(set(statuses) - seen), problems


def _policy_line(policy: DisruptionPolicy, decision: Decision) -> str:
    shown = format_policy(policy)
    if decision.allowed and decision.window_end is not None:
        return (
            f"{shown}; inside the window until {decision.window_end.isoformat()}: starts now "
            "(pauses between nodes if the window closes, resumes in the next one)"
        )
    if decision.allowed:
        return f"{shown}: proceeds now"
    if decision.next_window_start is not None:
        return (
            f"{shown}; outside the window: waits until {decision.next_window_start.isoformat()}"
        )
    return f"{shown}: {decision.sentence}"


def _view(status: NodeStatus, backend: BackendConfig) -> NodeView:
    networks = []
    for text in status.underlay_networks:
        try:
            net = ip_network(text, strict=False)
        except ValueError:
            continue
        if isinstance(net, IPv4Network):
            networks.append(net)
    # has_vtep None: predicted by the VTEP rule, since these states do not exist yet.
    return NodeView(status.node, IPv4Address(status.public_ip), tuple(networks), backend, None)


def _path_problems(
    statuses: Mapping[str, NodeStatus], steps: Sequence[NodeStep], target: BackendConfig
) -> list[str]:
    """Pairs left without a path after each node switches (and in the final state)."""
    if not statuses:
        return []
    try:
        current = {n: running_backend(st.backend) for n, st in statuses.items()}
        public = {n: IPv4Address(st.public_ip) for n, st in statuses.items()}
    except ValueError as e:
        return [f"a node status has an unusable PublicIP ({e}); fix that node's agent"]
    switching = [s.node for s in steps if not s.skip]
    reported: set[tuple[str, str]] = set()
    problems = []
    # One state per switch; the last is the final state (every node on the target).
    for count in range(1, len(switching) + 1) if switching else [0]:
        switched = set(switching[:count])
        views = [
            _view(st, target if n in switched else current[n])
            for n, st in sorted(statuses.items())
        ]
        final = count == len(switching)
        for a, b, reason in pairs_without_path(views):
            pair = (a, b)
            if pair in reported:
                continue
            reported.add(pair)
            ends = f"{a} ({public[a]}) and {b} ({public[b]})"
            if final:
                problems.append(f"{target.type} cannot work: {ends}: {reason}")
            else:
                step = switching[count - 1]
                problems.append(
                    f"switching {step} ({count} of {len(switching)}) would leave {ends} "
                    f"without a path while the rest still run their old backend: {reason}"
                )
    return problems


# ---------------------------------------------------------------------------
# The record (stored at node_records.rollout_key)
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeEntry:
    node: str
    state: NodeState = "pending"
    transition: str = ""
    skipped: bool = False  # already ran the target when the rollout started
    previous: Mapping[str, Any] | None = None  # the override this node had (a JSON doc)
    generation: int | None = None  # the override generation we wrote
    applied_at: float | None = None  # the node's AppliedAt for it (the node's clock)
    rollback_generation: int | None = None
    started_at: str | None = None  # ISO, the rollout's wall clock
    finished_at: str | None = None

    def to_doc(self) -> dict[str, Any]:
        return {
            "node": self.node, "state": self.state, "transition": self.transition,
            "skipped": self.skipped,
            "previous": dict(self.previous) if self.previous is not None else None,
            "generation": self.generation, "appliedAt": self.applied_at,
            "rollbackGeneration": self.rollback_generation,
            "startedAt": self.started_at, "finishedAt": self.finished_at,
        }  # fmt: skip

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> NodeEntry:
        return cls(
            node=str(doc["node"]), state=doc.get("state", "pending"),
            transition=str(doc.get("transition", "")), skipped=bool(doc.get("skipped")),
            previous=doc.get("previous"), generation=doc.get("generation"),
            applied_at=doc.get("appliedAt"), rollback_generation=doc.get("rollbackGeneration"),
            started_at=doc.get("startedAt"), finished_at=doc.get("finishedAt"),
        )  # fmt: skip


@dataclass(frozen=True)
class RolloutRecord:
    """One rollout. Keys are lower camel case: agents read ``id`` and ``state`` to decide
    whether an override naming this rollout is vouched for."""

    id: str
    state: RecordState
    target: Mapping[str, Any]  # the Backend document
    config_backend: Mapping[str, Any] | None  # the config's Backend at the start
    nodes: tuple[NodeEntry, ...]
    created_at: str
    updated_at: str
    step_timeout: float = DEFAULT_STEP_TIMEOUT
    reason: str | None = None  # why failed / paused / aborted
    request: Literal["pause", "abort"] | None = None  # honoured after the current step
    next_window: str | None = None  # paused-window: when the next window opens (ISO)
    force: ForceRecord | None = None
    driver: str | None = None  # the driver that may act; another one stops
    config_written: bool = False
    note: str | None = None  # what the final step could not finish

    @property
    def order(self) -> tuple[str, ...]:
        return tuple(e.node for e in self.nodes)

    def entry(self, node: str) -> NodeEntry:
        return next(e for e in self.nodes if e.node == node)

    def current(self) -> NodeEntry | None:
        """The node a step is in flight for, if any."""
        return next((e for e in self.nodes if e.state in IN_FLIGHT), None)

    def with_entry(self, entry: NodeEntry) -> RolloutRecord:
        return replace(self, nodes=tuple(entry if e.node == entry.node else e
                                         for e in self.nodes))  # fmt: skip

    def to_json(self) -> str:
        return json.dumps(
            {
                "id": self.id, "state": self.state, "target": dict(self.target),
                "configBackend": dict(self.config_backend) if self.config_backend else None,
                "order": list(self.order), "nodes": [e.to_doc() for e in self.nodes],
                "createdAt": self.created_at, "updatedAt": self.updated_at,
                "stepTimeout": self.step_timeout, "reason": self.reason,
                "request": self.request, "nextWindow": self.next_window,
                "force": self.force.to_doc() if self.force else None,
                "driver": self.driver, "configWritten": self.config_written,
                "note": self.note,
            },
            indent=1,
        )  # fmt: skip

    @classmethod
    def from_json(cls, raw: str | bytes) -> RolloutRecord:
        """Raises ValueError naming what is wrong."""
        try:
            doc = json.loads(raw)
            force = doc.get("force")
            return cls(
                id=str(doc["id"]), state=doc["state"], target=dict(doc["target"]),
                config_backend=doc.get("configBackend"),
                nodes=tuple(NodeEntry.from_doc(e) for e in doc["nodes"]),
                created_at=str(doc["createdAt"]), updated_at=str(doc["updatedAt"]),
                step_timeout=float(doc.get("stepTimeout", DEFAULT_STEP_TIMEOUT)),
                reason=doc.get("reason"), request=doc.get("request"),
                next_window=doc.get("nextWindow"),
                force=ForceRecord(str(force["Reason"]), str(force["By"]), str(force["At"]))
                if isinstance(force, dict) else None,
                driver=doc.get("driver"), config_written=bool(doc.get("configWritten")),
                note=doc.get("note"),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"the rollout record lacks or mangles a field: {e!r}") from e


def new_record(
    plan: RolloutPlan,
    rollout_id: str,
    config_backend: Mapping[str, Any] | None,
    now: datetime,
    step_timeout: float = DEFAULT_STEP_TIMEOUT,
    force: ForceRecord | None = None,
) -> RolloutRecord:
    stamp = now.isoformat()
    return RolloutRecord(
        id=rollout_id,
        state="running",
        target=dict(plan.target),
        config_backend=dict(config_backend) if config_backend is not None else None,
        nodes=tuple(
            NodeEntry(
                s.node, "done" if s.skip else "pending", s.transition, skipped=s.skip,
                finished_at=stamp if s.skip else None,
            )
            for s in plan.steps
        ),
        created_at=stamp,
        updated_at=stamp,
        step_timeout=step_timeout,
        force=force,
    )


# ---------------------------------------------------------------------------
# Actions and the next one
# ---------------------------------------------------------------------------


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
    WriteOverride | MarkApplied | MarkVerified | RollBack | MarkRolledBack | Wait
    | PauseForWindow | Resume | Halt | Finalize | Finish | Fail | Done
)  # fmt: skip


def next_action(
    record: RolloutRecord,
    statuses: Mapping[str, NodeStatus],
    policy: DisruptionPolicy,
    now: datetime,
    step_elapsed: float,
    overrides: Mapping[str, NodeOverride] | None = None,
    poll: float = POLL,
) -> Action:
    """The one next thing to do. ``step_elapsed``: monotonic seconds since the current step
    (the node and its state) began; ``overrides``: the nodes' overrides as read now, if
    known (to re-write one a killed driver recorded but never wrote)."""
    state = record.state
    if state in TERMINAL or state == "paused":
        return Done(state)
    timeout = record.step_timeout
    if state == "rolling-back":
        entry = next((e for e in record.nodes if e.state == "rolling-back"), None)
        if entry is None:
            return Fail(record.reason or "rolled back")
        return _rollback_step(record, entry, statuses, step_elapsed, overrides, poll)
    if state == "finalizing":
        if not record.config_written:
            return Finalize()
        return _vtep_step(record, statuses, step_elapsed, poll)
    entry = record.current()
    if entry is not None:  # a step in flight finishes before any request is honoured
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
            return Halt("paused", f"{node} {what} after {timeout:g} s, before it was "
                        "switched; fix it (flannelpy doctor), then run flannelpy rollout "
                        "resume")  # fmt: skip
        return Wait(f"{node}: waiting for it to be Ready before switching it", poll)
    target = backend_config(record.target)
    if record.force is None:
        changes = _changes(status.backend, target)
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
            return MarkApplied(node, status.applied_at if status.applied_at is not None
                               else status.at)  # fmt: skip
        if status is not None and status.blocked is not None and (
            status.blocked.generation == generation
        ):
            return _roll_back(record, entry, statuses, overrides,
                              f"{node} refused generation {generation}: "
                              f"{status.blocked.sentence}")  # fmt: skip
        if elapsed > timeout:
            return _roll_back(record, entry, statuses, overrides,
                              f"{node} did not apply generation {generation} within "
                              f"{timeout:g} s ({_shows(status)})")  # fmt: skip
        if _missing_write(node, generation, overrides):
            return WriteOverride(node, record.target, generation)  # the same generation
        return Wait(f"{node}: waiting for generation {generation} to apply", poll)
    failures = verification_failures(node, generation, entry.applied_at, target, statuses)
    if not failures:
        return MarkVerified(node)
    if elapsed > timeout:
        shown = "; ".join(failures[:8]) + (f"; and {len(failures) - 8} more"
                                           if len(failures) > 8 else "")  # fmt: skip
        return _roll_back(record, entry, statuses, overrides,
                          f"{node} failed verification after {timeout:g} s: {shown}")
    return Wait(f"{node}: verifying probes to and from every peer", poll,
                f"{len(failures)} pending, e.g. {failures[0]}")  # fmt: skip


def _shows(status: NodeStatus | None) -> str:
    if status is None:
        return "it reports no status"
    generation = status.applied_generation
    applied = "no override generation" if generation is None else f"generation {generation}"
    return (
        f"it reports {applied}, {'Ready' if status.ready else 'not Ready'}, "
        f"{short(status.backend)}"
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
    return Wait("waiting for the nodes to drop VTEPs they no longer need", poll,
                ", ".join(keeping))  # fmt: skip


def _subnet(text: str) -> str:
    try:
        return str(ip_network(text, strict=False))
    except ValueError:
        return text


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
    ended after the node applied the change. Probe times are the prober's node's
    clock, compared with the switched node's AppliedAt: agents' clocks agree (NTP),
    the rollout's clock plays no part.
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
    own = [_subnet(s) for s in status.subnets]
    own_probes = {_subnet(k): p for k, p in status.probes.items()}
    for peer, peer_status in sorted(statuses.items()):
        if peer == node:
            continue
        peer_probes = {_subnet(k): p for k, p in peer_status.probes.items()}
        for subnet in (_subnet(s) for s in peer_status.subnets):
            found.extend(_probe_problem(f"{node} -> {peer}", own_probes.get(subnet), since))
        for subnet in own:
            found.extend(_probe_problem(f"{peer} -> {node}", peer_probes.get(subnet), since))
    return found


def _probe_problem(pair: str, probe: Any, since: float) -> list[str]:
    if probe is None:
        return [f"{pair}: no probe result"]
    if probe.probes < 1 or probe.at <= since:
        return [f"{pair}: no probe round since the change"]
    if not probe.reachable:
        return [f"{pair}: unreachable"]
    if probe.mtu_ok is False:
        return [f"{pair}: the full-MTU probe was lost"]
    if probe.mtu_ok is None:
        return [f"{pair}: no full-MTU probe answer yet"]
    if not probe.ok:
        return [f"{pair}: the last probe round failed"]
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
        return r.with_entry(replace(entry, state="applying", previous=previous_override,
                                    generation=action.generation, started_at=stamp,
                                    applied_at=None))  # fmt: skip
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
        return r.with_entry(replace(entry, state="rolling-back",
                                    rollback_generation=action.generation))  # fmt: skip
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
        return replace(r, state=action.state, reason=action.reason, request=None,
                       next_window=None)  # fmt: skip
    if isinstance(action, Finalize):
        return record if record.state == "finalizing" else replace(r, state="finalizing")
    if isinstance(action, Finish):
        return replace(r, state="done", note=action.note, request=None)
    return record  # Wait, Done: nothing to record


# ---------------------------------------------------------------------------
# Showing a record
# ---------------------------------------------------------------------------


def describe_state(record: RolloutRecord) -> str:
    text: str = record.state
    if record.request is not None and record.state not in TERMINAL:
        text += f" ({record.request} requested: after the current step)"
    if record.state == "paused-window" and record.next_window:
        text += f" until {record.next_window}"
    return text


def summary(record: RolloutRecord) -> str:
    """One line on how the rollout ended (or where it stands)."""
    target = backend_name(backend_config(record.target))
    switched = [e.node for e in record.nodes if e.state == "done" and not e.skipped]
    skipped = [e.node for e in record.nodes if e.skipped]
    text = f"rollout {record.id} {describe_state(record)}: {len(switched)} of "
    text += f"{len(record.nodes)} nodes switched to {target}"
    if switched:
        text += f" ({', '.join(switched)})"
    if skipped:
        text += f"; already on it: {', '.join(skipped)}"
    if record.reason:
        text += f"; {record.reason}"
    if record.note:
        text += f"; note: {record.note}"
    return text


@dataclass(frozen=True)
class NodeRow:
    """A line of ``rollout status`` for one node."""

    node: str
    rollout_state: str
    backend: str
    applied_generation: int | None
    ready: bool | None
    blocked: str | None


def status_rows(record: RolloutRecord | None, statuses: Mapping[str, NodeStatus]) -> list[NodeRow]:
    names = list(record.order) if record else []
    names += sorted(set(statuses) - set(names))
    rows = []
    for name in names:
        st = statuses.get(name)
        entry = record.entry(name) if record and name in record.order else None
        rows.append(NodeRow(
            node=name,
            rollout_state=(entry.state + (" (skipped)" if entry.skipped else "")) if entry
            else "-",
            backend=short(st.backend) if st else "no status",
            applied_generation=st.applied_generation if st else None,
            ready=st.ready if st else None,
            blocked=st.blocked.sentence if st and st.blocked else None,
        ))  # fmt: skip
    return rows


def how_to_go_back(record: RolloutRecord) -> str | None:
    """For a stopped rollout: which nodes run the target through an override, and the
    command that walks them back to the config's Backend one at a time."""
    switched = [e.node for e in record.nodes if not e.skipped and e.state == "done"]
    if not switched or record.config_written:
        return None
    back = backend_config(record.config_backend or {"Type": "vxlan"})
    command = f"flannelpy rollout start --backend {back.type}"
    if back.type == "vxlan" and back.direct_routing:
        command += " --direct-routing"
    return (
        f"{', '.join(switched)} keep {backend_name(backend_config(record.target))} through "
        f"their overrides; to go back to the config's {backend_name(back)}, run `{command}` "
        "(it walks them back one at a time)"
    )
