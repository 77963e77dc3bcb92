"""The firewall mode (iptables, or nftables with EnableNFTables) and the clean-up of the
other mode's rules before the first sync, as flanneld does at start."""

from __future__ import annotations

from ipaddress import IPv4Network, IPv6Network
from typing import Any

from flannelpy.agent.firewall_sync import firewall_factory
from flannelpy.config.settings import AgentSettings
from flannelpy.dataplane.firewall import SyncResult
from flannelpy.dataplane.nftables import NftRules
from flannelpy.errors import DataplaneError
from flannelpy.observe.metrics import AgentMetrics

NET = IPv4Network("10.244.0.0/16")
SUBNET = IPv4Network("10.244.1.0/24")


class Recording:
    """Either adapter's surface: records syncs and removals in one shared log."""

    random_fully = True

    def __init__(self, name: str, log: list[Any], remove_error: str | None = None) -> None:
        self.name, self.log, self.remove_error = name, log, remove_error

    def sync(self, rules: Any) -> SyncResult:
        self.log.append((self.name, "sync", rules))
        return SyncResult(False)

    def remove(self) -> None:
        self.log.append((self.name, "remove"))
        if self.remove_error:
            raise DataplaneError(self.remove_error)


def factory(nftables: bool, log: list[Any], **settings: Any) -> Any:
    ipt, nft = Recording("iptables", log), Recording("nft", log)
    return firewall_factory(
        AgentSettings(**settings),
        AgentMetrics(),
        ipt,
        nft,
        nftables=nftables,  # type: ignore[arg-type]
    )


def test_iptables_mode_removes_flannels_nft_tables_once_then_syncs_chains() -> None:
    log: list[Any] = []
    sync = factory(False, log, ip_masq=True).for_networks([NET], [SUBNET])
    assert sync() and sync()
    assert log[0] == ("nft", "remove")
    assert [entry[:2] for entry in log[1:]] == [("iptables", "sync")] * 4
    chains = [{r.chain for r in entry[2]} for entry in log[1:3]]
    assert chains == [{"POSTROUTING", "FLANNEL-POSTRTG"}, {"FORWARD", "FLANNEL-FWD"}]


def test_nftables_mode_removes_the_iptables_chains_then_syncs_flannels_tables() -> None:
    log: list[Any] = []
    sync = factory(True, log, ip_masq=True).for_networks([NET], [SUBNET])
    assert sync() and sync()
    assert log[0] == ("iptables", "remove")
    assert [entry[:2] for entry in log[1:]] == [("nft", "sync")] * 2
    rules = log[1][2]
    assert isinstance(rules, NftRules)
    assert rules.postrtg is not None and rules.postrtg[-1] == (
        "ip saddr != 10.244.0.0/16 ip daddr 10.244.0.0/16 masquerade fully-random"
    )
    assert rules.forward == ("ip saddr 10.244.0.0/16 accept", "ip daddr 10.244.0.0/16 accept")


def test_nftables_mode_in_dual_stack_fills_flannels_ipv6_table() -> None:
    log: list[Any] = []
    net6, subnet6 = IPv6Network("fd10:244::/56"), IPv6Network("fd10:244:0:1::/64")
    factory(True, log, ip_masq=True).for_networks([NET, net6], [SUBNET, subnet6])()
    assert [entry[:2] for entry in log[1:]] == [("nft", "sync")]
    rules = log[1][2]
    assert rules.postrtg[1] == "ip saddr 10.244.1.0/24 ip daddr 10.244.0.0/16 return"
    assert rules.postrtg6 is not None and rules.postrtg6[1] == (
        "ip6 saddr fd10:244:0:1::/64 ip6 daddr fd10:244::/56 return"
    )
    assert rules.forward6 == ("ip6 saddr fd10:244::/56 accept", "ip6 daddr fd10:244::/56 accept")


def test_nftables_mode_honours_the_flags() -> None:
    log: list[Any] = []
    factory(True, log, ip_masq=False).for_networks([NET], [SUBNET])()
    assert log[1][2] == NftRules(
        None, ("ip saddr 10.244.0.0/16 accept", "ip daddr 10.244.0.0/16 accept")
    )
    log.clear()
    factory(True, log, ip_masq=True, ip_masq_fully_random_disable=True).for_networks(
        [NET], [SUBNET]
    )()
    assert log[1][2].postrtg[-1].endswith(" masquerade")
    # flanneld creates its tables even with neither rule set; iptables mode has nothing to do.
    log.clear()
    factory(True, log, ip_masq=False, iptables_forward_rules=False).for_networks([NET], [SUBNET])()
    assert log[1][2] == NftRules(None, None)
    assert factory(False, [], ip_masq=False, iptables_forward_rules=False) is None


def test_a_failed_clean_up_of_the_other_mode_does_not_stop_the_start() -> None:
    log: list[Any] = []
    ipt = Recording("iptables", log)
    nft = Recording("nft", log, remove_error="nft is not installed; install the nftables package")
    make = firewall_factory(AgentSettings(ip_masq=True), AgentMetrics(), ipt, nft)  # type: ignore[arg-type]
    assert make is not None
    assert make.for_networks([NET], [SUBNET])()
    assert [entry[:2] for entry in log] == [("nft", "remove"), *[("iptables", "sync")] * 2]
