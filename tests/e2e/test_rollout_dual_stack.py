"""Issue 31: a rollout verified in both families, on a 3-node dual-stack vxlan lab.

A dual-stack node's status record lists its IPv4 and its IPv6 subnet, and the prober
probes each; a step is verified only when the probes of both families pass. One test
rolls the lab to host-gw cleanly; in the other, n2's underlay drops unencapsulated IPv6
pod traffic towards n3 (IPv4 and the encapsulated IPv6 pass), so n2's step fails its
verification in IPv6 alone: n2 is rolled back and the rollout stops. The cluster
fixture and its clean-up are ``test_rollout_lab``'s.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from ipaddress import ip_network

import pytest
from flannelpy_lab import Lab, plan

# pytestmark: the IPv4 module's marks (a lab, network namespaces, root).
from tests.e2e.test_rollout_lab import (
    AGENT_ARGS,
    Cluster,
    cluster,
    flannelpy,
    output,
    pytestmark,
    summary_line,
)
from tests.support.lab_util import running_dual_stack_lab, wait_until

__all__ = ["cluster", "pytestmark"]
NODES = 3


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    # A pod per node: as the IPv4 module's lab.
    with running_dual_stack_lab(NODES, AGENT_ARGS, 1, name=f"d{secrets.randbelow(100_000)}") as lab:
        yield lab


def subnet6(c: Cluster, node: str) -> str:
    """The node's IPv6 subnet, as its status record lists it beside the IPv4 one."""
    subnets = c.statuses()[node].subnets
    assert sorted(ip_network(s).version for s in subnets) == [4, 6], subnets
    return next(s for s in subnets if ip_network(s).version == 6)


def test_a_clean_dual_stack_rollout_is_verified_in_both_families(cluster: Cluster) -> None:
    proc = flannelpy(cluster.lab, "rollout", "start", "--backend", "host-gw")
    print(proc.stdout)
    assert proc.returncode == 0, output(proc)
    assert f" done: {NODES} of {NODES} nodes switched to host-gw " in summary_line(proc.stdout)
    for node, status in cluster.statuses().items():
        # Each peer probed in both families, none failing.
        assert (status.probes.peers, status.probes.failing) == (2 * (NODES - 1), 0), node
        assert subnet6(cluster, node)


def test_a_node_failing_only_in_ipv6_is_rolled_back_and_stops_the_rollout(
    cluster: Cluster,
) -> None:
    lab = cluster.lab
    ipv6_network = plan.ip_family_net_conf("dual")["IPv6Network"]
    rule = ["-o", "eth0", "-s", ipv6_network, "-d", subnet6(cluster, "n3"), "-j", "DROP"]
    try:
        lab.exec("n2", ["ip6tables", "-t", "mangle", "-A", "POSTROUTING", *rule])
        # Nothing is lost while n2 encapsulates (once the previous test's config change,
        # which every node applied at once, has settled).
        wait_until(lambda: bool(lab.status()["ok"]), 30, what="every pair reaching")
        proc = flannelpy(lab, "rollout", "start", "--backend", "host-gw", "--step-timeout", "15")
        print(proc.stdout)
        assert proc.returncode == 1, output(proc)
        record = cluster.record()
        assert (record.state, [e.state for e in record.nodes]) == (
            "failed",
            ["done", "rolled-back", "pending"],
        ), record
        reason = record.reason or ""
        assert reason.startswith("n2 failed verification"), reason
        assert "(IPv6)" in reason, reason  # the probes that failed are IPv6's
        assert cluster.backends() == {"n1": "host-gw", "n2": "vxlan", "n3": "vxlan"}
        assert cluster.lease_types()["n2"] == "vxlan"
    finally:
        lab.exec("n2", ["ip6tables", "-t", "mangle", "-D", "POSTROUTING", *rule], check=False)
