"""masq and forward rules for every pod range (all pools) and every lease we hold."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from ipaddress import IPv4Network

from flannelpy.agent.state import NodeState
from flannelpy.errors import FlannelpyError

log = logging.getLogger("flannelpy.agent.firewall")

# (pod ranges, our lease subnets) -> a sync that returns True once the rules are in place
FirewallFactory = Callable[[Sequence[IPv4Network], Sequence[IPv4Network]], Callable[[], bool]]


class FirewallRules:
    def __init__(self, state: NodeState, factory: FirewallFactory | None) -> None:
        self.state = state
        self.factory = factory
        self._sync: Callable[[], bool] | None = None
        self._view: tuple[tuple[IPv4Network, ...], ...] = ()
        state.rules_in_place = factory is None

    def setup(self) -> None:
        """Build the rule set for the current pools and leases (when they changed)."""
        s = self.state
        own = s.own_subnets()
        if self.factory is None or not own:
            return
        networks = [pool.network for pool in s.pools]
        if s.config.network is not None and s.config.network not in networks:
            networks.insert(0, s.config.network)
        # Pools without leases of ours still need rules: our pods talk to theirs.
        view = (tuple(networks), tuple(own))
        if view == self._view and self._sync is not None:
            return
        self._view = view
        self._sync = self.factory(networks, own)
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
