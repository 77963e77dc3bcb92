"""The masq and forward rules for the node's pod ranges, in iptables or nftables.

:func:`firewall_factory` builds the node's :class:`FirewallSync`, to which the reconciler
hands the planned :class:`~flannelpy.dataplane.state.PodRanges`: it puts every chain in
place, masq then forward, per family (IPv4 in iptables, IPv6 in ip6tables), or Flannel's
nftables tables with ``EnableNFTables``. Before the first sync the other mode's rules are
removed, as flanneld does at start, so a node switched between modes keeps one set.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from ipaddress import IPv4Network, IPv6Network
from typing import TYPE_CHECKING

from flannelpy.agent.firewall import PodNet
from flannelpy.config.settings import AgentSettings
from flannelpy.dataplane.state import PodRanges
from flannelpy.errors import DataplaneError
from flannelpy.observe.metrics import AgentMetrics

if TYPE_CHECKING:
    from flannelpy.dataplane.firewall import IptablesFirewall, SyncResult
    from flannelpy.dataplane.nftables import NftablesFirewall

log = logging.getLogger("flannelpy.agent.compose")

SyncStep = Callable[[], "SyncResult"]


def firewall_factory(
    settings: AgentSettings,
    metrics: AgentMetrics,
    firewall: IptablesFirewall | None = None,
    nft: NftablesFirewall | None = None,
    *,
    nftables: bool = False,
) -> FirewallSync | None:
    """The node's firewall, or None when no flag asks for rules. Tests pass the adapters;
    a mode whose adapter is not passed is then left alone."""
    if not nftables and not settings.ip_masq and not settings.iptables_forward_rules:
        return None
    firewall6 = None
    if firewall is None and nft is None:
        from flannelpy.dataplane.firewall import IptablesFirewall
        from flannelpy.dataplane.nfgen import RulesetGeneration
        from flannelpy.dataplane.nftables import NftablesFirewall

        # With iptables-nft, a resync while this namespace's nftables generation has not
        # moved since the last check found every chain in place lists nothing.
        generation = RulesetGeneration()
        firewall, nft = IptablesFirewall(generation=generation), NftablesFirewall()
        firewall6 = IptablesFirewall(ipv6=True, generation=generation)
    return FirewallSync(settings, metrics, firewall, firewall6, nft, nftables)


class FirewallSync:
    """One node's firewall adapters and what has happened to them so far."""

    def __init__(
        self,
        settings: AgentSettings,
        metrics: AgentMetrics,
        firewall: IptablesFirewall | None,
        firewall6: IptablesFirewall | None,
        nft: NftablesFirewall | None,
        nftables: bool,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.firewall = firewall
        self.firewall6 = firewall6
        self.nft = nft
        self.nftables = nftables
        self.worked = False  # some sync has succeeded: the firewall works on this host
        self.other_mode_cleaned = False
        self.in_place = False  # the last sync put every chain in place
        self._ranges: PodRanges | None = None
        self._sync: Callable[[], bool] | None = None

    def apply(self, ranges: PodRanges) -> bool:
        """Put the rules for ``ranges`` in place (the reconciler's step): True once every
        chain is as desired. Raises before the firewall ever worked on this host."""
        if ranges != self._ranges or self._sync is None:
            self._sync = self.for_networks(ranges.networks, ranges.subnets)
            self._ranges = ranges
        self.in_place = self._sync()
        return self.in_place

    def for_networks(
        self, all_nets: Sequence[PodNet], all_subnets: Sequence[PodNet]
    ) -> Callable[[], bool]:
        """The sync for these pod networks (``all_nets``) and own subnets."""
        steps = self.steps(all_nets, all_subnets)
        return lambda: self.sync(steps)

    def steps(self, all_nets: Sequence[PodNet], all_subnets: Sequence[PodNet]) -> list[SyncStep]:
        # Dual stack: the IPv6 ranges get the same rules in ip6tables, or in nftables'
        # ip6 flannel-ipv6 table.
        networks6 = [n for n in all_nets if isinstance(n, IPv6Network)]
        subnets6 = [n for n in all_subnets if isinstance(n, IPv6Network)]
        networks = [n for n in all_nets if isinstance(n, IPv4Network)]
        subnets = [n for n in all_subnets if isinstance(n, IPv4Network)]
        if self.nftables:
            return [self._nftables_step(networks, subnets, networks6, subnets6)]
        steps: list[SyncStep] = []
        assert self.firewall is not None
        if networks:  # IPv6-only: ip6tables alone
            steps.extend(self._iptables_steps(self.firewall, networks, subnets))
        if networks6 and self.firewall6 is not None:
            steps.extend(self._iptables_steps(self.firewall6, networks6, subnets6))
        return steps

    def _random_fully(self, supported: bool) -> bool:
        # --ip-masq-fully-random-disable: flanneld's opt-out of --random-fully.
        return supported and not self.settings.ip_masq_fully_random_disable

    def _iptables_steps(
        self, fw: IptablesFirewall, networks: Sequence[PodNet], subnets: Sequence[PodNet]
    ) -> list[SyncStep]:
        """One family's iptables (or ip6tables) chains: masq, then forward."""
        from flannelpy.dataplane.firewall import forward_rules, masq_rules

        steps: list[SyncStep] = []
        if self.settings.ip_masq:
            masq = masq_rules(networks, subnets, self._random_fully(fw.random_fully))
            steps.append(lambda: fw.sync(masq))
        if self.settings.iptables_forward_rules:
            forward = forward_rules(networks)
            steps.append(lambda: fw.sync(forward))
        return steps

    def _nftables_step(
        self,
        networks: Sequence[PodNet],
        subnets: Sequence[PodNet],
        networks6: Sequence[PodNet],
        subnets6: Sequence[PodNet],
    ) -> SyncStep:
        """Both families' tables in one nftables sync."""
        from flannelpy.dataplane import nftables as nft_rules

        nft = self.nft
        assert nft is not None
        masq, forward = self.settings.ip_masq, self.settings.iptables_forward_rules
        random_fully = self._random_fully(nft.random_fully)

        def masq_of(nets: Sequence[PodNet], subs: Sequence[PodNet]) -> tuple[str, ...] | None:
            # IPv6-only: no IPv4 table, and the other way round
            return nft_rules.masq_rules(nets, subs, random_fully) if masq and nets else None

        def forward_of(nets: Sequence[PodNet]) -> tuple[str, ...] | None:
            return nft_rules.forward_rules(nets) if forward and nets else None

        desired = nft_rules.NftRules(
            masq_of(networks, subnets),
            forward_of(networks),
            masq_of(networks6, subnets6),
            forward_of(networks6),
        )
        return lambda: nft.sync(desired)

    def _clean_other_mode(self) -> None:
        # nftables mode removes the ip6tables chains too, as flanneld's clean-up does.
        others = (self.firewall, self.firewall6) if self.nftables else (self.nft,)
        self.other_mode_cleaned = True
        for other in others:
            if other is None:
                continue
            try:
                other.remove()
            except DataplaneError as e:  # e.g. nft not installed: nothing of it to remove
                log.info("rules of the unused firewall mode not removed: %s", e)

    def sync(self, steps: Sequence[SyncStep]) -> bool:
        """True once every chain is as desired. Before the first success a failure raises
        (start-up refuses a host where the firewall does not work); after it, a failure
        is passing (the xtables lock held past the wait, e.g. by kube-proxy while a lease
        is recovered): False, and the firewall timer tries again."""
        try:
            if not self.other_mode_cleaned:
                self._clean_other_mode()
            for step in steps:
                result = step()  # logs what it repaired
                self.metrics.firewall_sync(result.repaired)
        except DataplaneError as e:
            if not self.worked:
                raise
            log.warning("firewall rules not in place yet, retrying on the firewall timer: %s", e)
            return False
        self.worked = True
        return True
