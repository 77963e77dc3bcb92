"""iptables mode against the real flanneld: n1, n2 ours, n3, n4 flanneld, one etcd, one config.

- the whole ``iptables-save`` of a node of ours equals a flanneld node's, subnets aside;
- a policy agent's chain jumped to from position 1 of POSTROUTING and FORWARD (as
  Calico's Felix does in Canal), put there after both agents programmed their rules,
  is never fought: no rule rewritten over five resyncs, by us or by flanneld, and the
  foreign jump stays first;
- switching the config to EnableNFTables and restarting: what each side leaves of the
  iptables mode (flanneld's own clean-up is incomplete, ours is not), and back again.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from flannelpy_lab import Lab, etcd, plan

from tests.support.agent_events import (
    FIREWALL_RESYNCS,
    fresh_status,
    processed,
    wait_until_processed,
)
from tests.support.firewall_lab import (
    counted_rules,
    in_ns,
    iptables_save,
    log_count,
    nft_ruleset,
    normalized,
    restart,
)
from tests.support.lab_util import running_mixed_lab

pytestmark = [pytest.mark.lab]

RESYNC = 5.0  # both sides' --iptables-resync default
OURS_REPAIRED = "firewall repaired"  # our agent's log line for any rule it rewrote
FLANNELD_REWROTE = "bootstrap done"  # flanneld's, after each iptables-restore of its rules
M = '-m comment --comment "flanneld masq"'
F = '-m comment --comment "flanneld forward"'


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with running_mixed_lab("vxlan") as lab:
        yield lab


def test_our_iptables_rules_are_flanneld_s(lab: Lab) -> None:
    for ours, theirs in (("n1", "n3"), ("n2", "n4")):
        mine = normalized(lab, ours, iptables_save(lab, ours))
        assert mine == normalized(lab, theirs, iptables_save(lab, theirs))
    # The chains' shape, for the reader: our jumps are the builtin chains' only rules.
    saved = iptables_save(lab, "n1")
    assert f"-A POSTROUTING {M} -j FLANNEL-POSTRTG\n" in saved
    assert f"-A FORWARD {F} -j FLANNEL-FWD\n" in saved


def test_a_foreign_chain_put_first_is_never_fought(lab: Lab) -> None:
    nodes = ("n1", "n3")  # ours and flanneld, side by side
    for node in nodes:
        ns = lab.node(node).namespace
        for table, builtin in (("nat", "POSTROUTING"), ("filter", "FORWARD")):
            chain = "cali-" + builtin
            in_ns(ns, ["iptables", "-w", "-t", table, "-N", chain])
            in_ns(ns, ["iptables", "-w", "-t", table, "-A", chain, "-j", "RETURN"])
            in_ns(ns, ["iptables", "-w", "-t", table, "-I", builtin, "1", "-j", chain])
    before = {n: counted_rules(iptables_save(lab, n, counters=True)) for n in nodes}
    writes = {
        "n1": log_count(lab, "n1", OURS_REPAIRED),
        "n3": log_count(lab, "n3", FLANNELD_REWROTE),
    }

    # Five resyncs of ours begun after this point (counted by the agent), by when flanneld,
    # on the same interval and observable only by its log, has made about as many.
    mark = processed(fresh_status(lab.node("n1")), FIREWALL_RESYNCS)
    wait_until_processed(lab.node("n1"), FIREWALL_RESYNCS, after=mark + 5, timeout=10 * RESYNC)

    for node in nodes:
        after = counted_rules(iptables_save(lab, node, counters=True))
        assert [r for r, _, _ in after] == [r for r, _, _ in before[node]], node
        # A rewritten rule starts again at [0:0]: every counter only grew.
        for (rule, p0, b0), (_, p1, b1) in zip(before[node], after, strict=True):
            assert (p1, b1) >= (p0, b0), f"{node}: {rule} was rewritten"
        saved = iptables_save(lab, node)
        assert saved.index("-A POSTROUTING -j cali-POSTROUTING") < saved.index(
            "-A POSTROUTING " + M
        )
        assert saved.index("-A FORWARD -j cali-FORWARD") < saved.index("-A FORWARD " + F)
    assert log_count(lab, "n1", OURS_REPAIRED) == writes["n1"]
    assert log_count(lab, "n3", FLANNELD_REWROTE) == writes["n3"]
    # Both still the same, the foreign chains included.
    assert normalized(lab, "n1", iptables_save(lab, "n1")) == normalized(
        lab, "n3", iptables_save(lab, "n3")
    )


def _put_config(lab: Lab, **extra: object) -> None:
    doc = {**plan.net_conf(lab.state.network, lab.state.backend, lab.state.direct_routing), **extra}
    etcd.put_config(lab.state, json.dumps(doc))


def test_switching_modes_cleans_the_other_mode_at_start(lab: Lab) -> None:
    _put_config(lab, EnableNFTables=True)
    try:
        for node in ("n2", "n4"):
            restart(lab, node)
        # Both now run Flannel's nftables tables, the same ones.
        for node in ("n2", "n4"):
            assert "table ip flannel-ipv4" in nft_ruleset(lab, node)
        ours = normalized(lab, "n2", nft_ruleset(lab, "n2").split("table ip flannel-ipv4")[1])
        theirs = normalized(lab, "n4", nft_ruleset(lab, "n4").split("table ip flannel-ipv4")[1])
        assert ours == theirs
        # What is left of the iptables mode. Ours: nothing.
        assert "FLANNEL" not in iptables_save(lab, "n2")
        # flanneld's clean-up flushes nat/FLANNEL-POSTRTG but cannot delete it while
        # POSTROUTING still jumps to it, and looks for FLANNEL-FWD in nat, not filter:
        # its forward ACCEPTs stay (a difference we keep, see the README).
        left = iptables_save(lab, "n4")
        assert f"-A POSTROUTING {M} -j FLANNEL-POSTRTG\n" in left
        assert "-A FLANNEL-POSTRTG" not in left
        assert f"-A FLANNEL-FWD -s {lab.state.network} {F} -j ACCEPT\n" in left
    finally:
        _put_config(lab)
    for node in ("n2", "n4"):
        restart(lab, node)
    # Back in iptables mode: both removed the nftables tables, and the rules agree again.
    for node in ("n2", "n4"):
        assert "flannel-ipv" not in nft_ruleset(lab, node)
    assert normalized(lab, "n2", iptables_save(lab, "n2")) == normalized(
        lab, "n4", iptables_save(lab, "n4")
    )
