"""A backend rollout, node by node (pure): the plan, the record and the next step.

``flannelpy rollout`` switches the cluster's backend one node at a time while
every pod keeps reaching every pod (field notes §4). For each node it writes the
node's override (the target Backend, a new generation, the rollout's id), waits
until the node's status says it applied that generation, then waits until every
probe between that node and each peer, in both directions, answered a small and
a full-MTU echo after the change. A step that does not complete in time rolls
that node back and stops the rollout. After the last node the target Backend is
written into the network config and the overrides are removed.

Nothing here does I/O or reads a clock. :func:`plan_rollout` (here) decides whether
a target can work before anything changes; :func:`~.steps.next_action` looks at
the rollout record (:mod:`.record`: what the rollout did so far, kept in the store
so a killed driver can resume) and the nodes' statuses and returns the one next
thing to do; :func:`~.steps.record_after` is how the record changes when the
driver does it. :mod:`.backends` holds what a node runs and will run,
:mod:`.show` how a record is shown. The driver (:mod:`flannelpy.rollout.driver`)
performs actions and sleeps.

Times: the rollout's wall clock (``now``) only meets the disruption policy.
Step timeouts use elapsed time from a monotonic clock the driver keeps. Times
written by agents (``AppliedAt``, probe ``At``) are compared only with each
other, never with the rollout's clock, which may be another machine's (or a
test's fake).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from ipaddress import IPv4Address, IPv4Network, ip_network
from typing import Any

from flannelpy.backend.paths import NodeView, pairs_without_path
from flannelpy.config.netconf import (
    BackendConfig,
    NetworkConfig,
)
from flannelpy.control.policy import (
    Decision,
    DisruptionPolicy,
    decide,
    format_policy,
)
from flannelpy.control.records import BackendSummary, NodeStatus
from flannelpy.rollout.backends import (
    describe_transition,
    disruptions,
    expected_summary,
    parse_target,
    running_backend,
    runs,
    short,
)
from flannelpy.rollout.flanneld import FlanneldNode, flanneld_line, flanneld_problems

DEFAULT_STEP_TIMEOUT = 120.0  # seconds per step (apply, verify, roll back, drop VTEPs)
POLL = 1.0  # seconds between looks at the store while waiting


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
    flanneld: tuple[FlanneldNode, ...] = ()  # nodes the rollout cannot switch

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
        line = flanneld_line(self.flanneld)
        if line is not None:
            out.append(line)
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
    flanneld: Sequence[FlanneldNode] = (),
) -> RolloutPlan:
    """The plan for moving every node to ``target``; ``problems`` say why it cannot run.
    ``flanneld``: the cluster's flanneld nodes (:func:`~.flanneld.flanneld_nodes`), which
    stay on the network config's Backend.

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
        node_changes = () if skip else tuple(disruptions(status.backend, target_cfg))
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
    problems.extend(flanneld_problems(flanneld, config.backend, target_cfg))
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
        flanneld=tuple(flanneld),
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
        return f"{shown}; outside the window: waits until {decision.next_window_start.isoformat()}"
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
            _view(st, target if n in switched else current[n]) for n, st in sorted(statuses.items())
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
