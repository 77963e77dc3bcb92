"""The iptables-nft resync against the kernel: while the namespace's nftables ruleset
generation has not moved since the last check found our chains in place, a resync lists
nothing; a rule deleted by hand moves it, and is found and restored at the next resync."""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

from flannelpy.dataplane.firewall import MISSING, IptablesFirewall
from flannelpy.dataplane.nfgen import RulesetGeneration
from tests.integration.test_firewall import EXPECTED_FILTER, expected_nat, ipt, rules
from tests.support.netns_util import Netns, is_root, temp_netns

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(not is_root(), reason="network namespaces need root"),
]


class Listings:
    """subprocess.run that counts the `iptables -S` runs."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        self.count += "-S" in argv
        return subprocess.run(argv, **kwargs)


@pytest.fixture
def ns() -> Iterator[Netns]:
    with temp_netns("fwgen") as ns:
        yield ns


def nft_iptables() -> bool:
    version = subprocess.run(["iptables", "--version"], capture_output=True, text=True)
    return "(nf_tables)" in version.stdout


@pytest.fixture
def firewall(ns: Netns) -> Iterator[tuple[IptablesFirewall, Listings, RulesetGeneration]]:
    if not nft_iptables():
        pytest.skip("iptables here is not iptables-nft: no generation covers its rules")
    asker = RulesetGeneration()
    listings = Listings()
    fw = IptablesFirewall(
        run=listings,
        command_prefix=("ip", "netns", "exec", ns.name),
        generation=lambda: ns.call(asker),  # the socket is made, and stays, in the namespace
    )
    try:
        yield fw, listings, asker
    finally:
        asker.close()


def test_reading_the_rules_does_not_move_the_generation(ns: Netns) -> None:
    if not nft_iptables():
        pytest.skip("iptables here is not iptables-nft")
    asker = RulesetGeneration()
    try:
        ns.exec(["iptables", "-w", "5", "-t", "nat", "-A", "POSTROUTING", "-j", "RETURN"])
        start = ns.call(asker)
        assert start is not None
        for table, chain in (("nat", "POSTROUTING"), ("filter", "FORWARD")):
            ns.exec(["iptables", "-w", "5", "-t", table, "-S", chain])
        ns.exec(["iptables", "-w", "5", "-t", "nat", "-S", "NO-SUCH-CHAIN"], check=False)
        ns.exec(["iptables-save"])
        assert ns.call(asker) == start
        ns.exec(["iptables", "-w", "5", "-t", "nat", "-D", "POSTROUTING", "-j", "RETURN"])
        assert ns.call(asker) == start + 1
    finally:
        asker.close()


def test_an_unchanged_namespace_is_not_read_again(
    ns: Netns, firewall: tuple[IptablesFirewall, Listings, RulesetGeneration]
) -> None:
    fw, listings, _ = firewall
    assert fw.sync(rules()).repaired  # installed: our own commit moves the generation
    assert not fw.sync(rules()).repaired  # so this resync reads them once more
    read = listings.count
    for _ in range(3):
        assert not fw.sync(rules()).repaired
    assert listings.count == read
    assert ipt(ns.name, "-t", "nat", "-S") == expected_nat(fw)
    assert ipt(ns.name, "-t", "filter", "-S") == EXPECTED_FILTER

    # Someone else's nftables change moves the generation: read again, nothing to repair.
    ns.exec(["nft", "add", "table", "inet", "someone-else"])
    assert not fw.sync(rules()).repaired
    assert listings.count > read


def test_a_rule_deleted_by_hand_is_restored_at_the_next_resync(
    ns: Netns, firewall: tuple[IptablesFirewall, Listings, RulesetGeneration]
) -> None:
    fw, listings, _ = firewall
    fw.sync(rules())
    fw.sync(rules())  # now remembered as in place
    read = listings.count
    assert not fw.sync(rules()).repaired and listings.count == read

    ipt(ns.name, "-t", "nat", "-D", "FLANNEL-POSTRTG", "3")
    result = fw.sync(rules())
    assert (result.repaired, result.reason) == (True, MISSING)
    assert result.details == ("nat/FLANNEL-POSTRTG: missing",)
    assert ipt(ns.name, "-t", "nat", "-S") == expected_nat(fw)

    ipt(ns.name, "-t", "filter", "-D", "FORWARD", *ipt_spec(EXPECTED_FILTER[4]))
    result = fw.sync(rules())
    assert result.details == ("filter/FORWARD: missing",)
    assert ipt(ns.name, "-t", "filter", "-S") == EXPECTED_FILTER


def ipt_spec(line: str) -> list[str]:
    """The rule of an ``-A chain ...`` line, for ``-D chain <spec>``."""
    return shlex.split(line)[2:]
