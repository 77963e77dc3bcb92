"""The backend protocol: a backend is a pure planner of desired kernel state.

It advertises what peers need to reach this node (LeaseAttrs) and turns our
leases plus peer leases into a :class:`DesiredState`. It never touches the
kernel; the reconciler does. Every backend plans its peers through
:func:`plan_peers`, so a cluster of mixed backends agrees on each pair's path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from ipaddress import IPv4Address, IPv4Interface, IPv4Network, IPv6Address, IPv6Network
from typing import Any, NamedTuple, Protocol

from flannelpy.backend.paths import (
    Capabilities,
    NoPath,
    choose_path,
    needs_vtep,
    own_capabilities,
    peer_capabilities,
    peer_capabilities_v6,
)
from flannelpy.backend.wireguard_config import WireguardIdentity
from flannelpy.config.netconf import NetworkConfig
from flannelpy.dataplane.state import (
    Address,
    DesiredState,
    FdbEntry,
    Neighbour,
    Route,
    SetDelta,
    UnderlayInterface,
    Unreachable,
    VxlanLink,
    blackhole_route,
)
from flannelpy.subnet.lease import Lease, LeaseAttrs
from flannelpy.subnet.memo import LeaseMemo
from flannelpy.subnet.span import overlaps
from flannelpy.subnet.validate import Bounds


@dataclass(frozen=True)
class NodeContext:
    """What a backend knows about the node it plans for."""

    config: NetworkConfig
    underlay: UnderlayInterface
    # Advertised to peers; the underlay address unless --public-ip. None IPv6-only.
    public_ip: IPv4Address | None
    node_name: str
    # Dual stack: advertised as PublicIPv6; the underlay's global IPv6 unless --public-ipv6.
    public_ipv6: IPv6Address | None = None
    # --ip-blackhole-route: a blackhole route for each own subnet (see blackhole_route).
    blackhole_own_subnets: bool = False
    # Switched away from wireguard while a peer still runs it: the WireGuard device and
    # key stay, and the pair stays encrypted until that peer switches too (make before
    # break; :func:`flannelpy.backend.wireguard.keeping_context` decides).
    keeps_wireguard: bool = False
    # The public keys flannel-wg has completed a handshake with; None: not known (the
    # doctor), and no pair is held back. A wireguard pair whose handshake is still to come
    # stays on vxlan while both ends have a VTEP (:func:`held_on_vxlan`).
    wireguard_confirmed: frozenset[str] | None = None
    # The same for flannel-wg-v6, which carries the IPv6 half of each pair (dual stack).
    wireguard_confirmed_v6: frozenset[str] | None = None
    # Our WireGuard key and the options its device runs with, once the agent loaded the key
    # (it runs wireguard, or did and keeps the device); None before, and for the doctor.
    wireguard_identity: WireguardIdentity | None = None
    # --vxlan-tx-checksum-off: VTEPs get transmit checksum offload off once created.
    vtep_tx_checksum_off: bool = False


class Backend(Protocol):
    type_name: str

    def mtu(self, ctx: NodeContext) -> int:
        """The overlay MTU: what pods and subnet.env get."""
        ...

    def device_names(self, ctx: NodeContext) -> tuple[str, ...]:
        """Devices this backend creates and owns entirely."""
        ...

    def lease_attrs(self, ctx: NodeContext, vtep_mac: str | None) -> LeaseAttrs:
        """What we advertise; BackendData carries the VTEP only when ``vtep_mac`` is given."""
        ...

    def needs_vtep(self, ctx: NodeContext, peers: Sequence[Lease]) -> bool:
        """Whether this node must have a VTEP now (pass ``vtep_mac`` to plan/lease_attrs)."""
        ...

    def plan(
        self,
        ctx: NodeContext,
        own: Sequence[Lease],
        peers: Sequence[Lease],
        vtep_mac: str | None,
        memo: PlanMemo | None = None,
    ) -> DesiredState:
        """The plan; ``memo`` (kept by the caller between plans) makes it cost what changed."""
        ...


def node_needs_vtep(ctx: NodeContext, peers: Sequence[Lease]) -> bool:
    """:func:`~flannelpy.backend.paths.needs_vtep` for this node among ``peers``; and a
    wireguard node keeps its VTEP while a pair is held on vxlan for its handshake."""
    # A lease advertising our own address is a stale one of ours, not a peer.
    others = [peer for peer in peers if not is_own_address(ctx, peer)]
    if needs_vtep(ctx.config.backend, others):
        return True
    if ctx.config.backend.type.lower() != "wireguard" or ctx.wireguard_confirmed is None:
        return False
    return any(held_in_a_family(ctx, peer, ctx.config.backend.vni) for peer in others)


def held_on_vxlan(
    ctx: NodeContext, peer: Lease, peer_caps: Capabilities, vni: int | None, ipv6: bool = False
) -> bool:
    """Make before break, to wireguard: a pair the rule sends through WireGuard stays on
    vxlan until our device has completed a handshake with the peer, while both ends still
    have a VTEP of one VNI (``vni``: ours). Until then the peer may not know our key yet
    (it has not seen our lease) and drops what we encrypt; the handshake proves it does.
    Each family on its own (``ipv6``: flannel-wg-v6's handshake, BackendV6Data's key and
    VTEP, as ``peer_caps`` must be)."""
    confirmed = ctx.wireguard_confirmed_v6 if ipv6 else ctx.wireguard_confirmed
    if confirmed is None or not peer_caps.wireguard_key:
        return False
    if vni is None or peer_caps.vni != vni:
        return False
    data = peer.attrs.backend_v6_data if ipv6 else peer.attrs.backend_data
    return (data or {}).get("PublicKey") not in confirmed


def held_in_a_family(ctx: NodeContext, peer: Lease, vni: int | None) -> bool:
    """:func:`held_on_vxlan` in IPv4 or, on a dual-stack node, in IPv6."""
    flanneld_dr = ctx.config.flanneld_backend.direct_routing
    if held_on_vxlan(ctx, peer, peer_capabilities(peer, flanneld_dr), vni):
        return True
    return (
        ctx.config.enable_ipv6
        and ctx.underlay.ip6 is not None
        and held_on_vxlan(ctx, peer, peer_capabilities_v6(peer, flanneld_dr), vni, ipv6=True)
    )


def is_own_address(ctx: NodeContext, lease: Lease) -> bool:
    """Does ``lease`` advertise this node's address (IPv4, or IPv6 when IPv6-only)?"""
    if ctx.public_ip is not None:
        return lease.attrs.public_ip == ctx.public_ip
    return ctx.public_ipv6 is not None and lease.attrs.public_ipv6 == ctx.public_ipv6


def vxlan_link(
    ctx: NodeContext,
    name: str,
    local_ip: IPv4Address | IPv6Address,
    mtu: int,
    vtep_mac: str | None,
) -> VxlanLink:
    """A VTEP device of either family: the config's VNI, port and flags over our underlay."""
    backend = ctx.config.backend
    return VxlanLink(
        name=name,
        vni=backend.vni,
        local_ip=local_ip,
        underlay=ctx.underlay.name,
        port=backend.effective_port,
        mtu=mtu,
        mac=vtep_mac,
        gbp=backend.gbp,
        learning=backend.learning,
        tx_checksum_off=ctx.vtep_tx_checksum_off,
    )


def node_bounds(
    ctx: NodeContext,
    own: Sequence[Lease],
    extra_networks: Sequence[IPv4Network | IPv6Network] = (),
) -> Bounds:
    """What a peer lease must not contradict on this node: the Network and IPv6Network
    (and address pools beyond them), our leases of each family, our connected subnets
    and addresses."""
    networks = [ctx.config.network] if ctx.config.network is not None else []
    networks += [n for n in extra_networks if isinstance(n, IPv4Network)]
    networks6 = [ctx.config.ipv6_network] if ctx.config.ipv6_network is not None else []
    networks6 += [n for n in extra_networks if isinstance(n, IPv6Network)]
    underlay = ctx.underlay
    return Bounds(
        networks=tuple(dict.fromkeys(networks)),
        own=tuple(lease.subnet for lease in own if lease.subnet is not None),
        host=tuple(underlay.networks),
        public_ip=ctx.public_ip,
        host_ips=(underlay.ip,) if underlay.ip is not None else (),
        ipv6_networks=tuple(dict.fromkeys(networks6)),
        own6=tuple(lease.ipv6_subnet for lease in own if lease.ipv6_subnet is not None),
        host6=tuple(underlay.networks6),
        host_ips6=tuple(ip for ip in (underlay.ip6, ctx.public_ipv6) if ip is not None),
    )


def routable_peers(ctx: NodeContext, own: Sequence[Lease], peers: Sequence[Lease]) -> list[Lease]:
    """Peers worth a path: not ourselves under another key, not overlapping our own subnets.

    A peer lease that advertises our own address is a stale lease of this node
    (re-created, or left by a previous run); routing to it would loop.
    """
    own_nets = own_networks(own)
    return [peer for peer in peers if is_routable(ctx, own_nets, peer)]


def own_networks(own: Sequence[Lease]) -> tuple[IPv4Network | IPv6Network, ...]:
    return tuple(net for lease in own for net in lease.subnets)


def is_routable(
    ctx: NodeContext, own_nets: Sequence[IPv4Network | IPv6Network], peer: Lease
) -> bool:
    """One peer of :func:`routable_peers` (``own_nets``: our leases' subnets)."""
    return not is_own_address(ctx, peer) and not any(
        overlaps(theirs, mine) for theirs in peer.subnets for mine in own_nets
    )


class PeerEntries(NamedTuple):
    """What one peer adds to a plan (the entries of its path, or why it has none)."""

    routes: tuple[Route, ...] = ()
    neighbours: tuple[Neighbour, ...] = ()
    fdb: tuple[FdbEntry, ...] = ()
    unreachable: tuple[Unreachable, ...] = ()


NO_ENTRIES = PeerEntries()


class EntriesMemo:
    """The peers' entries of the last plan of one family, and their union, kept up to
    date by what changed: the union of thousands of entries is then copied, never
    hashed again (a set built from a dict or a set reuses the hashes they hold), and
    kept as it was when nothing in it changed. Each set comes with its
    :class:`~flannelpy.dataplane.state.SetDelta` from the last plan's."""

    def __init__(self) -> None:
        self._memo: LeaseMemo[PeerEntries] = LeaseMemo()
        self._forget()

    def _forget(self) -> None:
        # Per field of PeerEntries: entry -> how many peers plan it (two leases may).
        self._counts: tuple[dict[object, int], ...] = ({}, {}, {}, {})
        self._last: tuple[frozenset[Any], ...] = (frozenset(),) * 4  # the last union

    def union(
        self, context: object, peers: Sequence[Lease], one: Callable[[Lease], PeerEntries]
    ) -> tuple[tuple[frozenset[Any], ...], tuple[SetDelta, ...]]:
        """Every peer's entries of :func:`one` in ``context``, as one frozenset per field
        of PeerEntries, and how each was made from the last call's."""
        try:
            delta = self._memo.update(context, peers, one)
        except BaseException:  # the memo forgot every lease: so do the counts
            self._forget()
            raise
        gone: tuple[set[object], ...] = (set(), set(), set(), set())
        came: tuple[set[object], ...] = (set(), set(), set(), set())
        for entries in delta.dropped:
            for field, counts, removed in zip(entries, self._counts, gone, strict=True):
                for entry in field:
                    left = counts[entry] - 1
                    if left:
                        counts[entry] = left
                    else:
                        del counts[entry]
                        removed.add(entry)
        for entries in delta.added:
            for field, counts, added, removed in zip(
                entries, self._counts, came, gone, strict=True
            ):
                for entry in field:
                    had = counts.get(entry, 0)
                    counts[entry] = had + 1
                    if not had:
                        if entry in removed:  # planned again (a changed lease): no change
                            removed.discard(entry)
                        else:
                            added.add(entry)
        sets = tuple(
            last if not (added or removed) else frozenset(counts)
            for last, counts, added, removed in zip(
                self._last, self._counts, came, gone, strict=True
            )
        )
        deltas = tuple(
            SetDelta(last, now, frozenset(added), frozenset(removed))
            for last, now, added, removed in zip(self._last, sets, came, gone, strict=True)
        )
        self._last = sets
        return sets, deltas


class PlanMemo:
    """Each peer's entries of the last plan, per family, reused by the next plan for the
    leases that did not change (:class:`~flannelpy.subnet.memo.LeaseMemo`): a plan then
    costs what changed. Planning with it gives exactly what planning without it gives."""

    def __init__(self) -> None:
        self.v4 = EntriesMemo()
        self.v6 = EntriesMemo()


def peer_entries(
    peers: Sequence[Lease],
    context: object,
    one: Callable[[Lease], PeerEntries],
    memo: EntriesMemo | None,
) -> DesiredState:
    """The peers' entries, each from ``one`` (or ``memo``, in ``context``), as a plan
    without devices."""
    if memo is None:
        entries = [one(peer) for peer in peers]
        return DesiredState(
            routes=frozenset(r for e in entries for r in e.routes),
            neighbours=frozenset(n for e in entries for n in e.neighbours),
            fdb=frozenset(f for e in entries for f in e.fdb),
            unreachable=frozenset(u for e in entries for u in e.unreachable),
        )
    (routes, neighbours, fdb, unreachable), deltas = memo.union(context, peers, one)
    return DesiredState(
        routes=routes, neighbours=neighbours, fdb=fdb, unreachable=unreachable, deltas=deltas
    )


def plan_peers(
    ctx: NodeContext,
    own: Sequence[Lease],
    peers: Sequence[Lease],
    link: VxlanLink | None,
    memo: PlanMemo | None = None,
) -> DesiredState:
    """The one planner behind every backend: a path per peer, chosen by
    :func:`~flannelpy.backend.paths.choose_path` from both ends' capabilities.

    ``link`` is our VTEP (always under vxlan; under host-gw only while a peer is
    still vxlan), or None. Direct paths are a route via the peer's address on the
    underlay; vxlan paths are the three entries of the recipe in
    :mod:`flannelpy.backend.vxlan`. A peer without a path is reported, never
    routed into a black hole. ``memo`` keeps each peer's entries for the next plan.
    """
    # Our VTEP is the link we create; whether we prefer direct follows from the config.
    own_caps = own_capabilities(ctx.config.backend, None, ctx.keeps_wireguard)
    caps = Capabilities(
        prefers_direct=own_caps.prefers_direct,
        vni=link.vni if link else None,
        vtep_mac=link.mac if link else None,
        encrypts=own_caps.encrypts,
        wireguard_key=own_caps.wireguard_key,
    )
    own_nets = own_networks(own)

    def one(peer: Lease) -> PeerEntries:
        return _peer_path(ctx, own_nets, caps, link, peer)

    planned = peer_entries(peers, (ctx, own_nets, link), one, memo.v4 if memo else None)
    routes = planned.routes
    if ctx.blackhole_own_subnets:
        routes |= {blackhole_route(lease.subnet) for lease in own if lease.subnet is not None}
    links = [link] if link else []
    return replace(
        planned,
        links=frozenset(links),
        addresses=frozenset(
            Address(dev.name, IPv4Interface(f"{lease.vtep_ip}/32"))
            for dev in links
            for lease in own
            if lease.vtep_ip is not None
        ),
        routes=routes,
        owned_devices=frozenset(dev.name for dev in links),
    )


def _peer_path(
    ctx: NodeContext,
    own_nets: Sequence[IPv4Network | IPv6Network],
    caps: Capabilities,
    link: VxlanLink | None,
    peer: Lease,
) -> PeerEntries:
    """One peer's IPv4 entries in :func:`plan_peers`."""
    ip, subnet, vtep_ip = peer.attrs.public_ip, peer.subnet, peer.vtep_ip
    if ip is None or subnet is None or vtep_ip is None or not ctx.config.enable_ipv4:
        return NO_ENTRIES  # an IPv6-only peer or node: the path is backend.ipv6's
    if not is_routable(ctx, own_nets, peer):
        return NO_ENTRIES
    on_link = ctx.underlay.on_link(ip)
    # flanneld peers run the network config's own Backend, not this node's override.
    peer_caps = peer_capabilities(peer, ctx.config.flanneld_backend.direct_routing)
    path = choose_path(caps, peer_caps, on_link)
    if isinstance(path, NoPath):
        networks = ", ".join(str(n) for n in ctx.underlay.networks) or "none"
        where = (
            f"on a subnet of {ctx.underlay.name}"
            if on_link
            else f"not on a subnet of {ctx.underlay.name} ({networks})"
        )
        reason = f"no path to peer {ip}, which is {where}: {path.reason}"
        return PeerEntries(unreachable=(Unreachable(subnet=subnet, public_ip=ip, reason=reason),))
    if path == "wireguard" and not held_on_vxlan(ctx, peer, peer_caps, caps.vni):
        return NO_ENTRIES  # the WireGuard device's peer (backend.wireguard), under its one route
    if path == "direct":
        return PeerEntries(routes=(Route(dst=subnet, gateway=ip, ifname=ctx.underlay.name),))
    # choose_path answers vxlan only when both ends have a VTEP (a peer's needs its MAC).
    assert link is not None and peer_caps.vtep_mac is not None
    return PeerEntries(
        routes=(Route(dst=subnet, gateway=vtep_ip, ifname=link.name, onlink=True),),
        neighbours=(Neighbour(link.name, vtep_ip, peer_caps.vtep_mac),),
        fdb=(FdbEntry(link.name, peer_caps.vtep_mac, ip),),
    )
