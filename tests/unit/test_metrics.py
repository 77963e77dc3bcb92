"""AgentMetrics, the scrape-time collectors and the --metrics-addr flag (no kernel needed)."""

from __future__ import annotations

import argparse
import math
import random
import struct
import threading
from collections import Counter
from collections.abc import Sequence
from ipaddress import IPv4Address, IPv4Network
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from flannelpy.config.settings import AgentSettings, add_agent_arguments, settings_from_args
from flannelpy.dataplane import rtnl
from flannelpy.dataplane.linkstats import ROLES, RoleStats, RoleTotals, classify_links
from flannelpy.dataplane.reconciler import ReconcileResult
from flannelpy.dataplane.rtnl import LinkStats, LinkStatsRow
from flannelpy.dataplane.state import Changes
from flannelpy.errors import (
    ConfigError,
    KeyExists,
    RevisionCompacted,
    StoreError,
    StoreUnavailable,
)
from flannelpy.ipam.allocator import Accounting
from flannelpy.observe.health import Heartbeats, readiness, split_host_port
from flannelpy.observe.kernel_counters import KernelReading
from flannelpy.observe.metric_families import FAMILIES, sample_names
from flannelpy.observe.metrics import AgentMetrics, store_error_kind
from flannelpy.observe.policy_metrics import PolicyReading
from flannelpy.store.etcd.kv import FakeStore, WatchStream
from flannelpy.store.etcd.manager import EtcdSubnetManager
from flannelpy.store.etcd.member import CODES, MemberError
from flannelpy.store.etcd.rpc_errors import error_kind
from flannelpy.subnet.lease import Lease, LeaseAttrs
from flannelpy.subnet.memo import LeaseList
from tests.support.waiting import wait_until

Key = tuple[str, frozenset[tuple[str, str]]]

UP = rtnl.IFF_UP | rtnl.IFF_LOWER_UP


# --- helpers ---------------------------------------------------------------------------


def scrape(m: AgentMetrics) -> dict[Key, float]:
    """Every sample of a scrape: (name, labels) → value."""
    out: dict[Key, float] = {}
    for family in text_string_to_metric_families(m.exposition().decode()):
        for s in family.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def exposed_families(m: AgentMetrics) -> dict[str, str]:
    """Family name as exposed (counters with ``_total``) → type."""
    types = {}
    for family in text_string_to_metric_families(m.exposition().decode()):
        name = family.name + "_total" if family.type == "counter" else family.name
        types[name] = family.type
    return types


def value(samples: dict[Key, float], name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def peer(subnet: str, ip: str, backend: str = "vxlan", mtu: int | None = 1450) -> Lease:
    return Lease(IPv4Network(subnet), LeaseAttrs(IPv4Address(ip), backend, mtu=mtu))


def result(
    reason: str, failures: tuple[str, ...] = (), finished_at: float = 1000.0, **counts: int
) -> ReconcileResult:
    return ReconcileResult(reason, Changes(counts=counts), failures, 0.012, finished_at)


def row(
    ifindex: int,
    name: str,
    kind: str | None = "veth",
    master: int = 0,
    flags: int = UP,
    **counters: int,
) -> LinkStatsRow:
    return LinkStatsRow(ifindex, name, kind, master, flags, LinkStats(**counters))


def pools() -> list[Accounting]:
    return [
        Accounting(
            IPv4Network("10.244.1.0/24"), 253, assigned=100, cooling=20, free=133, next_free_in=12.0
        ),
        Accounting(
            IPv4Network("10.244.9.0/24"), 253, assigned=3, cooling=0, free=250, next_free_in=None
        ),
    ]


def links(n_pods: int = 3) -> list[RoleStats]:
    return [
        RoleStats("vxlan", 1, 1, LinkStats(rx_packets=10, tx_packets=12, tx_dropped=4)),
        RoleStats("bridge", 1, 1, LinkStats(rx_packets=5, rx_dropped=1)),
        RoleStats("underlay", 1, 1, LinkStats(rx_errors=2, tx_bytes=900)),
        RoleStats("pods", n_pods, n_pods, LinkStats(tx_dropped=7, rx_bytes=300)),
    ]


def kernel_reading() -> KernelReading:
    counts = {
        "tcp_sent": 100,
        "tcp_retransmitted": 3,
        "no_route": 1,
        "frag_needed": 2,
        "icmp_unreachable_sent": 2,
    }
    return KernelReading(counts, counts, pod_namespaces=2, pod_namespaces_unreadable=0)


def policy_reading() -> PolicyReading:
    return PolicyReading(3, 2, 40, {"deny_a_in": (("shop", "db", "ingress"), 7)})


@pytest.fixture
def metrics() -> AgentMetrics:
    return AgentMetrics()


def populated() -> AgentMetrics:
    """Every event method called at least once, both providers set."""
    m = AgentMetrics()
    m.set_link_provider(links)
    m.set_ipam_provider(pools)
    m.set_kernel_provider(kernel_reading)
    m.set_policy_provider(policy_reading)
    m.cni_request("ADD", 0, 0.004)
    m.lease("10.244.1.0/24", 2_000_000_000.0)
    m.renewal("success")
    m.overlay_mtu(1450)
    m.peers([peer("10.244.2.0/24", "192.168.1.2"), peer("10.244.3.0/24", "192.168.1.3")])
    m.observe_reconcile(result("start", route=2, neighbour=2, fdb=2))
    m.firewall_sync(repaired=True)
    m.store_error("unavailable")
    m.watch_restart("compacted")
    m.probe("10.244.2.0/24", True, 0.0005, 0.0, True)
    m.blocked_operation("backend_change")
    m.lease_counts(serving=2, draining=1)
    m.pool_utilisation({IPv4Network("10.244.0.0/16"): 0.25})
    m.wireguard_implementation("userspace")
    m.wireguard_repair("peers_set")
    m.wireguard_unencrypted_peers(0)
    return m


# --- names and conventions --------------------------------------------------------------


def test_every_family_is_exported_and_listed() -> None:
    exposed = exposed_families(populated())
    assert exposed == dict(FAMILIES)


def test_names_follow_prometheus_conventions() -> None:
    for name, kind in FAMILIES.items():
        assert name.startswith("flannelpy_"), name
        assert name == name.lower(), name
        assert name.endswith("_total") == (kind == "counter"), name
        if "duration" in name or "rtt" in name or "timestamp" in name:
            assert name.endswith("_seconds"), name
        assert not name.endswith(("_ms", "_milliseconds", "_kb", "_percent")), name
    assert "flannelpy_build_info" in FAMILIES


def test_no_label_names_a_pod_or_an_interface() -> None:
    samples = scrape(populated())
    # The one exception: NetworkPolicy's denials name the Kubernetes namespace of the
    # policies that deny (as many series as policies, at most), never a pod.
    by_policy = "flannelpy_policy_denied_packets_total"
    label_names = {k for (name, labels) in samples if name != by_policy for k, _ in labels}
    forbidden = {"pod", "container", "container_id", "namespace", "ifname", "interface", "ip"}
    assert not label_names & forbidden
    policy_labels = {k for (name, labels) in samples if name == by_policy for k, _ in labels}
    assert policy_labels == {"namespace", "policy", "direction"}
    assert label_names <= {
        "version",
        "python",
        "role",
        "direction",
        "subnet",
        "command",
        "code",
        "le",
        "result",
        "backend",
        "kind",
        "reason",
        "peer",
        "provider",
        "state",
        "pool",
        "scope",
        "readable",
        "implementation",
        "family",
    }


def test_pods_are_one_series_per_direction_however_many_veths() -> None:
    m = AgentMetrics()
    m.set_link_provider(lambda: links(n_pods=250))
    samples = scrape(m)
    pod_series = [k for k in samples if ("role", "pods") in k[1]]
    # 4 counter families x 2 directions + interfaces + interfaces_up
    assert len(pod_series) == 10
    assert value(samples, "flannelpy_interfaces", role="pods") == 250


def test_sample_names_cover_every_sample_of_a_scrape() -> None:
    names = {name for name, _ in scrape(populated())}
    assert names <= sample_names()
    assert "flannelpy_cni_request_duration_seconds_bucket" in sample_names()
    assert "flannelpy_interface_dropped_packets_total" in sample_names()


def test_build_info_is_one() -> None:
    samples = scrape(AgentMetrics())
    (info,) = [v for (n, _), v in samples.items() if n == "flannelpy_build_info"]
    assert info == 1.0


def test_each_instance_has_its_own_registry() -> None:
    a, b = AgentMetrics(), AgentMetrics()
    a.renewal("failure")
    assert value(scrape(a), "flannelpy_lease_renewals_total", result="failure") == 1
    assert value(scrape(b), "flannelpy_lease_renewals_total", result="failure") == 0


# --- CNI ------------------------------------------------------------------------------


def test_cni_requests_by_command_and_code_with_latency(metrics: AgentMetrics) -> None:
    metrics.cni_request("ADD", 0, 0.004)
    metrics.cni_request("add", 0, 0.020)
    metrics.cni_request("DEL", 0, 0.030)
    metrics.cni_request("ADD", 11, 200.0)
    metrics.cni_request("FROB", 4, 0.001)  # unknown commands never become a series
    s = scrape(metrics)
    assert value(s, "flannelpy_cni_requests_total", command="ADD", code="0") == 2
    assert value(s, "flannelpy_cni_requests_total", command="ADD", code="11") == 1
    assert value(s, "flannelpy_cni_requests_total", command="DEL", code="0") == 1
    assert value(s, "flannelpy_cni_requests_total", command="other", code="4") == 1
    hist = "flannelpy_cni_request_duration_seconds"
    assert value(s, hist + "_count", command="ADD") == 3
    assert value(s, hist + "_bucket", command="ADD", le="0.005") == 1
    assert value(s, hist + "_bucket", command="ADD", le="0.025") == 2
    assert value(s, hist + "_bucket", command="ADD", le="120.0") == 2
    assert value(s, hist + "_bucket", command="ADD", le="240.0") == 3
    assert value(s, hist + "_sum", command="ADD") == pytest.approx(200.024)


def test_cni_buckets_run_from_a_millisecond_to_the_kubelet_timeout() -> None:
    s = scrape(populated())
    bounds = sorted(
        float(dict(labels)["le"])
        for (name, labels) in s
        if name == "flannelpy_cni_request_duration_seconds_bucket"
    )
    assert bounds[0] == 0.001
    assert bounds[-2] == 240.0 and math.isinf(bounds[-1])


# --- leases and peers -------------------------------------------------------------------


def test_lease_expiry_renewals_and_dropping_a_lease(metrics: AgentMetrics) -> None:
    metrics.lease(IPv4Network("10.244.1.0/24"), 1_900_000_000.0)
    metrics.lease("10.244.7.0/24", None)  # a permanent reservation never expires
    metrics.renewal("success")
    metrics.renewal("success")
    metrics.renewal("failure")
    metrics.renewal("bogus")
    s = scrape(metrics)
    expiry = "flannelpy_lease_expiry_timestamp_seconds"
    assert value(s, expiry, subnet="10.244.1.0/24") == 1_900_000_000.0
    assert math.isinf(value(s, expiry, subnet="10.244.7.0/24"))
    assert value(s, "flannelpy_lease_renewals_total", result="success") == 2
    assert value(s, "flannelpy_lease_renewals_total", result="failure") == 1
    assert value(s, "flannelpy_lease_renewals_total", result="other") == 1
    metrics.drop_lease("10.244.1.0/24")
    metrics.drop_lease("10.244.99.0/24")  # never held: no error
    s = scrape(metrics)
    assert (expiry, frozenset({("subnet", "10.244.1.0/24")})) not in s
    assert (expiry, frozenset({("subnet", "10.244.7.0/24")})) in s


def test_leases_by_state_exist_from_the_start(metrics: AgentMetrics) -> None:
    s = scrape(metrics)
    assert value(s, "flannelpy_leases", state="serving") == 0
    assert value(s, "flannelpy_leases", state="draining") == 0
    metrics.lease_counts(serving=2, draining=1)
    s = scrape(metrics)
    assert value(s, "flannelpy_leases", state="serving") == 2
    assert value(s, "flannelpy_leases", state="draining") == 1
    metrics.lease_counts(serving=1, draining=0)
    s = scrape(metrics)
    assert value(s, "flannelpy_leases", state="serving") == 1
    assert value(s, "flannelpy_leases", state="draining") == 0


def test_pool_utilisation_per_pool_and_pools_that_vanish(metrics: AgentMetrics) -> None:
    name = "flannelpy_pool_utilisation_ratio"
    metrics.pool_utilisation(
        {IPv4Network("10.244.0.0/16"): 0.5, "10.250.0.0/16": 1.5, "10.251.0.0/16": -0.1}
    )
    s = scrape(metrics)
    assert value(s, name, pool="10.244.0.0/16") == 0.5
    assert value(s, name, pool="10.250.0.0/16") == 1.0  # clamped to a ratio
    assert value(s, name, pool="10.251.0.0/16") == 0.0
    metrics.pool_utilisation({"10.250.0.0/16": 0.75})
    s = scrape(metrics)
    assert [k for k in s if k[0] == name] == [(name, frozenset({("pool", "10.250.0.0/16")}))]
    assert value(s, name, pool="10.250.0.0/16") == 0.75
    metrics.pool_utilisation({})
    assert not [k for k in scrape(metrics) if k[0] == name]


def test_peers_by_backend_and_backends_that_vanish(metrics: AgentMetrics) -> None:
    metrics.peers(
        [
            peer("10.244.2.0/24", "192.168.1.2"),
            peer("10.244.3.0/24", "192.168.1.3"),
            peer("10.244.4.0/24", "192.168.1.4", backend="host-gw"),
            peer("10.244.5.0/24", "192.168.1.5", backend="weird backend!"),
        ]
    )
    s = scrape(metrics)
    assert value(s, "flannelpy_peers", backend="vxlan") == 2
    assert value(s, "flannelpy_peers", backend="host-gw") == 1
    assert value(s, "flannelpy_peers", backend="other") == 1
    metrics.peers([peer("10.244.2.0/24", "192.168.1.2")])
    s = scrape(metrics)
    assert value(s, "flannelpy_peers", backend="vxlan") == 1
    assert ("flannelpy_peers", frozenset({("backend", "host-gw")})) not in s


def test_mtu_mismatch_counts_differing_peers_not_silent_ones(metrics: AgentMetrics) -> None:
    metrics.peers(
        [
            peer("10.244.2.0/24", "192.168.1.2", mtu=1450),
            peer("10.244.3.0/24", "192.168.1.3", mtu=1400),
            peer("10.244.4.0/24", "192.168.1.4", mtu=8950),
            peer("10.244.5.0/24", "192.168.1.5", mtu=None),  # flanneld: unknown
        ]
    )
    s = scrape(metrics)
    assert value(s, "flannelpy_peers_mtu_mismatch") == 0  # our MTU is not known yet
    metrics.overlay_mtu(1450)
    s = scrape(metrics)
    assert value(s, "flannelpy_overlay_mtu_bytes") == 1450
    assert value(s, "flannelpy_peers_mtu_mismatch") == 2
    assert value(s, "flannelpy_peers_mtu_unknown") == 1
    metrics.overlay_mtu(1400)
    assert value(scrape(metrics), "flannelpy_peers_mtu_mismatch") == 2  # 1450 and 8950


# --- reconciler -----------------------------------------------------------------------


def test_changes_count_always_repairs_only_when_nothing_asked_for_them(
    metrics: AgentMetrics,
) -> None:
    metrics.observe_reconcile(result("start", route=5, neighbour=5, fdb=5, link=1))
    metrics.observe_reconcile(result("desired state changed, route", route=1))
    metrics.observe_reconcile(result("neighbour, route", route=1, neighbour=1, stale=2))
    metrics.observe_reconcile(result("periodic resync"))
    metrics.firewall_sync(repaired=False)
    metrics.firewall_sync(repaired=True)
    s = scrape(metrics)
    changes, repairs = "flannelpy_reconciler_changes_total", "flannelpy_reconciler_repairs_total"
    assert value(s, changes, kind="route") == 7
    assert value(s, changes, kind="link") == 1
    assert value(s, changes, kind="stale") == 2
    assert value(s, repairs, kind="route") == 1
    assert value(s, repairs, kind="neighbour") == 1
    assert value(s, repairs, kind="stale") == 2
    assert value(s, repairs, kind="fdb") == 0
    assert value(s, repairs, kind="link") == 0
    assert value(s, repairs, kind="rule") == 1
    assert value(s, "flannelpy_reconciler_sync_duration_seconds_count") == 4


def test_failed_passes_keep_the_last_success_time(metrics: AgentMetrics) -> None:
    metrics.observe_reconcile(result("start", finished_at=1000.0, route=1))
    s = scrape(metrics)
    assert value(s, "flannelpy_reconciler_last_success_timestamp_seconds") == 1000.0
    assert value(s, "flannelpy_reconciler_converged") == 1
    metrics.observe_reconcile(
        result("route", failures=("route 10.244.2.0/24: EPERM",), finished_at=1010.0, route=1)
    )
    metrics.reconcile_error()
    s = scrape(metrics)
    assert value(s, "flannelpy_reconciler_last_success_timestamp_seconds") == 1000.0
    assert value(s, "flannelpy_reconciler_converged") == 0
    assert value(s, "flannelpy_reconciler_failed_syncs_total") == 2
    metrics.observe_reconcile(result("periodic resync", finished_at=1020.0))
    s = scrape(metrics)
    assert value(s, "flannelpy_reconciler_last_success_timestamp_seconds") == 1020.0
    assert value(s, "flannelpy_reconciler_converged") == 1


# --- store ------------------------------------------------------------------------------


def test_store_errors_and_watch_restarts(metrics: AgentMetrics) -> None:
    metrics.store_error("unavailable")
    metrics.store_error("permission_denied")
    metrics.store_error("Not A Kind; DROP TABLE")
    metrics.watch_restart("compacted")
    metrics.watch_restart("unavailable")
    metrics.watch_restart("unavailable")
    s = scrape(metrics)
    assert value(s, "flannelpy_store_errors_total", kind="unavailable") == 1
    assert value(s, "flannelpy_store_errors_total", kind="permission_denied") == 1
    assert value(s, "flannelpy_store_errors_total", kind="other") == 1
    assert value(s, "flannelpy_store_watch_restarts_total", reason="compacted") == 1
    assert value(s, "flannelpy_store_watch_restarts_total", reason="unavailable") == 2


def test_store_error_kind_of_our_exceptions() -> None:
    assert store_error_kind(RevisionCompacted("gone", 5)) == "compacted"
    assert store_error_kind(StoreUnavailable("down")) == "unavailable"
    assert store_error_kind(KeyExists("taken")) == "conflict"
    assert store_error_kind(StoreError("refused")) == "request"
    assert store_error_kind(ValueError("x")) == "other"


def test_etcd_error_kind_is_the_grpc_status_in_snake_case() -> None:
    try:
        raise StoreError("permission denied") from MemberError(
            CODES["PERMISSION_DENIED"], "etcdserver: permission denied"
        )
    except StoreError as e:
        assert error_kind(e) == "permission_denied"
    assert error_kind(StoreError("no cause")) == "request"


class _GatedStore:
    """FakeStore whose first watch waits for ``gate``: writes and a compaction happen
    while the manager is between its list and its watch."""

    def __init__(self, inner: FakeStore) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.watches = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def watch_prefix(self, prefix: str, start: int, stop: threading.Event) -> WatchStream:
        self.watches += 1
        if self.watches == 1:
            assert self.gate.wait(5)
        return self.inner.watch_prefix(prefix, start, stop)


def test_etcd_manager_reports_watch_restarts_by_reason() -> None:
    store = FakeStore()
    gated = _GatedStore(store)
    restarts: list[str] = []
    relisted = threading.Event()
    stop = threading.Event()
    manager = EtcdSubnetManager(
        gated,  # type: ignore[arg-type]
        AgentSettings(),
        sleep=lambda stop, seconds: None,
        on_watch_restart=restarts.append,
    )
    lists = 0

    def on_leases(leases: object, revision: int) -> None:
        nonlocal lists
        lists += 1
        if lists == 2:
            relisted.set()

    thread = threading.Thread(target=manager.watch_leases, args=(on_leases, stop), daemon=True)
    thread.start()
    try:
        prefix = "/coreos.com/network/subnets/"
        store.put(prefix + "10.244.2.0-24", b'{"PublicIP": "192.168.1.2"}')
        store.put(prefix + "10.244.3.0-24", b'{"PublicIP": "192.168.1.3"}')
        store.compact(store.revision)
        gated.gate.set()
        assert relisted.wait(5), "the manager did not re-list after the compaction"
        assert restarts[0] == "compacted"
        store.set_available(False)
        wait_until(lambda: "unavailable" in restarts, 5.0, "a restart after the outage")
    finally:
        store.set_available(True)
        stop.set()
        thread.join(5)


# --- prober -----------------------------------------------------------------------------


def test_probe_series_per_peer_unknowns_are_nan(metrics: AgentMetrics) -> None:
    metrics.probe(IPv4Network("10.244.2.0/24"), True, 0.0004, 0.0, True)
    metrics.probe("10.244.3.0/24", False, None, 1.0, None)
    s = scrape(metrics)
    assert value(s, "flannelpy_peer_reachable", peer="10.244.2.0/24", family="ipv4") == 1
    assert value(s, "flannelpy_peer_rtt_seconds", peer="10.244.2.0/24", family="ipv4") == 0.0004
    assert value(s, "flannelpy_peer_loss_ratio", peer="10.244.2.0/24", family="ipv4") == 0
    assert value(s, "flannelpy_peer_path_mtu_verified", peer="10.244.2.0/24", family="ipv4") == 1
    assert value(s, "flannelpy_peer_reachable", peer="10.244.3.0/24", family="ipv4") == 0
    assert math.isnan(value(s, "flannelpy_peer_rtt_seconds", peer="10.244.3.0/24", family="ipv4"))
    assert value(s, "flannelpy_peer_loss_ratio", peer="10.244.3.0/24", family="ipv4") == 1
    assert math.isnan(
        value(s, "flannelpy_peer_path_mtu_verified", peer="10.244.3.0/24", family="ipv4")
    )


def test_probe_series_of_departed_peers_are_removed(metrics: AgentMetrics) -> None:
    metrics.probe("10.244.2.0/24", True, 0.001, 0.0, True)
    metrics.probe("10.244.3.0/24", True, 0.001, 0.0, True)
    metrics.forget_probes(["10.244.2.0/24", "10.244.7.0/24"])  # one never probed
    peers = {
        dict(labels)["peer"]
        for (name, labels) in scrape(metrics)
        if name.startswith("flannelpy_peer_")
    }
    assert peers == {"10.244.3.0/24"}
    metrics.forget_probes(["10.244.3.0/24"])
    assert not [n for (n, _) in scrape(metrics) if n.startswith("flannelpy_peer_")]
    # A peer that comes back has its series again (none kept from before it left).
    metrics.probe("10.244.3.0/24", False, None, 1.0, None)
    s = scrape(metrics)
    assert value(s, "flannelpy_peer_reachable", peer="10.244.3.0/24", family="ipv4") == 0


def test_probe_series_per_family_and_departed_ipv6_sides_removed(metrics: AgentMetrics) -> None:
    metrics.probe("10.244.2.0/24", True, 0.001, 0.0, True)
    metrics.probe("fd10:244:0:2::/64", True, 0.001, 0.0, False)
    metrics.probe("fd10:244:0:3::/64", True, 0.001, 0.0, True)
    s = scrape(metrics)
    assert value(s, "flannelpy_peer_path_mtu_verified", peer="10.244.2.0/24", family="ipv4") == 1
    assert (
        value(s, "flannelpy_peer_path_mtu_verified", peer="fd10:244:0:2::/64", family="ipv6") == 0
    )
    metrics.forget_probes(["fd10:244:0:3::/64"])  # the peer of fd10:244:0:3::/64 is gone
    sides = {
        (dict(labels)["peer"], dict(labels)["family"])
        for (name, labels) in scrape(metrics)
        if name == "flannelpy_peer_reachable"
    }
    assert sides == {("10.244.2.0/24", "ipv4"), ("fd10:244:0:2::/64", "ipv6")}


@pytest.mark.parametrize("lists", [False, True], ids=["plain", "lease-lists"])
@pytest.mark.parametrize("seed", range(5))
def test_peer_counts_follow_random_changes(seed: int, lists: bool) -> None:
    """Peers come, go and change backend: after every change the counts by backend are
    the current peers', and a backend no peer has any more has no series. With lists
    made one after another (the planner's), counted by what came and went; now and then
    a plain list comes between, and the next is counted whole."""
    rnd = random.Random(seed)
    metrics = AgentMetrics()
    current: dict[int, Lease] = {}
    listed: LeaseList | None = None
    for step in range(30):
        for _ in range(rnd.randint(1, 3)):
            n = rnd.randint(2, 12)
            if n in current and rnd.random() < 0.4:
                del current[n]
            else:
                backend = rnd.choice(["vxlan", "host-gw", "wireguard", "Weird!"])
                current[n] = peer(f"10.244.{n}.0/24", f"192.168.1.{n}", backend)
        if lists and step % 11 != 10:
            listed = LeaseList(current.values(), listed)
            metrics.peers(listed)
        else:
            metrics.peers(list(current.values()))
        counts = Counter(
            "other" if p.attrs.backend_type == "Weird!" else p.attrs.backend_type
            for p in current.values()
        )
        gauges = {
            dict(labels)["backend"]: v
            for (name, labels), v in scrape(metrics).items()
            if name == "flannelpy_peers"
        }
        assert gauges == dict(counts)


def test_blocked_operations_counted_by_kind(metrics: AgentMetrics) -> None:
    metrics.blocked_operation("backend_change")
    metrics.blocked_operation("backend_change")
    metrics.blocked_operation("mtu_change")
    s = scrape(metrics)
    assert value(s, "flannelpy_blocked_operations_total", kind="backend_change") == 2
    assert value(s, "flannelpy_blocked_operations_total", kind="mtu_change") == 1


# --- scrape-time providers ----------------------------------------------------------------


def test_ipam_per_lease_and_cooling_never_free(metrics: AgentMetrics) -> None:
    metrics.set_ipam_provider(pools)
    s = scrape(metrics)
    lease = {"subnet": "10.244.1.0/24"}
    assert value(s, "flannelpy_ipam_assigned_addresses", **lease) == 100
    assert value(s, "flannelpy_ipam_cooling_addresses", **lease) == 20
    assert value(s, "flannelpy_ipam_free_addresses", **lease) == 133
    assert value(s, "flannelpy_ipam_capacity_addresses", **lease) == 253
    assert value(s, "flannelpy_ipam_assigned_addresses", subnet="10.244.9.0/24") == 3


def test_providers_are_read_at_every_scrape(metrics: AgentMetrics) -> None:
    calls = []

    def provider() -> list[Accounting]:
        calls.append(1)
        return pools()[: len(calls) % 2 + 1]

    metrics.set_ipam_provider(provider)
    first = scrape(metrics)
    second = scrape(metrics)
    assert len(calls) == 2
    assert ("flannelpy_ipam_free_addresses", frozenset({("subnet", "10.244.9.0/24")})) in first
    assert ("flannelpy_ipam_free_addresses", frozenset({("subnet", "10.244.9.0/24")})) not in (
        second
    )


def test_link_counters_by_role_and_direction(metrics: AgentMetrics) -> None:
    metrics.set_link_provider(links)
    s = scrape(metrics)
    drops = "flannelpy_interface_dropped_packets_total"
    assert value(s, drops, role="vxlan", direction="tx") == 4
    assert value(s, drops, role="bridge", direction="rx") == 1
    assert value(s, drops, role="pods", direction="tx") == 7
    assert value(s, "flannelpy_interface_errors_total", role="underlay", direction="rx") == 2
    assert value(s, "flannelpy_interface_packets_total", role="vxlan", direction="tx") == 12
    assert value(s, "flannelpy_interface_bytes_total", role="underlay", direction="tx") == 900
    assert value(s, "flannelpy_interfaces_up", role="pods") == 3


def test_a_failing_provider_costs_its_families_not_the_scrape(metrics: AgentMetrics) -> None:
    def broken() -> list[RoleStats]:
        raise OSError(9, "bad file descriptor")

    metrics.set_link_provider(broken)
    metrics.set_ipam_provider(pools)
    s = scrape(metrics)
    assert not [n for (n, _) in s if n.startswith("flannelpy_interface")]
    assert value(s, "flannelpy_ipam_assigned_addresses", subnet="10.244.1.0/24") == 100
    assert value(s, "flannelpy_scrape_errors_total", provider="links") == 1
    assert value(s, "flannelpy_scrape_errors_total", provider="ipam") == 0


# --- link classification and monotonic sums ---------------------------------------------


def test_classify_links_by_role() -> None:
    rows = [
        row(1, "lo", kind=None),
        row(2, "eth0", kind=None),
        row(3, "cni0", kind="bridge"),
        row(4, "flannel.1", kind="vxlan"),
        row(5, "flannel-v6.1", kind="vxlan"),
        row(6, "veth1", master=3),
        row(7, "veth2", master=3),
        row(8, "veth3", master=0),  # not on the bridge
        row(9, "tap0", kind="tun", master=3),  # on the bridge, not a veth
        row(10, "flannel.x", kind="bridge"),  # named like ours, not a vxlan device
        row(11, "vxlan0", kind="vxlan"),  # somebody else's vxlan device
    ]
    roles = classify_links(rows, underlay="eth0")
    names = {role: [r.name for r in found] for role, found in roles.items()}
    assert names == {
        "vxlan": ["flannel.1", "flannel-v6.1"],
        "bridge": ["cni0"],
        "underlay": ["eth0"],
        "pods": ["veth1", "veth2"],
    }
    assert classify_links(rows[3:], underlay=None)["pods"] == []  # no bridge: no pods
    assert classify_links(rows, underlay=None)["underlay"] == []


def test_role_totals_stay_monotonic_when_pods_come_and_go() -> None:
    totals = RoleTotals()

    def pods(*rows: LinkStatsRow) -> RoleStats:
        (stats,) = [s for s in totals.update({"pods": list(rows)}) if s.role == "pods"]
        return stats

    first = pods(row(6, "veth1", tx_dropped=5, rx_packets=100), row(7, "veth2", rx_packets=50))
    assert first.counters.rx_packets == 150 and first.counters.tx_dropped == 5
    assert first.interfaces == 2
    # veth1's pod is deleted: its counts stay in the sum.
    second = pods(row(7, "veth2", rx_packets=60))
    assert second.counters.rx_packets == 160 and second.counters.tx_dropped == 5
    assert second.interfaces == 1
    # ifindex 7 reused by a new veth whose counters start low: the old ones are kept too.
    third = pods(row(7, "veth9", rx_packets=2))
    assert third.counters.rx_packets == 162
    fourth = pods(row(7, "veth9", rx_packets=12), row(8, "veth10", flags=rtnl.IFF_UP))
    assert fourth.counters.rx_packets == 172
    assert fourth.up == 1  # veth10 has no carrier


def test_role_totals_report_every_role_even_when_absent() -> None:
    stats = RoleTotals().update({})
    assert [s.role for s in stats] == list(ROLES)
    assert all(s.interfaces == 0 and s.counters == LinkStats() for s in stats)


def _attr(kind: int, payload: bytes) -> bytes:
    return rtnl.attr(kind, payload)


def _link_message(
    ifindex: int, name: str, kind: str | None, master: int, stats: Sequence[int], extra: int = 0
) -> bytes:
    body = struct.pack("=BxHiII", 0, 1, ifindex, UP, 0)
    body += _attr(rtnl.IFLA_IFNAME, name.encode() + b"\0")
    if master:
        body += _attr(rtnl.IFLA_MASTER, struct.pack("=I", master))
    # rtnl_link_stats64 of today's kernels: 25 counters; only the first eight matter.
    body += _attr(rtnl.IFLA_STATS64, struct.pack("=25Q", *stats, *([999] * (25 - len(stats)))))
    if kind:
        info = _attr(rtnl.IFLA_INFO_KIND, kind.encode() + b"\0")
        body += _attr(rtnl.IFLA_LINKINFO | 0x8000, info)
    header = rtnl.HDR.pack(rtnl.HDR.size + len(body), rtnl.RTM_NEWLINK, 2, 1, 0)
    return header + body


def test_decode_link_stats_reads_name_kind_master_and_counters() -> None:
    msg = _link_message(7, "veth1", "veth", 3, [1, 2, 3, 4, 5, 6, 7, 8])
    decoded = rtnl.decode_link_stats(msg, 0, len(msg))
    assert decoded == LinkStatsRow(7, "veth1", "veth", 3, UP, LinkStats(1, 2, 3, 4, 5, 6, 7, 8))
    plain = _link_message(1, "eth0", None, 0, [9] * 8)
    assert rtnl.decode_link_stats(plain, 0, len(plain)).kind is None
    assert rtnl.decode_link_stats(plain, 0, len(plain)).master == 0


# --- the --metrics-addr flag ------------------------------------------------------------


def _settings(argv: list[str], env: dict[str, str] | None = None) -> AgentSettings:
    parser = argparse.ArgumentParser()
    add_agent_arguments(parser)
    return settings_from_args(parser.parse_args(argv), env or {})


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], {}, "127.0.0.1:9403"),
        (["--metrics-addr", "0.0.0.0:9403"], {}, "0.0.0.0:9403"),
        (["--metrics-addr", " 10.0.0.7:80 "], {}, "10.0.0.7:80"),
        ([], {"FLANNELD_METRICS_ADDR": "[::1]:9403"}, "[::1]:9403"),
        ([], {"FLANNELD_METRICS_ADDR": "[0:0::1]:09403"}, "[::1]:9403"),
        (["--metrics-addr", "127.0.0.1:0"], {}, "127.0.0.1:0"),
        (["--metrics-addr", "off"], {"FLANNELD_METRICS_ADDR": "1.2.3.4:5"}, None),
    ],
)
def test_metrics_addr_flag(argv: list[str], env: dict[str, str], expected: str | None) -> None:
    assert _settings(argv, env).metrics_addr == expected


@pytest.mark.parametrize(
    "bad", ["127.0.0.1", "localhost:9403", "::1:9403", "127.0.0.1:99999", "1.2.3.4:x", ":9403"]
)
def test_metrics_addr_flag_refuses_what_is_not_ip_port(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"--metrics-addr .* is not IP:PORT; write it like"):
        _settings(["--metrics-addr", bad])


# --- health: heartbeats and readiness (pure) ---------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 500.0

    def __call__(self) -> float:
        return self.now


def test_heartbeats_live_until_a_loop_stops_beating() -> None:
    clock = Clock()
    beats = Heartbeats(clock)
    assert beats.live() == (True, "ok")  # nothing registered: alive
    beats.register("reconciler", 30.0)
    beats.register("lease-watch", 10.0)
    clock.now += 10.0
    assert beats.live() == (True, "ok")  # exactly the allowed age is still fine
    clock.now += 5.0
    ok, reason = beats.live()
    assert not ok
    assert reason == "loop stuck: lease-watch last beat 15 s ago (allowed 10 s)"
    beats.beat("lease-watch")
    assert beats.live() == (True, "ok")
    clock.now += 31.0
    ok, reason = beats.live()
    assert reason == (
        "loop stuck: lease-watch last beat 31 s ago (allowed 10 s); "
        "reconciler last beat 46 s ago (allowed 30 s)"
    )
    beats.unregister("lease-watch")
    beats.unregister("reconciler")
    assert beats.live() == (True, "ok")


def test_heartbeats_refuse_unknown_names_and_bad_ages() -> None:
    beats = Heartbeats(Clock())
    with pytest.raises(KeyError, match="never registered"):
        beats.beat("renew")
    with pytest.raises(ValueError, match="max_age must be positive"):
        beats.register("renew", 0)


def test_heartbeat_ages() -> None:
    clock = Clock()
    beats = Heartbeats(clock)
    beats.register("a", 5)
    clock.now += 2
    beats.register("b", 5)
    clock.now += 1
    assert beats.ages() == {"a": 3.0, "b": 1.0}


def _ready(**overrides: Any) -> tuple[bool, str]:
    facts: dict[str, Any] = {
        "lease_held": True,
        "subnet_env_written": True,
        "last_reconcile": result("start", route=3),
        "rules_in_place": True,
    }
    facts.update(overrides)
    return readiness(**facts)


def test_readiness_ok_only_when_everything_holds() -> None:
    assert _ready() == (True, "ok")


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        ({"lease_held": False}, "no subnet lease held yet"),
        ({"last_reconcile": None}, "has not been programmed yet"),
        (
            {"last_reconcile": result("route", failures=("route 10.244.2.0/24: EPERM", "x"))},
            "the reconciler cannot converge: route 10.244.2.0/24: EPERM (and 1 more)",
        ),
        ({"rules_in_place": False}, "firewall rules are not in place"),
        ({"subnet_env_written": False}, "subnet.env is not written yet"),
    ],
)
def test_readiness_names_the_first_thing_missing(overrides: dict[str, Any], reason: str) -> None:
    ok, text = _ready(**overrides)
    assert not ok
    assert reason in text


@pytest.mark.parametrize(
    ("addr", "expected"),
    [
        ("127.0.0.1:9403", ("127.0.0.1", 9403)),
        ("[::1]:0", ("::1", 0)),
        ("0.0.0.0:80", ("0.0.0.0", 80)),
    ],
)
def test_split_host_port(addr: str, expected: tuple[str, int]) -> None:
    assert split_host_port(addr) == expected


@pytest.mark.parametrize("bad", ["9403", "127.0.0.1:", ":80", "127.0.0.1:70000", "h:x"])
def test_split_host_port_refuses(bad: str) -> None:
    with pytest.raises(ConfigError, match="is not HOST:PORT"):
        split_host_port(bad)
