"""Cost of one /metrics scrape on a node with 100 pods and 100 peers.

    python -m bench.metrics_scrape [--pods 100] [--peers 100] [--scrapes 200]

Builds a node namespace with ``cni0`` and one veth port per pod (the pod ends
sit in a second namespace, as on a real node), an underlay veth and a
``flannel.1`` vxlan device; a NodeIpam on a /24 with one address assigned
per pod (a temporary state directory); and an AgentMetrics with the probe
series of every peer, their leases, and some CNI, reconciler and store
history. The link provider is the real one (a netlink dump of every link per
scrape), the IPAM provider is ``NodeIpam.accounting`` and the kernel counters read
the host's tables and one namespace per pod (``snmp`` through a kept descriptor).

Timed, after 10 warm-up scrapes each:

- ``exposition``: the registry rendered in-process (``AgentMetrics.exposition``, what
  /metrics does);
- its scrape-time parts alone: the link dump, the IPAM accounting, the kernel counters;
- HTTP: GET /metrics from a HealthServer on 127.0.0.1, over one keep-alive
  connection (as Prometheus scrapes) and with a new connection per scrape.

Each row also gives the process's CPU time per scrape (p50; for HTTP, server and client
together), which other load on the machine disturbs less than the wall time.

Goal (issue 5): a scrape under 20 ms. Everything created is removed at exit.
"""

from __future__ import annotations

import argparse
import http.client
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from ipaddress import IPv4Address, IPv4Network

from bench.common import median, percentile, table
from flannelpy.dataplane.linkstats import NetlinkLinkStats
from flannelpy.dataplane.netns import run_in_netns
from flannelpy.dataplane.reconciler import ReconcileResult
from flannelpy.dataplane.state import Changes
from flannelpy.ipam.manager import NodeIpam
from flannelpy.observe.health import HealthServer
from flannelpy.observe.kernel_counters import KernelCounters, PodCounters
from flannelpy.observe.metrics import AgentMetrics
from flannelpy.subnet.lease import Lease, LeaseAttrs

GOAL_SECONDS = 0.020
WARMUP = 10
LEASE = IPv4Network("10.244.1.0/24")


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def ip_batch(netns: str, commands: list[str]) -> None:
    subprocess.run(
        ["ip", "-n", netns, "-batch", "-"],
        input="\n".join(commands) + "\n",
        text=True,
        check=True,
        capture_output=True,
        timeout=120,
    )


@contextmanager
def node_namespaces(pods: int) -> Iterator[str]:
    """A node namespace (cni0 + ``pods`` veth ports, underlay, flannel.1) and a pod
    namespace holding the veths' other ends; both deleted on exit."""
    tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
    node, pod = f"fpbmnode{tag}", f"fpbmpods{tag}"
    try:
        for name in (node, pod):
            subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
        commands = [
            "link set lo up",
            "link add cni0 type bridge",
            "addr add 10.244.1.1/24 dev cni0",
            "link set cni0 up",
            "link add ul0 type veth peer name ul0p",
            "addr add 192.168.77.1/24 dev ul0",
            "link set ul0 up",
            "link set ul0p up",
            "link add flannel.1 type vxlan id 1 local 192.168.77.1 dev ul0 dstport 8472 nolearning",
            "link set flannel.1 up",
        ]
        for i in range(pods):
            commands += [
                f"link add vp{i} type veth peer name e{i} netns {pod}",
                f"link set vp{i} master cni0 up",
            ]
        ip_batch(node, commands)
        ip_batch(pod, [f"link set e{i} up" for i in range(pods)])
        yield node
    finally:
        for name in (node, pod):
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


@contextmanager
def pod_namespaces(pods: int) -> Iterator[list[tuple[str, str]]]:
    """One empty namespace per pod (key, path), as the kernel counters read them; deleted
    on exit."""
    tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
    names = [f"fpbmk{tag}-{i}" for i in range(pods)]
    try:
        for name in names:
            subprocess.run(["ip", "netns", "add", name], check=True, capture_output=True)
        yield [(name, f"/run/netns/{name}") for name in names]
    finally:
        for name in names:
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


def peer_leases(count: int) -> list[Lease]:
    """Peers on 10.245.x.0/24, every tenth advertising a different MTU."""
    return [
        Lease(
            IPv4Network((int(IPv4Address("10.245.0.0")) + (i << 8), 24)),
            LeaseAttrs(
                IPv4Address(int(IPv4Address("192.168.78.10")) + i),
                "vxlan",
                {"VNI": 1, "VtepMAC": f"02:00:00:00:{i >> 8:02x}:{i & 0xFF:02x}"},
                node_name=f"node-{i}",
                mtu=1450 if i % 10 else 1400,
            ),
        )
        for i in range(count)
    ]


def build_metrics(ipam: NodeIpam, provider: NetlinkLinkStats, peers: int) -> AgentMetrics:
    metrics = AgentMetrics()
    metrics.set_link_provider(provider)
    metrics.set_ipam_provider(ipam.accounting)
    metrics.overlay_mtu(1450)
    leases = peer_leases(peers)
    metrics.peers(leases)
    for i, lease in enumerate(leases):
        metrics.probe(lease.subnet, i % 17 != 0, 0.0004 + i * 1e-6, (i % 5) / 20, i % 10 != 0)
    metrics.lease(LEASE, time.time() + 86400)
    for command in ("ADD", "DEL", "CHECK"):
        for code, seconds in ((0, 0.004), (0, 0.02), (11, 1.5)):
            metrics.cni_request(command, code, seconds)
    metrics.observe_reconcile(
        ReconcileResult("start", Changes(counts={"route": peers, "neighbour": peers}), (), 0.05)
    )
    metrics.renewal("success")
    metrics.store_error("unavailable")
    metrics.watch_restart("unavailable")
    return metrics


def timed(fn: Callable[[], object], count: int) -> tuple[list[float], list[float]]:
    """Wall and process CPU seconds of each of ``count`` calls, after the warm-up."""
    for _ in range(WARMUP):
        fn()
    wall, cpu = [], []
    for _ in range(count):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return wall, cpu


def http_scrapes(port: int, count: int, keep_alive: bool) -> tuple[list[float], list[float]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)

    def once() -> None:
        nonlocal conn
        if not keep_alive:
            conn.close()
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        conn.request("GET", "/metrics")
        resp = conn.getresponse()
        body = resp.read()
        if resp.status != 200 or b"flannelpy_interface_dropped_packets_total" not in body:
            raise RuntimeError(f"bad scrape: HTTP {resp.status}")

    try:
        return timed(once, count)
    finally:
        conn.close()


def run(pods: int, peers: int, scrapes: int) -> tuple[str, bool]:
    with (
        node_namespaces(pods) as node,
        tempfile.TemporaryDirectory() as state,
        pod_namespaces(pods) as pod_netns,
    ):
        say(f"namespace {node} ready with {pods} pod veths")
        ipam = NodeIpam(state, fsync=False)
        ipam.set_leases([LEASE])
        for i in range(pods):
            ipam.allocate(f"container-{i}", "eth0")
        provider = run_in_netns(node, NetlinkLinkStats, "ul0")
        pod_counters = PodCounters(lambda: pod_netns)
        kernel = KernelCounters(pod_counters)
        server = None
        try:
            metrics = build_metrics(ipam, provider, peers)
            metrics.set_kernel_provider(kernel)
            if kernel().pod_namespaces != pods:
                raise RuntimeError(f"the kernel counters read {kernel().pod_namespaces} pods")
            roles = {s.role: s.interfaces for s in provider()}
            if roles["pods"] != pods or roles["vxlan"] != 1:
                raise RuntimeError(f"the provider sees {roles}, expected {pods} pods")
            body = metrics.exposition()
            series = sum(1 for line in body.splitlines() if line and not line.startswith(b"#"))
            say(f"exposition: {len(body)} bytes, {series} series; timing {scrapes} scrapes")
            results = {
                "exposition, in-process": timed(metrics.exposition, scrapes),
                "  link dump + sums": timed(provider, scrapes),
                "  IPAM accounting": timed(ipam.accounting, scrapes),
                "  kernel counters (node + pods)": timed(kernel, scrapes),
            }
            server = HealthServer(
                "127.0.0.1:0", metrics.registry, lambda: (True, "ok"), lambda: (True, "ok")
            )
            server.start()
            port = server.address[1]
            results["HTTP, keep-alive"] = http_scrapes(port, scrapes, keep_alive=True)
            results["HTTP, new connection"] = http_scrapes(port, scrapes, keep_alive=False)
        finally:
            if server is not None:
                server.stop()
            provider.close()
            pod_counters.close()
            ipam.close()
    rows = [
        [name, median(v) * 1000, percentile(v, 95) * 1000, max(v) * 1000, median(c) * 1000]
        for name, (v, c) in results.items()
    ]
    worst = max(percentile(v, 95) for k, (v, _) in results.items() if not k.startswith(" "))
    ok = worst < GOAL_SECONDS
    text = "\n\n".join(
        [
            f"{pods} pods, {peers} peers, {series} series, {len(body)} bytes, {scrapes} scrapes",
            table(["milliseconds", "p50", "p95", "max", "CPU p50"], rows),
            f"goal: a scrape < {GOAL_SECONDS * 1000:.0f} ms (p95): {'met' if ok else 'NOT met'}",
        ]
    )
    return text, ok


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.metrics_scrape",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--pods", type=int, default=100)
    parser.add_argument("--peers", type=int, default=100)
    parser.add_argument("--scrapes", type=int, default=200)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.metrics_scrape needs root (network namespaces)", file=sys.stderr)
        return 2
    if not 1 <= args.pods <= 250:
        print("--pods must be 1..250 (one /24 lease)", file=sys.stderr)
        return 2
    try:
        text, ok = run(args.pods, args.peers, args.scrapes)
    except KeyboardInterrupt:
        return 130
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
