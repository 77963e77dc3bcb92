"""Prometheus metrics of the agent: one dedicated registry, Prometheus naming.

Two kinds of values:

- **events**, reported by the agent as they happen (a CNI request, a reconcile
  pass, a renewal, a probe): one :class:`AgentMetrics` method call each;
- **state read at scrape time** (link counters, IPAM accounting), from
  providers the agent registers. Reading when Prometheus asks costs nothing
  between scrapes and is never stale.

Names: prefix ``flannelpy_``, base units (``_seconds``, ``_bytes``), counters
end in ``_total``. Labels stay low-cardinality: interface *roles*, not
interfaces (every pod veth is summed into ``role="pods"``), leases and peers
(one per node), never pods.

Summed counters stay monotonic: when a link disappears (a pod deleted) its
last counts are kept in the role's total, so Prometheus never sees the sum
fall and mistake it for a counter reset. What a link counted between the last
scrape and its deletion is lost; that is the price of never storing per-pod
series.
"""

from __future__ import annotations

import logging
import math
import platform
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from ipaddress import IPv4Network, IPv6Network
from typing import TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
)

import flannelpy
from flannelpy.dataplane.linkstats import RoleStats
from flannelpy.dataplane.reconciler import ReconcileResult
from flannelpy.errors import KeyExists, RevisionCompacted, StoreError, StoreUnavailable
from flannelpy.ipam.allocator import Accounting
from flannelpy.observe.exposition import TextRenderer
from flannelpy.observe.kernel_counters import KernelCollector, KernelReading
from flannelpy.observe.mtu import mtu_mismatches
from flannelpy.observe.scrape import IpamProvider, LinkProvider, ScrapeCollector
from flannelpy.subnet.lease import Lease
from flannelpy.subnet.validate import REASONS

log = logging.getLogger("flannelpy.observe.metrics")

T = TypeVar("T")

PREFIX = "flannelpy_"

DIRECTIONS = ("rx", "tx")

# Reconciler change kinds (Changes.counts keys) plus the firewall's "rule".
CHANGE_KINDS = ("link", "address", "route", "neighbour", "fdb", "stale", "rule")
# Reasons of a pass that programs a new desired state rather than repairing the old one.
PROGRAMMING_REASONS = frozenset({"start", "desired state changed"})

CNI_COMMANDS = ("ADD", "DEL", "CHECK", "STATUS", "GC", "VERSION")
LEASE_STATES = ("serving", "draining")  # flannelpy_leases{state}
RENEWAL_RESULTS = ("success", "failure")
WATCH_RESTART_REASONS = ("compacted", "unavailable", "error")
# flannelpy_rejected_leases_total{reason}
REJECTION_REASONS = REASONS
# flannelpy_agent_events_total{kind}: what the agent's writer handled
AGENT_EVENT_KINDS = ("leases", "lease_lost", "control", "probe", "capacity", "tick", "handshake")

# CNI latency: 1 ms to the kubelet's default 4-minute runtime request timeout.
CNI_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 240.0,
)  # fmt: skip
SYNC_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

_SAFE_LABEL = re.compile(r"[a-z0-9][a-z0-9_.-]{0,39}")

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
    # the metrics themselves
    "flannelpy_scrape_errors_total": "counter",
    # the wireguard backend
    "flannelpy_wireguard_implementation": "gauge",
    "flannelpy_wireguard_repairs_total": "counter",
    "flannelpy_wireguard_unencrypted_peers": "gauge",
}


WIREGUARD_IMPLEMENTATIONS = ("kernel", "userspace")
WIREGUARD_REPAIR_KINDS = ("peers_set", "peers_removed", "key", "port", "process")


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
# The metrics object
# ---------------------------------------------------------------------------


def _label(value: str, allowed: Sequence[str] | None = None) -> str:
    """A label value from a bounded set; anything else becomes "other" (cardinality guard)."""
    if allowed is not None:
        return value if value in allowed else "other"
    folded = value.strip().lower()
    return folded if _SAFE_LABEL.fullmatch(folded) else "other"


def _family(peer_subnet: str) -> str:
    """The ``family`` label of a probed peer's subnet."""
    return "ipv6" if ":" in peer_subnet else "ipv4"


def _gauge_value(value: float | bool | None) -> float:
    return math.nan if value is None else float(value)


def store_error_kind(error: BaseException) -> str:
    """The ``kind`` label for a store error raised outside the store adapter's own hook."""
    if isinstance(error, RevisionCompacted):
        return "compacted"
    if isinstance(error, StoreUnavailable):
        return "unavailable"
    if isinstance(error, KeyExists):
        return "conflict"
    if isinstance(error, StoreError):
        return "request"
    return "other"


class AgentMetrics:
    """Every family of the agent, in ``registry`` (a new dedicated one by default).

    Methods are cheap and thread-safe; call them from any loop. Label values
    are checked against bounded sets (unknown ones become "other") so a bug or
    a strange peer can never explode the series count.
    """

    def __init__(
        self,
        registry: CollectorRegistry | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        # prometheus-client adds a "<name>_created" series per counter and histogram
        # child; nothing reads them and they double the output. The switch is
        # process-wide, and the agent's process exports only this registry.
        disable_created_metrics()
        self.registry = registry if registry is not None else CollectorRegistry()
        self._clock = clock
        self._lock = threading.Lock()
        self._link_provider: LinkProvider | None = None
        self._ipam_provider: IpamProvider | None = None
        self._kernel_provider: Callable[[], KernelReading] | None = None
        self._overlay_mtu: int | None = None
        self._peer_leases: list[Lease] = []
        self._backends: set[str] = set()
        self._probed: set[str] = set()
        self._leases: set[str] = set()
        self._pools: set[str] = set()
        r = self.registry

        self._build = Gauge(
            "flannelpy_build_info", "flannelpy version and Python version; always 1.",
            ["version", "python"], registry=r,
        )  # fmt: skip
        self._build.labels(flannelpy.__version__, platform.python_version()).set(1)

        self._cni_requests = Counter(
            "flannelpy_cni_requests_total",
            "CNI requests answered by the agent, by command and CNI result code (0: success).",
            ["command", "code"], registry=r,
        )  # fmt: skip
        self._cni_duration = Histogram(
            "flannelpy_cni_request_duration_seconds",
            "Time the agent took to answer a CNI request.",
            ["command"], buckets=CNI_BUCKETS, registry=r,
        )  # fmt: skip

        self._lease_expiry = Gauge(
            "flannelpy_lease_expiry_timestamp_seconds",
            "Unix time at which this node's lease expires (+Inf for a permanent reservation).",
            ["subnet"], registry=r,
        )  # fmt: skip
        self._renewals = Counter(
            "flannelpy_lease_renewals_total", "Lease renewals by result.", ["result"], registry=r
        )
        self._peers = Gauge(
            "flannelpy_peers", "Peer leases (other nodes) by backend type.", ["backend"],
            registry=r,
        )  # fmt: skip
        self._without_path = Gauge(
            "flannelpy_peers_without_path",
            "Peer leases this node has no path to (status.json and the doctor say why).",
            registry=r,
        )  # fmt: skip

        self._lease_count = Gauge(
            "flannelpy_leases",
            "Leases this node holds, by state: serving (may get new pod addresses) or "
            "draining (its pool is excluded; released when its last pod ends).",
            ["state"], registry=r,
        )  # fmt: skip
        self._lease_max = Gauge(
            "flannelpy_leases_max",
            "How many leases this node may hold (MaxLeasesPerNode): with flannelpy_leases, "
            "how close warm capacity is to its limit.",
            registry=r,
        )
        self._lease_max.set(1)
        self._pool_utilisation = Gauge(
            "flannelpy_pool_utilisation_ratio",
            "Share (0..1) of the address pool's leasable subnets that nodes hold, by pool CIDR.",
            ["pool"], registry=r,
        )  # fmt: skip

        self._changes = Counter(
            "flannelpy_reconciler_changes_total",
            "Kernel entries the reconciler set or removed, by kind.", ["kind"], registry=r,
        )  # fmt: skip
        self._repairs = Counter(
            "flannelpy_reconciler_repairs_total",
            "Changes made although the desired state had not changed: something else altered "
            "the kernel (or a firewall rule), by kind.",
            ["kind"], registry=r,
        )  # fmt: skip
        self._sync_duration = Histogram(
            "flannelpy_reconciler_sync_duration_seconds",
            "Duration of a reconcile pass (dump, diff, apply).", buckets=SYNC_BUCKETS,
            registry=r,
        )  # fmt: skip
        self._last_success = Gauge(
            "flannelpy_reconciler_last_success_timestamp_seconds",
            "Unix time of the last reconcile pass that converged.", registry=r,
        )  # fmt: skip
        self._failed_syncs = Counter(
            "flannelpy_reconciler_failed_syncs_total",
            "Reconcile passes that left failures or raised.", registry=r,
        )  # fmt: skip
        self._converged = Gauge(
            "flannelpy_reconciler_converged",
            "1 when the last reconcile pass converged, 0 when it failed.", registry=r,
        )  # fmt: skip

        self._store_errors = Counter(
            "flannelpy_store_errors_total",
            "Failed requests to the lease store (etcd or the Kubernetes API), by kind.",
            ["kind"], registry=r,
        )  # fmt: skip
        self._watch_restarts = Counter(
            "flannelpy_store_watch_restarts_total",
            "Lease watches re-listed after a compaction, an outage or an unexpected error, "
            "by reason.",
            ["reason"], registry=r,
        )  # fmt: skip
        self._rejected = Counter(
            "flannelpy_rejected_leases_total",
            "Peer leases ignored as invalid (never programmed), once per lease and reason.",
            ["reason"], registry=r,
        )  # fmt: skip

        self._reachable = Gauge(
            "flannelpy_peer_reachable",
            "1 when the last probe of the peer (by its lease subnet of that family) was "
            "answered.",
            ["peer", "family"], registry=r,
        )  # fmt: skip
        self._rtt = Gauge(
            "flannelpy_peer_rtt_seconds", "Round-trip time of the last answered probe.",
            ["peer", "family"], registry=r,
        )  # fmt: skip
        self._loss = Gauge(
            "flannelpy_peer_loss_ratio", "Share of recent probes not answered (0..1).",
            ["peer", "family"], registry=r,
        )  # fmt: skip
        self._mtu_ok = Gauge(
            "flannelpy_peer_path_mtu_verified",
            "1 when a full overlay-MTU probe with DF set reached the peer, 0 when it failed.",
            ["peer", "family"], registry=r,
        )  # fmt: skip

        self._mtu = Gauge(
            "flannelpy_overlay_mtu_bytes", "This node's overlay (pod) MTU.", registry=r
        )
        self._mtu_mismatch = Gauge(
            "flannelpy_peers_mtu_mismatch",
            "Peers whose lease advertises an overlay MTU different from ours.", registry=r,
        )  # fmt: skip
        self._mtu_unknown = Gauge(
            "flannelpy_peers_mtu_unknown",
            "Peers whose lease advertises no MTU (flanneld, older flannelpy).", registry=r,
        )  # fmt: skip

        self._agent_events = Counter(
            "flannelpy_agent_events_total",
            "Events the agent's writer finished handling, by kind.", ["kind"], registry=r,
        )  # fmt: skip
        for kind in AGENT_EVENT_KINDS:
            self._agent_events.labels(kind)

        self._wg_impl = Gauge(
            "flannelpy_wireguard_implementation",
            "1 for the WireGuard implementation this node runs (kernel or userspace).",
            ["implementation"], registry=r,
        )  # fmt: skip
        self._wg_repairs = Counter(
            "flannelpy_wireguard_repairs_total",
            "Changes written to the WireGuard device that it did not have (peers, key, "
            "port, a restarted wireguard-go), by kind.", ["kind"], registry=r,
        )  # fmt: skip

        self._wg_unencrypted = Gauge(
            "flannelpy_wireguard_unencrypted_peers",
            "Peer nodes a wireguard node still reaches without encryption (vxlan while a "
            "rollout is under way); 0 when the switch is complete.", registry=r,
        )  # fmt: skip

        self._blocked = Counter(
            "flannelpy_blocked_operations_total",
            "Disruptive operations refused by the disruption policy, by kind.",
            ["kind"], registry=r,
        )  # fmt: skip
        # Registered after the scrape collector (below), so that a failure is
        # counted in the very scrape it happens in.
        self._scrape_errors = Counter(
            "flannelpy_scrape_errors_total",
            "Scrape-time readings that failed (their families are left out), by provider.",
            ["provider"], registry=None,
        )  # fmt: skip

        # Series that must exist from the start, so rate() and alerts see a zero.
        for kind in CHANGE_KINDS:
            self._changes.labels(kind)
            self._repairs.labels(kind)
        for result in RENEWAL_RESULTS:
            self._renewals.labels(result)
        for reason in WATCH_RESTART_REASONS:
            self._watch_restarts.labels(reason)
        self._store_errors.labels("unavailable")
        # increase() sees no rise in a series that appears at 1: the first block must count.
        self._blocked.labels("backend_change")
        for provider in ("links", "ipam", "kernel"):
            self._scrape_errors.labels(provider)
        self._mtu_mismatch.set(0)
        self._mtu_unknown.set(0)
        for state in LEASE_STATES:
            self._lease_count.labels(state).set(0)
        r.register(ScrapeCollector(self._read_links, self._read_ipam))
        r.register(KernelCollector(self._read_kernel))
        r.register(self._scrape_errors)
        self._renderer = TextRenderer(r)

    # -- providers --------------------------------------------------------------------

    def set_link_provider(self, fn: LinkProvider | None) -> None:
        """Read interface counters per role at scrape time (e.g. a NetlinkLinkStats)."""
        self._link_provider = fn

    def set_kernel_provider(self, fn: Callable[[], KernelReading] | None) -> None:
        """Read TCP and drop counters of the node and its pods at scrape time (a
        ``kernel_counters.KernelCounters``, which follows ADD and DEL as a pod listener)."""
        self._kernel_provider = fn

    def set_ipam_provider(self, fn: IpamProvider | None) -> None:
        """Read IPAM accounting per lease at scrape time (e.g. ``NodeIpam.accounting``)."""
        self._ipam_provider = fn

    # -- CNI --------------------------------------------------------------------------

    def cni_request(self, command: str, code: int, seconds: float) -> None:
        """One CNI request answered: its command, CNI result code (0: success), duration."""
        cmd = _label(command.upper(), CNI_COMMANDS)
        self._cni_requests.labels(cmd, str(int(code))).inc()
        self._cni_duration.labels(cmd).observe(max(0.0, seconds))

    # -- leases -----------------------------------------------------------------------

    def lease(self, subnet: IPv4Network | IPv6Network | str, expiration: float | None) -> None:
        """Our lease and its expiry (unix time; None: a permanent reservation)."""
        key = str(subnet)
        with self._lock:
            self._leases.add(key)
        self._lease_expiry.labels(key).set(math.inf if expiration is None else expiration)

    def drop_lease(self, subnet: IPv4Network | IPv6Network | str) -> None:
        """Our lease is gone (replaced or released): remove its expiry series."""
        key = str(subnet)
        with self._lock:
            self._leases.discard(key)
        self._lease_expiry.remove(key)

    def lease_counts(self, serving: int, draining: int) -> None:
        """How many leases this node holds that serve new pods, and how many drain."""
        self._lease_count.labels("serving").set(serving)
        self._lease_count.labels("draining").set(draining)

    def lease_limit(self, maximum: int) -> None:
        """MaxLeasesPerNode as configured now."""
        self._lease_max.set(maximum)

    def pool_utilisation(self, ratios: Mapping[IPv4Network | str, float]) -> None:
        """Every known pool's utilisation by CIDR (``PoolCapacity.utilisation`` of
        ``subnet.pools.capacity``); pools not in ``ratios`` any more lose their series.
        Values are clamped to 0..1."""
        values = {str(pool): min(1.0, max(0.0, ratio)) for pool, ratio in ratios.items()}
        with self._lock:  # two callers must not interleave set and remove
            for pool in self._pools - values.keys():
                self._pool_utilisation.remove(pool)
            self._pools = set(values)
            for pool, ratio in values.items():
                self._pool_utilisation.labels(pool).set(ratio)

    def renewal(self, result: str) -> None:
        """A lease renewal attempt: "success" or "failure"."""
        self._renewals.labels(_label(result, RENEWAL_RESULTS)).inc()

    def peers(self, leases: Iterable[Lease]) -> None:
        """The current peer leases (other nodes only, never ours): counts by backend,
        MTU mismatches against the overlay MTU; drops probe series of peers gone."""
        peers = list(leases)
        counts: dict[str, int] = {}
        for lease in peers:
            backend = _label(lease.attrs.backend_type or "unknown")
            counts[backend] = counts.get(backend, 0) + 1
        with self._lock:
            self._peer_leases = peers
            gone = self._probed - {
                str(net) for lease in peers for net in (lease.subnet, lease.ipv6_subnet) if net
            }
            vanished = self._backends - counts.keys()
            self._backends = set(counts)
        for backend, count in counts.items():
            self._peers.labels(backend).set(count)
        for backend in vanished:
            self._peers.remove(backend)
        for peer in gone:
            self.forget_probe(peer)
        self._update_mtu_consistency()

    def peers_without_path(self, count: int) -> None:
        """How many peers the latest plan found no path to (not a readiness matter)."""
        self._without_path.set(count)

    def overlay_mtu(self, mtu: int) -> None:
        """This node's overlay MTU (the one it advertises and gives pods)."""
        with self._lock:
            self._overlay_mtu = mtu
        self._mtu.set(mtu)
        self._update_mtu_consistency()

    def _update_mtu_consistency(self) -> None:
        with self._lock:
            own, peers = self._overlay_mtu, self._peer_leases
        if own is None:
            return
        report = mtu_mismatches(own, peers)
        self._mtu_mismatch.set(len(report.mismatched))
        self._mtu_unknown.set(len(report.unknown))

    # -- reconciler -------------------------------------------------------------------

    def observe_reconcile(self, result: ReconcileResult) -> None:
        """A finished reconcile pass (the Reconciler's ``on_result``)."""
        counts = {k: v for k, v in result.changes.counts.items() if v}
        reasons = {r.strip() for r in result.reason.split(",")}
        repair = not reasons & PROGRAMMING_REASONS
        for kind, count in counts.items():
            label = _label(kind, CHANGE_KINDS)
            self._changes.labels(label).inc(count)
            if repair:
                self._repairs.labels(label).inc(count)
        self._sync_duration.observe(result.duration_seconds)
        if result.converged:
            self._last_success.set(result.finished_at)
            self._converged.set(1)
        else:
            self._failed_syncs.inc()
            self._converged.set(0)

    def reconcile_error(self) -> None:
        """A reconcile pass raised instead of returning a result."""
        self._failed_syncs.inc()
        self._converged.set(0)

    def firewall_sync(self, repaired: bool) -> None:
        """A firewall sync (SyncResult.repaired): a repair counts as kind "rule"."""
        if repaired:
            self._changes.labels("rule").inc()
            self._repairs.labels("rule").inc()

    # -- store ------------------------------------------------------------------------

    def store_error(self, kind: str) -> None:
        """A failed store request; kind is short snake_case ("unavailable",
        "permission_denied", ... see store_error_kind)."""
        self._store_errors.labels(_label(kind)).inc()

    def watch_restart(self, reason: str) -> None:
        """The lease watch re-listed: reason "compacted", "unavailable" or "error"."""
        self._watch_restarts.labels(_label(reason, WATCH_RESTART_REASONS)).inc()

    def rejected_lease(self, reason: str) -> None:
        """A peer lease was ignored (a reason of :mod:`flannelpy.subnet.validate`)."""
        self._rejected.labels(_label(reason, REJECTION_REASONS)).inc()

    # -- prober -----------------------------------------------------------------------

    def probe(
        self,
        peer_subnet: IPv4Network | IPv6Network | str,
        reachable: bool,
        rtt_seconds: float | None,
        loss_ratio: float | None,
        mtu_ok: bool | None,
    ) -> None:
        """The prober's current view of one side of a peer, labelled by its lease subnet
        of that family and the family ("ipv4", "ipv6": at most two series per peer).
        None means "not known yet" and is exported as NaN."""
        peer = str(peer_subnet)
        family = _family(peer)
        with self._lock:
            self._probed.add(peer)
        self._reachable.labels(peer, family).set(1 if reachable else 0)
        self._rtt.labels(peer, family).set(_gauge_value(rtt_seconds))
        self._loss.labels(peer, family).set(_gauge_value(loss_ratio))
        self._mtu_ok.labels(peer, family).set(_gauge_value(mtu_ok))

    def forget_probe(self, peer_subnet: IPv4Network | IPv6Network | str) -> None:
        """Remove a peer's probe series of that subnet's family (it left the cluster)."""
        peer = str(peer_subnet)
        with self._lock:
            self._probed.discard(peer)
        for gauge in (self._reachable, self._rtt, self._loss, self._mtu_ok):
            gauge.remove(peer, _family(peer))

    def agent_event(self, kind: str) -> None:
        """The agent's writer handled one event (kind: one of AGENT_EVENT_KINDS)."""
        self._agent_events.labels(_label(kind, AGENT_EVENT_KINDS)).inc()

    # -- wireguard --------------------------------------------------------------------

    def wireguard_implementation(self, implementation: str) -> None:
        for name in WIREGUARD_IMPLEMENTATIONS:
            self._wg_impl.labels(name).set(1 if name == implementation else 0)

    def wireguard_unencrypted_peers(self, count: int) -> None:
        self._wg_unencrypted.set(count)

    def wireguard_repair(self, kind: str, count: int = 1) -> None:
        self._wg_repairs.labels(_label(kind, WIREGUARD_REPAIR_KINDS)).inc(count)

    # -- disruption policy ------------------------------------------------------------

    def blocked_operation(self, kind: str) -> None:
        """A disruptive operation refused by the policy (kind: short snake_case)."""
        self._blocked.labels(_label(kind)).inc()

    # -- output -----------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The registry in Prometheus text format (what /metrics serves)."""
        return self._renderer.render()

    def _read_links(self) -> Sequence[RoleStats] | None:
        fn = self._link_provider
        return None if fn is None else self._read("links", fn)

    def _read_kernel(self) -> KernelReading | None:
        fn = self._kernel_provider
        if fn is None:
            return None
        got = self._read("kernel", lambda: [fn()])
        return got[0] if got else None

    def _read_ipam(self) -> Sequence[Accounting] | None:
        fn = self._ipam_provider
        return None if fn is None else self._read("ipam", fn)

    def _read(self, provider: str, fn: Callable[[], Sequence[T]]) -> Sequence[T] | None:
        try:
            return fn()
        except Exception as e:  # a scrape must never fail as a whole
            log.warning("metrics provider failed provider=%s error=%s", provider, e)
            self._scrape_errors.labels(provider).inc()
            return None
