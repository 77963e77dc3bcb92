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
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Network
from typing import TypeVar

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

import flannelpy
from flannelpy.dataplane import nlbatch
from flannelpy.dataplane.nlbatch import LinkStats, LinkStatsRow
from flannelpy.dataplane.reconciler import ReconcileResult
from flannelpy.errors import KeyExists, RevisionCompacted, StoreError, StoreUnavailable
from flannelpy.ipam.allocator import Accounting
from flannelpy.observe.mtu import mtu_mismatches
from flannelpy.subnet.lease import Lease

log = logging.getLogger("flannelpy.observe.metrics")

T = TypeVar("T")

PREFIX = "flannelpy_"

# Interface roles (label ``role``) and what each one is.
ROLE_VXLAN = "vxlan"  # the backend's vxlan devices (flannel.<VNI>)
ROLE_BRIDGE = "bridge"  # the CNI bridge (cni0) itself
ROLE_UNDERLAY = "underlay"  # the interface that carries overlay traffic between nodes
ROLE_PODS = "pods"  # every veth port of the CNI bridge, summed
ROLES = (ROLE_VXLAN, ROLE_BRIDGE, ROLE_UNDERLAY, ROLE_PODS)
DIRECTIONS = ("rx", "tx")

# Reconciler change kinds (Changes.counts keys) plus the firewall's "rule".
CHANGE_KINDS = ("link", "address", "route", "neighbour", "fdb", "stale", "rule")
# Reasons of a pass that programs a new desired state rather than repairing the old one.
PROGRAMMING_REASONS = frozenset({"start", "desired state changed"})

CNI_COMMANDS = ("ADD", "DEL", "CHECK", "STATUS", "GC", "VERSION")
LEASE_STATES = ("serving", "draining")  # flannelpy_leases{state}
RENEWAL_RESULTS = ("success", "failure")
WATCH_RESTART_REASONS = ("compacted", "unavailable")

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
    # the metrics themselves
    "flannelpy_scrape_errors_total": "counter",
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
# Scrape-time providers
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class RoleStats:
    """One interface role at one instant: how many links, how many up, summed counters."""

    role: str
    interfaces: int
    up: int
    counters: LinkStats


LinkProvider = Callable[[], Sequence[RoleStats]]
IpamProvider = Callable[[], Sequence[Accounting]]


def _add(a: LinkStats, b: LinkStats) -> LinkStats:
    return LinkStats(*(x + y for x, y in zip(a, b, strict=True)))


def _is_up(flags: int) -> bool:
    want = nlbatch.IFF_UP | nlbatch.IFF_LOWER_UP
    return flags & want == want


def classify_links(
    rows: Iterable[LinkStatsRow],
    underlay: str | None,
    bridge: str = "cni0",
    vxlan_prefix: str = "flannel",
) -> dict[str, list[LinkStatsRow]]:
    """Group links by role: vxlan devices named ``<vxlan_prefix>*`` (flannel.1,
    flannel-v6.1), the bridge, the underlay, and the bridge's veth ports."""
    rows = list(rows)
    roles: dict[str, list[LinkStatsRow]] = {role: [] for role in ROLES}
    bridge_index = next((r.ifindex for r in rows if r.name == bridge), 0)
    for row in rows:
        if row.name == bridge:
            roles[ROLE_BRIDGE].append(row)
        elif underlay is not None and row.name == underlay:
            roles[ROLE_UNDERLAY].append(row)
        elif row.kind == "vxlan" and row.name.startswith(vxlan_prefix):
            roles[ROLE_VXLAN].append(row)
        elif bridge_index and row.master == bridge_index and row.kind == "veth":
            roles[ROLE_PODS].append(row)
    return roles


class RoleTotals:
    """Monotonic per-role sums of link counters across links coming and going.

    Keyed by ifindex: a link that vanished, or whose counters went down (its
    index reused by a new link), leaves its last counts in a retired total.
    """

    def __init__(self) -> None:
        self._seen: dict[str, dict[int, LinkStats]] = {role: {} for role in ROLES}
        self._retired: dict[str, LinkStats] = {role: LinkStats() for role in ROLES}

    def update(self, by_role: Mapping[str, Sequence[LinkStatsRow]]) -> list[RoleStats]:
        return [self._update_role(role, by_role.get(role, ())) for role in ROLES]

    def _update_role(self, role: str, rows: Sequence[LinkStatsRow]) -> RoleStats:
        seen = self._seen[role]
        retired = self._retired[role]
        current: dict[int, LinkStats] = {}
        total = LinkStats()
        for row in rows:
            before = seen.pop(row.ifindex, None)
            if before is not None and any(n < o for n, o in zip(row.stats, before, strict=True)):
                retired = _add(retired, before)
            current[row.ifindex] = row.stats
            total = _add(total, row.stats)
        for gone in seen.values():
            retired = _add(retired, gone)
        self._seen[role] = current
        self._retired[role] = retired
        up = sum(1 for row in rows if _is_up(row.flags))
        return RoleStats(role, len(rows), up, _add(retired, total))


class NetlinkLinkStats:
    """The real link provider: one netlink dump of every link per scrape.

    The socket is opened here, so it reads the network namespace of the thread
    that constructs the provider (the agent's), whichever thread scrapes later.
    ``underlay`` may be set later, when the agent has chosen its interface.
    """

    def __init__(
        self, underlay: str | None = None, bridge: str = "cni0", vxlan_prefix: str = "flannel"
    ) -> None:
        self.underlay = underlay
        self.bridge = bridge
        self.vxlan_prefix = vxlan_prefix
        self._sock = nlbatch.NetlinkSocket(rcvbuf=1024 * 1024)
        self._lock = threading.Lock()  # one socket, possibly concurrent scrapes
        self._totals = RoleTotals()

    def __call__(self) -> list[RoleStats]:
        with self._lock:
            rows = nlbatch.dump_link_stats(self._sock)
            roles = classify_links(rows, self.underlay, self.bridge, self.vxlan_prefix)
            return self._totals.update(roles)

    def close(self) -> None:
        self._sock.close()


# ---------------------------------------------------------------------------
# The metrics object
# ---------------------------------------------------------------------------


def _label(value: str, allowed: Sequence[str] | None = None) -> str:
    """A label value from a bounded set; anything else becomes "other" (cardinality guard)."""
    if allowed is not None:
        return value if value in allowed else "other"
    folded = value.strip().lower()
    return folded if _SAFE_LABEL.fullmatch(folded) else "other"


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
            "Lease watches re-listed after a compaction or an outage, by reason.",
            ["reason"], registry=r,
        )  # fmt: skip

        self._reachable = Gauge(
            "flannelpy_peer_reachable",
            "1 when the last probe of the peer (by its lease subnet) was answered.",
            ["peer"], registry=r,
        )  # fmt: skip
        self._rtt = Gauge(
            "flannelpy_peer_rtt_seconds", "Round-trip time of the last answered probe.",
            ["peer"], registry=r,
        )  # fmt: skip
        self._loss = Gauge(
            "flannelpy_peer_loss_ratio", "Share of recent probes not answered (0..1).",
            ["peer"], registry=r,
        )  # fmt: skip
        self._mtu_ok = Gauge(
            "flannelpy_peer_path_mtu_verified",
            "1 when a full overlay-MTU probe with DF set reached the peer, 0 when it failed.",
            ["peer"], registry=r,
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
        for provider in ("links", "ipam"):
            self._scrape_errors.labels(provider)
        self._mtu_mismatch.set(0)
        self._mtu_unknown.set(0)
        for state in LEASE_STATES:
            self._lease_count.labels(state).set(0)
        r.register(_ScrapeCollector(self))
        r.register(self._scrape_errors)

    # -- providers --------------------------------------------------------------------

    def set_link_provider(self, fn: LinkProvider | None) -> None:
        """Read interface counters per role at scrape time (e.g. a NetlinkLinkStats)."""
        self._link_provider = fn

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

    def lease(self, subnet: IPv4Network | str, expiration: float | None) -> None:
        """Our lease and its expiry (unix time; None: a permanent reservation)."""
        key = str(subnet)
        with self._lock:
            self._leases.add(key)
        self._lease_expiry.labels(key).set(math.inf if expiration is None else expiration)

    def drop_lease(self, subnet: IPv4Network | str) -> None:
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
            gone = self._probed - {str(lease.subnet) for lease in peers}
            vanished = self._backends - counts.keys()
            self._backends = set(counts)
        for backend, count in counts.items():
            self._peers.labels(backend).set(count)
        for backend in vanished:
            self._peers.remove(backend)
        for peer in gone:
            self.forget_probe(peer)
        self._update_mtu_consistency()

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
        """The lease watch re-listed: reason "compacted" or "unavailable"."""
        self._watch_restarts.labels(_label(reason, WATCH_RESTART_REASONS)).inc()

    # -- prober -----------------------------------------------------------------------

    def probe(
        self,
        peer_subnet: IPv4Network | str,
        reachable: bool,
        rtt_seconds: float | None,
        loss_ratio: float | None,
        mtu_ok: bool | None,
    ) -> None:
        """The prober's current view of one peer (labelled by its lease subnet).
        None means "not known yet" and is exported as NaN."""
        peer = str(peer_subnet)
        with self._lock:
            self._probed.add(peer)
        self._reachable.labels(peer).set(1 if reachable else 0)
        self._rtt.labels(peer).set(_gauge_value(rtt_seconds))
        self._loss.labels(peer).set(_gauge_value(loss_ratio))
        self._mtu_ok.labels(peer).set(_gauge_value(mtu_ok))

    def forget_probe(self, peer_subnet: IPv4Network | str) -> None:
        """Remove a peer's probe series (it left the cluster)."""
        peer = str(peer_subnet)
        with self._lock:
            self._probed.discard(peer)
        for gauge in (self._reachable, self._rtt, self._loss, self._mtu_ok):
            gauge.remove(peer)

    # -- disruption policy ------------------------------------------------------------

    def blocked_operation(self, kind: str) -> None:
        """A disruptive operation refused by the policy (kind: short snake_case)."""
        self._blocked.labels(_label(kind)).inc()

    # -- output -----------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The registry in Prometheus text format (what /metrics serves)."""
        return generate_latest(self.registry)

    def _read(self, provider: str, fn: Callable[[], Sequence[T]]) -> Sequence[T] | None:
        try:
            return fn()
        except Exception as e:  # a scrape must never fail as a whole
            log.warning("metrics provider failed provider=%s error=%s", provider, e)
            self._scrape_errors.labels(provider).inc()
            return None


class _ScrapeCollector(Collector):
    """Families whose values are read from the providers when Prometheus scrapes."""

    def __init__(self, owner: AgentMetrics) -> None:
        self._owner = owner

    def describe(self) -> Iterator[Metric]:
        # Names only, so registering never calls the providers.
        yield from _link_families()
        yield from _ipam_families()

    def collect(self) -> Iterator[Metric]:
        owner = self._owner
        links_fn = owner._link_provider
        if links_fn is not None:
            links = owner._read("links", links_fn)
            if links is not None:
                yield from _link_families(links)
        ipam_fn = owner._ipam_provider
        if ipam_fn is not None:
            pools = owner._read("ipam", ipam_fn)
            if pools is not None:
                yield from _ipam_families(pools)


def _link_families(stats: Sequence[RoleStats] = ()) -> list[Metric]:
    labels = ["role", "direction"]
    dropped = CounterMetricFamily(
        "flannelpy_interface_dropped_packets",
        "Packets dropped by managed interfaces (kernel link statistics), by role; "
        "role=pods sums every pod veth.",
        labels=labels,
    )
    errors = CounterMetricFamily(
        "flannelpy_interface_errors",
        "Receive/transmit errors of managed interfaces, by role.", labels=labels,
    )  # fmt: skip
    packets = CounterMetricFamily(
        "flannelpy_interface_packets", "Packets through managed interfaces, by role.",
        labels=labels,
    )  # fmt: skip
    octets = CounterMetricFamily(
        "flannelpy_interface_bytes", "Bytes through managed interfaces, by role.", labels=labels
    )
    count = GaugeMetricFamily(
        "flannelpy_interfaces", "Links in each role (role=pods: pod veths on the bridge).",
        labels=["role"],
    )  # fmt: skip
    up = GaugeMetricFamily(
        "flannelpy_interfaces_up", "Links in each role that are up with carrier.",
        labels=["role"],
    )  # fmt: skip
    for s in stats:
        c = s.counters
        for direction, drop, err, pkt, byt in (
            ("rx", c.rx_dropped, c.rx_errors, c.rx_packets, c.rx_bytes),
            ("tx", c.tx_dropped, c.tx_errors, c.tx_packets, c.tx_bytes),
        ):
            dropped.add_metric([s.role, direction], drop)
            errors.add_metric([s.role, direction], err)
            packets.add_metric([s.role, direction], pkt)
            octets.add_metric([s.role, direction], byt)
        count.add_metric([s.role], s.interfaces)
        up.add_metric([s.role], s.up)
    return [dropped, errors, packets, octets, count, up]


def _ipam_families(pools: Sequence[Accounting] = ()) -> list[Metric]:
    assigned = GaugeMetricFamily(
        "flannelpy_ipam_assigned_addresses", "Pod addresses assigned, per lease.",
        labels=["subnet"],
    )  # fmt: skip
    cooling = GaugeMetricFamily(
        "flannelpy_ipam_cooling_addresses",
        "Released addresses in cooldown, per lease: not usable yet, never counted as free.",
        labels=["subnet"],
    )  # fmt: skip
    free = GaugeMetricFamily(
        "flannelpy_ipam_free_addresses",
        "Addresses a new pod can get now (capacity - assigned - cooling), per lease.",
        labels=["subnet"],
    )  # fmt: skip
    capacity = GaugeMetricFamily(
        "flannelpy_ipam_capacity_addresses",
        "Allocatable addresses of the lease (without network, gateway, broadcast).",
        labels=["subnet"],
    )  # fmt: skip
    for a in pools:
        subnet = [str(a.subnet)]
        assigned.add_metric(subnet, a.assigned)
        cooling.add_metric(subnet, a.cooling)
        free.add_metric(subnet, a.free)
        capacity.add_metric(subnet, a.total)
    return [assigned, cooling, free, capacity]
