"""Flannel's exact ip-masq / forward rules, chain comparison, and the adapter against a fake."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
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
    missing_jumps,
    plan_chain,
    plan_jumps,
    random_fully_supported,
    restore_script,
    without_random_fully,
)
from flannelpy.errors import ConfigError, DataplaneError

NET = IPv4Network("10.244.0.0/16")
SUBNET = IPv4Network("10.244.1.0/24")
M = '-m comment --comment "flanneld masq"'
F = '-m comment --comment "flanneld forward"'

# What `iptables -S` prints for Flannel's rules (checked against iptables 1.8.9).
FLANNEL_MASQ_LINES = [
    f"-A POSTROUTING {M} -j FLANNEL-POSTRTG",
    f"-A FLANNEL-POSTRTG -m mark --mark 0x4000/0x4000 {M} -j RETURN",
    f"-A FLANNEL-POSTRTG -s 10.244.1.0/24 -d 10.244.0.0/16 {M} -j RETURN",
    f"-A FLANNEL-POSTRTG -s 10.244.0.0/16 -d 10.244.1.0/24 {M} -j RETURN",
    f"-A FLANNEL-POSTRTG ! -s 10.244.0.0/16 -d 10.244.1.0/24 {M} -j RETURN",
    f"-A FLANNEL-POSTRTG -s 10.244.0.0/16 ! -d 224.0.0.0/4 {M} -j MASQUERADE --random-fully",
    f"-A FLANNEL-POSTRTG ! -s 10.244.0.0/16 -d 10.244.0.0/16 {M} -j MASQUERADE --random-fully",
]
FLANNEL_FORWARD_LINES = [
    f"-A FORWARD {F} -j FLANNEL-FWD",
    f"-A FLANNEL-FWD -s 10.244.0.0/16 {F} -j ACCEPT",
    f"-A FLANNEL-FWD -d 10.244.0.0/16 {F} -j ACCEPT",
]


def chain_rules(rules: Sequence[Rule], chain: str) -> list[Rule]:
    return [r for r in rules if r.chain == chain]


# --- exact rules ----------------------------------------------------------------------


def test_masq_rules_are_flannels_in_order() -> None:
    rules = masq_rules(NET, [SUBNET], random_fully=True)
    assert [r.line for r in rules] == FLANNEL_MASQ_LINES
    assert {r.table for r in rules} == {"nat"}


def test_masq_rules_without_random_fully() -> None:
    lines = [r.line for r in masq_rules(NET, [SUBNET], random_fully=False)]
    assert lines == [line.removesuffix(" --random-fully") for line in FLANNEL_MASQ_LINES]
    stripped = without_random_fully(masq_rules(NET, [SUBNET], random_fully=True))
    assert [r.line for r in stripped] == lines


def test_masq_rules_one_return_pair_per_subnet() -> None:
    second = IPv4Network("10.244.7.0/24")
    lines = [r.line for r in masq_rules(NET, [SUBNET, second, SUBNET], random_fully=True)]
    assert lines[2:8] == [
        f"-A FLANNEL-POSTRTG -s 10.244.1.0/24 -d 10.244.0.0/16 {M} -j RETURN",
        f"-A FLANNEL-POSTRTG -s 10.244.0.0/16 -d 10.244.1.0/24 {M} -j RETURN",
        f"-A FLANNEL-POSTRTG -s 10.244.7.0/24 -d 10.244.0.0/16 {M} -j RETURN",
        f"-A FLANNEL-POSTRTG -s 10.244.0.0/16 -d 10.244.7.0/24 {M} -j RETURN",
        f"-A FLANNEL-POSTRTG ! -s 10.244.0.0/16 -d 10.244.1.0/24 {M} -j RETURN",
        f"-A FLANNEL-POSTRTG ! -s 10.244.0.0/16 -d 10.244.7.0/24 {M} -j RETURN",
    ]
    assert len(lines) == 10  # the duplicate subnet added nothing


def test_masq_rules_reject_a_subnet_outside_the_network() -> None:
    with pytest.raises(ConfigError, match=r"10\.9\.1\.0/24"):
        masq_rules(NET, [IPv4Network("10.9.1.0/24")], random_fully=True)


def test_masq_rules_over_several_pools_keep_pod_to_pod_sources() -> None:
    pool = IPv4Network("10.250.0.0/16")
    new = IPv4Network("10.250.3.0/24")
    lines = [r.line for r in masq_rules([NET, pool], [SUBNET, new], random_fully=False)]
    r = f"{M} -j RETURN"
    assert lines[2:] == [
        f"-A FLANNEL-POSTRTG -s 10.244.1.0/24 -d 10.244.0.0/16 {r}",
        f"-A FLANNEL-POSTRTG -s 10.244.0.0/16 -d 10.244.1.0/24 {r}",
        f"-A FLANNEL-POSTRTG -s 10.244.1.0/24 -d 10.250.0.0/16 {r}",
        f"-A FLANNEL-POSTRTG -s 10.250.0.0/16 -d 10.244.1.0/24 {r}",
        f"-A FLANNEL-POSTRTG -s 10.250.3.0/24 -d 10.244.0.0/16 {r}",
        f"-A FLANNEL-POSTRTG -s 10.244.0.0/16 -d 10.250.3.0/24 {r}",
        f"-A FLANNEL-POSTRTG -s 10.250.3.0/24 -d 10.250.0.0/16 {r}",
        f"-A FLANNEL-POSTRTG -s 10.250.0.0/16 -d 10.250.3.0/24 {r}",
        f"-A FLANNEL-POSTRTG ! -s 10.244.0.0/16 -d 10.244.1.0/24 {r}",
        f"-A FLANNEL-POSTRTG ! -s 10.244.0.0/16 -d 10.250.3.0/24 {r}",
        f"-A FLANNEL-POSTRTG -s 10.244.0.0/16 -d 10.250.0.0/16 {r}",
        f"-A FLANNEL-POSTRTG -s 10.250.0.0/16 -d 10.244.0.0/16 {r}",
        f"-A FLANNEL-POSTRTG -s 10.244.0.0/16 ! -d 224.0.0.0/4 {M} -j MASQUERADE",
        f"-A FLANNEL-POSTRTG -s 10.250.0.0/16 ! -d 224.0.0.0/4 {M} -j MASQUERADE",
        f"-A FLANNEL-POSTRTG ! -s 10.244.0.0/16 -d 10.244.0.0/16 {M} -j MASQUERADE",
        f"-A FLANNEL-POSTRTG ! -s 10.250.0.0/16 -d 10.250.0.0/16 {M} -j MASQUERADE",
    ]
    with pytest.raises(ConfigError, match=r"10\.9\.1\.0/24"):
        masq_rules([NET, pool], [IPv4Network("10.9.1.0/24")], random_fully=True)


def test_forward_rules_cover_every_pool() -> None:
    lines = [r.line for r in forward_rules([NET, IPv4Network("10.250.0.0/16")])]
    assert lines == [
        *FLANNEL_FORWARD_LINES,
        f"-A FLANNEL-FWD -s 10.250.0.0/16 {F} -j ACCEPT",
        f"-A FLANNEL-FWD -d 10.250.0.0/16 {F} -j ACCEPT",
    ]


def test_forward_rules_are_flannels() -> None:
    rules = forward_rules(NET)
    assert [r.line for r in rules] == FLANNEL_FORWARD_LINES
    assert {r.table for r in rules} == {"filter"}


# --- plan_chain / plan_jumps -----------------------------------------------------------

DESIRED = chain_rules(masq_rules(NET, [SUBNET], random_fully=True), "FLANNEL-POSTRTG")
GOOD = ["-N FLANNEL-POSTRTG", *(r.line for r in DESIRED)]


def test_plan_chain_all_good() -> None:
    assert plan_chain(DESIRED, GOOD).in_sync


@pytest.mark.parametrize(
    ("observed", "reason"),
    [
        pytest.param([], MISSING, id="chain-absent"),
        pytest.param(["-N FLANNEL-POSTRTG"], MISSING, id="flushed"),
        pytest.param(GOOD[:3] + GOOD[4:], MISSING, id="one-rule-gone"),
        pytest.param([GOOD[0], GOOD[2], GOOD[1], *GOOD[3:]], WRONG_ORDER, id="reordered"),
        pytest.param([*GOOD, GOOD[2]], DUPLICATES, id="duplicated"),
        pytest.param(
            [*GOOD[:3], "-A FLANNEL-POSTRTG -s 1.2.3.4/32 -j ACCEPT", *GOOD[3:]],
            EXTRA,
            id="foreign-rule-inside",
        ),
        pytest.param([*GOOD[:-1], GOOD[-1] + " --random-fully"], MISSING, id="rule-altered"),
    ],
)
def test_plan_chain_out_of_sync(observed: list[str], reason: str) -> None:
    plan = plan_chain(DESIRED, observed)
    assert not plan.in_sync
    assert plan.reason == reason


JUMP = masq_rules(NET, [SUBNET], random_fully=True)[:1]
JUMP_LINE = FLANNEL_MASQ_LINES[0]
KUBE = '-A POSTROUTING -m comment --comment "kubernetes postrouting rules" -j KUBE-POSTROUTING'


OLD_STYLE = "-A POSTROUTING -j FLANNEL-POSTRTG"
FELIX = "-A POSTROUTING -m comment --comment cali:O3lYWMrLQYEMJtB5 -j cali-POSTROUTING"


@pytest.mark.parametrize(
    "observed",
    [
        pytest.param([KUBE, JUMP_LINE], id="after-foreign"),
        pytest.param([FELIX, JUMP_LINE, KUBE], id="between-foreign"),
        pytest.param([JUMP_LINE, KUBE, JUMP_LINE], id="twice"),
        pytest.param([JUMP_LINE, OLD_STYLE], id="old-style-beside"),
    ],
)
def test_plan_jumps_after_start_only_asks_that_the_jump_exists(observed: list[str]) -> None:
    # Flannel's check: the rule exists. Position and neighbours are not ours to fix.
    assert plan_jumps(JUMP, ["-P POSTROUTING ACCEPT", *observed]).in_sync


def test_plan_jumps_after_start_a_missing_jump_is_appended_alone() -> None:
    plan = plan_jumps(JUMP, ["-P POSTROUTING ACCEPT", FELIX, KUBE])
    assert (plan.in_sync, plan.reason, plan.stale) == (False, MISSING, ())
    assert missing_jumps(JUMP, [FELIX, KUBE]) == JUMP
    assert missing_jumps(JUMP, [FELIX, JUMP_LINE]) == []


def test_plan_jumps_at_start_wants_the_jump_last() -> None:
    assert plan_jumps(JUMP, ["-P POSTROUTING ACCEPT", KUBE, JUMP_LINE], bootstrap=True).in_sync
    assert plan_jumps(JUMP, ["-P POSTROUTING ACCEPT", JUMP_LINE], bootstrap=True).in_sync


@pytest.mark.parametrize(
    ("observed", "reason", "stale"),
    [
        pytest.param([KUBE], MISSING, (), id="absent"),
        pytest.param([JUMP_LINE, KUBE], WRONG_ORDER, (JUMP_LINE,), id="not-last"),
        pytest.param([JUMP_LINE, KUBE, JUMP_LINE], DUPLICATES, (JUMP_LINE,) * 2, id="twice"),
        pytest.param([JUMP_LINE, OLD_STYLE], EXTRA, (JUMP_LINE, OLD_STYLE), id="old-style-jump"),
    ],
)
def test_plan_jumps_at_start_out_of_sync(
    observed: list[str], reason: str, stale: tuple[str, ...]
) -> None:
    plan = plan_jumps(JUMP, observed, bootstrap=True)
    assert (plan.in_sync, plan.reason, plan.stale) == (False, reason, stale)


def test_restore_script_rewrites_our_chain_and_appends_the_jump() -> None:
    script = restore_script(
        "nat", [("FLANNEL-POSTRTG", DESIRED)], [("POSTROUTING", JUMP, [JUMP_LINE])]
    )
    assert script.splitlines() == [
        "*nat",
        ":FLANNEL-POSTRTG - [0:0]",
        *FLANNEL_MASQ_LINES[1:],
        f"-D POSTROUTING {M} -j FLANNEL-POSTRTG",
        f"-A POSTROUTING {M} -j FLANNEL-POSTRTG",
        "COMMIT",
    ]
    assert not any(line.startswith("-I") for line in script.splitlines())


@pytest.mark.parametrize(
    ("version", "kernel", "expected"),
    [
        ("iptables v1.8.9 (nf_tables)", "6.1.0-18-amd64", True),
        ("iptables v1.6.2", "4.19.0", True),
        ("iptables v1.6.1", "5.10.0", False),
        ("iptables v1.8.7 (legacy)", "3.10.0-1160.el7.x86_64", False),
        ("garbage", "6.1.0", False),
    ],
)
def test_random_fully_supported(version: str, kernel: str, expected: bool) -> None:
    assert random_fully_supported(version, kernel) is expected


# --- the adapter, against a fake iptables ------------------------------------------------


class FakeIptables:
    """Answers `iptables -S` from a dict and records every command and restore script."""

    def __init__(self, chains: dict[tuple[str, str], list[str]], version: str = "v1.8.9") -> None:
        self.chains = chains
        self.version = version
        self.calls: list[list[str]] = []
        self.scripts: list[str] = []
        self.envs: list[dict[str, str]] = []

    def __call__(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        self.calls.append(argv)
        self.envs.append(kwargs["env"])
        if "--version" in argv:
            return subprocess.CompletedProcess(argv, 0, f"iptables {self.version}\n", "")
        if "iptables-restore" in argv:
            self.scripts.append(kwargs["input"])
            return subprocess.CompletedProcess(argv, 0, "", "")
        table, chain = argv[argv.index("-t") + 1], argv[argv.index("-S") + 1]
        if (table, chain) not in self.chains:
            return subprocess.CompletedProcess(argv, 1, "", f"chain `{chain}' is incompatible")
        return subprocess.CompletedProcess(argv, 0, "\n".join(self.chains[table, chain]), "")


def in_sync_state() -> dict[tuple[str, str], list[str]]:
    return {
        ("nat", "POSTROUTING"): ["-P POSTROUTING ACCEPT", KUBE, JUMP_LINE],
        ("nat", "FLANNEL-POSTRTG"): GOOD,
    }


def test_sync_in_sync_runs_no_restore_and_uses_the_lock_and_prefix() -> None:
    fake = FakeIptables(in_sync_state())
    fw = IptablesFirewall(run=fake, command_prefix=("ip", "netns", "exec", "x"), lock_file="/l")
    result = fw.sync(masq_rules(NET, [SUBNET], random_fully=True))
    assert (result.repaired, result.reason) == (False, "")
    assert fake.scripts == []
    assert all(call[:4] == ["ip", "netns", "exec", "x"] for call in fake.calls)
    listing = [c for c in fake.calls if "-S" in c]
    assert [
        "ip",
        "netns",
        "exec",
        "x",
        "iptables",
        "-w",
        "5",
        "-t",
        "nat",
        "-S",
        "FLANNEL-POSTRTG",
    ] in listing
    assert {env["XTABLES_LOCKFILE"] for env in fake.envs} == {"/l"}


def test_sync_repairs_only_what_differs() -> None:
    state = in_sync_state()
    state["nat", "POSTROUTING"] = ["-P POSTROUTING ACCEPT", KUBE, JUMP_LINE, JUMP_LINE]
    fake = FakeIptables(state)

    def restore_fixes(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        if "iptables-restore" in argv:
            state["nat", "POSTROUTING"] = ["-P POSTROUTING ACCEPT", KUBE, JUMP_LINE]
        return fake(argv, **kwargs)

    fw = IptablesFirewall(run=restore_fixes, random_fully=True)
    result = fw.sync(masq_rules(NET, [SUBNET], random_fully=True))
    assert (result.repaired, result.reason) == (True, DUPLICATES)
    assert result.details == ("nat/POSTROUTING: duplicates",)
    # Our chain was fine, so it is not re-declared (that would flush it).
    assert fake.scripts == [
        f"*nat\n-D POSTROUTING {M} -j FLANNEL-POSTRTG\n-D POSTROUTING {M} -j FLANNEL-POSTRTG\n"
        f"-A POSTROUTING {M} -j FLANNEL-POSTRTG\nCOMMIT\n"
    ]
    assert ["iptables-restore", "-w", "5", "--noflush"] in fake.calls


def test_after_start_rules_put_above_ours_are_left_alone() -> None:
    state = in_sync_state()
    state["nat", "POSTROUTING"] = ["-P POSTROUTING ACCEPT", KUBE, JUMP_LINE]
    fake = FakeIptables(state)
    fw = IptablesFirewall(run=fake, random_fully=True)
    assert not fw.sync(masq_rules(NET, [SUBNET], random_fully=True)).repaired
    state["nat", "POSTROUTING"] = ["-P POSTROUTING ACCEPT", FELIX, KUBE, JUMP_LINE, JUMP_LINE]
    for _ in range(5):
        assert not fw.sync(masq_rules(NET, [SUBNET], random_fully=True)).repaired
    assert fake.scripts == []


def test_after_start_a_deleted_jump_is_appended_without_touching_the_rest() -> None:
    state = in_sync_state()
    fake = FakeIptables(state)

    def restore_appends(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        if "iptables-restore" in argv:
            state["nat", "POSTROUTING"] = [*state["nat", "POSTROUTING"], JUMP_LINE]
        return fake(argv, **kwargs)

    fw = IptablesFirewall(run=restore_appends, random_fully=True)
    state["nat", "POSTROUTING"] = ["-P POSTROUTING ACCEPT", KUBE, JUMP_LINE]
    fw.sync(masq_rules(NET, [SUBNET], random_fully=True))  # start: already last, nothing done
    state["nat", "POSTROUTING"] = ["-P POSTROUTING ACCEPT", FELIX, KUBE]
    result = fw.sync(masq_rules(NET, [SUBNET], random_fully=True))
    assert (result.repaired, result.details) == (True, ("nat/POSTROUTING: missing",))
    assert fake.scripts == [f"*nat\n-A POSTROUTING {M} -j FLANNEL-POSTRTG\nCOMMIT\n"]


def test_sync_drops_random_fully_when_iptables_is_too_old() -> None:
    state = in_sync_state()
    state["nat", "FLANNEL-POSTRTG"] = [line.removesuffix(" --random-fully") for line in GOOD]
    fake = FakeIptables(state, version="v1.6.1")
    result = IptablesFirewall(run=fake).sync(masq_rules(NET, [SUBNET], random_fully=True))
    assert not result.repaired
    assert fake.scripts == []


def test_sync_raises_when_a_repair_does_not_stick() -> None:
    fake = FakeIptables({("nat", "POSTROUTING"): ["-P POSTROUTING ACCEPT"]})
    fw = IptablesFirewall(run=fake, random_fully=True)
    with pytest.raises(DataplaneError, match="still differ"):
        fw.sync(masq_rules(NET, [SUBNET], random_fully=True))


def test_failed_restore_is_a_dataplane_error() -> None:
    def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        if "iptables-restore" in argv:
            return subprocess.CompletedProcess(argv, 4, "", "Another app holds the lock\n")
        return FakeIptables({("nat", "POSTROUTING"): []})(argv, **kwargs)

    with pytest.raises(DataplaneError, match="iptables-restore failed for table nat"):
        IptablesFirewall(run=run, random_fully=True).sync(masq_rules(NET, [SUBNET], True))


def test_missing_binary_is_a_dataplane_error() -> None:
    def run(argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        raise FileNotFoundError(argv[0])

    with pytest.raises(DataplaneError, match="not installed"):
        IptablesFirewall(run=run, random_fully=True).sync(forward_rules(NET))
