"""The node status record: a fixed-size probe summary, an older agent's record still
read, and a rollout's verification from the summaries alone."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from flannelpy.config.netconf import BackendConfig
from flannelpy.control.records import (
    BackendSummary,
    NodeStatus,
    PeerProbe,
    ProbeSummary,
)
from flannelpy.rollout.steps import verification_failures

GOOD = PeerProbe(True, True, True, 9, 200.0)
DOWN = PeerProbe(False, None, False, 9, 200.0)


def subnet(i: int) -> str:
    return f"10.{i // 256}.{i % 256}.0/24"


def status(
    node: str,
    own: str,
    probes: dict[str, PeerProbe],
    applied_at: float = 10.0,
    generation: int | None = None,
) -> NodeStatus:
    return NodeStatus(
        node,
        300.0,
        True,
        "100.64.0.2",
        ("100.64.0.0/24",),
        BackendSummary("host-gw", 1, 8472, False, 1500),
        False,
        generation,
        applied_at,
        subnets=(own,),
        probes=ProbeSummary.of(probes),
    )


@pytest.mark.parametrize("peers", [1, 100, 1000, 10_000])
def test_the_record_size_does_not_grow_with_the_peers(peers: int) -> None:
    probes = {subnet(i): DOWN if i % 2 else GOOD for i in range(peers)}
    record = status("n1", "10.250.0.0/24", probes).to_json()
    assert len(record) < 2048, len(record)
    back = NodeStatus.from_json(record).probes
    assert (back.peers, back.failing) == (peers, peers // 2)
    assert len(back.failing_peers) == min(5, peers // 2)


def test_one_lost_echo_is_not_a_failing_peer_and_keeps_the_last_pass() -> None:
    lossy = PeerProbe(True, True, False, 10, 205.0, passed_at=200.0)
    summary = ProbeSummary.of({"a": GOOD, "b": lossy})
    assert (summary.failing, summary.ok, summary.passed_at) == (0, 1, 200.0)
    mtu = PeerProbe(True, False, False, 10, 205.0, passed_at=150.0)
    summary = ProbeSummary.of({"a": GOOD, "b": mtu})
    assert summary.failing_peers[0].problem == "mtu" and summary.passed_at == 200.0
    never = PeerProbe(True, None, True, 1, 205.0)  # no full-MTU answer yet: no pass
    assert ProbeSummary.of({"a": GOOD, "b": never}).passed_at is None


def test_an_older_agents_per_peer_record_is_summarised() -> None:
    doc = json.loads(status("n1", "10.250.0.0/24", {}).to_json())
    del doc["ProbeSummary"]
    doc["Probes"] = {
        "10.0.1.0/24": {"Reachable": True, "MtuOk": True, "Ok": True, "Probes": 3, "At": 150.5},
        "10.0.2.0/24": {"Reachable": False, "MtuOk": None, "Ok": False, "Probes": 3, "At": 151},
    }
    summary = NodeStatus.from_json(json.dumps(doc)).probes
    assert (summary.peers, summary.failing, summary.passed_at) == (2, 1, 150.5)
    doc["ProbeSummary"] = {"Peers": -1}
    with pytest.raises(ValueError, match="mangles"):
        NodeStatus.from_json(json.dumps(doc))


def test_verification_reads_the_summaries_of_the_node_and_every_peer() -> None:
    target = BackendConfig(type="host-gw")
    subnets = {"n1": subnet(1), "n2": subnet(2), "n3": subnet(3)}

    def cluster(**probes: dict[str, PeerProbe]) -> dict[str, NodeStatus]:
        return {
            n: status(
                n,
                subnets[n],
                probes.get(n) or {subnets[p]: GOOD for p in subnets if p != n},
                generation=1 if n == "n1" else None,
            )
            for n in subnets
        }

    assert verification_failures("n1", 1, 100.0, target, cluster()) == []
    # A link between two other nodes does not hold n1 back...
    assert (
        verification_failures(
            "n1", 1, 100.0, target, cluster(n2={subnets["n1"]: GOOD, subnets["n3"]: DOWN})
        )
        == []
    )
    # ...but a peer that cannot reach n1 does, and so does a round before the change.
    assert verification_failures(
        "n1", 1, 100.0, target, cluster(n3={subnets["n1"]: DOWN, subnets["n2"]: GOOD})
    ) == ["n3 -> n1: unreachable"]
    stale = PeerProbe(True, True, True, 2, 99.0)
    assert verification_failures(
        "n1", 1, 100.0, target, cluster(n1={subnets["n2"]: GOOD, subnets["n3"]: stale})
    ) == ["n1 -> its peers: no probe round since the change"]
    assert verification_failures("n1", 1, 100.0, target, cluster(n1={subnets["n2"]: GOOD})) == [
        "n1 -> its peers: probe results for 1 of 2 peer subnets"
    ]


def test_a_failing_peer_without_a_record_is_not_the_rollouts_to_verify() -> None:
    target = BackendConfig(type="host-gw")
    flanneld = subnet(9)  # a flanneld node: leases, no status record
    sts = {
        "n1": status("n1", subnet(1), {subnet(2): GOOD, flanneld: DOWN}, generation=1),
        "n2": status("n2", subnet(2), {subnet(1): GOOD, flanneld: DOWN}),
    }
    assert verification_failures("n1", 1, 100.0, target, sts) == []
    many = {subnet(2): GOOD, **{subnet(10 + i): DOWN for i in range(6)}}
    sts["n1"] = status("n1", subnet(1), many, generation=1)
    assert verification_failures("n1", 1, 100.0, target, sts) == ["n1 reports 6 failing peers"]


def test_a_dual_stack_step_is_verified_only_when_both_families_pass() -> None:
    target = BackendConfig(type="host-gw")
    subnets = {n: (subnet(i), f"fc00:0:0:{i:x}::/64") for i, n in enumerate(("n1", "n2", "n3"))}

    def cluster(fault: tuple[str, str] | None = None) -> dict[str, NodeStatus]:
        """Every node probing both families of every peer; ``fault``: (prober, peer)
        whose IPv6 side is unreachable."""
        sts = {}
        for n, own in subnets.items():
            probes = {
                net: DOWN if (n, p) == fault and ":" in net else GOOD
                for p, nets in subnets.items()
                if p != n
                for net in nets
            }
            sts[n] = replace(status(n, own[0], probes, generation=1), subnets=own)
        return sts

    assert verification_failures("n1", 1, 100.0, target, cluster()) == []
    # IPv4 passes everywhere: the IPv6 side alone holds the step back, and is named.
    assert verification_failures("n1", 1, 100.0, target, cluster(("n3", "n1"))) == [
        "n3 -> n1 (IPv6): unreachable"
    ]
    assert verification_failures("n1", 1, 100.0, target, cluster(("n1", "n2"))) == [
        "n1 -> n2 (IPv6): unreachable"
    ]
    # A node whose prober has not probed the peers' IPv6 sides is not verified yet.
    only_v4 = cluster()
    only_v4["n2"] = replace(
        only_v4["n2"], probes=ProbeSummary.of({subnets["n1"][0]: GOOD, subnets["n3"][0]: GOOD})
    )
    assert verification_failures("n1", 1, 100.0, target, only_v4) == [
        "n2 -> n1: probe results for 2 of 4 peer subnets"
    ]
