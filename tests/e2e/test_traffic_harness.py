"""The traffic harness (tests/support/traffic.py) on a 5-node vxlan lab with 2 pods per node.

It must count every lost echo and every broken stream, so it is checked against
faults whose size is known: ICMP dropped at random in one node's FORWARD hook
(this kernel has no netem), whose iptables counter says exactly how many packets
died, and a TCP stream blackholed for longer than its timeout.

The drops go into the mangle table, where no firewall rule of the agent's can
sit before them and accept the packet first.

An echo crosses the lossy node's FORWARD hook once as a request and once as a
reply when exactly one end lives on that node (it is routed there), and also
when both do if the node bridges through iptables (bridge-nf-call-iptables=1,
read from the node). Every lost echo is one dropped packet, either way.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from flannelpy_lab import Lab
from flannelpy_lab.state import PodInfo

from tests.support.lab_util import running_lab
from tests.support.traffic import TCP_PORT, PodTraffic, TrafficError, TrafficReport

pytestmark = [
    pytest.mark.lab,
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to build the netns lab"),
]

NODES = 5
PODS_PER_NODE = 2
RATE = 20.0  # echoes per second per ordered pair
STREAM_RATE = 50.0
STEADY_S = 10.0
LOSSY_NODE = "n3"
DROP_PROBABILITY = 0.3
FAULT_S = 4.0
STREAM_TIMEOUT = 2.0  # < FAULT_S: the blackholed stream must break


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with running_lab(NODES, "vxlan", pods_per_node=PODS_PER_NODE) as lab:
        yield lab


@contextmanager
def mangle_rule(lab: Lab, node: str, spec: list[str]) -> Iterator[None]:
    """``spec`` at the top of mangle FORWARD in ``node``, removed on exit whatever happens."""
    lab.exec(node, ["iptables", "-t", "mangle", "-I", "FORWARD", *spec])
    try:
        yield
    finally:
        lab.exec(node, ["iptables", "-t", "mangle", "-D", "FORWARD", *spec], check=False)


@contextmanager
def icmp_loss(lab: Lab, node: str, probability: float) -> Iterator[list[int]]:
    """Random ICMP loss in ``node``'s FORWARD hook while inside. On exit an ACCEPT
    above the DROP ends the loss at once, so the DROP's counter, appended to the
    yielded list, is final when read; then both rules go."""
    drop = [
        "-p",
        "icmp",
        "-m",
        "statistic",
        "--mode",
        "random",
        "--probability",
        str(probability),
        "-j",
        "DROP",
    ]
    freeze = ["-p", "icmp", "-j", "ACCEPT"]
    dropped: list[int] = []
    lab.exec(node, ["iptables", "-t", "mangle", "-I", "FORWARD", *drop])
    try:
        yield dropped
    finally:
        lab.exec(node, ["iptables", "-t", "mangle", "-I", "FORWARD", *freeze], check=False)
        try:
            dropped.append(dropped_packets(lab, node, "--probability"))
        finally:
            for spec in (drop, freeze):
                lab.exec(node, ["iptables", "-t", "mangle", "-D", "FORWARD", *spec], check=False)


def dropped_packets(lab: Lab, node: str, match: str) -> int:
    """The packet counter of the mangle FORWARD rule whose text contains ``match``."""
    saved = lab.exec(node, ["iptables-save", "-c", "-t", "mangle"]).stdout
    counts = [
        int(m[1])
        for line in saved.splitlines()
        if match in line and (m := re.match(r"\[(\d+):\d+\] -A FORWARD ", line))
    ]
    assert len(counts) == 1, saved
    return counts[0]


def assert_consistent(report: TrafficReport) -> None:
    """Invariants of every report: each echo answered or lost, at the rate asked."""
    assert len(report.pairs) == NODES * PODS_PER_NODE * (NODES * PODS_PER_NODE - 1)
    for p in report.pairs:
        assert p.sent == p.received + p.lost, p
        assert p.duplicates == 0 and p.send_errors == 0, p
        assert p.measured_s >= report.measured_s - 0.2, p  # the probe counted throughout
        assert p.sent >= RATE * p.measured_s - 1, f"{p.src}->{p.dst} sent {p.rate:.2f}/s"


def test_steady_state_every_echo_answered_and_no_stream_broken(lab: Lab) -> None:
    with PodTraffic(lab, rate=RATE, streams=3, stream_rate=STREAM_RATE) as traffic:
        time.sleep(STEADY_S)
        report = traffic.stop()
    print(report.summary())
    assert traffic.alive() == []

    assert report.measured_s >= STEADY_S
    assert_consistent(report)
    assert report.lost == 0 and report.lost_pairs == [], report.summary()
    assert report.received == report.sent >= 90 * RATE * STEADY_S - 90
    assert len(report.streams) == 3 and report.broken_streams == [], report.summary()
    assert {(s.client[:2], s.server[:2]) for s in report.streams} == {
        ("n1", "n2"),
        ("n2", "n3"),
        ("n3", "n4"),
    }
    for s in report.streams:
        assert s.echoed == s.sent >= STREAM_RATE * report.measured_s - 1, s
        assert s.error is None


def test_losses_counted_on_exactly_the_pairs_through_the_lossy_node_and_a_blackholed_stream_breaks(
    lab: Lab,
) -> None:
    bridged = lab.exec(LOSSY_NODE, ["cat", "/proc/sys/net/bridge/bridge-nf-call-iptables"])
    same_node_too = bridged.stdout.strip() == "1"

    def through_lossy_node(a: PodInfo, b: PodInfo) -> bool:
        ends = (a.node == LOSSY_NODE) + (b.node == LOSSY_NODE)
        return ends == 1 or (ends == 2 and same_node_too)

    expected = {
        (a.name, b.name)
        for a in lab.pods
        for b in lab.pods
        if a.name != b.name and through_lossy_node(a, b)
    }
    # 2 pods there x 8 elsewhere, both directions; plus the 2 pairs on the node if bridged.
    assert len(expected) == 2 * 8 * 2 + (2 if same_node_too else 0)

    victim = (lab.pod("n1-p1"), lab.pod("n2-p1"))  # blackholed at its client's node n1
    streams = [("n1-p1", "n2-p1"), ("n2-p2", "n3-p2"), ("n3-p2", "n4-p2")]
    blackhole = [
        "-p",
        "tcp",
        "-s",
        str(victim[0].ip),
        "-d",
        str(victim[1].ip),
        "--dport",
        str(TCP_PORT),
        "-j",
        "DROP",
    ]
    with PodTraffic(
        lab, rate=RATE, streams=streams, stream_rate=STREAM_RATE, stream_timeout=STREAM_TIMEOUT
    ) as traffic:
        with (
            icmp_loss(lab, LOSSY_NODE, DROP_PROBABILITY) as dropped,
            mangle_rule(lab, "n1", blackhole),
        ):
            time.sleep(FAULT_S)
        time.sleep(1.0)
        report = traffic.stop()
    print(report.summary())
    assert traffic.alive() == []

    assert_consistent(report)
    assert set(report.lost_pairs) == expected, report.summary()
    # Every dropped packet is one lost echo (a dropped request gets no reply), and
    # the rule was in place only while counting: the counts must agree exactly.
    assert dropped[0] > 0 and report.lost == dropped[0], (dropped, report.summary())
    # About half the echoes through the node die while the rule is in (0.3 each way).
    window_echoes = len(expected) * RATE * FAULT_S
    assert 0.3 * window_echoes < report.lost < 0.7 * window_echoes, report.summary()

    broken = report.broken_streams
    assert [(s.client, s.server) for s in broken] == [("n1-p1", "n2-p1")], report.summary()
    assert broken[0].error is not None and "no echo of seq" in broken[0].error
    assert broken[0].max_stall_ms >= STREAM_TIMEOUT * 1000
    for s in report.streams[1:]:  # through the lossy node, but ICMP loss spares TCP
        assert not s.broken and s.echoed == s.sent >= STREAM_RATE * report.measured_s - 1, s


def test_a_pair_that_never_answers_fails_the_warm_up_naming_it_and_leaves_no_probe(
    lab: Lab,
) -> None:
    silent = lab.pod("n4-p2")
    traffic = PodTraffic(lab, streams=1, warmup_timeout=3.0)
    rule = ["-p", "icmp", "-d", str(silent.ip), "-j", "DROP"]
    with mangle_rule(lab, "n4", rule), pytest.raises(TrafficError) as failed:
        traffic.start()
    assert "n1-p1 has no reply from n4-p2" in str(failed.value), failed.value
    assert traffic.alive() == []

    # An exception inside the block kills every probe too.
    with pytest.raises(ValueError, match="the test failed"), PodTraffic(lab, streams=1) as running:
        assert len(running.alive()) == NODES * PODS_PER_NODE + 2
        raise ValueError("the test failed")
    assert running.alive() == []
