"""What the agent exports: every family's name, type, help text, labels and buckets.

The families are registered by concept (CNI, leases and peers, the reconciler, the
store, probes, MTU, WireGuard, ...): each concept's class registers its families in a
registry, with the series that must exist from the start (so that rate() and alerts
see a zero). :class:`~flannelpy.observe.metrics.AgentMetrics` composes them and turns the
agent's events into values; :data:`FAMILIES` is the contract with ``manifests/`` and
the dashboard.

Names: prefix ``flannelpy_``, base units (``_seconds``, ``_bytes``), counters end in
``_total``. Labels stay low-cardinality: interface *roles*, not interfaces (every pod
veth is summed into ``role="pods"``), leases and peers (one per node), never pods.
"""

from __future__ import annotations

import platform
import threading
from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

import flannelpy
from flannelpy.subnet.validate import REASONS

PREFIX = "flannelpy_"

DIRECTIONS = ("rx", "tx")

# Reconciler change kinds (Changes.counts keys) plus the firewall's "rule".
CHANGE_KINDS = ("link", "address", "route", "neighbour", "fdb", "stale", "rule")

CNI_COMMANDS = ("ADD", "DEL", "CHECK", "STATUS", "GC", "VERSION")
LEASE_STATES = ("serving", "draining")  # flannelpy_leases{state}
RENEWAL_RESULTS = ("success", "failure")
WATCH_RESTART_REASONS = ("compacted", "unavailable", "malformed", "error")
# flannelpy_rejected_leases_total{reason}
REJECTION_REASONS = REASONS
# flannelpy_agent_events_total{kind}: what the agent's writer handled
AGENT_EVENT_KINDS = (
    "leases",
    "lease_lost",
    "control",
    "probe",
    "capacity",
    "tick",
    "handshake",
    "policy",
)
# flannelpy_policy_refused_objects_total{kind}: API objects NetworkPolicy cannot represent
POLICY_OBJECT_KINDS = ("networkpolicy", "pod", "namespace")
WIREGUARD_IMPLEMENTATIONS = ("kernel", "userspace")
WIREGUARD_REPAIR_KINDS = ("peers_set", "peers_removed", "key", "port", "process")
SCRAPE_PROVIDERS = ("links", "ipam", "kernel", "policy")

# CNI latency: 1 ms to the kubelet's default 4-minute runtime request timeout.
CNI_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    240.0,
)
SYNC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# Exposition family names and types: the contract with manifests/ and the dashboard.
FAMILIES: Mapping[str, str] = {
    "flannelpy_build_info": "gauge",
    # links (scrape time)
    "flannelpy_interface_dropped_packets_total": "counter",
    "flannelpy_interface_errors_total": "counter",
    "flannelpy_interface_packets_total": "counter",
    "flannelpy_interface_bytes_total": "counter",
    "flannelpy_interfaces": "gauge",
    "flannelpy_interfaces_up": "gauge",
    # kernel counters (scrape time, flannelpy.observe.kernel_counters)
    "flannelpy_node_tcp_retransmitted_segments_total": "counter",
    "flannelpy_node_tcp_sent_segments_total": "counter",
    "flannelpy_pod_tcp_retransmitted_segments_total": "counter",
    "flannelpy_pod_tcp_sent_segments_total": "counter",
    "flannelpy_kernel_drops_total": "counter",
    "flannelpy_kernel_icmp_unreachable_sent_total": "counter",
    "flannelpy_pod_namespaces_counted": "gauge",
    # IPAM (scrape time)
    "flannelpy_ipam_assigned_addresses": "gauge",
    "flannelpy_ipam_cooling_addresses": "gauge",
    "flannelpy_ipam_free_addresses": "gauge",
    "flannelpy_ipam_capacity_addresses": "gauge",
    # CNI
    "flannelpy_cni_requests_total": "counter",
    "flannelpy_cni_request_duration_seconds": "histogram",
    # leases
    "flannelpy_lease_expiry_timestamp_seconds": "gauge",
    "flannelpy_lease_renewals_total": "counter",
    "flannelpy_peers": "gauge",
    "flannelpy_peers_without_path": "gauge",
    # warm capacity and pools
    "flannelpy_leases": "gauge",
    "flannelpy_leases_max": "gauge",
    "flannelpy_pool_utilisation_ratio": "gauge",
    # reconciler
    "flannelpy_reconciler_changes_total": "counter",
    "flannelpy_reconciler_repairs_total": "counter",
    "flannelpy_reconciler_sync_duration_seconds": "histogram",
    "flannelpy_reconciler_last_success_timestamp_seconds": "gauge",
    "flannelpy_reconciler_failed_syncs_total": "counter",
    "flannelpy_reconciler_converged": "gauge",
    # store
    "flannelpy_store_errors_total": "counter",
    "flannelpy_store_watch_restarts_total": "counter",
    "flannelpy_rejected_leases_total": "counter",
    # prober
    "flannelpy_peer_reachable": "gauge",
    "flannelpy_peer_rtt_seconds": "gauge",
    "flannelpy_peer_loss_ratio": "gauge",
    "flannelpy_peer_path_mtu_verified": "gauge",
    # MTU
    "flannelpy_overlay_mtu_bytes": "gauge",
    "flannelpy_peers_mtu_mismatch": "gauge",
    "flannelpy_peers_mtu_unknown": "gauge",
    # disruption policy (a later issue)
    "flannelpy_blocked_operations_total": "counter",
    # the agent's writer
    "flannelpy_agent_events_total": "counter",
    # NetworkPolicy (--enable-network-policy)
    "flannelpy_policy_refused_objects_total": "counter",
    "flannelpy_policy_denied_packets_total": "counter",
    "flannelpy_policy_policies": "gauge",
    "flannelpy_policy_selected_pods": "gauge",
    "flannelpy_policy_set_elements": "gauge",
    # the metrics themselves
    "flannelpy_scrape_errors_total": "counter",
    # the wireguard backend
    "flannelpy_wireguard_implementation": "gauge",
    "flannelpy_wireguard_repairs_total": "counter",
    "flannelpy_wireguard_unencrypted_peers": "gauge",
}


def sample_names() -> frozenset[str]:
    """Every series name a scrape may contain (a histogram's ``_bucket``, ``_sum`` and
    ``_count``), for checking dashboards and alert rules against what we export."""
    names: set[str] = set()
    for name, kind in FAMILIES.items():
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
        else:
            names.add(name)
    return frozenset(names)


# ---------------------------------------------------------------------------
# Registration by concept, in the order the families are exposed
# ---------------------------------------------------------------------------


def register_build_info(r: CollectorRegistry) -> None:
    build = Gauge(
        "flannelpy_build_info",
        "flannelpy version and Python version; always 1.",
        ["version", "python"],
        registry=r,
    )
    build.labels(flannelpy.__version__, platform.python_version()).set(1)


class CniFamilies:
    """CNI requests the agent answered and how long each took."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.requests = Counter(
            "flannelpy_cni_requests_total",
            "CNI requests answered by the agent, by command and CNI result code (0: success).",
            ["command", "code"],
            registry=r,
        )
        self.duration = Histogram(
            "flannelpy_cni_request_duration_seconds",
            "Time the agent took to answer a CNI request.",
            ["command"],
            buckets=CNI_BUCKETS,
            registry=r,
        )


class LeaseFamilies:
    """This node's leases, its peers and its warm capacity."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.expiry = Gauge(
            "flannelpy_lease_expiry_timestamp_seconds",
            "Unix time at which this node's lease expires (+Inf for a permanent reservation).",
            ["subnet"],
            registry=r,
        )
        self.renewals = Counter(
            "flannelpy_lease_renewals_total",
            "Lease renewals by result.",
            ["result"],
            registry=r,
        )
        self.peers = Gauge(
            "flannelpy_peers",
            "Peer leases (other nodes) by backend type.",
            ["backend"],
            registry=r,
        )
        self.without_path = Gauge(
            "flannelpy_peers_without_path",
            "Peer leases this node has no path to (status.json and the doctor say why).",
            registry=r,
        )
        self.held = Gauge(
            "flannelpy_leases",
            "Leases this node holds, by state: serving (may get new pod addresses) or "
            "draining (its pool is excluded; released when its last pod ends).",
            ["state"],
            registry=r,
        )
        self.held_max = Gauge(
            "flannelpy_leases_max",
            "How many leases this node may hold (MaxLeasesPerNode): with flannelpy_leases, "
            "how close warm capacity is to its limit.",
            registry=r,
        )
        self.pool_utilisation = Gauge(
            "flannelpy_pool_utilisation_ratio",
            "Share (0..1) of the address pool's leasable subnets that nodes hold, by pool CIDR.",
            ["pool"],
            registry=r,
        )
        self.held_max.set(1)
        for result in RENEWAL_RESULTS:
            self.renewals.labels(result)
        for state in LEASE_STATES:
            self.held.labels(state).set(0)


class ReconcileFamilies:
    """The data plane's reconcile passes and what they changed."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.changes = Counter(
            "flannelpy_reconciler_changes_total",
            "Kernel entries the reconciler set or removed, by kind.",
            ["kind"],
            registry=r,
        )
        self.repairs = Counter(
            "flannelpy_reconciler_repairs_total",
            "Changes made although the desired state had not changed: something else "
            "altered the kernel (or a firewall rule), by kind.",
            ["kind"],
            registry=r,
        )
        self.sync_duration = Histogram(
            "flannelpy_reconciler_sync_duration_seconds",
            "Duration of a reconcile pass (dump, diff, apply).",
            buckets=SYNC_BUCKETS,
            registry=r,
        )
        self.last_success = Gauge(
            "flannelpy_reconciler_last_success_timestamp_seconds",
            "Unix time of the last reconcile pass that converged.",
            registry=r,
        )
        self.failed_syncs = Counter(
            "flannelpy_reconciler_failed_syncs_total",
            "Reconcile passes that left failures or raised.",
            registry=r,
        )
        self.converged = Gauge(
            "flannelpy_reconciler_converged",
            "1 when the last reconcile pass converged, 0 when it failed.",
            registry=r,
        )
        for kind in CHANGE_KINDS:
            self.changes.labels(kind)
            self.repairs.labels(kind)


class StoreFamilies:
    """The lease store: failed requests, watch restarts, leases refused as invalid."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.errors = Counter(
            "flannelpy_store_errors_total",
            "Failed requests to the lease store (etcd or the Kubernetes API), by kind.",
            ["kind"],
            registry=r,
        )
        self.watch_restarts = Counter(
            "flannelpy_store_watch_restarts_total",
            "Lease watches re-listed after a compaction, an outage, a malformed event or an "
            "unexpected error, by reason.",
            ["reason"],
            registry=r,
        )
        self.rejected = Counter(
            "flannelpy_rejected_leases_total",
            "Peer leases ignored as invalid (never programmed), once per lease and reason.",
            ["reason"],
            registry=r,
        )
        for reason in WATCH_RESTART_REASONS:
            self.watch_restarts.labels(reason)
        self.errors.labels("unavailable")


# The prober's families: (name, help), in the order of a peer's values.
PROBE_FAMILIES = (
    (
        "flannelpy_peer_reachable",
        "1 when the last probe of the peer (by its lease subnet of that family) was answered.",
    ),
    ("flannelpy_peer_rtt_seconds", "Round-trip time of the last answered probe."),
    ("flannelpy_peer_loss_ratio", "Share of recent probes not answered (0..1)."),
    (
        "flannelpy_peer_path_mtu_verified",
        "1 when a full overlay-MTU probe with DF set reached the peer, 0 when it failed.",
    ),
)
PROBE_LABELS = ("peer", "family")


class ProbeFamilies(Collector):
    """The prober's view of each peer, by its lease subnet and family: kept as plain
    values and rendered when Prometheus scrapes. Labelled Gauges cost four child objects
    per peer (4,000 at 1,000 peers, made in the first probe cycle after a start) and
    four ``labels()`` look-ups per probe round, about 28 µs for a peer's first round and
    8 µs for each later one; a round's values here are one dict entry (about 1 µs)."""

    def __init__(self, r: CollectorRegistry) -> None:
        self._lock = threading.Lock()
        # (peer, family) -> (reachable, rtt, loss, mtu_ok), as PROBE_FAMILIES
        self._values: dict[tuple[str, str], tuple[float, float, float, float]] = {}
        r.register(self)

    def set(self, peer: str, family: str, values: tuple[float, float, float, float]) -> None:
        with self._lock:
            self._values[(peer, family)] = values

    def remove(self, peer: str, family: str) -> None:
        with self._lock:
            self._values.pop((peer, family), None)

    def describe(self) -> Iterator[Metric]:
        for name, documentation in PROBE_FAMILIES:
            yield GaugeMetricFamily(name, documentation, labels=PROBE_LABELS)

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            values = list(self._values.items())
        for i, (name, documentation) in enumerate(PROBE_FAMILIES):
            family = GaugeMetricFamily(name, documentation, labels=PROBE_LABELS)
            for labels, value in values:
                family.add_metric(labels, value[i])
            yield family


class MtuFamilies:
    """Our overlay MTU and how many peers advertise another one (or none)."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.overlay = Gauge(
            "flannelpy_overlay_mtu_bytes", "This node's overlay (pod) MTU.", registry=r
        )
        self.mismatch = Gauge(
            "flannelpy_peers_mtu_mismatch",
            "Peers whose lease advertises an overlay MTU different from ours.",
            registry=r,
        )
        self.unknown = Gauge(
            "flannelpy_peers_mtu_unknown",
            "Peers whose lease advertises no MTU (flanneld, older flannelpy).",
            registry=r,
        )
        self.mismatch.set(0)
        self.unknown.set(0)


def register_agent_events(r: CollectorRegistry) -> Counter:
    events = Counter(
        "flannelpy_agent_events_total",
        "Events the agent's writer finished handling, by kind.",
        ["kind"],
        registry=r,
    )
    for kind in AGENT_EVENT_KINDS:
        events.labels(kind)
    return events


class WireguardFamilies:
    """The WireGuard backend: its implementation, its repairs, the peers not yet encrypted."""

    def __init__(self, r: CollectorRegistry) -> None:
        self.implementation = Gauge(
            "flannelpy_wireguard_implementation",
            "1 for the WireGuard implementation this node runs (kernel or userspace).",
            ["implementation"],
            registry=r,
        )
        self.repairs = Counter(
            "flannelpy_wireguard_repairs_total",
            "Changes written to the WireGuard device that it did not have (peers, key, "
            "port, a restarted wireguard-go), by kind.",
            ["kind"],
            registry=r,
        )
        self.unencrypted = Gauge(
            "flannelpy_wireguard_unencrypted_peers",
            "Peer nodes a wireguard node still reaches without encryption (vxlan while a "
            "rollout is under way); 0 when the switch is complete.",
            registry=r,
        )


def register_blocked_operations(r: CollectorRegistry) -> Counter:
    blocked = Counter(
        "flannelpy_blocked_operations_total",
        "Disruptive operations refused by the disruption policy, by kind.",
        ["kind"],
        registry=r,
    )
    # increase() sees no rise in a series that appears at 1: the first block must count.
    blocked.labels("backend_change")
    return blocked


def register_policy_refusals(r: CollectorRegistry) -> Counter:
    refused = Counter(
        "flannelpy_policy_refused_objects_total",
        "NetworkPolicies, Pods and Namespaces the policy compiler cannot represent, once "
        "per object version (nothing of it is enforced; an edit keeps the last accepted "
        "version), by kind.",
        ["kind"],
        registry=r,
    )
    for kind in POLICY_OBJECT_KINDS:
        refused.labels(kind)
    return refused


def unregistered_scrape_errors() -> Counter:
    """The owner registers it after its scrape-time collectors, so that a failure is
    counted in the very scrape it happens in."""
    errors = Counter(
        "flannelpy_scrape_errors_total",
        "Scrape-time readings that failed (their families are left out), by provider.",
        ["provider"],
        registry=None,
    )
    for provider in SCRAPE_PROVIDERS:
        errors.labels(provider)
    return errors
