"""What agents and operators' tools tell each other through the store (etcd mode).

Three records under ``<prefix>/flannelpy/`` (keys: :mod:`flannelpy.subnet.keys`), all
JSON that Flannel never reads:

- ``nodes/<node>/override``: a node's wanted Backend, written by ``rollout`` or by
  hand. It wins over the config's Backend for that node only.
- ``nodes/<node>/status``: what the node's agent runs and sees (its effective
  backend, readiness, the override generation it applied, a blocked change, a
  fixed-size summary of its probe results). Its size does not grow with the number
  of nodes, and the agent writes it on a change an operator acts on, else every few
  minutes (:mod:`flannelpy.agent.status`). ``rollout`` and ``policy show`` read
  it; it is how a tool off the node learns that a step took effect without
  reaching the node itself.
- ``events/<unix-ns>-<node>``: a record of each change forced past the policy.

Parsing is strict about types and lenient about unknown keys, so a newer agent's
status stays readable by an older tool.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from flannelpy.config.netconf import BackendConfig
from flannelpy.subnet.bounded_json import loads_bounded

# A node's agent rewrites its status record at least once per heartbeat interval
# (--status-publish-interval, 300 s by default). A holder whose record has gone
# unwritten for HEARTBEATS_MISSED intervals and CLOCK_SLACK_SECONDS more (17 min by
# default) is not running: the lease it holds under a node name may be taken over.
HEARTBEATS_MISSED = 3
CLOCK_SLACK_SECONDS = 120.0  # the writer's clock against the reader's


def _decode(raw: str | bytes, what: str) -> dict[str, Any]:
    try:
        doc = loads_bounded(raw)  # written by another machine: bounded before parsing
    except ValueError as e:
        raise ValueError(f"{what} is not valid JSON: {e}") from e
    if not isinstance(doc, dict):
        raise ValueError(f"{what} must be a JSON object")
    return doc


@dataclass(frozen=True)
class BackendSummary:
    """The parts of a node's running backend that peers and tools care about."""

    type: str
    vni: int
    port: int
    direct_routing: bool
    mtu: int  # the overlay MTU pods get

    @classmethod
    def of(cls, backend: BackendConfig, mtu: int) -> BackendSummary:
        return cls(
            type=backend.type,
            vni=backend.vni,
            port=backend.effective_port,
            direct_routing=backend.direct_routing,
            mtu=mtu,
        )

    def to_doc(self) -> dict[str, Any]:
        return {
            "Type": self.type,
            "VNI": self.vni,
            "Port": self.port,
            "DirectRouting": self.direct_routing,
            "MTU": self.mtu,
        }

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> BackendSummary:
        return cls(
            type=str(doc["Type"]),
            vni=int(doc["VNI"]),
            port=int(doc["Port"]),
            direct_routing=bool(doc["DirectRouting"]),
            mtu=int(doc["MTU"]),
        )

    def describe(self) -> str:
        if self.type == "vxlan":
            dr = "+DirectRouting" if self.direct_routing else ""
            return f"vxlan{dr} (VNI {self.vni}, port {self.port}, MTU {self.mtu})"
        return f"{self.type} (MTU {self.mtu})"


@dataclass(frozen=True)
class ForceRecord:
    reason: str
    by: str
    at: str  # ISO-8601 UTC

    def to_doc(self) -> dict[str, str]:
        return {"Reason": self.reason, "By": self.by, "At": self.at}


@dataclass(frozen=True)
class NodeOverride:
    """``nodes/<node>/override``: the Backend this node should run instead of the config's."""

    backend: Mapping[str, Any]  # a Backend object exactly as in net-conf.json
    generation: int
    rollout: str | None = None  # set when a rollout wrote it (the rollout checked the policy)
    force: ForceRecord | None = None

    def to_json(self) -> str:
        doc: dict[str, Any] = {"Backend": dict(self.backend), "Generation": self.generation}
        if self.rollout:
            doc["Rollout"] = self.rollout
        if self.force:
            doc["Force"] = self.force.to_doc()
        return json.dumps(doc, separators=(",", ":"), sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes) -> NodeOverride:
        doc = _decode(raw, "the node override")
        backend = doc.get("Backend")
        if not isinstance(backend, dict):
            raise ValueError('the node override needs a "Backend" object like net-conf.json\'s')
        generation = doc.get("Generation", 0)
        if not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
            raise ValueError('the node override\'s "Generation" must be a non-negative integer')
        rollout = doc.get("Rollout")
        force = doc.get("Force")
        force_record = None
        if isinstance(force, dict):
            force_record = ForceRecord(
                reason=str(force.get("Reason", "")),
                by=str(force.get("By", "")),
                at=str(force.get("At", "")),
            )
        return cls(
            backend=backend,
            generation=generation,
            rollout=str(rollout) if rollout else None,
            force=force_record,
        )


@dataclass(frozen=True)
class BlockedChange:
    generation: int | None  # the override generation blocked; None for a config change
    change: str  # "backend vxlan -> host-gw"
    sentence: str  # what the operator reads: the policy and what to do
    since: float

    def to_doc(self) -> dict[str, Any]:
        return {
            "Generation": self.generation,
            "Change": self.change,
            "Sentence": self.sentence,
            "Since": self.since,
        }


@dataclass(frozen=True)
class PeerProbe:
    """One peer's latest probe round as the node sees it: input to :class:`ProbeSummary`,
    never a record of its own (per-peer detail stays on the node)."""

    reachable: bool
    mtu_ok: bool | None
    ok: bool  # the latest round answered both the small and the full-MTU echo
    probes: int  # rounds completed since the peer was added
    at: float  # when the latest round completed (unix seconds, the node's clock)
    passed_at: float | None = None  # the latest round that passed; None: ``at`` if ok

    def last_pass(self) -> float | None:
        if self.passed_at is not None:
            return self.passed_at
        return self.at if self.ok and self.mtu_ok is True else None

    def problem(self) -> str | None:
        """The prober's settled verdicts only: one lost echo is loss, not a failing peer,
        so noise does not change the failing set (which triggers a write)."""
        if not self.reachable:
            return "unreachable"
        if self.mtu_ok is False:
            return "mtu"
        return None


MAX_FAILING_SHOWN = 5  # failing peers named in a record; the count covers the rest
PROBLEM_TEXT = {"unreachable": "unreachable", "mtu": "the full-MTU probe was lost"}


@dataclass(frozen=True)
class FailingPeer:
    subnet: str  # the peer's lease subnet (the prober's key)
    problem: str  # "unreachable" or "mtu"

    def describe(self) -> str:
        return PROBLEM_TEXT.get(self.problem, self.problem)


@dataclass(frozen=True)
class ProbeSummary:
    """A node's probe results in a fixed size, whatever the number of peers.

    ``passed_at``: every peer not failing answered a small and a full-MTU echo in one
    round that completed at or after this time (the node's clock); None until each has.
    A rollout compares it with a switched node's AppliedAt.
    """

    peers: int = 0  # peers with a completed round
    ok: int = 0  # peers whose latest round passed
    failing: int = 0
    failing_peers: tuple[FailingPeer, ...] = ()  # at most MAX_FAILING_SHOWN
    passed_at: float | None = None

    @classmethod
    def of(cls, probes: Mapping[str, PeerProbe]) -> ProbeSummary:
        failing = failing_peers(probes)
        passes = [p.last_pass() for k, p in probes.items() if k not in failing]
        known = [t for t in passes if t is not None]
        passed = min(known) if known and len(known) == len(passes) else None
        return cls(
            peers=len(probes),
            ok=sum(p.ok for p in probes.values()),
            failing=len(failing),
            failing_peers=tuple(
                FailingPeer(k, failing[k]) for k in sorted(failing)[:MAX_FAILING_SHOWN]
            ),
            passed_at=None if passed is None else round(passed, 3),
        )

    def to_doc(self) -> dict[str, Any]:
        return {
            "Peers": self.peers,
            "Ok": self.ok,
            "Failing": self.failing,
            "FailingPeers": [
                {"Subnet": f.subnet, "Problem": f.problem} for f in self.failing_peers
            ],
            "PassedAt": self.passed_at,
        }

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> ProbeSummary:
        shown = doc.get("FailingPeers") or []
        if not isinstance(shown, list):
            raise ValueError('"FailingPeers" must be a list')
        passed = doc.get("PassedAt")
        return cls(
            peers=_count(doc.get("Peers", 0)),
            ok=_count(doc.get("Ok", 0)),
            failing=_count(doc.get("Failing", 0)),
            failing_peers=tuple(
                FailingPeer(str(f["Subnet"]), str(f.get("Problem", "")))
                for f in shown[:MAX_FAILING_SHOWN]
            ),
            passed_at=None if passed is None else float(passed),
        )


def _count(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"a probe count must be a non-negative integer, not {value!r}")
    return value


def failing_peers(probes: Mapping[str, PeerProbe]) -> dict[str, str]:
    """Every failing peer's key and problem (the whole set, not just those shown)."""
    return {k: problem for k, p in probes.items() if (problem := p.problem()) is not None}


def _legacy_probes(doc: Mapping[str, Any]) -> ProbeSummary:
    """An older agent's per-peer ``Probes`` object, summarised as a newer one would."""
    return ProbeSummary.of(
        {
            str(k): PeerProbe(
                reachable=bool(v["Reachable"]),
                mtu_ok=v.get("MtuOk"),
                ok=bool(v.get("Ok", False)),
                probes=int(v.get("Probes", 0)),
                at=float(v.get("At", 0.0)),
            )
            for k, v in doc.items()
        }
    )


@dataclass(frozen=True)
class NodeStatus:
    """``nodes/<node>/status``: written by the node's agent."""

    node: str
    at: float
    ready: bool
    public_ip: str
    underlay_networks: tuple[str, ...]
    backend: BackendSummary
    vtep: bool
    applied_generation: int | None
    applied_at: float | None = None  # when the running backend took effect (node's clock)
    blocked: BlockedChange | None = None
    subnets: tuple[str, ...] = ()
    probes: ProbeSummary = field(default_factory=ProbeSummary)
    public_ipv6: str | None = None
    heartbeat_seconds: float | None = None  # its --status-publish-interval

    def to_json(self) -> str:
        return json.dumps(
            {
                "Node": self.node,
                "At": round(self.at, 3),
                "Ready": self.ready,
                "PublicIP": self.public_ip,
                "UnderlayNetworks": list(self.underlay_networks),
                "Backend": self.backend.to_doc(),
                "Vtep": self.vtep,
                "AppliedGeneration": self.applied_generation,
                "AppliedAt": self.applied_at,
                "Blocked": self.blocked.to_doc() if self.blocked else None,
                "Subnets": list(self.subnets),
                "ProbeSummary": self.probes.to_doc(),
                "PublicIPv6": self.public_ipv6,
                "HeartbeatSeconds": self.heartbeat_seconds,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> NodeStatus:
        doc = _decode(raw, "the node status")
        try:
            blocked = doc.get("Blocked")
            return cls(
                node=str(doc["Node"]),
                at=float(doc["At"]),
                ready=bool(doc["Ready"]),
                public_ip=str(doc["PublicIP"]),
                underlay_networks=tuple(str(n) for n in doc.get("UnderlayNetworks", [])),
                backend=BackendSummary.from_doc(doc["Backend"]),
                vtep=bool(doc.get("Vtep", False)),
                applied_generation=doc.get("AppliedGeneration"),
                applied_at=doc.get("AppliedAt"),
                blocked=BlockedChange(
                    generation=blocked.get("Generation"),
                    change=str(blocked.get("Change", "")),
                    sentence=str(blocked.get("Sentence", "")),
                    since=float(blocked.get("Since", 0.0)),
                )
                if isinstance(blocked, dict)
                else None,
                subnets=tuple(str(s) for s in doc.get("Subnets", [])),
                probes=(
                    ProbeSummary.from_doc(doc["ProbeSummary"])
                    if "ProbeSummary" in doc
                    else _legacy_probes(doc.get("Probes") or {})
                ),
                public_ipv6=_str_or_none(doc.get("PublicIPv6")),
                heartbeat_seconds=_positive_or_none(doc.get("HeartbeatSeconds")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"the node status lacks or mangles a field: {e}") from e


def _str_or_none(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _positive_or_none(value: Any) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < 1e9
    return float(value) if ok else None


def names_holder(status: NodeStatus, public_ip: object, public_ipv6: object) -> bool:
    """The record was written by the node at these addresses (a lease's PublicIP, or
    PublicIPv6 when it has none): only then does it say whether that node runs."""
    if public_ip is not None:
        return status.public_ip == str(public_ip)
    return public_ipv6 is not None and status.public_ipv6 == str(public_ipv6)


def heartbeat_deadline(status: NodeStatus, interval: float) -> float:
    """Unix time after which the node that wrote ``status``, having written no newer
    one, is judged gone: :data:`HEARTBEATS_MISSED` of its heartbeat intervals (the one
    its record names, else ``interval``) and :data:`CLOCK_SLACK_SECONDS` after the
    time it wrote it."""
    every = status.heartbeat_seconds or interval
    return status.at + HEARTBEATS_MISSED * every + CLOCK_SLACK_SECONDS
