"""The doctor's plan of a node: the desired data plane exactly as the agent computes
it (the same backend planner, the VTEP MAC of the live device), from the facts.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from ipaddress import IPv4Address

from flannelpy.backend.base import Backend, NodeContext
from flannelpy.backend.registry import get_backend
from flannelpy.backend.vxlan import device_name
from flannelpy.control.change import wanted_config
from flannelpy.control.records import NodeOverride
from flannelpy.dataplane.state import (
    DesiredState,
)
from flannelpy.doctor.facts import NodeFacts
from flannelpy.errors import ConfigError
from flannelpy.subnet.lease import Lease
from flannelpy.subnet.validate import Bounds, Rejection, split_peers


@dataclass(frozen=True)
class Plan:
    backend: Backend
    ctx: NodeContext
    own: Lease | None
    peers: tuple[Lease, ...]
    own_all: tuple[Lease, ...]  # every lease of this node (own first); () without own
    overlay_mtu: int
    desired: DesiredState | None  # None without our own lease
    device: str  # flannel.<VNI>: ours under vxlan, stale under host-gw
    rejected: tuple[Rejection, ...] = ()  # peer leases the agent never programs


def plan_node(facts: NodeFacts) -> Plan | str:
    """The agent's view of this node, or why it cannot be computed."""
    if facts.config is None or facts.config.network is None:
        return "the network config is unknown"
    if facts.underlay is None:
        return "the underlay interface is unknown"
    config = facts.config
    network = facts.config.network
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
    ctx = NodeContext(
        config=config,
        underlay=facts.underlay,
        public_ip=settings.public_ip or facts.underlay.ip,
        node_name=settings.node_name or "",
        blackhole_own_subnets=settings.ip_blackhole_route,
    )
    own = own_lease(facts, ctx.public_ip)
    reported = (facts.status or {}).get("leases") or []
    others = tuple(
        lease for lease in facts.leases
        if own is not None and lease.key != own.key and str(lease.subnet) in reported
    )  # fmt: skip
    own_all = (own, *others) if own is not None else ()
    own_keys = {lease.key for lease in own_all}
    bounds = Bounds(
        networks=tuple(dict.fromkeys([network, *facts.pool_networks])),
        own=tuple(lease.subnet for lease in own_all if lease.subnet is not None),
        host=facts.underlay.networks,
        public_ip=ctx.public_ip,
        host_ips=(facts.underlay.ip,) if facts.underlay.ip is not None else (),
    )
    accepted, rejected = split_peers({x.key: x for x in facts.leases}, own_keys, bounds)
    peers = tuple(accepted.values())
    vtep_mac = facts.vtep_mac if backend.needs_vtep(ctx, peers) else None
    desired = backend.plan(ctx, list(own_all), list(peers), vtep_mac) if own else None
    return Plan(
        backend, ctx, own, peers, own_all, backend.mtu(ctx), desired,
        device_name(config.backend.vni), tuple(rejected[k] for k in sorted(rejected)),
    )  # fmt: skip


def own_lease(facts: NodeFacts, public_ip: IPv4Address | None) -> Lease | None:
    """Our lease: the subnet the agent reports, else the one advertising our address
    (Flannel's identity of a node), else the one carrying our node name."""
    reported = (facts.status or {}).get("lease")
    for lease in facts.leases:
        if reported and str(lease.subnet) == reported:
            return lease
    for lease in facts.leases:
        if public_ip is not None and lease.attrs.public_ip == public_ip:
            return lease
    name = facts.settings.node_name
    return next((lease for lease in facts.leases if name and lease.attrs.node_name == name), None)


def peer_name(lease: Lease) -> str:
    return lease.attrs.node_name or str(lease.attrs.public_ip)
