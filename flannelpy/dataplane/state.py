"""Kernel state as plain values: what the planner wants and what a netlink dump finds.

Both sides use the same frozen types so that reconciling is set arithmetic
(:mod:`flannelpy.dataplane.diff`). Interfaces are named, not indexed: an index
changes when a device is re-created, a name does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from ipaddress import (
    IPv4Address,
    IPv4Interface,
    IPv4Network,
    IPv6Address,
    IPv6Interface,
    IPv6Network,
)
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:  # a type only: the planner's values stay free of the device code
    from flannelpy.dataplane.wgspec import WgDeviceSpec

# Dual stack: every entry below holds either family; its address says which.
IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network

# Routes we own carry this protocol number (see /etc/iproute2/rt_protos), so that
# stale ones from a previous run or a removed peer are garbage-collected without
# touching anything another tool installed. Not used by any routing daemon we know.
ROUTE_PROTOCOL = 75
# The metric of the blackhole route for the node's own subnet. flanneld adds it with
# metric 0, which the kernel refuses (EEXIST) while cni0 holds its connected route, and
# which shadows that route when added before cni0's address (every pod unreachable).
# Above 0, cni0's connected route wins while it exists and the blackhole takes over
# only without it.
BLACKHOLE_METRIC = 1024


@dataclass(frozen=True)
class VxlanLink:
    """The VXLAN device (Flannel: ``flannel.<VNI>``, ``flannel-v6.<VNI>`` over an IPv6
    underlay; learning off)."""

    name: str
    vni: int
    local_ip: IPv4Address | IPv6Address
    underlay: str  # name of the underlay interface
    port: int  # UDP destination port; 8472 is the kernel's (and Flannel's) default
    mtu: int
    mac: str | None  # None: keep whatever the kernel chose (read back and advertised)
    gbp: bool = False
    learning: bool = False
    # Transmit checksum offload off once created (a kernel bug on some NICs; Flannel's
    # documented fix). A setting, not part of the device's identity: never compared.
    tx_checksum_off: bool = field(default=False, compare=False)


@dataclass(frozen=True, slots=True)
class Address:
    ifname: str
    address: IPv4Interface | IPv6Interface  # 10.244.1.0/32 on flannel.1, fd00:1::/128 on -v6


@dataclass(frozen=True, slots=True)
class Route:
    """A route in the main table with protocol :data:`ROUTE_PROTOCOL` (or one being taken
    over, see ``protocol``). Keyed by ``dst``."""

    dst: IPv4Network | IPv6Network
    gateway: IPv4Address | IPv6Address
    ifname: str
    onlink: bool = False
    # None: ours (ROUTE_PROTOCOL). Another value: a route another Flannel left that we
    # take over (dataplane.adopt); unequal to the desired one, so it is replaced (re-tagged)
    # or deleted with its own protocol.
    protocol: int | None = None
    # A blackhole route (no device, no gateway, metric BLACKHOLE_METRIC): --ip-blackhole-route.
    blackhole: bool = False


def blackhole_route(dst: IPv4Network | IPv6Network) -> Route:
    """What --ip-blackhole-route asks for the node's own subnet: packets to its unused
    addresses are dropped here instead of following the default route out."""
    none = IPv6Address(0) if isinstance(dst, IPv6Network) else IPv4Address(0)
    return Route(dst=dst, gateway=none, ifname="", blackhole=True)


@dataclass(frozen=True, slots=True)
class Neighbour:
    """A permanent ARP (or IPv6 neighbour) entry. Keyed by ``(ifname, ip)``."""

    ifname: str
    ip: IPv4Address | IPv6Address
    mac: str


@dataclass(frozen=True, slots=True)
class FdbEntry:
    """A permanent bridge FDB entry on a vxlan device: send frames for ``mac`` to ``dst``."""

    ifname: str
    mac: str
    dst: IPv4Address | IPv6Address


@dataclass(frozen=True, slots=True)
class Unreachable:
    """A peer the backend cannot reach (host-gw to a peer that is not on our L2 segment)."""

    subnet: IPv4Network | IPv6Network
    public_ip: IPv4Address | IPv6Address
    reason: str


@dataclass(frozen=True)
class PodRanges:
    """What the masq and forward rules are written for: every pod network (the config's
    Network and IPv6Network, every pool's) and every subnet this node holds."""

    networks: tuple[IPNetwork, ...]
    subnets: tuple[IPNetwork, ...]


class NftTableSpec(Protocol):
    """A whole nftables table of ours as a value (NetworkPolicy's ``Ruleset``): its name
    and the one atomic ``nft -f`` transaction that turns another such value into it."""

    @property
    def table(self) -> str:
        """``<family> <name>``, e.g. ``inet flannelpy-policy``."""
        ...

    def script_from(self, old: Any) -> str:
        """The transaction from ``old`` (the same kind of value) to this; from nothing
        (the table absent) when ``old`` is None; empty when nothing differs."""
        ...


@dataclass(frozen=True, eq=False)
class SetDelta:
    """How one set of a plan was made from the last plan's: ``result`` is ``base`` less
    ``removed`` plus ``added`` (``added`` disjoint from ``base``, ``removed`` within it).
    A diff whose observed set is ``base`` itself, as the reconciler's view is after a
    pass that applied the last plan, takes its differences from here instead of
    comparing thousands of entries; any other observed set is compared in full."""

    base: frozenset[Any]
    result: frozenset[Any]
    added: frozenset[Any]
    removed: frozenset[Any]


def delta_between(
    deltas: Sequence[SetDelta], result: frozenset[Any], base: frozenset[Any]
) -> SetDelta | None:
    """The delta that made ``result`` from ``base`` itself, if one of ``deltas`` did."""
    for delta in deltas:
        if delta.result is result and delta.base is base:
            return delta
    return None


@dataclass(frozen=True)
class DesiredState:
    """Everything the agent owns in the kernel. Anything of ours not listed here is stale.

    ``owned_devices`` are devices whose permanent neighbours and FDB entries are
    entirely ours (the vxlan device): entries there that are not desired are removed.
    """

    links: frozenset[VxlanLink] = frozenset()
    addresses: frozenset[Address] = frozenset()
    routes: frozenset[Route] = frozenset()
    neighbours: frozenset[Neighbour] = frozenset()
    fdb: frozenset[FdbEntry] = frozenset()
    owned_devices: frozenset[str] = frozenset()
    unreachable: frozenset[Unreachable] = frozenset()
    # WireGuard devices and their peers, applied before the routes that lead into them.
    wireguard: frozenset[WgDeviceSpec] = frozenset()
    # The ranges of the masq and forward rules; None before we hold a lease.
    firewall: PodRanges | None = None
    # The NetworkPolicy table; None: policy is off, or not synced since start (whatever
    # table the kernel holds is kept, so a restart opens no window).
    policy: NftTableSpec | None = None
    # How some of the sets above were made from the last plan's; never compared. Each
    # names its result set, so one whose set was since replaced is simply not found.
    deltas: tuple[SetDelta, ...] = field(default=(), compare=False, repr=False)


_COMPARED_FIELDS = tuple(f.name for f in fields(DesiredState) if f.compare)


def same_plan(new: DesiredState, old: DesiredState | None) -> bool:
    """``new == old``, where ``new``'s deltas from ``old``'s own sets answer for those
    sets without comparing their entries (a rewritten MAC leaves a set's size alone)."""
    if old is None:
        return False
    for name in _COMPARED_FIELDS:
        a, b = getattr(new, name), getattr(old, name)
        if a is b:
            continue
        delta = delta_between(new.deltas, a, b)
        if delta is not None:
            if delta.added or delta.removed:
                return False
        elif a != b:
            return False
    return True


@dataclass(frozen=True)
class ObservedState:
    """What a netlink dump found of the things we may own."""

    links: frozenset[VxlanLink] = frozenset()
    addresses: frozenset[Address] = frozenset()
    routes: frozenset[Route] = frozenset()  # ROUTE_PROTOCOL ones, and ones being taken over
    neighbours: frozenset[Neighbour] = frozenset()  # only permanent ones on owned devices
    fdb: frozenset[FdbEntry] = frozenset()  # only permanent ones with a dst on owned devices


class Compared(NamedTuple):
    """The set differences a diff computed: kept with its Changes so that what follows
    the kernel's view from pass to pass (the reconciler's view and identity counts)
    changes by them, not by comparing thousands of entries again."""

    whole: bool  # the plan was compared with the observed state given (no device re-created)
    routes: tuple[frozenset[Route], frozenset[Route]]  # (desired - observed, observed - desired)
    neighbours: tuple[frozenset[Neighbour], frozenset[Neighbour]]
    fdb_added: frozenset[FdbEntry]  # desired - observed


@dataclass(frozen=True)
class Changes:
    """What to do to turn observed into desired.

    The applier (``NetlinkKernel.apply``) goes: links, stale routes, addresses, then per
    peer neighbour, FDB entry and route, and stale neighbours and FDB entries last: a
    peer switching from vxlan to a direct route keeps its neighbour until its route no
    longer uses it, or packets in between would wait for an ARP that never comes.
    """

    links_to_delete: tuple[str, ...] = ()  # names; re-created because immutable attrs differ
    links_to_create: tuple[VxlanLink, ...] = ()
    links_to_update: tuple[VxlanLink, ...] = ()  # MTU / MAC changes applied in place
    routes_to_delete: tuple[Route, ...] = ()
    neighbours_to_delete: tuple[Neighbour, ...] = ()
    fdb_to_delete: tuple[FdbEntry, ...] = ()
    addresses_to_add: tuple[Address, ...] = ()
    addresses_to_delete: tuple[Address, ...] = ()
    # Per peer the kernel recipe is neighbour, then FDB, then route (the route
    # last so the kernel never has to ARP); the applier keeps that order.
    neighbours_to_set: tuple[Neighbour, ...] = ()
    fdb_to_set: tuple[FdbEntry, ...] = ()
    routes_to_set: tuple[Route, ...] = ()
    counts: dict[str, int] = field(default_factory=dict, compare=False)
    compared: Compared | None = field(default=None, compare=False, repr=False)

    @property
    def empty(self) -> bool:
        return not any(
            (
                self.links_to_delete,
                self.links_to_create,
                self.links_to_update,
                self.routes_to_delete,
                self.neighbours_to_delete,
                self.fdb_to_delete,
                self.addresses_to_add,
                self.addresses_to_delete,
                self.neighbours_to_set,
                self.fdb_to_set,
                self.routes_to_set,
            )
        )


@dataclass(frozen=True)
class UnderlayInterface:
    """The interface that carries overlay traffic between nodes (Flannel's external interface)."""

    name: str
    index: int
    # The interface's own IPv4 address: the vxlan local address (--public-ip may differ);
    # None in IPv6-only mode.
    ip: IPv4Address | None
    networks: tuple[IPv4Network, ...]  # subnets directly connected on this interface
    mtu: int
    # The interface's first global IPv6 address (the IPv6 vxlan local address) and its
    # connected IPv6 subnets; None and () on a node without IPv6 there.
    ip6: IPv6Address | None = None
    networks6: tuple[IPv6Network, ...] = ()

    def on_link(self, peer: IPv4Address | IPv6Address) -> bool:
        """True when ``peer`` is on one of our connected subnets: reachable without a gateway."""
        if isinstance(peer, IPv6Address):
            return any(peer in net for net in self.networks6)
        return any(peer in net for net in self.networks)
