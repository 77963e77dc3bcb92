"""Leases to kernel state: plan with the running backend, hand the plan to the reconciler.

Also what a plan tells about peers: the ones we cannot program (reported once
per change), overlay MTU disagreements, and the peer set the prober follows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from ipaddress import IPv4Address, IPv6Address
from typing import TYPE_CHECKING, Generic, TypeVar

from flannelpy.agent.firewall import pod_ranges
from flannelpy.agent.state import NodeState
from flannelpy.agent.vtep import VtepMac
from flannelpy.backend import ipv6 as ipv6_plan
from flannelpy.backend.base import NodeContext, PlanMemo, node_bounds
from flannelpy.backend.paths import is_flanneld_lease
from flannelpy.backend.wireguard import (
    WireguardBackend,
    keeping_context,
    plan_kept,
    unencrypted_peers,
)
from flannelpy.backend.wireguard_config import DEVICE as WG_DEVICE
from flannelpy.dataplane.reconciler import Reconciler
from flannelpy.dataplane.state import DesiredState, VxlanLink
from flannelpy.observe.metrics import AgentMetrics
from flannelpy.observe.mtu import (
    MtuReport,
    MtuTally,
    PeerMtu,
    describe_mismatch,
    describe_unknown,
    follow_mtu,
)
from flannelpy.observe.prober import Prober
from flannelpy.subnet.lease import Lease
from flannelpy.subnet.memo import LeaseList, LeaseMemo
from flannelpy.subnet.validate import Bounds, PeerSplit, Rejection

if TYPE_CHECKING:
    from flannelpy.dataplane.wgspec import WgDeviceSpec

log = logging.getLogger("flannelpy.agent.planning")
UNKNOWN_MTU_LINES = 3  # more new peers of unknown MTU than this: one line for them all
# How long a device that left the plan stays: peers see our new lease well within it.
LINGER_SECONDS = 5.0
T = TypeVar("T")


def probe_target6(peer: Lease) -> IPv6Address | None:
    """Where a peer answers over IPv6: cni0's IPv6 gateway, as over IPv4 (ours carry it
    from the start); a flanneld node advertising an IPv6 VTEP at that VTEP's address,
    since its cni0 has no IPv6 gateway. Not our VTEP's: with cni0's /64 beside it, the
    subnet's first address is its Subnet-Router anycast, and the kernel answers an echo
    to it from whichever address routes back (the underlay's, on a direct path), which
    the prober cannot match."""
    if peer.ipv6_subnet is None:
        return None
    if is_flanneld_lease(peer) and ipv6_plan.peer_capabilities_v6(peer).vtep_mac is not None:
        return peer.vtep_ip6
    return peer.gateway6


def probe_source6(ctx: NodeContext, own: Lease | None) -> IPv6Address | None:
    """Our IPv6 probe source, chosen as :func:`probe_target6` chooses a peer's target:
    the VTEP address with a ``flannel-v6`` device, else cni0's IPv6 gateway."""
    if own is None or own.ipv6_subnet is None or not ipv6_plan.enabled(ctx):
        return None
    return own.vtep_ip6 if ctx.config.backend.type == "vxlan" else own.gateway6


def probe_peers(
    peers: Sequence[Lease],
    *,
    ipv6: bool,
    memo: LeaseMemo[ProbeEntries] | None = None,
) -> dict[str, tuple[IPv4Address | IPv6Address, str]]:
    """The prober's peer set: one entry per family a peer has (keyed by its subnet of
    that family), so the per-interval budget counts both. ``memo`` keeps each lease's
    entries for the next call."""
    if memo is None:
        found = [probe_entries(p, ipv6) for p in peers]
    else:
        found = memo.results(ipv6, peers, lambda p: probe_entries(p, ipv6))
    return {key: value for entries in found for key, value in entries}


ProbeEntries = tuple[tuple[str, tuple[IPv4Address | IPv6Address, str]], ...]


def probe_entries(p: Lease, ipv6: bool) -> ProbeEntries:
    """One lease's entries of :func:`probe_peers`."""
    label = p.attrs.node_name or str(p.attrs.public_ip or p.attrs.public_ipv6)
    out: list[tuple[str, tuple[IPv4Address | IPv6Address, str]]] = []
    if p.subnet is not None and p.gateway is not None:
        out.append((str(p.subnet), (p.gateway, label)))
    target6 = probe_target6(p) if ipv6 else None
    if target6 is not None:
        out.append((str(p.ipv6_subnet), (target6, label)))
    return tuple(out)


class Lingering(Generic[T]):
    """Named things of the plan that stay ``seconds`` after they left it."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._planned: dict[str, T] = {}  # of the last plan
        self._lingering: dict[str, tuple[float, T]] = {}  # name -> (until, last form)

    def update(self, planned: dict[str, T], now: float) -> dict[str, T]:
        """Take the new plan's things; what lingers now (and was not planned again)."""
        for name in self._planned.keys() - planned.keys():
            self._lingering[name] = (now + self.seconds, self._planned[name])
        self._planned = planned
        self._lingering = {
            n: v for n, v in self._lingering.items() if v[0] > now and n not in planned
        }
        return {name: thing for name, (_, thing) in self._lingering.items()}

    def over(self, now: float) -> bool:
        return any(until <= now for until, _ in self._lingering.values())


class Planner:
    def __init__(
        self,
        state: NodeState,
        reconciler: Reconciler,
        vtep: VtepMac,
        metrics: AgentMetrics,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.state = state
        self.reconciler = reconciler
        self.vtep = vtep
        self.metrics = metrics
        self.prober: Prober | None = None  # set once it runs
        # Lease values the manager could not parse (it logs them): counted and shown here.
        self.undecodable: Callable[[], Mapping[str, Rejection]] = dict
        self.monotonic = monotonic
        # Devices that left the plan, kept a few seconds in their last planned form.
        self._links: Lingering[VxlanLink] = Lingering(LINGER_SECONDS)
        self._wireguard: Lingering[WgDeviceSpec] = Lingering(LINGER_SECONDS)
        # The last plan handed over, for a new policy table alone (replan_policy).
        self._last: tuple[DesiredState, frozenset[str]] | None = None
        # Per peer lease, what the last plan found (verdict, paths, MTU, probe targets):
        # the next plan recomputes only the leases that changed (subnet.memo).
        self.forget()

    def forget(self) -> None:
        """Drop what earlier plans found: the next plan computes every lease anew (it
        gives the same plan; tests compare the two)."""
        self._split = PeerSplit()  # the verdicts, and each plan's peers made after the last's
        self._plans = PlanMemo()
        self._mtus: LeaseMemo[PeerMtu | None] = LeaseMemo()
        self._mtu_tally = MtuTally()  # the MTU report's lists, kept with self._mtus
        self._probes: LeaseMemo[ProbeEntries] = LeaseMemo()

    def follow_peers(self, peers: Sequence[Lease] | None = None) -> None:
        """Hand the prober the current peers: each lease's IPv4 overlay address (its
        first address, on the owner's cni0) and, on a dual-stack node, its IPv6 one
        (:func:`probe_target6`), keyed by that family's subnet."""
        if self.prober is None or not self.state.own:
            return
        if peers is None:
            peers = self.state.peers()
        ipv6 = ipv6_plan.enabled(self.state.ctx)
        # By difference: the memo's delta is what changed since the prober was last told
        # (it is told by no one else), so one lease among thousands costs that lease.
        delta = self._probes.update(ipv6, peers, lambda p: probe_entries(p, ipv6))
        if delta.added or delta.dropped:
            added = {key: value for entries in delta.added for key, value in entries}
            left = [key for entries in delta.dropped for key, _ in entries if key not in added]
            self.prober.change_peers(added, left)
            self.metrics.forget_probes(left)  # a late round's result is not reported

    def replan(self) -> None:
        """Plan from the whole current state and hand the plan to the reconciler."""
        s = self.state
        if not s.own:
            return
        peers = self.check_peers()
        self.metrics.peers(peers, self.check_mtu(peers))
        self.follow_peers(peers)
        vtep_mac = self.vtep.if_needed(s.backend, s.ctx, peers)
        ctx = keeping_context(s.ctx, s.backend.type_name, peers, s.wireguard_device_up)
        s.kept_in_plan = ctx.keeps_wireguard  # the prober's MTU follows this plan
        if (vtep_mac is not None) != s.vtep_advertised or (
            ctx.keeps_wireguard != s.keeps_wireguard
        ):
            s.attrs_dirty = True  # the writer rewrites our lease next
        desired = s.backend.plan(ctx, s.own, peers, vtep_mac, self._plans)
        if s.backend.type_name == WireguardBackend.type_name:
            self.metrics.wireguard_unencrypted_peers(
                unencrypted_peers(ctx, s.own, peers, vtep_mac is not None)
            )
        else:
            desired = plan_kept(ctx, s.own, peers, desired)
        desired, stale_links = self._with_lingering(desired)
        desired = replace(desired, firewall=pod_ranges(s), policy=s.policy)
        s.wireguard_device_up = any(spec.name == WG_DEVICE for spec in desired.wireguard)
        if desired.unreachable != s.unreachable:
            for peer in sorted(desired.unreachable - s.unreachable, key=lambda u: u.subnet):
                log.warning("peer unreachable subnet=%s reason=%s", peer.subnet, peer.reason)
            s.unreachable = desired.unreachable
            self.metrics.peers_without_path(len(desired.unreachable))
        self._last = (desired, stale_links)
        self.reconciler.set_desired(desired, stale_links)

    def replan_policy(self) -> None:
        """Hand over the last plan with the new policy table: nothing else changed since
        (any other change asks for :meth:`replan`), so re-planning every peer would give
        the same routes, and a policy change's latency must not grow with the cluster."""
        if self._last is None:
            self.replan()
            return
        desired, stale_links = self._last
        desired = replace(desired, policy=self.state.policy)
        self._last = (desired, stale_links)
        self.reconciler.set_desired_policy(desired)

    def _with_lingering(self, desired: DesiredState) -> tuple[DesiredState, frozenset[str]]:
        """``desired`` with the devices that left the plan less than
        :data:`LINGER_SECONDS` ago, and our devices to remove (the others not planned).
        A lingering VTEP stays, with no address, route, neighbour or FDB entry, so that
        peers which have not seen our new lease yet still reach us through it: make before
        break, as when the last node of a rollout to wireguard drops its VTEP. A lingering
        WireGuard device keeps its peers: those may still send to us encrypted."""
        now = self.monotonic()
        links = self._links.update({link.name: link for link in desired.links}, now)
        devices = self._wireguard.update({d.name: d for d in desired.wireguard}, now)
        planned = {link.name for link in desired.links}
        stale = frozenset(self.state.known_devices - planned - links.keys())
        if not links and not devices:
            return desired, stale
        kept = frozenset(links.values())
        return replace(
            desired,
            links=desired.links | kept,
            owned_devices=desired.owned_devices | {link.name for link in kept},
            wireguard=desired.wireguard | frozenset(devices.values()),
        ), stale

    def linger_over(self) -> bool:
        """A lingering device is due for removal: the writer replans."""
        now = self.monotonic()
        return self._links.over(now) or self._wireguard.over(now)

    def bounds(self) -> Bounds:
        """What a peer lease must not contradict: the networks, our leases, our addresses."""
        s = self.state
        return node_bounds(s.ctx, s.own, [p.network for p in s.pools])

    def check_peers(self) -> LeaseList:
        """Set aside the peer leases that must never reach the kernel; each new rejection
        is logged once and counted (with the values the store could not even parse).
        The others are the peers to plan (:meth:`NodeState.peers`), as a list made after
        the last plan's, which the plan's memos follow."""
        s = self.state
        peers, rejected = self._split.split(s.leases, (x.key for x in s.own), self.bounds())
        for key, why in self.undecodable().items():
            rejected.setdefault(key, why)
        for key, why in sorted(rejected.items()):
            old = s.rejected.get(key)
            if old is None or old.reason != why.reason:
                log.warning(
                    "ignoring a peer lease key=%s reason=%s: %s", key, why.reason, why.detail
                )
                self.metrics.rejected_lease(why.reason)
        s.rejected = rejected
        return peers

    def check_mtu(self, peers: Sequence[Lease]) -> MtuReport:
        """Peers must agree on the overlay MTU, or large packets vanish silently between them.

        Between nodes on different backends (a backend switch under way) the MTUs differ
        by design; that is said once at info level, not warned per peer."""
        s = self.state
        report, fresh, gone = follow_mtu(s.mtu, peers, self._mtus, s.mtu_report, self._mtu_tally)
        if s.mtu_report is None or report.mismatched != s.mtu_report.mismatched:
            backend_of = {p.primary_subnet: p.attrs.backend_type for p in peers}
            mixed = [
                p for p in report.mismatched if backend_of.get(p.subnet) != s.backend.type_name
            ]
            for peer in report.mismatched:
                if peer not in mixed:
                    log.warning("MTU mismatch: %s", describe_mismatch(report.own_mtu, peer))
            if mixed:
                log.info(
                    "overlay MTU differs from %d peer lease(s) on another backend, as expected "
                    "while backends are mixed; pods keep their MTU until re-created",
                    len(mixed),
                )
        # A flanneld peer advertises no MTU: normal in a mixed cluster, said once per peer,
        # or in one line for many at once (a start among thousands of flanneld nodes
        # would log a line for each).
        s.mtu_report = report
        if not fresh and not gone:
            return report
        # Only what changed is looked at (follow_mtu's leases that came and went): a peer
        # whose lease changed but still advertises no MTU went and came in one plan, and
        # was said when it first came.
        went = {peer.subnet for peer in gone}
        new = [peer for peer in fresh if peer.subnet not in went]
        if len(new) > UNKNOWN_MTU_LINES:
            log.info(
                "MTU unknown for %d peers (%s, ...): %s",
                len(new),
                ", ".join(str(peer.subnet) for peer in new[:UNKNOWN_MTU_LINES]),
                describe_unknown(new[0]),
            )
        else:
            for peer in new:
                log.info("MTU unknown: %s", describe_unknown(peer))
        return report
