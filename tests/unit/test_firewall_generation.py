"""With iptables-nft, a resync lists our chains only when the namespace's nftables
ruleset generation moved since the last check found them in place."""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Sequence
from ipaddress import IPv4Network
from typing import Any

import pytest

from flannelpy.dataplane.firewall import (
    Checked,
    IptablesFirewall,
    Rule,
    forward_rules,
    masq_rules,
    needs_check,
)
from tests.unit.test_firewall_rules import NET, SUBNET, FakeIptables, in_sync_state

NFT = "v1.8.9 (nf_tables)"
MASQ = masq_rules(NET, [SUBNET], random_fully=True)
FORWARD = forward_rules(NET)


@pytest.mark.parametrize(
    ("last", "rules", "generation", "expected"),
    [
        (None, MASQ, 7, True),  # never checked
        (Checked(tuple(MASQ), 7), MASQ, 7, False),  # nothing committed since
        (Checked(tuple(MASQ), 7), MASQ, 8, True),  # something was
        (Checked(tuple(MASQ), 7), MASQ, None, True),  # no generation to go by
        (Checked(tuple(MASQ), 7), MASQ[:-1], 7, True),  # other rules wanted now
        (Checked(tuple(FORWARD), 7), MASQ, 7, True),
    ],
)
def test_needs_check(
    last: Checked | None, rules: Sequence[Rule], generation: int | None, expected: bool
) -> None:
    assert needs_check(last, rules, generation) is expected


class NftIptables:
    """A fake iptables-nft: the namespace's generation moves with every restore (and by
    hand, with ``bump``); ``on_restore`` is what a restore does to the fake's chains."""

    def __init__(self, version: str = NFT, value: int | None = 10) -> None:
        self.fake = FakeIptables(in_sync_state(), version=version)
        self.value = value
        self.asked = 0
        self.on_restore: Callable[[], None] = lambda: None

    def generation(self) -> int | None:
        self.asked += 1
        return self.value

    def bump(self) -> None:
        assert self.value is not None
        self.value += 1

    def run(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        if "iptables-restore" in argv:
            self.on_restore()
            self.bump()  # a committed change, as the kernel counts it
        return self.fake(argv, **kwargs)

    def listings(self) -> int:
        return sum("-S" in call for call in self.fake.calls)

    def firewall(self) -> IptablesFirewall:
        return IptablesFirewall(run=self.run, random_fully=True, generation=self.generation)

    def chain(self, table: str, chain: str, rules: Sequence[Rule]) -> None:
        builtin = chain in ("POSTROUTING", "FORWARD")
        self.fake.chains[table, chain] = [f"-P {chain} ACCEPT"] * builtin + [
            r.line for r in rules if r.chain == chain
        ]


def test_an_unchanged_generation_skips_the_listing() -> None:
    ipt = NftIptables()
    fw = ipt.firewall()
    assert not fw.sync(MASQ).repaired
    assert ipt.listings() == 2  # the jump's chain and ours
    for _ in range(5):
        assert not fw.sync(MASQ).repaired
    assert ipt.listings() == 2
    assert ipt.asked == 6
    assert ipt.fake.scripts == []


def test_a_moved_generation_lists_again_and_repairs_what_changed() -> None:
    ipt = NftIptables()
    fw = ipt.firewall()
    fw.sync(MASQ)
    good = ipt.fake.chains["nat", "FLANNEL-POSTRTG"]
    ipt.fake.chains["nat", "FLANNEL-POSTRTG"] = []  # flushed by hand: one commit
    ipt.bump()
    ipt.on_restore = lambda: ipt.fake.chains.update({("nat", "FLANNEL-POSTRTG"): good})
    result = fw.sync(MASQ)
    assert result.repaired and result.details == ("nat/FLANNEL-POSTRTG: missing",)
    assert ipt.listings() == 2 + 4  # found, then verified after the repair
    # Our own repair moved the generation: the next resync checks once, then skips.
    assert not fw.sync(MASQ).repaired
    assert ipt.listings() == 2 + 6
    assert not fw.sync(MASQ).repaired
    assert ipt.listings() == 2 + 6


def test_iptables_legacy_lists_at_every_resync() -> None:
    ipt = NftIptables(version="v1.8.9 (legacy)")
    fw = ipt.firewall()
    for _ in range(3):
        assert not fw.sync(MASQ).repaired
    assert ipt.listings() == 6
    assert ipt.asked == 0  # no generation covers legacy tables: not asked


def test_no_generation_answer_lists_at_every_resync() -> None:
    ipt = NftIptables(value=None)
    fw = ipt.firewall()
    for _ in range(3):
        assert not fw.sync(MASQ).repaired
    assert ipt.listings() == 6


def test_each_rule_set_is_remembered_on_its_own_and_new_rules_are_checked() -> None:
    ipt = NftIptables()
    ipt.chain("filter", "FORWARD", FORWARD)
    ipt.chain("filter", "FLANNEL-FWD", FORWARD)
    fw = ipt.firewall()
    assert not fw.sync(MASQ).repaired
    assert not fw.sync(FORWARD).repaired
    assert ipt.listings() == 4
    assert not fw.sync(MASQ).repaired
    assert not fw.sync(FORWARD).repaired
    assert ipt.listings() == 4
    # A second subnet: other rules for the same chains, listed and written at once.
    other = masq_rules(NET, [SUBNET, IPv4Network("10.244.2.0/24")], random_fully=True)
    ipt.on_restore = lambda: ipt.chain("nat", "FLANNEL-POSTRTG", other)
    result = fw.sync(other)
    assert result.details == ("nat/FLANNEL-POSTRTG: missing",)
