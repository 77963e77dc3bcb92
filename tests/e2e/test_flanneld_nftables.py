"""nftables mode (``EnableNFTables: true``) against the real flanneld: n1, n2 ours, n3, n4
flanneld, one etcd, one config, one pod per node.

- every pod reaches every pod, across both kinds;
- pod-to-pod traffic keeps the pod's source address and traffic leaving the pod
  network is masqueraded to the node's address, from our nodes as from flanneld's;
- ``nft list ruleset`` of a node of ours is byte for byte a flanneld node's, subnets
  aside (both tables, flannel-ipv6 included, and no iptables rules on either);
- a rule, a chain or a table deleted on our node is back at the next firewall tick.
"""

from __future__ import annotations

import re
from collections.abc import Iterator

import pytest
from flannelpy_lab import Lab
from flannelpy_lab.state import PodInfo

from tests.support.agent_events import FIREWALL_RESYNCS, processed_mark, wait_until_processed
from tests.support.firewall_lab import (
    in_ns,
    iptables_save,
    nft_ruleset,
    nft_table,
    normalized,
    source_seen,
)
from tests.support.lab_util import running_mixed_lab, wait_until

pytestmark = [pytest.mark.lab]

CONVERGE = 20.0
TICK = 5.0  # --iptables-resync default: the firewall timer


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with running_mixed_lab(
        "vxlan", pods_per_node=1, net_conf_extra={"EnableNFTables": True}
    ) as lab:
        yield lab


def _pod_on(lab: Lab, node: str) -> PodInfo:
    return next(p for p in lab.pods if p.node == node)


def test_every_pod_reaches_every_pod(lab: Lab) -> None:
    def all_reach() -> bool:
        return bool(lab.status()["ok"])

    wait_until(all_reach, timeout=CONVERGE, interval=1.0, what="every pair reaching")
    pods = [ok for row in lab.status()["pod_matrix"].values() for ok in row.values()]
    assert len(pods) == 4 * 3 and all(pods)


def test_pod_traffic_keeps_its_source_and_leaving_traffic_is_masqueraded(lab: Lab) -> None:
    for src_node, pod_peer, outside in (("n1", "n3", "n4"), ("n3", "n1", "n2")):
        pod, peer = _pod_on(lab, src_node), _pod_on(lab, pod_peer)
        # pod → pod on the other kind: no NAT.
        assert source_seen(peer.namespace, pod.namespace, str(peer.ip)) == str(pod.ip)
        # pod → another node's underlay address (outside the pod network): the node's.
        seen = source_seen(lab.node(outside).namespace, pod.namespace, str(lab.node(outside).ip))
        assert seen == str(lab.node(src_node).ip), f"from a pod on {src_node}"


def test_ruleset_is_flanneld_s_byte_for_byte(lab: Lab) -> None:
    for ours, theirs in (("n1", "n3"), ("n2", "n4")):
        assert normalized(lab, ours, nft_ruleset(lab, ours)) == normalized(
            lab, theirs, nft_ruleset(lab, theirs)
        )
    # For the reader: both tables, in that order; nothing in iptables.
    ruleset = nft_ruleset(lab, "n1")
    assert re.findall(r"^table .*$", ruleset, re.MULTILINE) == [
        "table ip flannel-ipv4 {",
        "table ip6 flannel-ipv6 {",
    ]
    assert "FLANNEL" not in iptables_save(lab, "n1") + iptables_save(lab, "n3")


def test_deleted_rule_chain_and_table_are_back_at_the_next_tick(lab: Lab) -> None:
    ns = lab.node("n1").namespace
    reference = normalized(lab, "n3", nft_table(lab, "n3", "ip", "flannel-ipv4"))
    whole = nft_table(lab, "n1", "ip", "flannel-ipv4")
    assert normalized(lab, "n1", whole) == reference

    def restored() -> bool:
        listed = in_ns(ns, ["nft", "list", "table", "ip", "flannel-ipv4"], check=False)
        return listed == whole

    handles = in_ns(ns, ["nft", "-a", "list", "chain", "ip", "flannel-ipv4", "postrtg"])
    handle = next(
        line.rsplit("# handle ", 1)[1] for line in handles.splitlines() if "masquerade" in line
    )
    damage = [
        ["delete", "rule", "ip", "flannel-ipv4", "postrtg", "handle", handle],
        ["delete", "chain", "ip", "flannel-ipv4", "forward"],
        ["delete", "table", "ip", "flannel-ipv4"],
    ]
    node = lab.node("n1")
    for argv in damage:
        in_ns(ns, ["nft", *argv])  # raises unless nft did it
        if restored():
            continue  # a tick that began between the damage and this look put it back already
        # The first resync the agent begins after the damage puts it back: wait for it by
        # the agent's count, not by the clock (a loaded machine delays a tick, not a count).
        mark = processed_mark(node, FIREWALL_RESYNCS)
        wait_until_processed(node, FIREWALL_RESYNCS, after=mark, timeout=6 * TICK)
        assert restored(), argv
    assert "table ip6 flannel-ipv6" in nft_ruleset(lab, "n1")
    # Pods still reach across both kinds after the rebuilds.
    a, b = _pod_on(lab, "n1"), _pod_on(lab, "n3")
    assert source_seen(b.namespace, a.namespace, str(b.ip)) == str(a.ip)
