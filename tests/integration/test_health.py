"""The health/metrics HTTP server on loopback, and link counters from a real kernel.

Link tests build their own namespaces: a node with cni0, a pod veth, a
flannel.1 vxlan device and an underlay veth whose far end sits in a "remote"
namespace. All traffic stays inside them. HTTP goes to 127.0.0.1 (or ::1
inside a namespace) through http.client, which never consults proxy settings.
"""

from __future__ import annotations

import http.client
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from prometheus_client.parser import text_string_to_metric_families

from flannelpy.dataplane.linkstats import NetlinkLinkStats, RoleStats
from flannelpy.dataplane.rtnl import LinkStats
from flannelpy.errors import ConfigError, StoreUnavailable
from flannelpy.observe.health import HealthServer, Heartbeats
from flannelpy.observe.metrics import AgentMetrics
from flannelpy.store.etcd.client import EtcdStore
from tests.support.etcd_server import free_port
from tests.support.netns_util import Netns, is_root, temp_netns

needs_root = pytest.mark.skipif(not is_root(), reason="network namespaces need root")


# --- HTTP helpers ------------------------------------------------------------------------


def get(port: int, path: str, host: str = "127.0.0.1") -> tuple[int, str, str]:
    """(status, content type, body) of one GET, with a fresh connection."""
    conn = http.client.HTTPConnection(host, port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.getheader("Content-Type") or "", resp.read().decode()
    finally:
        conn.close()


class Switch:
    """A check whose answer the test flips."""

    def __init__(self, ok: bool, reason: str) -> None:
        self.ok = ok
        self.reason = reason

    def __call__(self) -> tuple[bool, str]:
        return self.ok, self.reason


@dataclass
class Served:
    server: HealthServer
    metrics: AgentMetrics
    ready: Switch
    live: Switch

    @property
    def port(self) -> int:
        return self.server.address[1]


@pytest.fixture
def served() -> Iterator[Served]:
    metrics = AgentMetrics()
    ready = Switch(False, "no subnet lease held yet: the store may be unreachable")
    live = Switch(True, "ok")
    server = HealthServer("127.0.0.1:0", metrics.registry, ready=ready, live=live)
    server.start()
    try:
        yield Served(server, metrics, ready, live)
    finally:
        server.stop()


# --- HealthServer ------------------------------------------------------------------------


def test_readyz_and_healthz_follow_their_checks(served: Served) -> None:
    assert get(served.port, "/readyz") == (
        503,
        "text/plain; charset=utf-8",
        "no subnet lease held yet: the store may be unreachable\n",
    )
    assert get(served.port, "/healthz")[::2] == (200, "ok\n")
    served.ready.ok = True
    assert get(served.port, "/readyz")[::2] == (200, "ok\n")
    served.live.ok, served.live.reason = False, "loop stuck: reconciler last beat 95 s ago"
    assert get(served.port, "/healthz")[::2] == (
        503,
        "loop stuck: reconciler last beat 95 s ago\n",
    )
    served.live.ok = True
    assert get(served.port, "/healthz?verbose=1")[0] == 200


def test_a_check_that_raises_is_a_failing_check(served: Served) -> None:
    def broken() -> tuple[bool, str]:
        raise RuntimeError("status lock poisoned")

    server = HealthServer("127.0.0.1:0", served.metrics.registry, ready=broken, live=broken)
    server.start()
    try:
        status, _, body = get(server.address[1], "/readyz")
        assert status == 503 and "status lock poisoned" in body
    finally:
        server.stop()


def test_metrics_endpoint_serves_the_registry(served: Served) -> None:
    served.metrics.cni_request("ADD", 0, 0.003)
    served.metrics.probe("10.244.2.0/24", True, 0.0007, 0.0, True)
    status, content_type, body = get(served.port, "/metrics")
    assert status == 200
    assert content_type.startswith("text/plain; version=0.0.4")
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }
    assert samples[("flannelpy_cni_requests_total", (("code", "0"), ("command", "ADD")))] == 1
    rtt = ("flannelpy_peer_rtt_seconds", (("family", "ipv4"), ("peer", "10.244.2.0/24")))
    assert samples[rtt] == 0.0007


def test_unknown_paths_are_404(served: Served) -> None:
    status, _, body = get(served.port, "/")
    assert status == 404 and "/metrics" in body


def test_keep_alive_serves_repeated_scrapes_on_one_connection(served: Served) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", served.port, timeout=5)
    try:
        for _ in range(3):
            conn.request("GET", "/metrics")
            resp = conn.getresponse()
            assert resp.status == 200 and b"flannelpy_build_info" in resp.read()
    finally:
        conn.close()


def test_liveness_from_heartbeats_over_http() -> None:
    now = [100.0]
    beats = Heartbeats(clock=lambda: now[0])
    beats.register("reconciler", 30.0)
    server = HealthServer(
        "127.0.0.1:0", AgentMetrics().registry, ready=lambda: (True, "ok"), live=beats.live
    )
    server.start()
    try:
        port = server.address[1]
        now[0] += 29
        assert get(port, "/healthz")[0] == 200
        now[0] += 2
        status, _, body = get(port, "/healthz")
        assert status == 503
        assert body == "loop stuck: reconciler last beat 31 s ago (allowed 30 s)\n"
        beats.beat("reconciler")
        assert get(port, "/healthz")[0] == 200
    finally:
        server.stop()


def test_stop_closes_the_port_and_is_idempotent() -> None:
    server = HealthServer(
        "127.0.0.1:0", AgentMetrics().registry, lambda: (True, "ok"), lambda: (True, "ok")
    )
    server.start()
    port = server.address[1]
    assert get(port, "/healthz")[0] == 200
    server.stop()
    server.stop()
    with pytest.raises(ConnectionRefusedError):
        get(port, "/healthz")


def test_a_taken_port_is_a_config_error_naming_the_flag() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = HealthServer(
            f"127.0.0.1:{port}", AgentMetrics().registry, lambda: (True, "ok"), lambda: (True, "ok")
        )
        with pytest.raises(ConfigError, match="--metrics-addr"):
            server.start()


def test_scrapes_do_not_wait_for_a_slow_client(served: Served) -> None:
    # A client that connects and says nothing must not block other requests.
    idle = socket.create_connection(("127.0.0.1", served.port), timeout=5)
    try:
        results: list[int] = []
        thread = threading.Thread(target=lambda: results.append(get(served.port, "/healthz")[0]))
        thread.start()
        thread.join(5)
        assert results == [200]
    finally:
        idle.close()


@needs_root
def test_ipv6_listen_address_inside_a_namespace() -> None:
    with temp_netns("h6") as ns:
        server = HealthServer(
            "[::1]:0", AgentMetrics().registry, lambda: (True, "ok"), lambda: (True, "ok")
        )
        ns.call(server.start)
        try:
            status, _, body = ns.call(get, server.address[1], "/readyz", "::1")
            assert (status, body) == (200, "ok\n")
        finally:
            server.stop()


# --- store hook ------------------------------------------------------------------------


def test_etcd_store_reports_unavailable_to_its_hook() -> None:
    kinds: list[str] = []
    store = EtcdStore([f"http://127.0.0.1:{free_port()}"], timeout=0.5, on_error=kinds.append)
    try:
        with pytest.raises(StoreUnavailable):
            store.get("/coreos.com/network/config")
    finally:
        store.close()
    assert kinds == ["unavailable"]


# --- link counters from the kernel -------------------------------------------------------


@dataclass
class Node:
    ns: Netns
    pod: Netns
    remote: Netns


@pytest.fixture
def node() -> Iterator[Node]:
    """cni0 (10.244.1.1/24) with one pod veth, flannel.1 with a route to 10.244.2.0/24
    whose FDB entry is missing, and an underlay ul0 (192.168.77.1) to a remote namespace."""
    with temp_netns("mn") as ns, temp_netns("mp") as pod, temp_netns("mr") as remote:
        ns.ip("link add cni0 type bridge")
        ns.ip("addr add 10.244.1.1/24 dev cni0")
        ns.ip("link set cni0 up")
        ns.ip(f"link add vethpod1 type veth peer name eth0 netns {pod.name}")
        ns.ip("link set vethpod1 master cni0 up")
        pod.ip("link set eth0 up")
        pod.ip("addr add 10.244.1.2/24 dev eth0")
        ns.ip(f"link add ul0 type veth peer name ul0 netns {remote.name}")
        ns.ip("addr add 192.168.77.1/24 dev ul0")
        ns.ip("link set ul0 up")
        remote.ip("addr add 192.168.77.2/24 dev ul0")
        remote.ip("link set ul0 up")
        ns.ip(
            "link add flannel.1 type vxlan id 1 local 192.168.77.1 dev ul0 dstport 8472 nolearning"
        )
        ns.ip("addr add 10.244.1.0/32 dev flannel.1")
        ns.ip("link set flannel.1 up")
        # The neighbour without its FDB entry: the half-programmed peer of field notes §1.
        ns.ip("neigh replace 10.244.2.0 lladdr 02:00:00:00:00:02 dev flannel.1 nud permanent")
        ns.ip("route add 10.244.2.0/24 via 10.244.2.0 dev flannel.1 onlink")
        yield Node(ns, pod, remote)


def ping(ns: Netns, target: str, count: int = 3) -> None:
    ns.exec(["ping", "-c", str(count), "-i", "0.2", "-W", "1", target], check=False)


def by_role(stats: list[RoleStats]) -> dict[str, RoleStats]:
    return {s.role: s for s in stats}


def delta(after: RoleStats, before: RoleStats) -> LinkStats:
    return LinkStats(*(a - b for a, b in zip(after.counters, before.counters, strict=True)))


@needs_root
def test_link_counters_by_role_move_with_traffic(node: Node) -> None:
    provider = node.ns.call(NetlinkLinkStats, "ul0")
    try:
        first = by_role(provider())
        assert {r: s.interfaces for r, s in first.items()} == {
            "vxlan": 1,
            "bridge": 1,
            "underlay": 1,
            "pods": 1,
        }
        assert {r: s.up for r, s in first.items()} == {
            "vxlan": 1,
            "bridge": 1,
            "underlay": 1,
            "pods": 1,
        }

        ping(node.ns, "10.244.1.2")  # node → pod, over cni0 and the pod veth
        ping(node.ns, "192.168.77.2")  # node → remote, over the underlay
        second = by_role(provider())
        pods = delta(second["pods"], first["pods"])
        assert pods.tx_packets >= 3 and pods.rx_packets >= 3  # host side of the pod veth
        assert pods.tx_dropped == 0
        bridge = delta(second["bridge"], first["bridge"])
        assert bridge.tx_packets >= 3 and bridge.rx_packets >= 3
        underlay = delta(second["underlay"], first["underlay"])
        assert underlay.tx_packets >= 3 and underlay.rx_packets >= 3
        assert underlay.tx_bytes >= 3 * 98
    finally:
        provider.close()


@needs_root
def test_drops_are_counted_where_the_kernel_drops(node: Node) -> None:
    provider = node.ns.call(NetlinkLinkStats, "ul0")
    try:
        ping(node.ns, "10.244.1.2", count=1)  # the pod's neighbour entry, before the drops
        before = by_role(provider())
        # A route and a neighbour but no FDB entry: the vxlan device drops on transmit.
        ping(node.ns, "10.244.2.5")
        # The silent MTU drop: the pod end's MTU is below the host end's, so the host
        # end of the veth drops every larger packet it is given (and says nothing).
        node.pod.ip("link set eth0 mtu 1000")
        ns_ping = ["ping", "-c", "3", "-i", "0.2", "-W", "1", "-s", "1400", "10.244.1.2"]
        node.ns.exec(ns_ping, check=False)
        after = by_role(provider())
        assert delta(after["vxlan"], before["vxlan"]).tx_dropped >= 3
        assert delta(after["pods"], before["pods"]).tx_dropped >= 3
        assert delta(after["underlay"], before["underlay"]).tx_dropped == 0
        assert delta(after["bridge"], before["bridge"]).tx_dropped == 0
        assert after["pods"].up == 1  # nothing looks wrong but the counter
    finally:
        provider.close()


@needs_root
def test_pod_counters_survive_the_pod_and_scrape_as_one_series(node: Node) -> None:
    provider = node.ns.call(NetlinkLinkStats, "ul0")
    metrics = AgentMetrics()
    metrics.set_link_provider(provider)
    try:
        ping(node.ns, "10.244.1.2")
        before = by_role(provider())["pods"]
        node.ns.ip("link del vethpod1")  # the pod is deleted
        after = by_role(provider())["pods"]
        assert after.interfaces == 0
        assert after.counters == before.counters  # the sum never goes down
        samples = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(metrics.exposition().decode())
            for s in family.samples
            if s.name.startswith("flannelpy_interface")
        }
        key = ("flannelpy_interface_packets_total", (("direction", "tx"), ("role", "pods")))
        assert samples[key] == before.counters.tx_packets >= 3
        assert samples[("flannelpy_interfaces", (("role", "pods"),))] == 0
    finally:
        provider.close()


@needs_root
def test_underlay_can_be_named_after_the_provider_is_made(node: Node) -> None:
    provider = node.ns.call(NetlinkLinkStats)
    try:
        assert by_role(provider())["underlay"].interfaces == 0
        provider.underlay = "ul0"
        assert by_role(provider())["underlay"].interfaces == 1
    finally:
        provider.close()
