"""IptablesFirewall against real iptables, inside a network namespace of our own.

iptables state is per network namespace, so nothing here touches the host's rules.
"""

from __future__ import annotations

import os
import secrets
import shlex
import subprocess
from collections.abc import Iterator
from ipaddress import IPv4Network
from typing import Any

import pytest

from flannelpy.dataplane.firewall import (
    DUPLICATES,
    EXTRA,
    MISSING,
    WRONG_ORDER,
    IptablesFirewall,
    Rule,
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
M = '-m comment --comment "flanneld masq"'
F = '-m comment --comment "flanneld forward"'
FOREIGN_POST = "-A POSTROUTING -s 192.0.2.0/24 -j MASQUERADE"
FOREIGN_FWD = "-A FORWARD -s 198.51.100.0/24 -j DROP"


class Recorder:
    """subprocess.run that remembers which programs it ran."""

    def __init__(self) -> None:
        self.programs: list[str] = []

    def __call__(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        self.programs.append(argv[4])  # after "ip netns exec <ns>"
        return subprocess.run(argv, **kwargs)

    def restores(self) -> int:
        return self.programs.count("iptables-restore")


@pytest.fixture
def netns() -> Iterator[str]:
    name = f"fp-fw-{os.getpid()}-{secrets.token_hex(2)}"
    add_netns(name)
    try:
        yield name
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def ipt(ns: str, *args: str) -> list[str]:
    proc = subprocess.run(
        ["ip", "netns", "exec", ns, "iptables", "-w", "5", *args],
        capture_output=True,
        text=True,
        check=True,
    )
    return proc.stdout.splitlines()


def rules() -> list[Rule]:
    random_fully = True  # iptables 1.8 on a modern kernel; the adapter drops it otherwise
    return masq_rules(NET, [SUBNET], random_fully) + forward_rules(NET)


@pytest.fixture
def fw(netns: str) -> tuple[IptablesFirewall, Recorder]:
    recorder = Recorder()
    return IptablesFirewall(run=recorder, command_prefix=("ip", "netns", "exec", netns)), recorder


def expected_nat(fw: IptablesFirewall) -> list[str]:
    rf = " --random-fully" if fw.random_fully else ""
    return [
        "-P PREROUTING ACCEPT",
        "-P INPUT ACCEPT",
        "-P OUTPUT ACCEPT",
        "-P POSTROUTING ACCEPT",
        "-N FLANNEL-POSTRTG",
        f"-A POSTROUTING {M} -j FLANNEL-POSTRTG",
        f"-A FLANNEL-POSTRTG -m mark --mark 0x4000/0x4000 {M} -j RETURN",
        f"-A FLANNEL-POSTRTG -s 10.244.1.0/24 -d 10.244.0.0/16 {M} -j RETURN",
        f"-A FLANNEL-POSTRTG -s 10.244.0.0/16 -d 10.244.1.0/24 {M} -j RETURN",
        f"-A FLANNEL-POSTRTG ! -s 10.244.0.0/16 -d 10.244.1.0/24 {M} -j RETURN",
        f"-A FLANNEL-POSTRTG -s 10.244.0.0/16 ! -d 224.0.0.0/4 {M} -j MASQUERADE{rf}",
        f"-A FLANNEL-POSTRTG ! -s 10.244.0.0/16 -d 10.244.0.0/16 {M} -j MASQUERADE{rf}",
    ]


EXPECTED_FILTER = [
    "-P INPUT ACCEPT",
    "-P FORWARD ACCEPT",
    "-P OUTPUT ACCEPT",
    "-N FLANNEL-FWD",
    f"-A FORWARD {F} -j FLANNEL-FWD",
    f"-A FLANNEL-FWD -s 10.244.0.0/16 {F} -j ACCEPT",
    f"-A FLANNEL-FWD -d 10.244.0.0/16 {F} -j ACCEPT",
]


def test_sync_installs_exactly_flannels_rules_then_does_nothing(
    netns: str, fw: tuple[IptablesFirewall, Recorder]
) -> None:
    firewall, recorder = fw
    first = firewall.sync(rules())
    assert (first.repaired, first.reason) == (True, MISSING)
    assert ipt(netns, "-t", "nat", "-S") == expected_nat(firewall)
    assert ipt(netns, "-t", "filter", "-S") == EXPECTED_FILTER

    restores = recorder.restores()
    again = firewall.sync(rules())
    assert (again.repaired, again.reason) == (False, "")
    assert recorder.restores() == restores  # only reads when already correct


def test_flushed_chain_is_repaired_and_reported_missing(
    netns: str, fw: tuple[IptablesFirewall, Recorder]
) -> None:
    firewall, _ = fw
    firewall.sync(rules())
    ipt(netns, "-t", "nat", "-F", "FLANNEL-POSTRTG")
    result = firewall.sync(rules())
    assert (result.repaired, result.reason) == (True, MISSING)
    assert result.details == ("nat/FLANNEL-POSTRTG: missing",)
    assert ipt(netns, "-t", "nat", "-S") == expected_nat(firewall)


def test_duplicate_reordered_and_foreign_rules_in_our_chain_are_repaired(
    netns: str, fw: tuple[IptablesFirewall, Recorder]
) -> None:
    firewall, _ = fw
    firewall.sync(rules())
    mark_rule = shlex.split(expected_nat(firewall)[6])[2:]

    ipt(netns, "-t", "nat", "-A", "FLANNEL-POSTRTG", *mark_rule)  # duplicate at the end
    assert firewall.sync(rules()).reason == DUPLICATES
    assert ipt(netns, "-t", "nat", "-S") == expected_nat(firewall)

    ipt(netns, "-t", "nat", "-D", "FLANNEL-POSTRTG", "1")  # mark rule moved last
    ipt(netns, "-t", "nat", "-A", "FLANNEL-POSTRTG", *mark_rule)
    assert firewall.sync(rules()).reason == WRONG_ORDER
    assert ipt(netns, "-t", "nat", "-S") == expected_nat(firewall)

    ipt(netns, "-t", "filter", "-I", "FLANNEL-FWD", "2", "-s", "203.0.113.0/24", "-j", "DROP")
    result = firewall.sync(rules())
    assert (result.repaired, result.reason) == (True, EXTRA)
    assert result.details == ("filter/FLANNEL-FWD: extra rules",)
    assert ipt(netns, "-t", "filter", "-S") == EXPECTED_FILTER


def save_rules(ns: str) -> list[str]:
    """``iptables-save -c`` without its timestamped comment lines: every rule, in order,
    with its packet and byte counters (a rewritten rule restarts at [0:0])."""
    proc = subprocess.run(
        ["ip", "netns", "exec", ns, "iptables-save", "-c"],
        capture_output=True,
        text=True,
        check=True,
    )
    return [line for line in proc.stdout.splitlines() if not line.startswith("#")]


def test_jumps_are_appended_and_a_foreign_chain_above_them_is_never_fought(
    netns: str, fw: tuple[IptablesFirewall, Recorder]
) -> None:
    firewall, recorder = fw
    ipt(netns, "-t", "nat", *FOREIGN_POST.split())
    ipt(netns, "-t", "filter", *FOREIGN_FWD.split())
    firewall.sync(rules())
    jump = f"-A POSTROUTING {M} -j FLANNEL-POSTRTG"
    fwd_jump = f"-A FORWARD {F} -j FLANNEL-FWD"
    assert ipt(netns, "-t", "nat", "-S", "POSTROUTING") == [
        "-P POSTROUTING ACCEPT",
        FOREIGN_POST,
        jump,
    ]
    assert ipt(netns, "-t", "filter", "-S", "FORWARD") == [
        "-P FORWARD ACCEPT",
        FOREIGN_FWD,
        fwd_jump,
    ]

    # A policy agent (Calico's Felix in Canal) puts its own chain first, after us.
    for table, builtin in (("nat", "POSTROUTING"), ("filter", "FORWARD")):
        ipt(netns, "-t", table, "-N", "cali-" + builtin)
        ipt(netns, "-t", table, "-I", builtin, "1", "-j", "cali-" + builtin)
    before = save_rules(netns)
    restores = recorder.restores()
    for _ in range(5):
        result = firewall.sync(rules())
        assert (result.repaired, result.details) == (False, ())
    assert recorder.restores() == restores, "no rule was rewritten"
    assert save_rules(netns) == before
    assert ipt(netns, "-t", "nat", "-S", "POSTROUTING")[1] == "-A POSTROUTING -j cali-POSTROUTING"
    assert ipt(netns, "-t", "filter", "-S", "FORWARD")[1] == "-A FORWARD -j cali-FORWARD"

    # A deleted jump comes back at the end; the foreign chain stays first.
    ipt(netns, "-t", "nat", *shlex.split("-D" + jump[2:]))
    result = firewall.sync(rules())
    assert (result.repaired, result.details) == (True, ("nat/POSTROUTING: missing",))
    assert ipt(netns, "-t", "nat", "-S", "POSTROUTING") == [
        "-P POSTROUTING ACCEPT",
        "-A POSTROUTING -j cali-POSTROUTING",
        FOREIGN_POST,
        jump,
    ]


def test_start_moves_an_old_jump_from_the_top_to_the_end(netns: str) -> None:
    # What an older agent (or a restart after something appended) leaves: our jump
    # first, twice. A new start places it as flanneld does: once, last.
    jump = f"-A POSTROUTING {M} -j FLANNEL-POSTRTG"
    ipt(netns, "-t", "nat", "-N", "FLANNEL-POSTRTG")
    ipt(netns, "-t", "nat", *FOREIGN_POST.split())
    ipt(netns, "-t", "nat", "-I", "POSTROUTING", "1", *shlex.split(jump)[2:])
    ipt(netns, "-t", "nat", *shlex.split(jump))
    firewall = IptablesFirewall(command_prefix=("ip", "netns", "exec", netns))
    result = firewall.sync(masq_rules(NET, [SUBNET], True))
    assert result.repaired and "nat/POSTROUTING: duplicates" in result.details
    assert ipt(netns, "-t", "nat", "-S", "POSTROUTING") == [
        "-P POSTROUTING ACCEPT",
        FOREIGN_POST,
        jump,
    ]
    assert ipt(netns, "-t", "nat", "-S", "FLANNEL-POSTRTG") == [
        "-N FLANNEL-POSTRTG",
        *expected_nat(firewall)[6:],
    ]
    # A second copy appearing later is Flannel's "exists": left as it is.
    ipt(netns, "-t", "nat", "-I", "POSTROUTING", "1", *shlex.split(jump)[2:])
    assert not firewall.sync(masq_rules(NET, [SUBNET], True)).repaired


def test_remove_deletes_only_ours(netns: str, fw: tuple[IptablesFirewall, Recorder]) -> None:
    firewall, _ = fw
    ipt(netns, "-t", "nat", *FOREIGN_POST.split())
    firewall.sync(rules())
    firewall.remove()
    assert ipt(netns, "-t", "nat", "-S") == [
        "-P PREROUTING ACCEPT",
        "-P INPUT ACCEPT",
        "-P OUTPUT ACCEPT",
        "-P POSTROUTING ACCEPT",
        FOREIGN_POST,
    ]
    assert ipt(netns, "-t", "filter", "-S") == EXPECTED_FILTER[:3]
    firewall.remove()  # idempotent
