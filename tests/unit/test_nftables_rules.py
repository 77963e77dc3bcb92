"""Flannel's nftables rules (the text flanneld writes), the rebuild script, and the
adapter against a fake ``nft``."""

from __future__ import annotations

import subprocess
from ipaddress import IPv4Network, IPv6Network
from typing import Any

import pytest

from flannelpy.dataplane.firewall import MISSING
from flannelpy.dataplane.nftables import (
    AT_START,
    CHANGED,
    NftablesFirewall,
    NftRules,
    forward_rules,
    masq_rules,
    rebuild_script,
    remove_script,
)
from flannelpy.errors import ConfigError, DataplaneError

NET = IPv4Network("10.244.0.0/16")
SUBNET = IPv4Network("10.244.1.0/24")

# flanneld v0.28.9's addMasqRules / SetupAndEnsureForwardRules, as knftables.Concat joins them.
FLANNEL_POSTRTG = (
    "meta mark 0x4000 return",
    "ip saddr 10.244.1.0/24 ip daddr 10.244.0.0/16 return",
    "ip saddr 10.244.0.0/16 ip daddr 10.244.1.0/24 return",
    "ip saddr != 10.244.1.0/24 ip daddr 10.244.0.0/16 return",
    "ip saddr 10.244.0.0/16 ip daddr != 224.0.0.0/4 masquerade fully-random",
    "ip saddr != 10.244.0.0/16 ip daddr 10.244.0.0/16 masquerade fully-random",
)
FLANNEL_FORWARD = ("ip saddr 10.244.0.0/16 accept", "ip daddr 10.244.0.0/16 accept")
NET6 = IPv6Network("fd10:244::/56")
SUBNET6 = IPv6Network("fd10:244:0:1::/64")
# The same functions with knftables.IPv6Family ("ip6") and ff00::/8 (dual stack).
FLANNEL_POSTRTG6 = (
    "meta mark 0x4000 return",
    "ip6 saddr fd10:244:0:1::/64 ip6 daddr fd10:244::/56 return",
    "ip6 saddr fd10:244::/56 ip6 daddr fd10:244:0:1::/64 return",
    "ip6 saddr != fd10:244:0:1::/64 ip6 daddr fd10:244::/56 return",
    "ip6 saddr fd10:244::/56 ip6 daddr != ff00::/8 masquerade fully-random",
    "ip6 saddr != fd10:244::/56 ip6 daddr fd10:244::/56 masquerade fully-random",
)
FLANNEL_FORWARD6 = ("ip6 saddr fd10:244::/56 accept", "ip6 daddr fd10:244::/56 accept")


def test_masq_rules_are_flannels() -> None:
    assert masq_rules(NET, [SUBNET], random_fully=True) == FLANNEL_POSTRTG


def test_masq_rules_without_fully_random() -> None:
    assert masq_rules(NET, [SUBNET], random_fully=False) == tuple(
        r.removesuffix(" fully-random") for r in FLANNEL_POSTRTG
    )


def test_forward_rules_are_flannels() -> None:
    assert forward_rules(NET) == FLANNEL_FORWARD


def test_ipv6_rules_are_flannels() -> None:
    assert masq_rules(NET6, [SUBNET6], random_fully=True) == FLANNEL_POSTRTG6
    assert forward_rules(NET6) == FLANNEL_FORWARD6


def test_mixed_families_in_one_table_are_refused() -> None:
    with pytest.raises(ConfigError, match="mix IPv4 and IPv6"):
        forward_rules([NET, NET6])
    with pytest.raises(ConfigError, match=r"node subnet 10\.244\.1\.0/24 is outside"):
        masq_rules(NET6, [SUBNET], random_fully=True)


def test_several_pools_and_subnets_keep_pod_to_pod_sources() -> None:
    pool, new = IPv4Network("10.250.0.0/16"), IPv4Network("10.250.3.0/24")
    rules = masq_rules([NET, pool], [SUBNET, new, SUBNET], random_fully=False)
    assert rules == (
        "meta mark 0x4000 return",
        "ip saddr 10.244.1.0/24 ip daddr 10.244.0.0/16 return",
        "ip saddr 10.244.0.0/16 ip daddr 10.244.1.0/24 return",
        "ip saddr 10.244.1.0/24 ip daddr 10.250.0.0/16 return",
        "ip saddr 10.250.0.0/16 ip daddr 10.244.1.0/24 return",
        "ip saddr 10.250.3.0/24 ip daddr 10.244.0.0/16 return",
        "ip saddr 10.244.0.0/16 ip daddr 10.250.3.0/24 return",
        "ip saddr 10.250.3.0/24 ip daddr 10.250.0.0/16 return",
        "ip saddr 10.250.0.0/16 ip daddr 10.250.3.0/24 return",
        "ip saddr != 10.244.1.0/24 ip daddr 10.244.0.0/16 return",
        "ip saddr != 10.250.3.0/24 ip daddr 10.244.0.0/16 return",
        "ip saddr 10.244.0.0/16 ip daddr 10.250.0.0/16 return",
        "ip saddr 10.250.0.0/16 ip daddr 10.244.0.0/16 return",
        "ip saddr 10.244.0.0/16 ip daddr != 224.0.0.0/4 masquerade",
        "ip saddr 10.250.0.0/16 ip daddr != 224.0.0.0/4 masquerade",
        "ip saddr != 10.244.0.0/16 ip daddr 10.244.0.0/16 masquerade",
        "ip saddr != 10.250.0.0/16 ip daddr 10.250.0.0/16 masquerade",
    )
    assert forward_rules([NET, pool])[2:] == (
        "ip saddr 10.250.0.0/16 accept",
        "ip daddr 10.250.0.0/16 accept",
    )


def test_a_subnet_outside_the_network_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"node subnet 10\.9\.1\.0/24 is outside"):
        masq_rules(NET, [IPv4Network("10.9.1.0/24")], random_fully=True)
    with pytest.raises(ConfigError, match="set Network"):
        forward_rules([])


def test_rebuild_script_replaces_both_tables_in_flannels_chain_order() -> None:
    script = rebuild_script(NftRules(FLANNEL_POSTRTG, FLANNEL_FORWARD))
    assert script.splitlines() == [
        "add table ip flannel-ipv4",
        "delete table ip flannel-ipv4",
        "add table ip6 flannel-ipv6",
        "delete table ip6 flannel-ipv6",
        'add table ip flannel-ipv4 { comment "rules for flannel-ipv4" ; }',
        'add table ip6 flannel-ipv6 { comment "rules for flannel-ipv6" ; }',
        "add chain ip flannel-ipv4 postrtg { type nat hook postrouting priority srcnat ; "
        'comment "chain to manage traffic masquerading by flannel" ; }',
        *(f"add rule ip flannel-ipv4 postrtg {r}" for r in FLANNEL_POSTRTG),
        "add chain ip flannel-ipv4 forward { type filter hook forward priority filter ; "
        'comment "chain to accept flannel traffic" ; }',
        *(f"add rule ip flannel-ipv4 forward {r}" for r in FLANNEL_FORWARD),
    ]


def test_rebuild_script_fills_the_ipv6_table_in_dual_stack() -> None:
    rules = NftRules(FLANNEL_POSTRTG, FLANNEL_FORWARD, FLANNEL_POSTRTG6, FLANNEL_FORWARD6)
    ipv4 = rebuild_script(NftRules(FLANNEL_POSTRTG, FLANNEL_FORWARD)).splitlines()
    assert rebuild_script(rules).splitlines() == [
        *ipv4,
        "add chain ip6 flannel-ipv6 postrtg { type nat hook postrouting priority srcnat ; "
        'comment "chain to manage traffic masquerading by flannel" ; }',
        *(f"add rule ip6 flannel-ipv6 postrtg {r}" for r in FLANNEL_POSTRTG6),
        "add chain ip6 flannel-ipv6 forward { type filter hook forward priority filter ; "
        'comment "chain to accept flannel traffic" ; }',
        *(f"add rule ip6 flannel-ipv6 forward {r}" for r in FLANNEL_FORWARD6),
    ]


def test_rebuild_script_leaves_out_a_chain_that_is_off() -> None:
    script = rebuild_script(NftRules(None, FLANNEL_FORWARD))
    assert "postrtg" not in script and "add chain ip flannel-ipv4 forward" in script
    # Both tables exist even with no chain at all, as flanneld creates them at start.
    empty = rebuild_script(NftRules(None, None)).splitlines()
    assert empty[-2:] == [
        'add table ip flannel-ipv4 { comment "rules for flannel-ipv4" ; }',
        'add table ip6 flannel-ipv6 { comment "rules for flannel-ipv6" ; }',
    ]


def test_remove_script_deletes_both_tables_whether_or_not_they_exist() -> None:
    assert remove_script().splitlines() == [
        "add table ip flannel-ipv4",
        "delete table ip flannel-ipv4",
        "add table ip6 flannel-ipv6",
        "delete table ip6 flannel-ipv6",
    ]


# --- the adapter, against a fake nft -------------------------------------------------------


class FakeNft:
    """Tables as listing text; ``nft -f -`` replaces both with ``rendered``."""

    def __init__(self, rendered: dict[str, str], check_ok: bool = True) -> None:
        self.tables: dict[str, str] = {}
        self.rendered = rendered
        self.check_ok = check_ok
        self.scripts: list[str] = []
        self.calls: list[list[str]] = []

    def __call__(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        nft = argv[argv.index("nft") :]
        if nft[:2] == ["nft", "--check"]:
            return subprocess.CompletedProcess(argv, 0 if self.check_ok else 1, "", "")
        if nft[:2] == ["nft", "-f"]:
            self.scripts.append(kwargs["input"])
            self.tables = dict(self.rendered)
            return subprocess.CompletedProcess(argv, 0, "", "")
        name = " ".join(nft[3:5])
        if name not in self.tables:
            err = f"Error: No such file or directory\nlist table {name}\n"
            return subprocess.CompletedProcess(argv, 1, "", err)
        return subprocess.CompletedProcess(argv, 0, self.tables[name], "")


RENDERED = {
    "ip flannel-ipv4": "table ip flannel-ipv4 {\n\tchain postrtg {\n\t}\n}\n",
    "ip6 flannel-ipv6": "table ip6 flannel-ipv6 {\n}\n",
}
RULES = NftRules(FLANNEL_POSTRTG, FLANNEL_FORWARD)


def test_first_sync_builds_then_nothing_until_something_differs() -> None:
    fake = FakeNft(RENDERED)
    fw = NftablesFirewall(run=fake, command_prefix=("ip", "netns", "exec", "x"))
    first = fw.sync(RULES)
    assert (first.repaired, first.reason) == (True, MISSING)
    assert fake.scripts == [rebuild_script(RULES)]
    assert all(call[:4] == ["ip", "netns", "exec", "x"] for call in fake.calls)
    for _ in range(5):
        assert not fw.sync(RULES).repaired
    assert len(fake.scripts) == 1

    fake.tables["ip flannel-ipv4"] = "table ip flannel-ipv4 {\n}\n"  # a chain deleted
    result = fw.sync(RULES)
    assert (result.repaired, result.reason) == (True, CHANGED)
    assert result.details == ("ip flannel-ipv4: changed",)
    del fake.tables["ip6 flannel-ipv6"]  # a table deleted
    result = fw.sync(RULES)
    assert (result.repaired, result.reason) == (True, MISSING)
    assert result.details == ("ip6 flannel-ipv6: missing",)
    assert len(fake.scripts) == 3


def test_a_restart_rewrites_tables_that_are_already_there() -> None:
    fake = FakeNft(RENDERED)
    fake.tables = dict(RENDERED)
    result = NftablesFirewall(run=fake).sync(RULES)
    assert (result.repaired, result.reason) == (True, AT_START)


def test_new_rules_rebuild_even_when_the_listing_is_unchanged() -> None:
    fake = FakeNft(RENDERED)
    fw = NftablesFirewall(run=fake)
    fw.sync(RULES)
    other = NftRules(masq_rules(NET, [IPv4Network("10.244.9.0/24")], True), FLANNEL_FORWARD)
    assert fw.sync(other).reason == CHANGED
    assert fake.scripts[-1] == rebuild_script(other)


def test_random_fully_is_asked_of_nft_once() -> None:
    fake = FakeNft(RENDERED, check_ok=False)
    fw = NftablesFirewall(run=fake)
    assert fw.random_fully is False
    assert fw.random_fully is False
    assert sum(1 for c in fake.calls if "--check" in c) == 1


def test_failed_rebuild_is_a_dataplane_error() -> None:
    def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        if argv[:2] == ["nft", "-f"]:
            return subprocess.CompletedProcess(argv, 1, "", "Error: Could not process rule\n")
        return FakeNft(RENDERED)(argv, **kwargs)

    with pytest.raises(DataplaneError, match="nft could not rebuild the flannel tables: Error"):
        NftablesFirewall(run=run).sync(RULES)


def test_unlistable_table_and_missing_nft_are_dataplane_errors() -> None:
    def denied(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.CompletedProcess(argv, 1, "", "Error: Operation not permitted\n")

    with pytest.raises(DataplaneError, match="cannot list table ip flannel-ipv4"):
        NftablesFirewall(run=denied).sync(RULES)

    def absent(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        raise FileNotFoundError(argv[0])

    with pytest.raises(DataplaneError, match="install the nftables package"):
        NftablesFirewall(run=absent).remove()
