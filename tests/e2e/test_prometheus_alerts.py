"""Issue 18's "Must show" on one 3-node vxlan lab scraped by a real Prometheus.

The lab runs Debian's ``prometheus`` on the host's lab address (``up --prometheus``),
scraping each agent on its node's lab address every 2 s, with the rules of
manifests/prometheusrule.yaml loaded as a plain rules file: the same expressions with
every ``for:`` cut to at most 10 s and every range window to 30 s
(``flannelpy_lab.prometheus``), so an alert fires and resolves within a minute.

Faults are real and run several at a time, each on its own node or pair, since every
alert names its node: UDP 8472 dropped between n1 and n3, a policy route with a
1400-byte MTU on n1 with a pod sending full-size DF packets, n2's /28 filled with pods,
a disruptive config change under DisruptionPolicy Block; then random loss on n2's
underlay with a TCP stream between two pods, and etcd stopped; then a 1400-byte
underlay on n2.

Rules the lab does not make fire, and why, are listed in ``NOT_FIRED``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from flannelpy_lab import Lab
from flannelpy_lab import prometheus as prom
from flannelpy_lab.state import PodInfo

from flannelpy.observe.metric_families import FAMILIES
from tests.support.lab_util import running_lab, wait_until

pytestmark = [
    pytest.mark.lab,
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to build the netns lab"),
]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SUBNET_LEN = 28  # 13 pod addresses per node: IPAM exhaustion takes 12 pods
NETWORK = "10.244.0.0/16"
PREFIX = "/coreos.com/network"
OVERLAY_MTU = 1450

# Rules the lab cannot make fire, with the reason (each is still loaded and evaluated).
NOT_FIRED = {
    "FlannelpyDroppedPacketsRising": "link drops need a saturated or faulty link; iptables "
    "and veth MTU drops are counted by no managed interface (the kernel drop reasons are, "
    "see FlannelpyKernelDropsRising)",
    "FlannelpyInterfaceErrorsRising": "veth and vxlan devices report no rx/tx errors for any "
    "fault that can be injected from user space",
    "FlannelpyReconcilerFailing": "needs a kernel refusing the agent's netlink requests",
    "FlannelpyReconcilerStalled": "needs 10 minutes without a converged pass",
    "FlannelpyLeaseExpiringSoon": "leases last 24 h and are renewed an hour before expiry",
    "FlannelpyLeaseExpiryImminent": "leases last 24 h and are renewed an hour before expiry",
    "FlannelpyLeaseRenewalsFailing": "a renewal is due only an hour before expiry",
    "FlannelpyAddressPoolHalfUsed": "a 10.244.0.0/16 pool is 3 /28 leases out of 4096",
    "FlannelpyPolicyDenialsRising": "NetworkPolicy needs Kubernetes mode; this lab runs etcd "
    "mode (promtool's rule tests show it firing)",
}


# --- reading Prometheus ------------------------------------------------------------------


def manifest_alerts() -> list[str]:
    with open(os.path.join(ROOT, "manifests", "prometheusrule.yaml"), encoding="utf-8") as f:
        doc = yaml.safe_load(f)
    return [r["alert"] for g in doc["spec"]["groups"] for r in g["rules"]]


def firing(lab: Lab) -> set[tuple[str, str]]:
    """(alertname, node) of every firing alert."""
    return {
        (a["labels"]["alertname"], a["labels"].get("node", ""))
        for a in prom.alerts(lab.state)
        if a["state"] == "firing"
    }


def value(lab: Lab, expr: str) -> float:
    result = prom.query(lab.state, expr)
    assert len(result) == 1, f"{expr}: {result}"
    return float(result[0]["value"][1])


class AlertClock:
    """When each awaited alert started firing and stopped, measured from its fault."""

    def __init__(self, lab: Lab) -> None:
        self.lab = lab
        self.fired: dict[tuple[str, str], float] = {}
        self.resolved: dict[tuple[str, str], float] = {}

    def wait_firing(self, wanted: dict[tuple[str, str], float], timeout: float) -> None:
        """``wanted``: (alert, node) -> when its fault was made (monotonic)."""

        def all_fired() -> bool:
            now, on = time.monotonic(), firing(self.lab)
            for key, since in wanted.items():
                if key in on and key not in self.fired:
                    self.fired[key] = now - since
            return all(k in self.fired for k in wanted)

        try:
            wait_until(all_fired, timeout=timeout, interval=1.0, what="alerts firing")
        except AssertionError as e:
            raise AssertionError(
                f"{e}: still not firing {sorted(set(wanted) - set(self.fired))}; {self.state()}"
            ) from None

    def wait_resolved(self, wanted: dict[tuple[str, str], float], timeout: float) -> None:
        def all_gone() -> bool:
            now, on = time.monotonic(), firing(self.lab)
            for key, since in wanted.items():
                if key not in on and key not in self.resolved:
                    self.resolved[key] = now - since
            return all(k in self.resolved for k in wanted)

        try:
            wait_until(all_gone, timeout=timeout, interval=1.0, what="alerts resolved")
        except AssertionError as e:
            raise AssertionError(
                f"{e}: still firing {sorted(set(wanted) - set(self.resolved))}; {self.state()}"
            ) from None

    def state(self) -> str:
        """What Prometheus shows now: alerts by state, targets up."""
        alerts = sorted(
            (a["state"], a["labels"]["alertname"], a["labels"].get("node", ""))
            for a in prom.alerts(self.lab.state)
        )
        return f"alerts {alerts}, targets up {prom.targets_up(self.lab.state)}"

    def report(self) -> str:
        return "; ".join(
            f"{a}@{n}: fired {self.fired[(a, n)]:.0f} s after the fault, resolved "
            f"{self.resolved.get((a, n), float('nan')):.0f} s after its removal"
            for a, n in sorted(self.fired)
        )


# --- the lab ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with running_lab(
        3,
        "vxlan",
        start_agents=False,
        with_prometheus=True,
        net_conf_extra={"SubnetLen": SUBNET_LEN},
    ) as lab:
        # Probes every second: unreachable after 3 s, a 20-round loss window of 20 s.
        lab.set_agent_args(["--probe-interval=1", "--status-publish-interval=2"])
        lab.start_agents()
        for node in ("n1", "n2", "n3"):
            lab.add_pod(node)
        wait_until(
            lambda: all(prom.targets_up(lab.state).get(n) for n in ("n1", "n2", "n3")),
            timeout=20,
            what="Prometheus scraping every agent",
        )
        yield lab


@pytest.fixture(scope="module")
def clock(lab: Lab) -> AlertClock:
    return AlertClock(lab)


def pod_on(lab: Lab, node: str) -> PodInfo:
    return next(p for p in lab.pods if p.node == node)


def in_pod(pod: PodInfo, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", pod.namespace, *argv]


def iptables(lab: Lab, node: str, op: str, rule: list[str]) -> None:
    lab.exec(node, ["iptables", "-w", op, *rule])


def write_config(lab: Lab, backend: str, policy: str | None, max_leases: int = 1) -> None:
    doc: dict[str, Any] = {
        "Network": NETWORK,
        "SubnetLen": SUBNET_LEN,
        "Backend": {"Type": backend},
        "MaxLeasesPerNode": max_leases,
    }
    if policy:
        doc["DisruptionPolicy"] = {"Mode": policy}
    subprocess.run(
        ["etcdctl", f"--endpoints={lab.etcd_endpoint}", "put", f"{PREFIX}/config", json.dumps(doc)],
        check=True,
        capture_output=True,
        timeout=20,
    )


# --- 1. every family is scraped ----------------------------------------------------------


def test_prometheus_scrapes_every_family_of_every_agent(lab: Lab) -> None:
    def metadata() -> dict[str, Any]:
        data: dict[str, Any] = prom.api(lab.state, "metadata")
        return data

    wait_until(
        lambda: set(FAMILIES) <= set(metadata()),
        timeout=20,
        what="every family in Prometheus's metadata",
    )
    meta = metadata()
    assert {n: meta[n][0]["type"] for n in FAMILIES} == dict(FAMILIES)
    for name in (
        "flannelpy_pod_tcp_sent_segments_total",
        "flannelpy_node_tcp_sent_segments_total",
        "flannelpy_kernel_drops_total",
    ):
        nodes = {r["metric"]["node"] for r in prom.query(lab.state, name)}
        assert nodes == {"n1", "n2", "n3"}, (name, nodes)
    n1_drops = prom.query(lab.state, 'flannelpy_kernel_drops_total{node="n1"}')
    reasons = {r["metric"]["reason"] for r in n1_drops}
    assert {"no_route", "frag_needed", "rp_filter", "conntrack_insert_failed"} <= reasons
    # The kernel shows unresolved_discards only in the initial namespace (where a
    # DaemonSet's agent runs); a lab node is another namespace, so the reason is absent.
    assert "neighbour_unresolved" not in reasons
    assert value(lab, 'flannelpy_pod_namespaces_counted{node="n1",readable="true"}') == 1


# --- 2. several faults at once -----------------------------------------------------------

# Five DF datagrams a second for at most 90 s, whatever path MTU the pod has learnt.
_DF_SENDER = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.IPPROTO_IP, 10, 3)  # IP_MTU_DISCOVER: IP_PMTUDISC_PROBE
for _ in range(450):
    s.sendto(b"x" * int(sys.argv[2]), (sys.argv[1], 9))
    time.sleep(0.2)
"""


def test_unreachable_peer_frag_needed_ipam_exhaustion_and_a_blocked_change_fire_and_resolve(
    lab: Lab, clock: AlertClock
) -> None:
    n1 = lab.node("n1")
    src, dst = pod_on(lab, "n1"), pod_on(lab, "n2")
    drop_vxlan = ["INPUT", "-s", str(n1.ip), "-p", "udp", "--dport", "8472", "-j", "DROP"]
    # A path of 1400 bytes from n1-p1 to n2-p1 (a policy route, so the agent's own routes
    # stay as they are); the pod sends full-size UDP datagrams with DF set, ignoring the
    # path MTU it learns (IP_PMTUDISC_PROBE; this ping has no -M probe).
    gateway = json.loads(lab.exec("n1", ["ip", "-j", "route", "get", str(dst.ip)]).stdout)[0]
    route = [
        "ip",
        "route",
        "add",
        f"{dst.ip}/32",
        "via",
        gateway["gateway"],
        "dev",
        gateway["dev"],
        "onlink",
        "mtu",
        "1400",
        "table",
        "77",
    ]
    rule = [
        "ip",
        "rule",
        "add",
        "from",
        str(src.ip),
        "to",
        str(dst.ip),
        "lookup",
        "77",
        "pref",
        "77",
    ]
    frag_before = value(
        lab, 'flannelpy_kernel_drops_total{node="n1",scope="node",reason="frag_needed"}'
    )
    extra_pods: list[str] = []
    pinger = None
    t0 = time.monotonic()
    try:
        iptables(lab, "n3", "-I", drop_vxlan)
        lab.exec("n1", route)
        lab.exec("n1", rule)
        pinger = subprocess.Popen(
            in_pod(src, [sys.executable, "-c", _DF_SENDER, str(dst.ip), str(OVERLAY_MTU - 28)])
        )
        write_config(lab, "vxlan", "Block")
        write_config(lab, "host-gw", "Block")
        usable = 2 ** (32 - SUBNET_LEN) - 3
        for _ in range(usable - 1):  # n2 has one pod already
            extra_pods.append(lab.add_pod("n2").name)
        full = time.monotonic()
        with pytest.raises(Exception, match=r"(?i)no free|exhaust|address"):
            lab.add_pod("n2")
        wanted = {
            ("FlannelpyPeerUnreachable", "n1"): t0,
            ("FlannelpyPeerUnreachable", "n3"): t0,
            ("FlannelpyKernelDropsRising", "n1"): t0,
            ("FlannelpyIPAMExhausted", "n2"): full,
            ("FlannelpyIPAMNearlyExhausted", "n2"): full,
            ("FlannelpyDisruptiveChangeBlocked", "n1"): t0,
            ("FlannelpyDisruptiveChangeBlocked", "n3"): t0,
            # A /28 with one lease allowed is short of addresses from the start.
            ("FlannelpyNodeAtLeaseLimit", "n1"): t0,
        }
        clock.wait_firing(wanted, timeout=60)
        # Must show: FragFails rose with DF packets over the lowered path MTU, and the
        # node answered each with an ICMP "fragmentation needed" (a destination unreachable).
        frag = value(
            lab, 'flannelpy_kernel_drops_total{node="n1",scope="node",reason="frag_needed"}'
        )
        assert frag - frag_before >= 20, (frag_before, frag)
        print(f"\nn1 frag_needed drops: {frag_before:.0f} -> {frag:.0f}")
        assert (
            value(
                lab,
                'rate(flannelpy_kernel_icmp_unreachable_sent_total{node="n1",scope="node"}[30s])',
            )
            >= 1
        )
    finally:
        removed = time.monotonic()
        if pinger is not None:
            pinger.kill()
            pinger.wait()
        iptables(lab, "n3", "-D", drop_vxlan)
        lab.exec("n1", ["ip", "rule", "del", "pref", "77"], check=False)
        lab.exec("n1", ["ip", "route", "flush", "table", "77"], check=False)
        # The applied backend again; a second lease allowed (the lease-limit alert's fix).
        write_config(lab, "vxlan", "Block", max_leases=2)
        for name in extra_pods:
            lab.delete_pod(name)
    # IPAM: released addresses cool down for 30 s before they count as free again.
    clock.wait_resolved(dict.fromkeys(wanted, removed), timeout=90)


# --- 3. loss, retransmissions and a store outage -----------------------------------------

_SINK = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5001)); s.listen(1)
c, _ = s.accept()
while c.recv(1 << 16):
    pass
"""
# About 4 MB/s in 32 KiB writes: a steady stream that leaves the CPU to the lab.
_SOURCE = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], 5001), timeout=10)
chunk = b"x" * 32768
while True:
    s.sendall(chunk)
    time.sleep(0.008)
"""


def pod_tcp(lab: Lab) -> tuple[float, float]:
    """n1's pods' (retransmitted, sent) TCP segments, as Prometheus last scraped them."""
    return (
        value(lab, 'flannelpy_pod_tcp_retransmitted_segments_total{node="n1"}'),
        value(lab, 'flannelpy_pod_tcp_sent_segments_total{node="n1"}'),
    )


def test_loss_raises_retransmissions_and_peer_loss_and_a_store_outage_fires(
    lab: Lab, clock: AlertClock
) -> None:
    src, dst = pod_on(lab, "n1"), pod_on(lab, "n2")
    eth = lab.node("n2").underlay_iface
    loss = [
        "INPUT",
        "-i",
        eth,
        "-p",
        "udp",
        "--dport",
        "8472",
        "-m",
        "statistic",
        "--mode",
        "random",
        "--probability",
        "0.2",
        "-j",
        "DROP",
    ]
    sink = subprocess.Popen(in_pod(dst, [sys.executable, "-c", _SINK]))
    source = None
    window = 16.0
    try:
        time.sleep(0.5)
        source = subprocess.Popen(in_pod(src, [sys.executable, "-c", _SOURCE, str(dst.ip)]))
        time.sleep(4)  # two scrapes into the stream
        r0, s0 = pod_tcp(lab)
        time.sleep(window)
        r1, s1 = pod_tcp(lab)
        iptables(lab, "n2", "-I", loss)
        t0 = time.monotonic()
        lab.stop_etcd()
        time.sleep(window)
        r2, s2 = pod_tcp(lab)
        assert source.poll() is None, "the TCP stream broke"
        clean, lossy = (r1 - r0, s1 - s0), (r2 - r1, s2 - s1)
        print(
            f"\nn1's pods over {window:g} s: without loss {clean[0]:.0f} of {clean[1]:.0f} "
            f"segments retransmitted, with 20% loss {lossy[0]:.0f} of {lossy[1]:.0f}"
        )
        # Flat without loss: the same stream, an equal window, (almost) no retransmission.
        assert clean[1] > 1000 and clean[0] <= max(2.0, clean[1] * 0.001), (clean, lossy)
        # Under 20% loss of n2's incoming VXLAN packets the sender retransmits.
        assert lossy[1] > 100 and lossy[0] > max(20.0, lossy[1] * 0.02), (clean, lossy)
        wanted = {
            ("FlannelpyTCPRetransmissionsHigh", "n1"): t0,
            ("FlannelpyPeerPacketLoss", "n1"): t0,
            ("FlannelpyStoreErrors", "n1"): t0,
        }
        clock.wait_firing(wanted, timeout=60)
    finally:
        removed = time.monotonic()
        iptables(lab, "n2", "-D", loss)
        for proc in (source, sink):
            if proc is not None:
                proc.kill()
                proc.wait()
        lab.start_etcd()
    clock.wait_resolved(dict.fromkeys(wanted, removed), timeout=60)


# --- 4. a lowered underlay MTU -----------------------------------------------------------


def test_lowered_underlay_mtu_fires_path_mtu_and_mtu_mismatch(lab: Lab, clock: AlertClock) -> None:
    n2 = lab.node("n2")
    t0 = time.monotonic()
    try:
        lab.exec("n2", ["ip", "link", "set", n2.underlay_iface, "mtu", "1400"])
        # n1's full-size DF probes of n2 vanish: the path MTU alert.
        clock.wait_firing({("FlannelpyPeerPathMTUBroken", "n1"): t0}, timeout=40)
        # n2's agent restarted on the smaller underlay advertises 1350: the others differ.
        restart_agent(lab, "n2")
        t1 = time.monotonic()
        clock.wait_firing(
            {("FlannelpyMTUMismatch", "n1"): t1, ("FlannelpyMTUMismatch", "n3"): t1}, timeout=40
        )
    finally:
        removed = time.monotonic()
        lab.exec("n2", ["ip", "link", "set", n2.underlay_iface, "mtu", "1500"])
        lab.exec("n2", ["ip", "route", "flush", "cache"])
        restart_agent(lab, "n2")
    clock.wait_resolved(
        {
            ("FlannelpyPeerPathMTUBroken", "n1"): removed,
            ("FlannelpyMTUMismatch", "n1"): removed,
            ("FlannelpyMTUMismatch", "n3"): removed,
        },
        timeout=60,
    )


def restart_agent(lab: Lab, node: str) -> None:
    lab.kill_agent(node)
    lab.start_agent(node)
    lab.wait_ready(node, timeout=40)


# --- 5. every rule accounted for, every dashboard panel has data -------------------------


def test_every_rule_fired_or_says_why_not(lab: Lab, clock: AlertClock) -> None:
    fired = {alert for alert, _ in clock.fired}
    print(f"\nalert timings: {clock.report()}")
    missing = [a for a in manifest_alerts() if a not in fired and a not in NOT_FIRED]
    assert not missing, f"rules neither fired nor explained: {missing}; fired: {sorted(fired)}"
    assert not fired & NOT_FIRED.keys(), "a rule listed as not fired did fire: update NOT_FIRED"


def panel_exprs() -> list[tuple[str, str]]:
    with open(os.path.join(ROOT, "manifests", "grafana-dashboard.json"), encoding="utf-8") as f:
        dashboard = json.load(f)
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            if target.get("expr"):
                out.append((panel.get("title", "?"), target["expr"]))
    return out


def grafana_to_promql(expr: str) -> str:
    """Grafana's variables as this lab has them: every node, a 30 s rate window."""
    return (
        expr.replace("$__rate_interval", "30s")
        .replace("$__interval", "30s")
        .replace("$node", ".*")
        .replace("${node}", ".*")
    )


def test_every_dashboard_panel_returns_data(lab: Lab) -> None:
    exprs = panel_exprs()
    assert len(exprs) >= 10
    empty = [
        (title, expr) for title, expr in exprs if not prom.query(lab.state, grafana_to_promql(expr))
    ]
    assert not empty, f"panels without data: {empty}"
