"""masq and forward rules for every pod range (all pools) and every lease we hold."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from ipaddress import IPv4Network, IPv6Network

from flannelpy.agent.state import NodeState
from flannelpy.errors import FlannelpyError

log = logging.getLogger("flannelpy.agent.firewall")

# (pod ranges, our lease subnets) -> a sync that returns True once the rules are in place.
# Dual stack: both lists hold the IPv6 ones too (IPv6Network: the ip6tables rules).
PodNet = IPv4Network | IPv6Network
FirewallFactory = Callable[[Sequence[PodNet], Sequence[PodNet]], Callable[[], bool]]


class FirewallRules:
    def __init__(self, state: NodeState, factory: FirewallFactory | None) -> None:
        self.state = state
        self.factory = factory
        self._sync: Callable[[], bool] | None = None
        self._view: tuple[tuple[PodNet, ...], ...] = ()
        state.rules_in_place = factory is None

    def setup(self) -> None:
        """Build the rule set for the current pools and leases (when they changed)."""
        s = self.state
        own = s.own_subnets()
        if self.factory is None or not s.own:
            return
        networks = [pool.network for pool in s.pools]
        if s.config.network is not None and s.config.network not in networks:
            networks.insert(0, s.config.network)
        # Pools without leases of ours still need rules: our pods talk to theirs.
        nets: list[PodNet] = list(networks)
        subnets: list[PodNet] = list(own)
        if s.config.ipv6_network is not None:
            nets.append(s.config.ipv6_network)
            subnets += [x.ipv6_subnet for x in s.own if x.ipv6_subnet is not None]
        view = (tuple(nets), tuple(subnets))
        if view == self._view and self._sync is not None:
            return
        self._view = view
        self._sync = self.factory(nets, subnets)
        s.rules_in_place = self._sync()

    def resync(self) -> None:
        """Repair what something else changed (on the firewall timer)."""
        if self._sync is None:
            return
        try:
            self.state.rules_in_place = self._sync()
        except FlannelpyError as e:
            self.state.rules_in_place = False
            log.warning("firewall resync failed: %s", e)
