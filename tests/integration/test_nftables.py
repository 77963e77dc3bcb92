"""NftablesFirewall against real nftables, inside a network namespace of our own.

nftables state is per network namespace, so nothing here touches the host's rules.
The listing below is what flanneld v0.28.9 leaves on a node (the lab test
``tests/e2e/test_flanneld_nftables.py`` compares the two byte for byte).
"""

from __future__ import annotations

import os
import secrets
import subprocess
from collections.abc import Iterator
from ipaddress import IPv4Network, IPv6Network

import pytest

from flannelpy.dataplane.firewall import MISSING
from flannelpy.dataplane.nftables import (
    CHANGED,
    NftablesFirewall,
    NftRules,
    forward_rules,
    masq_rules,
)
from tests.support.netns_util import add_netns

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create network namespaces"),
]

NET = IPv4Network("10.244.0.0/16")
SUBNET = IPv4Network("10.244.1.0/24")
FLANNEL_IPV4 = """table ip flannel-ipv4 {
	comment "rules for flannel-ipv4"
	chain postrtg {
		comment "chain to manage traffic masquerading by flannel"
		type nat hook postrouting priority srcnat; policy accept;
		meta mark 0x00004000 return
		ip saddr 10.244.1.0/24 ip daddr 10.244.0.0/16 return
		ip saddr 10.244.0.0/16 ip daddr 10.244.1.0/24 return
		ip saddr != 10.244.1.0/24 ip daddr 10.244.0.0/16 return
		ip saddr 10.244.0.0/16 ip daddr != 224.0.0.0/4 masquerade fully-random
		ip saddr != 10.244.0.0/16 ip daddr 10.244.0.0/16 masquerade fully-random
	}

	chain forward {
		comment "chain to accept flannel traffic"
		type filter hook forward priority filter; policy accept;
		ip saddr 10.244.0.0/16 accept
		ip daddr 10.244.0.0/16 accept
	}
}
"""
FLANNEL_IPV6 = """table ip6 flannel-ipv6 {
	comment "rules for flannel-ipv6"
}
"""
NET6 = IPv6Network("fd10:244::/56")
SUBNET6 = IPv6Network("fd10:244:0:1::/64")
# Dual stack (EnableIPv6): flanneld v0.28.9 fills its IPv6 table the same way (the lab
# test ``tests/e2e/test_dual_stack.py`` compares it with flanneld's byte for byte).
FLANNEL_IPV6_DUAL = """table ip6 flannel-ipv6 {
	comment "rules for flannel-ipv6"
	chain postrtg {
		comment "chain to manage traffic masquerading by flannel"
		type nat hook postrouting priority srcnat; policy accept;
		meta mark 0x00004000 return
		ip6 saddr fd10:244:0:1::/64 ip6 daddr fd10:244::/56 return
		ip6 saddr fd10:244::/56 ip6 daddr fd10:244:0:1::/64 return
		ip6 saddr != fd10:244:0:1::/64 ip6 daddr fd10:244::/56 return
		ip6 saddr fd10:244::/56 ip6 daddr != ff00::/8 masquerade fully-random
		ip6 saddr != fd10:244::/56 ip6 daddr fd10:244::/56 masquerade fully-random
	}

	chain forward {
		comment "chain to accept flannel traffic"
		type filter hook forward priority filter; policy accept;
		ip6 saddr fd10:244::/56 accept
		ip6 daddr fd10:244::/56 accept
	}
}
"""


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"fp-nft-{os.getpid()}-{secrets.token_hex(2)}"
    add_netns(name)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def nft(ns: str, *args: str, script: str | None = None) -> str:
    proc = subprocess.run(
        ["ip", "netns", "exec", ns, "nft", *args],
        input=script,
        capture_output=True,
        text=True,
        check=True,
    )
    return proc.stdout


def rules(random_fully: bool) -> NftRules:
    return NftRules(masq_rules(NET, [SUBNET], random_fully), forward_rules(NET))


@pytest.fixture
def fw(netns: str) -> NftablesFirewall:
    return NftablesFirewall(command_prefix=("ip", "netns", "exec", netns))


def expected_ipv4(fw: NftablesFirewall) -> str:
    return FLANNEL_IPV4 if fw.random_fully else FLANNEL_IPV4.replace(" fully-random", "")


def test_sync_installs_flannels_tables_and_nothing_else(netns: str, fw: NftablesFirewall) -> None:
    result = fw.sync(rules(fw.random_fully))
    assert (result.repaired, result.reason) == (True, MISSING)
    assert nft(netns, "list", "table", "ip", "flannel-ipv4") == expected_ipv4(fw)
    assert nft(netns, "list", "table", "ip6", "flannel-ipv6") == FLANNEL_IPV6
    assert nft(netns, "list", "tables") == "table ip flannel-ipv4\ntable ip6 flannel-ipv6\n"
    # The probe for fully-random left no chain behind.
    assert "masqueradeTest" not in nft(netns, "list", "ruleset")
    for _ in range(5):
        assert not fw.sync(rules(fw.random_fully)).repaired


def test_a_deleted_rule_chain_or_table_is_repaired(netns: str, fw: NftablesFirewall) -> None:
    fw.sync(rules(fw.random_fully))
    handles = nft(netns, "-a", "list", "chain", "ip", "flannel-ipv4", "postrtg")
    mark_handle = next(
        line.rsplit("# handle ", 1)[1] for line in handles.splitlines() if "meta mark" in line
    )
    nft(netns, "delete", "rule", "ip", "flannel-ipv4", "postrtg", "handle", mark_handle)
    result = fw.sync(rules(fw.random_fully))
    assert (result.repaired, result.details) == (True, ("ip flannel-ipv4: changed",))
    assert nft(netns, "list", "table", "ip", "flannel-ipv4") == expected_ipv4(fw)

    # The postrtg chain deleted: rebuilt in flanneld's chain order, not appended last.
    nft(netns, "delete", "chain", "ip", "flannel-ipv4", "postrtg")
    assert fw.sync(rules(fw.random_fully)).reason == CHANGED
    assert nft(netns, "list", "table", "ip", "flannel-ipv4") == expected_ipv4(fw)

    nft(netns, "delete", "table", "ip", "flannel-ipv4")
    result = fw.sync(rules(fw.random_fully))
    assert (result.repaired, result.details) == (True, ("ip flannel-ipv4: missing",))
    assert nft(netns, "list", "table", "ip", "flannel-ipv4") == expected_ipv4(fw)

    # A rule someone adds to our chain goes too: the table is ours alone.
    nft(netns, "add", "rule", "ip", "flannel-ipv4", "forward", "ip", "saddr", "192.0.2.1", "drop")
    assert fw.sync(rules(fw.random_fully)).reason == CHANGED
    assert nft(netns, "list", "table", "ip", "flannel-ipv4") == expected_ipv4(fw)


def test_dual_stack_fills_the_ipv6_table_and_repairs_it(netns: str, fw: NftablesFirewall) -> None:
    rf = fw.random_fully
    dual = NftRules(
        masq_rules(NET, [SUBNET], rf),
        forward_rules(NET),
        masq_rules(NET6, [SUBNET6], rf),
        forward_rules(NET6),
    )
    expected6 = FLANNEL_IPV6_DUAL if rf else FLANNEL_IPV6_DUAL.replace(" fully-random", "")
    assert fw.sync(dual).reason == MISSING
    assert nft(netns, "list", "table", "ip", "flannel-ipv4") == expected_ipv4(fw)
    assert nft(netns, "list", "table", "ip6", "flannel-ipv6") == expected6
    assert not fw.sync(dual).repaired
    nft(netns, "delete", "chain", "ip6", "flannel-ipv6", "forward")
    result = fw.sync(dual)
    assert (result.repaired, result.details) == (True, ("ip6 flannel-ipv6: changed",))
    assert nft(netns, "list", "table", "ip6", "flannel-ipv6") == expected6
    # Back to IPv4 only: the IPv6 table is emptied again.
    fw.sync(rules(rf))
    assert nft(netns, "list", "table", "ip6", "flannel-ipv6") == FLANNEL_IPV6


def test_remove_deletes_only_our_tables(netns: str, fw: NftablesFirewall) -> None:
    nft(netns, "-f", "-", script="add table inet other\nadd chain inet other c\n")
    fw.sync(rules(fw.random_fully))
    fw.remove()
    assert nft(netns, "list", "tables") == "table inet other\n"
    fw.remove()  # idempotent: absent tables are fine
    assert nft(netns, "list", "tables") == "table inet other\n"
    # And after a remove, the next sync builds them again.
    assert fw.sync(rules(fw.random_fully)).reason == MISSING
