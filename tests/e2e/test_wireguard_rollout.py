"""Issue 16's rollout on real agents: vxlan -> wireguard -> vxlan on 5 nodes under traffic.

Every ordered pair of pods echoes at 20/s the whole time, and not one echo is lost. After
the rollout to wireguard no pair is reached without encryption (the metric and the doctor
say 0, and a capture on the underlay switch sees no VXLAN between the nodes); after the
rollout back no wireguard-go runs and no node has a WireGuard device.

What makes it lossless (make before break, each side of each pair):
- to wireguard, a pair moves from vxlan to wireguard only once the node's device has
  completed a handshake with the peer (before, the peer may not know its key yet); both
  keep their VTEPs until then, and the last node to switch keeps its VTEP a few seconds
  after it stops needing it, for peers still encapsulating to it;
- back to vxlan, a node keeps its WireGuard device and key while a peer still runs
  wireguard (that peer may have no VTEP any more), and keeps nodes that just switched
  away as receive-only peers, since they send to it encrypted until they see its lease;
- the reconciler adds a pair's new route before it deletes the old one.

This kernel has no WireGuard module: every node runs wireguard-go. The dual-stack run
(``test_wireguard_rollout_dual.py``) goes through :func:`roll_to_wireguard_and_back` too.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from flannelpy_lab import Lab, plan

from tests.support.lab_util import lab_run_argv, running_lab, wait_until
from tests.support.traffic import PodTraffic, TrafficReport
from tests.support.underlay_capture import underlay_capture

# alone: every echo is counted through wireguard-go, userspace crypto on the machine's
# cores. Beside three other lab modules (load average near 20) a switch back lost 23
# echoes within 100 ms once, on one node's pairs; the README's rollout figures show one
# run of 17 with losses on a quieter machine too, cause not found yet.
pytestmark = [
    pytest.mark.lab,
    pytest.mark.netns,
    pytest.mark.alone,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to build the netns lab"),
]

REPO = Path(__file__).resolve().parents[2]
NODES = 5
PODS_PER_NODE = 2
NAMES = tuple(f"n{i}" for i in range(1, NODES + 1))
RATE = 20.0
VXLAN_PORT = 8472
WG_DEVICES = ("flannel-wg", "flannel-wg-v6")
CLI_TIMEOUT = 300.0


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with running_lab(NODES, "vxlan", start_agents=False) as lab:
        lab.set_agent_args(["--probe-interval", "1", "--status-publish-interval", "2"])
        lab.start_agents()
        for node in NAMES:
            for _ in range(PODS_PER_NODE):
                lab.add_pod(node)
        yield lab


def flannelpy(lab: Lab, *args: str, node: str | None = None) -> subprocess.CompletedProcess[str]:
    argv = lab_run_argv(lab.name, *args, node=node) if node else lab_run_argv(lab.name, *args)
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=CLI_TIMEOUT)


def rollout(lab: Lab, backend: str) -> float:
    began = time.monotonic()
    proc = flannelpy(lab, "rollout", "start", "--backend", backend)
    took = time.monotonic() - began
    print(f"--- rollout to {backend}: {took:.1f} s\n{proc.stdout}{proc.stderr}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    nodes = len(lab.nodes)
    assert f" done: {nodes} of {nodes} nodes switched to {backend} " in proc.stdout
    return took


def metric(lab: Lab, node: str, name: str) -> float | None:
    out = lab.exec(
        node,
        [
            "python3",
            "-c",
            "import urllib.request as u;print(u.urlopen("
            "'http://127.0.0.1:9403/metrics',timeout=5).read().decode())",
        ],
    )
    for line in out.stdout.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return None


def wg_devices(lab: Lab, node: str) -> list[str]:
    """The node's WireGuard devices (both families')."""
    out = lab.exec(node, ["ip", "-j", "link", "show"]).stdout
    return sorted(
        link["ifname"]
        for link in json.loads(out or "[]")
        if link["ifname"].startswith("flannel-wg")
    )


def wireguard_go_pids(lab: Lab) -> list[int]:
    """wireguard-go processes of this lab's nodes (their pid files, or still running)."""
    pids = []
    for node, device in ((n, d) for n in lab.nodes for d in WG_DEVICES):
        path = os.path.join(node.node_dir, "run", "wireguard", f"{device}.pid")
        try:
            with open(path) as f:
                pid = int(f.read())
        except (FileNotFoundError, ValueError):
            continue
        if os.path.exists(f"/proc/{pid}"):
            pids.append(pid)
    return pids


def udp_flows(pcap: str, port: int) -> str:
    """tcpdump's lines for the capture's UDP packets from or to ``port``."""
    return subprocess.run(
        ["tcpdump", "-nn", "-r", pcap, "udp", "port", str(port)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def vxlan_between_nodes(lab: Lab, pcap: str) -> list[str]:
    flows = udp_flows(pcap, VXLAN_PORT)
    node_ips = {str(n.ip) for n in lab.nodes} | {plan.ipv6_underlay_ip(n) for n in lab.nodes}
    found = []
    for line in flows.splitlines():
        fields = line.split()
        if len(fields) > 4 and fields[2].rsplit(".", 1)[0] in node_ips:
            found.append(line)
    return found


def longest_gap_ms(report: TrafficReport) -> float:
    """The longest run of consecutive lost echoes of any pair, in milliseconds."""
    longest = 0
    for p in report.pairs:
        run, last = 0, None
        for seq in p.lost_seqs:
            run = run + 1 if last is not None and seq == last + 1 else 1
            longest = max(longest, run)
            last = seq
    return longest * 1000.0 / report.rate


def lost_by_phase(report: TrafficReport, spans: list[tuple[str, float, float]]) -> dict[str, int]:
    """Lost echoes by when they were sent (sequence over rate, less the warm-up)."""
    counts: dict[str, int] = {}
    for p in report.pairs:
        for seq in p.lost_seqs:
            at = seq / report.rate - report.warmup_s
            phase = next((name for name, a, b in spans if a - 0.5 <= at <= b + 0.5), "between")
            counts[phase] = counts.get(phase, 0) + 1
    return counts


def lost_echoes(report: TrafficReport) -> list[str]:
    """Each lost echo as 'at s src->dst', by time: to match against the rollout's log."""
    found = sorted(
        (seq / report.rate - report.warmup_s, p.src, p.dst, ":" in p.dst_ip)
        for p in report.pairs
        for seq in p.lost_seqs
    )
    return [f"{at:.2f} s {src}->{dst}{' (IPv6)' * v6}" for at, src, dst, v6 in found]


def test_vxlan_to_wireguard_and_back_under_traffic(lab: Lab, tmp_path: Path) -> None:
    roll_to_wireguard_and_back(lab, tmp_path)


def roll_to_wireguard_and_back(lab: Lab, tmp_path: Path, ipv6: bool = False) -> None:
    """vxlan -> wireguard -> vxlan with every pod pair echoing (``ipv6``: in both
    families, a dual-stack lab), not one echo lost, no VXLAN between the nodes while
    they all run wireguard, no WireGuard device or wireguard-go left after."""
    names = [node.name for node in lab.nodes]
    seg = lab.state.segments[0]
    pcap = str(tmp_path / "wireguard-phase.pcap")
    spans: list[tuple[str, float, float]] = []
    with PodTraffic(lab, rate=RATE, streams=0, ipv6=ipv6) as traffic:
        t0 = time.monotonic()
        to_wg = rollout(lab, "wireguard")
        spans.append(("to wireguard", time.monotonic() - t0 - to_wg, time.monotonic() - t0))
        for node in names:
            wait_until(
                lambda node=node: (
                    metric(  # type: ignore[misc]
                        lab, node, "flannelpy_wireguard_unencrypted_peers"
                    )
                    == 0.0
                ),
                20,
                what=f"{node} to reach every peer encrypted",
            )
            # Each pair went through the tunnel only after its handshake, which the
            # device reported to the agent (make before break, to wireguard).
            handshakes = metric(lab, node, 'flannelpy_agent_events_total{kind="handshake"}')
            assert handshakes is not None and handshakes >= 1, (node, handshakes)
        doctor = flannelpy(lab, "doctor", node="n3")
        assert f"with all {len(names) - 1} peer(s) as the leases say" in doctor.stdout, (
            doctor.stdout
        )
        assert "without encryption" not in doctor.stdout, doctor.stdout
        with underlay_capture(seg.switch_namespace, pcap, ["udp"]):
            time.sleep(3.0)  # pods keep echoing through the tunnels meanwhile
        back = rollout(lab, "vxlan")
        spans.append(("to vxlan", time.monotonic() - t0 - back, time.monotonic() - t0))
        wait_until(lambda: wireguard_go_pids(lab) == [], 20, what="every wireguard-go to end")
        report = traffic.stop()
    print(report.summary())
    print(
        f"rollouts: wireguard {to_wg:.1f} s, vxlan {back:.1f} s; "
        f"longest gap {longest_gap_ms(report):.0f} ms"
    )
    for port in (51820, 51821) if ipv6 else (51820,):
        assert udp_flows(pcap, port).strip(), f"the capture saw no WireGuard traffic on {port}"
    assert vxlan_between_nodes(lab, pcap) == []
    for node in names:
        assert wg_devices(lab, node) == [], node
    pods = len(lab.pods)
    assert len(report.pairs) == pods * (pods - 1) * (2 if ipv6 else 1)
    for p in report.pairs:
        assert p.sent == p.received + p.lost and p.send_errors == 0, p
    assert report.sent > 0
    print(f"lost {report.lost} of {report.sent}; by phase {lost_by_phase(report, spans)}")
    print(f"phases (s from the start): {spans}; lost echoes: {lost_echoes(report)[:60]}")
    assert report.lost == 0, (
        f"{report.lost} echoes lost, by phase {lost_by_phase(report, spans)} (phases {spans}):"
        f" {lost_echoes(report)[:60]}"
    )
