"""The agent's state: one mutable record the writer owns, one immutable view for the rest.

Only the writer thread (``agent.writer``) changes a ``NodeState``. Every other
thread (the reconciler's status callback, the HTTP servers, CNI requests, the
prober) reads the latest ``AgentView``, a frozen copy the writer publishes
once its state is whole again, so nothing outside the writer ever sees a
half-applied change.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from ipaddress import IPv4Network

from flannelpy.backend.base import Backend, NodeContext
from flannelpy.backend.wireguard import kept_devices_mtu
from flannelpy.config.netconf import NetworkConfig
from flannelpy.control.records import BlockedChange
from flannelpy.dataplane.state import NftTableSpec, Unreachable
from flannelpy.ipam.capacity import CapacitySettings
from flannelpy.observe.mtu import MtuReport, PeerMtu
from flannelpy.subnet.lease import Lease
from flannelpy.subnet.pools import Pool
from flannelpy.subnet.validate import Rejection


@dataclass(frozen=True)
class Clocks:
    """Injected time: ``wall`` for what other machines read (lease expiry, records,
    policy windows), ``monotonic`` for intervals."""

    wall: Callable[[], float] = time.time
    monotonic: Callable[[], float] = time.monotonic


@dataclass(frozen=True)
class PolicyStatus:
    """NetworkPolicy as the writer last compiled it, for status.json."""

    synced: bool  # every kind listed whole since start; before, the kernel's table is kept
    policies: int
    pods: int  # in the cluster, with an address
    namespaces: int
    selected_pods: int  # this node's pods isolated in some direction
    set_elements: int  # in the sets and maps of the node's table
    refused: tuple[str, ...]  # one sentence per object refused now


@dataclass
class NodeState:
    """What this node runs and holds. Written by the writer only."""

    backend: Backend
    ctx: NodeContext
    pools: list[Pool]
    capacity: CapacitySettings
    own: list[Lease] = field(default_factory=list)  # our leases, oldest first
    leases: dict[str, Lease] = field(default_factory=dict)  # every lease, ours included
    # Peer leases never programmed (subnet.validate), by key; set by each plan.
    rejected: dict[str, Rejection] = field(default_factory=dict)
    known_devices: set[str] = field(default_factory=set)  # ours to remove when unplanned
    first_snapshot: bool = False
    vtep_advertised: bool = False  # whether our lease carries our VTEP
    keeps_wireguard: bool = False  # whether our lease carries a kept WireGuard key
    # Whether the last plan kept the WireGuard device for pairs still on it: ahead of
    # keeps_wireguard at a switch back from wireguard (the lease is rewritten after).
    kept_in_plan: bool = False
    unreachable: frozenset[Unreachable] = frozenset()
    mtu_report: MtuReport | None = None
    applied_generation: int | None = None
    applied_at: float = 0.0
    blocked: BlockedChange | None = None
    subnet_env_written: bool = False
    rules_in_place: bool = True
    ready: bool = False
    # Follow-ups the writer runs after an event, each until it succeeds.
    lease_lost: bool = False
    attrs_dirty: bool = False
    capacity_due: bool = True
    # ... and what those asked of the others (Writer._follow_up runs them in one order).
    replan_due: bool = False
    policy_due: bool = False  # a new policy table alone: the last plan carries it
    subnet_env_due: bool = False
    status_due: bool = False  # status.json and the store record, now (not at the next tick)
    # The last plan had flannel-wg (wireguard, a kept device, or one lingering after it).
    wireguard_device_up: bool = False
    # The NetworkPolicy table to enforce; None: off, or not synced since start.
    policy: NftTableSpec | None = None
    policy_status: PolicyStatus | None = None

    @property
    def config(self) -> NetworkConfig:
        return self.ctx.config

    @property
    def mtu(self) -> int:
        return self.backend.mtu(self.ctx)

    @property
    def probe_mtu(self) -> int:
        """The size of the prober's full-MTU probe: the overlay MTU, or the kept WireGuard
        devices' while pairs still run through them (switching back from wireguard), since a
        probe at the new MTU would not fit those paths and fail the node's verification.
        The plan says so first: at the switch, before the lease is rewritten."""
        if self.keeps_wireguard or self.kept_in_plan:
            return min(self.mtu, kept_devices_mtu(self.ctx))
        return self.mtu

    def peers(self) -> list[Lease]:
        """Every lease but ours and the rejected, in the store's order."""
        others = dict(self.leases)  # a copy in C: thousands of leases, a few to drop
        for key in [lease.key for lease in self.own] + list(self.rejected):
            others.pop(key, None)
        return list(others.values())

    def peer_count(self) -> int:
        """``len(self.peers())``, in what ours and the rejected number, not the leases."""
        leases = self.leases
        set_aside = {lease.key for lease in self.own} | self.rejected.keys()
        return len(leases) - sum(key in leases for key in set_aside)

    def own_subnets(self) -> list[IPv4Network]:
        return [lease.subnet for lease in self.own if lease.subnet is not None]

    def view(self) -> AgentView:
        return AgentView(
            backend=self.backend,
            ctx=self.ctx,
            mtu=self.mtu,
            probe_mtu=self.probe_mtu,
            own=tuple(self.own),
            peers=self.peer_count(),
            unreachable=self.unreachable,
            mtu_mismatched=tuple(self.mtu_report.mismatched) if self.mtu_report else (),
            applied_generation=self.applied_generation,
            applied_at=self.applied_at,
            blocked=self.blocked,
            vtep=self.vtep_advertised,
            subnet_env_written=self.subnet_env_written,
            rules_in_place=self.rules_in_place,
            ready=self.ready,
            rejected=tuple(self.rejected[k] for k in sorted(self.rejected)),
            policy=self.policy_status,
        )


@dataclass(frozen=True)
class AgentView:
    """An immutable copy of ``NodeState`` for readers on other threads."""

    backend: Backend
    ctx: NodeContext
    mtu: int
    probe_mtu: int
    own: tuple[Lease, ...]
    peers: int
    unreachable: frozenset[Unreachable]
    mtu_mismatched: tuple[PeerMtu, ...]
    applied_generation: int | None
    applied_at: float
    blocked: BlockedChange | None
    vtep: bool
    subnet_env_written: bool
    rules_in_place: bool
    ready: bool
    rejected: tuple[Rejection, ...] = ()  # peer leases ignored, for status.json and the doctor
    policy: PolicyStatus | None = None  # NetworkPolicy; None when off

    @property
    def lease(self) -> Lease | None:
        return self.own[0] if self.own else None


class SayOnce:
    """Warn about a lasting condition once, not on every event that meets it again."""

    def __init__(self, log: logging.Logger) -> None:
        self._log = log
        self._said: set[str] = set()

    def __call__(self, key: str, message: str, *args: object) -> None:
        if key not in self._said:
            self._said.add(key)
            self._log.warning(message, *args)
