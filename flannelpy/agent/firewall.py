"""The pod ranges the masq and forward rules are written for (pure).

Every pod network (the config's Network, every pool's: our pods talk to pods in pools we
hold no lease of, and IPv6Network in dual stack) and every subnet we hold. The planner
puts them in the desired state; the reconciler hands them to the firewall
(:mod:`flannelpy.agent.firewall_sync`).
"""

from __future__ import annotations

from ipaddress import IPv4Network, IPv6Network

from flannelpy.agent.state import NodeState
from flannelpy.dataplane.state import PodRanges

PodNet = IPv4Network | IPv6Network


def pod_ranges(state: NodeState) -> PodRanges | None:
    """The ranges for the current pools and leases; None before we hold a lease."""
    if not state.own:
        return None
    config = state.config
    networks: list[PodNet] = [config.network] if config.network is not None else []
    networks += [pool.network for pool in state.pools]
    subnets: list[PodNet] = list(state.own_subnets())
    if config.ipv6_network is not None:
        networks.append(config.ipv6_network)
        subnets += [x.ipv6_subnet for x in state.own if x.ipv6_subnet is not None]
    # IPv4 first, each range once (the pools hold the config's networks too).
    ordered = sorted(dict.fromkeys(networks), key=lambda n: n.version)
    return PodRanges(tuple(ordered), tuple(subnets))
