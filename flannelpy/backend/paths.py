"""The path between two nodes, chosen from what *both* ends can do (mixed backends).

This is what lets a cluster switch backends node by node while every pod keeps
reaching every pod. A node's capabilities:

- ``prefers_direct``: it routes peers on its L2 segment directly (host-gw, or
  vxlan with DirectRouting);
- a VTEP: a vxlan device with a VNI. A vxlan node always has one. A host-gw node
  keeps one while any peer lease is still vxlan, because such a peer may
  encapsulate to it (it has not seen our new lease yet, or it cannot route to us
  directly); when no peer is vxlan any more it drops the device and stops
  advertising VtepMAC, which ends the transition.

Our own capabilities come from our backend config; a peer's from its lease:
BackendType, BackendData ``{"VNI", "VtepMAC"}`` (a host-gw lease carries them
while that node keeps a VTEP; Go flanneld ignores BackendData of host-gw
leases) and our extension ``"Flannelpy": {"DirectRouting": true}``.

A flanneld lease (no ``Flannelpy`` extension) says nothing of DirectRouting, and
flanneld decides alone: with DirectRouting it routes an on-link peer directly
whatever the peer advertises, without it it encapsulates. So a flanneld peer is
taken to run the network config's own Backend (flanneld reads no per-node
override), and the pair goes direct exactly when that flanneld end would.

The rule, for a pair of nodes:

0. a peer of a backend we do not speak (ipsec, udp, ...) → no path: a plain
   route would carry its traffic unencrypted, or into a device it lacks;
0b. either end runs wireguard and both have a WireGuard key (a node that switched
   away from wireguard keeps its device, and its key in its lease, while any peer
   still runs wireguard) → wireguard, through the WireGuard device. Otherwise the
   node that asked for encryption never gets a plain direct route: vxlan while both
   ends still have a VTEP (a wireguard node keeps one while any peer is vxlan),
   else no path;
1. on the same L2 segment and (direct is wanted, or either end lacks a VTEP) →
   direct route ``peer-subnet via peer-PublicIP dev <underlay>``. Direct is
   wanted when an end prefers it and the other follows (ours follow a peer that
   prefers direct; flanneld follows no one), or both prefer it;
2. else both ends have a VTEP with the same VNI → vxlan (neighbour, FDB, onlink
   route; the recipe is in :mod:`flannelpy.backend.vxlan`);
3. else no path, reported in one sentence.

It is symmetric in the two ends, so both directions of a pair take the same
path: a reply never comes back on another device than the request left by,
which strict rp_filter would drop. Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from ipaddress import IPv4Address, IPv4Network
from typing import Any, Literal

from flannelpy.config.netconf import BackendConfig
from flannelpy.subnet.lease import Lease

PathKind = Literal["direct", "vxlan", "wireguard"]

_FIX_SEGMENTS = "host-gw needs every node on one L2 segment: use vxlan, or vxlan with DirectRouting"


@dataclass(frozen=True)
class Capabilities:
    """What one end of a path can do. ``vni`` is None when the node has no VTEP.

    ``vtep_mac`` is what peers put in their FDB; it may be unknown for our own
    device (the kernel picks one), which does not change our own choice of path.
    """

    prefers_direct: bool
    vni: int | None
    vtep_mac: str | None
    # Routes directly when the peer prefers it (ours do); flanneld decides alone.
    follows_peer: bool = True
    # The backend type, when it is one we cannot build a path to (udp, ipsec, ...).
    foreign_backend: str | None = None
    # Runs wireguard: asks for encryption.
    encrypts: bool = False
    # Has a WireGuard device and key (a peer: advertises a valid PublicKey). A node that
    # runs wireguard always has one; another keeps it while a peer still runs wireguard.
    wireguard_key: bool = False

    @property
    def has_vtep(self) -> bool:
        return self.vni is not None


@dataclass(frozen=True)
class NoPath:
    """No path between two nodes; ``reason`` is a clause saying why and what to change."""

    reason: str


def _encrypts(backend_type: str) -> bool:
    return backend_type == "wireguard"


def _prefers_direct(backend_type: str, direct_routing: bool) -> bool:
    return backend_type == "host-gw" or (backend_type == "vxlan" and direct_routing)


def own_capabilities(
    backend: BackendConfig, vtep_mac: str | None, keeps_wireguard: bool = False
) -> Capabilities:
    """Ours: a VTEP when we are given its MAC, and always under vxlan (we create the
    device); a WireGuard key under wireguard, or while we keep the device after a switch
    away (``keeps_wireguard``)."""
    backend_type = backend.type.lower()
    has_vtep = vtep_mac is not None or backend_type == "vxlan"
    return Capabilities(
        prefers_direct=_prefers_direct(backend_type, backend.direct_routing),
        vni=backend.vni if has_vtep else None,
        vtep_mac=vtep_mac if has_vtep else None,
        encrypts=_encrypts(backend_type),
        wireguard_key=_encrypts(backend_type) or keeps_wireguard,
    )


SPOKEN_BACKENDS = ("vxlan", "host-gw", "wireguard")


def is_flanneld_lease(lease: Lease) -> bool:
    """A lease without our extension: flanneld's (ours always advertise their MTU)."""
    return lease.attrs.mtu is None


def peer_capabilities(lease: Lease, flanneld_direct_routing: bool = False) -> Capabilities:
    """A peer's, from its lease. A VTEP counts only with both VNI and VtepMAC: without the
    MAC we could not write its FDB entry. ``flanneld_direct_routing``: what a flanneld
    peer runs with (the network config's own DirectRouting), since its lease cannot say."""
    attrs = lease.attrs
    backend_type = attrs.backend_type.lower()
    vni = _int_or_none((attrs.backend_data or {}).get("VNI"))
    mac = attrs.vtep_mac
    has_vtep = backend_type in SPOKEN_BACKENDS and vni is not None and mac is not None
    flanneld = is_flanneld_lease(lease)
    direct_routing = flanneld_direct_routing if flanneld else attrs.direct_routing is True
    return Capabilities(
        prefers_direct=_prefers_direct(backend_type, direct_routing),
        vni=vni if has_vtep else None,
        vtep_mac=mac if has_vtep else None,
        follows_peer=not flanneld,
        encrypts=_encrypts(backend_type),
        # A vxlan or host-gw lease of ours carries a key while that node keeps its device.
        wireguard_key=backend_type in SPOKEN_BACKENDS
        and (_encrypts(backend_type) or not flanneld)
        and _is_wg_key((attrs.backend_data or {}).get("PublicKey")),
        # flanneld's udp backend writes no BackendType at all.
        foreign_backend=None
        if backend_type in SPOKEN_BACKENDS
        else (backend_type or "udp (no BackendType)"),
    )


def peer_capabilities_v6(peer: Lease, flanneld_direct_routing: bool = False) -> Capabilities:
    """A peer's IPv6 capabilities: its IPv4 ones read from BackendV6Data (its IPv6 VTEP
    and, under wireguard or while it keeps its devices, its key)."""
    as_v4 = replace(peer, attrs=replace(peer.attrs, backend_data=peer.attrs.backend_v6_data))
    return peer_capabilities(as_v4, flanneld_direct_routing)


def _is_wg_key(value: Any) -> bool:
    from flannelpy.dataplane.wgkeys import is_key

    return is_key(value)


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def choose_path(own: Capabilities, peer: Capabilities, on_link: bool) -> PathKind | NoPath:
    """The path between two nodes (the rule in the module docstring); symmetric in own/peer."""
    for end in (own, peer):
        if end.foreign_backend is not None:
            return NoPath(
                f"it runs the {end.foreign_backend} backend, which flannelpy does not speak; "
                "run vxlan, host-gw or wireguard on every node that shares pods with "
                "flannelpy nodes"
            )
    if (own.encrypts or peer.encrypts) and own.wireguard_key and peer.wireguard_key:
        return "wireguard"
    if own.encrypts and peer.encrypts:
        return NoPath("its wireguard lease carries no valid PublicKey; restart its agent")
    if own.encrypts or peer.encrypts:
        # Never plain direct to or from a node that asked for encryption.
        if own.vni is not None and own.vni == peer.vni:
            return "vxlan"
        return NoPath(
            "one node runs wireguard and the other neither runs it nor shares a VTEP with "
            "it; roll out wireguard from vxlan, or run wireguard on both"
        )
    direct_wanted = (
        (own.prefers_direct and peer.follows_peer)
        or (peer.prefers_direct and own.follows_peer)
        or (own.prefers_direct and peer.prefers_direct)
    )
    if on_link and (direct_wanted or not own.has_vtep or not peer.has_vtep):
        return "direct"
    if own.vni is not None and peer.vni is not None:
        if own.vni == peer.vni:
            return "vxlan"
        low, high = sorted((own.vni, peer.vni))
        if on_link:  # both encapsulate: rule 1 did not apply
            return NoPath(
                f"both nodes encapsulate but their VTEPs use different VNIs ({low} and {high}); "
                "set one VNI on every node, or DirectRouting on one of them"
            )
        return NoPath(
            f"the nodes are on different L2 segments and their VTEPs use different VNIs "
            f"({low} and {high}); set one VNI on every node"
        )
    vteps = (
        "neither has a VTEP"
        if own.vni is None and peer.vni is None
        else ("only one of them has a VTEP")
    )
    return NoPath(f"the nodes are on different L2 segments and {vteps}; {_FIX_SEGMENTS}")


def needs_vtep(backend: BackendConfig, peers: Sequence[Lease]) -> bool:
    """Whether a node must have a VTEP: under vxlan always; under host-gw while any peer
    lease is vxlan, since such a peer may still encapsulate to us."""
    if backend.type.lower() == "vxlan":
        return True
    return any(peer.attrs.backend_type.lower() == "vxlan" for peer in peers)


# --- cluster feasibility, for the rollout planner ---------------------------------------


@dataclass(frozen=True)
class NodeView:
    """One node as the rollout planner sees it (from its status, with a backend to assume).

    ``has_vtep``: the node's VTEP as observed; None to predict it with the
    :func:`needs_vtep` rule applied to the set (for a state that does not exist yet).
    """

    name: str
    public_ip: IPv4Address
    underlay_networks: tuple[IPv4Network, ...]
    backend: BackendConfig
    has_vtep: bool | None = None


def _view_capabilities(node: NodeView, others: Sequence[NodeView]) -> Capabilities:
    backend_type = node.backend.type.lower()
    if node.has_vtep is not None:
        has_vtep = node.has_vtep
    else:
        has_vtep = backend_type == "vxlan" or any(
            other.backend.type.lower() == "vxlan" for other in others
        )
    return Capabilities(
        prefers_direct=_prefers_direct(backend_type, node.backend.direct_routing),
        vni=node.backend.vni if has_vtep else None,
        vtep_mac=None,  # not needed to decide; the agents exchange it in their leases
        encrypts=_encrypts(backend_type),
        wireguard_key=_encrypts(backend_type),
    )


def pairs_without_path(nodes: Sequence[NodeView]) -> list[tuple[str, str, str]]:
    """Every pair of nodes that would have no working path: (node a, node b, reason).

    Each end decides from its own view of the segment (``b.public_ip`` in one of
    ``a.underlay_networks``), as its agent will; if the two ends choose different
    paths the traffic would be asymmetric, which is reported as well.
    """
    caps = {
        node.name: _view_capabilities(node, [n for n in nodes if n.name != node.name])
        for node in nodes
    }
    found: list[tuple[str, str, str]] = []
    for i, a in enumerate(nodes):
        for b in nodes[i + 1 :]:
            a_sees_b = any(b.public_ip in net for net in a.underlay_networks)
            b_sees_a = any(a.public_ip in net for net in b.underlay_networks)
            forward = choose_path(caps[a.name], caps[b.name], a_sees_b)
            backward = choose_path(caps[b.name], caps[a.name], b_sees_a)
            if isinstance(forward, NoPath):
                found.append((a.name, b.name, forward.reason))
            elif isinstance(backward, NoPath):
                found.append((a.name, b.name, backward.reason))
            elif forward != backward:
                why = (
                    f"{a.name} takes a {forward} path and {b.name} a {backward} one, because "
                    "only one sees the other on its underlay networks; give both underlays the "
                    "same subnet"
                )
                found.append((a.name, b.name, why))
    return found
