"""The doctor's plan of a node: the desired data plane exactly as the agent computes
it (the same backend planner, the VTEP MAC of the live device), from the facts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from ipaddress import IPv4Address, IPv6Address

from flannelpy.backend.base import Backend, NodeContext, node_bounds
from flannelpy.backend.ipv6 import device_name_v6
from flannelpy.backend.registry import get_backend
from flannelpy.backend.vxlan import device_name
from flannelpy.backend.wireguard import keeping_context, plan_kept
from flannelpy.backend.wireguard_config import WireguardConfig, WireguardIdentity
from flannelpy.control.change import wanted_config
from flannelpy.control.records import NodeOverride
from flannelpy.dataplane.state import (
    DesiredState,
)
from flannelpy.doctor.facts import NodeFacts
from flannelpy.errors import ConfigError
from flannelpy.subnet.lease import Lease
from flannelpy.subnet.validate import Rejection, split_peers


@dataclass(frozen=True)
class Plan:
    backend: Backend
    ctx: NodeContext
    own: Lease | None
    peers: tuple[Lease, ...]
    own_all: tuple[Lease, ...]  # every lease of this node (own first); () without own
    overlay_mtu: int
    desired: DesiredState | None  # None without our own lease
    device: str  # flannel.<VNI> (IPv6-only flannel-v6.<VNI>): ours under vxlan, stale under host-gw
    rejected: tuple[Rejection, ...] = ()  # peer leases the agent never programs


def plan_node(facts: NodeFacts) -> Plan | str:
    """The agent's view of this node, or why it cannot be computed."""
    if facts.config is None or (facts.config.enable_ipv4 and facts.config.network is None):
        return "the network config is unknown"
    if facts.underlay is None:
        return "the underlay interface is unknown"
    config = facts.config
    running = (facts.status or {}).get("backend_config")
    try:
        if isinstance(running, Mapping):
            # The node may run an override (a rollout in progress): judge it by what it
            # runs; the change itself is the rollout's and the policy's business.
            config = wanted_config(json.dumps(config.raw).encode(), NodeOverride(running, 0))
        backend = get_backend(config.backend.type)
    except ConfigError as e:
        return str(e)
    settings = facts.settings
    underlay = facts.underlay
    public_ipv6 = IPv6Address(settings.public_ipv6) if settings.public_ipv6 else underlay.ip6
    ctx = NodeContext(
        config=config,
        underlay=underlay,
        public_ip=(settings.public_ip or underlay.ip) if config.enable_ipv4 else None,
        node_name=settings.node_name or "",
        public_ipv6=public_ipv6 if config.enable_ipv6 else None,
        blackhole_own_subnets=settings.ip_blackhole_route,
    )
    own = own_lease(facts, ctx.public_ip, ctx.public_ipv6)
    reported = (facts.status or {}).get("leases") or []
    others = tuple(
        lease
        for lease in facts.leases
        if own is not None and lease.key != own.key and str(lease.primary_subnet) in reported
    )
    own_all = (own, *others) if own is not None else ()
    own_keys = {lease.key for lease in own_all}
    bounds = node_bounds(ctx, own_all, facts.pool_networks)
    accepted, rejected = split_peers({x.key: x for x in facts.leases}, own_keys, bounds)
    peers = tuple(accepted.values())
    kept = kept_identity(own, backend)
    if kept is not None:  # as the agent plans it: the pairs still on wireguard go through it
        ctx = keeping_context(replace(ctx, wireguard_identity=kept), backend.type_name, peers, True)
    vtep_mac = facts.vtep_mac if backend.needs_vtep(ctx, peers) else None
    desired = backend.plan(ctx, list(own_all), list(peers), vtep_mac) if own else None
    if desired is not None and kept is not None:
        desired = plan_kept(ctx, list(own_all), list(peers), desired)
    return Plan(
        backend,
        ctx,
        own,
        peers,
        own_all,
        backend.mtu(ctx),
        desired,
        # IPv6-only, the one VTEP is flannel-v6.<VNI>.
        device_name(config.backend.vni)
        if config.enable_ipv4
        else device_name_v6(config.backend.vni),
        tuple(rejected[k] for k in sorted(rejected)),
    )


def kept_identity(own: Lease | None, backend: Backend) -> WireguardIdentity | None:
    """The WireGuard device a node keeps after switching away from wireguard, while a peer
    still runs it (:func:`~flannelpy.backend.wireguard.keeping_context`), as its lease
    says: the agent adds its key and port to BackendData exactly then. Its routes and the
    peers through it are then planned, not stale (the device's other options do not
    change them, and its private key stays with the agent)."""
    if own is None or backend.type_name == "wireguard":
        return None
    data = own.attrs.backend_data or {}
    key, port = data.get("PublicKey"), data.get("Port")
    if not isinstance(key, str) or not key:
        return None
    options = WireguardConfig()
    if isinstance(port, int) and not isinstance(port, bool) and 0 < port < 65536:
        options = replace(options, listen_port=port)
    return WireguardIdentity(key, options)


def own_lease(
    facts: NodeFacts, public_ip: IPv4Address | None, public_ipv6: IPv6Address | None = None
) -> Lease | None:
    """Our lease: the subnet the agent reports, else the one advertising our address
    (Flannel's identity of a node; IPv6-only, our IPv6 address), else the one carrying
    our node name."""
    reported = (facts.status or {}).get("lease")
    for lease in facts.leases:
        if reported and str(lease.primary_subnet) == reported:
            return lease
    for lease in facts.leases:
        if public_ip is not None and lease.attrs.public_ip == public_ip:
            return lease
        if (
            public_ip is None
            and public_ipv6 is not None
            and (lease.attrs.public_ipv6 == public_ipv6)
        ):
            return lease
    name = facts.settings.node_name
    return next((lease for lease in facts.leases if name and lease.attrs.node_name == name), None)


def peer_name(lease: Lease) -> str:
    return lease.attrs.node_name or str(lease.attrs.public_ip)
