"""Prometheus metrics of the agent: one dedicated registry, Prometheus naming.

Two kinds of values:

- **events**, reported by the agent as they happen (a CNI request, a reconcile
  pass, a renewal, a probe): one :class:`AgentMetrics` method call each;
- **state read at scrape time** (link counters, IPAM accounting), from
  providers the agent registers. Reading when Prometheus asks costs nothing
  between scrapes and is never stale.

The families themselves (names, help texts, labels, buckets) are declared in
:mod:`flannelpy.observe.metric_families`.

Summed counters stay monotonic: when a link disappears (a pod deleted) its
last counts are kept in the role's total, so Prometheus never sees the sum
fall and mistake it for a counter reset. What a link counted between the last
scrape and its deletion is lost; that is the price of never storing per-pod
series.
"""

from __future__ import annotations

import logging
import math
import operator
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from ipaddress import IPv4Network, IPv6Network
from typing import TypeVar

from prometheus_client import CollectorRegistry, disable_created_metrics

from flannelpy.dataplane.linkstats import RoleStats
from flannelpy.dataplane.reconciler import ReconcileResult
from flannelpy.errors import KeyExists, RevisionCompacted, StoreError, StoreUnavailable
from flannelpy.ipam.allocator import Accounting
from flannelpy.observe.exposition import TextRenderer
from flannelpy.observe.kernel_counters import KernelCollector, KernelReading
from flannelpy.observe.metric_families import (
    AGENT_EVENT_KINDS,
    CHANGE_KINDS,
    CNI_COMMANDS,
    POLICY_OBJECT_KINDS,
    REJECTION_REASONS,
    RENEWAL_RESULTS,
    WATCH_RESTART_REASONS,
    WIREGUARD_IMPLEMENTATIONS,
    WIREGUARD_REPAIR_KINDS,
    CniFamilies,
    LeaseFamilies,
    MtuFamilies,
    ProbeFamilies,
    ReconcileFamilies,
    StoreFamilies,
    WireguardFamilies,
    register_agent_events,
    register_blocked_operations,
    register_build_info,
    register_policy_refusals,
    unregistered_scrape_errors,
)
from flannelpy.observe.mtu import MtuReport, mtu_mismatches
from flannelpy.observe.policy_metrics import PolicyCollector, PolicyReading
from flannelpy.observe.scrape import IpamProvider, LinkProvider, ScrapeCollector
from flannelpy.subnet.lease import Lease
from flannelpy.subnet.memo import LeaseList

log = logging.getLogger("flannelpy.observe.metrics")

T = TypeVar("T")

# Reasons of a pass that programs a new desired state rather than repairing the old one.
PROGRAMMING_REASONS = frozenset({"start", "desired state changed"})

_SAFE_LABEL = re.compile(r"[a-z0-9][a-z0-9_.-]{0,39}")


def _label(value: str, allowed: Sequence[str] | None = None) -> str:
    """A label value from a bounded set; anything else becomes "other" (cardinality guard)."""
    if allowed is not None:
        return value if value in allowed else "other"
    folded = value.strip().lower()
    return folded if _SAFE_LABEL.fullmatch(folded) else "other"


_backend_type = operator.attrgetter("attrs.backend_type")  # of a Lease, in C


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
        self._policy_provider: Callable[[], PolicyReading | None] | None = None
        self._overlay_mtu: int | None = None
        self._peer_leases: list[Lease] = []
        self._peer_types: Counter[str | None] = Counter()  # of _peer_leases, by backend
        self._backends: set[str] = set()
        self._leases: set[str] = set()
        self._pools: set[str] = set()
        r = self.registry
        # Registration order is exposition order.
        register_build_info(r)
        self._cni = CniFamilies(r)
        self._lease = LeaseFamilies(r)
        self._reconcile = ReconcileFamilies(r)
        self._store = StoreFamilies(r)
        self._probe = ProbeFamilies(r)
        self._mtu = MtuFamilies(r)
        self._agent_events = register_agent_events(r)
        self._wireguard = WireguardFamilies(r)
        self._blocked = register_blocked_operations(r)
        self._policy_refused = register_policy_refusals(r)
        self._scrape_errors = unregistered_scrape_errors()
        r.register(ScrapeCollector(self._read_links, self._read_ipam))
        r.register(KernelCollector(self._read_kernel))
        r.register(PolicyCollector(self._read_policy))
        # Last, so that a failing reading is counted in the very scrape it fails in.
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

    def set_policy_provider(self, fn: Callable[[], PolicyReading | None] | None) -> None:
        """Read NetworkPolicy's counts and the kernel's denial counters at scrape time
        (``NetworkPolicySync.reading``)."""
        self._policy_provider = fn

    def set_ipam_provider(self, fn: IpamProvider | None) -> None:
        """Read IPAM accounting per lease at scrape time (e.g. ``NodeIpam.accounting``)."""
        self._ipam_provider = fn

    # -- CNI --------------------------------------------------------------------------

    def cni_request(self, command: str, code: int, seconds: float) -> None:
        """One CNI request answered: its command, CNI result code (0: success), duration."""
        cmd = _label(command.upper(), CNI_COMMANDS)
        self._cni.requests.labels(cmd, str(int(code))).inc()
        self._cni.duration.labels(cmd).observe(max(0.0, seconds))

    # -- leases -----------------------------------------------------------------------

    def lease(self, subnet: IPv4Network | IPv6Network | str, expiration: float | None) -> None:
        """Our lease and its expiry (unix time; None: a permanent reservation)."""
        key = str(subnet)
        with self._lock:
            self._leases.add(key)
        self._lease.expiry.labels(key).set(math.inf if expiration is None else expiration)

    def drop_lease(self, subnet: IPv4Network | IPv6Network | str) -> None:
        """Our lease is gone (replaced or released): remove its expiry series."""
        key = str(subnet)
        with self._lock:
            self._leases.discard(key)
        self._lease.expiry.remove(key)

    def lease_counts(self, serving: int, draining: int) -> None:
        """How many leases this node holds that serve new pods, and how many drain."""
        self._lease.held.labels("serving").set(serving)
        self._lease.held.labels("draining").set(draining)

    def lease_limit(self, maximum: int) -> None:
        """MaxLeasesPerNode as configured now."""
        self._lease.held_max.set(maximum)

    def pool_utilisation(self, ratios: Mapping[IPv4Network | IPv6Network | str, float]) -> None:
        """Every known pool's utilisation by CIDR (``PoolCapacity.utilisation`` of
        ``subnet.pools.capacity``); pools not in ``ratios`` any more lose their series.
        Values are clamped to 0..1."""
        values = {str(pool): min(1.0, max(0.0, ratio)) for pool, ratio in ratios.items()}
        with self._lock:  # two callers must not interleave set and remove
            for pool in self._pools - values.keys():
                self._lease.pool_utilisation.remove(pool)
            self._pools = set(values)
            for pool, ratio in values.items():
                self._lease.pool_utilisation.labels(pool).set(ratio)

    def renewal(self, result: str) -> None:
        """A lease renewal attempt: "success" or "failure"."""
        self._lease.renewals.labels(_label(result, RENEWAL_RESULTS)).inc()

    def peers(self, leases: Iterable[Lease], mtu: MtuReport | None = None) -> None:
        """The current peer leases (other nodes only, never ours): counts by backend,
        MTU mismatches against the overlay MTU (``mtu``: the caller's report of these
        peers, else computed). The probe series of peers that left go by
        :meth:`forget_probes` (the planner knows which left)."""
        last = self._peer_leases
        if (
            isinstance(leases, LeaseList)
            and isinstance(last, LeaseList)
            and (leases.follows is last.token)
        ):
            peers: list[Lease] = leases  # counted by the leases that came and went
            by_type = self._peer_types
            by_type.update(map(_backend_type, leases.added))
            gone = list(map(_backend_type, leases.dropped))
            by_type.subtract(gone)
            for backend_type in gone:  # no key outlives its last peer
                if not by_type.get(backend_type, 1):
                    del by_type[backend_type]
        else:
            peers = leases if isinstance(leases, LeaseList) else list(leases)
            by_type = self._peer_types = Counter(map(_backend_type, peers))  # in C
        counts: dict[str, int] = {}
        for backend_type, count in by_type.items():
            backend = _label(backend_type or "unknown")
            counts[backend] = counts.get(backend, 0) + count
        with self._lock:
            self._peer_leases = peers
            vanished = self._backends - counts.keys()
            self._backends = set(counts)
        for backend, count in counts.items():
            self._lease.peers.labels(backend).set(count)
        for backend in vanished:
            self._lease.peers.remove(backend)
        self._update_mtu_consistency(mtu)

    def forget_probes(self, peer_subnets: Iterable[str]) -> None:
        """Remove the probe series of these peers' subnets (the prober no longer follows
        them); those of no series are ignored."""
        for peer in peer_subnets:
            self._probe.remove(peer, _family(peer))

    def peers_without_path(self, count: int) -> None:
        """How many peers the latest plan found no path to (not a readiness matter)."""
        self._lease.without_path.set(count)

    def overlay_mtu(self, mtu: int) -> None:
        """This node's overlay MTU (the one it advertises and gives pods)."""
        with self._lock:
            self._overlay_mtu = mtu
        self._mtu.overlay.set(mtu)
        self._update_mtu_consistency()

    def _update_mtu_consistency(self, report: MtuReport | None = None) -> None:
        with self._lock:
            own, peers = self._overlay_mtu, self._peer_leases
        if own is None:
            return
        if report is None or report.own_mtu != own:
            report = mtu_mismatches(own, peers)
        self._mtu.mismatch.set(len(report.mismatched))
        self._mtu.unknown.set(report.unknown)

    # -- reconciler -------------------------------------------------------------------

    def observe_reconcile(self, result: ReconcileResult) -> None:
        """A finished reconcile pass (the Reconciler's ``on_result``)."""
        counts = {k: v for k, v in result.changes.counts.items() if v}
        reasons = {r.strip() for r in result.reason.split(",")}
        repair = not reasons & PROGRAMMING_REASONS
        for kind, count in counts.items():
            label = _label(kind, CHANGE_KINDS)
            self._reconcile.changes.labels(label).inc(count)
            if repair:
                self._reconcile.repairs.labels(label).inc(count)
        self._reconcile.sync_duration.observe(result.duration_seconds)
        if result.converged:
            self._reconcile.last_success.set(result.finished_at)
            self._reconcile.converged.set(1)
        else:
            self._reconcile.failed_syncs.inc()
            self._reconcile.converged.set(0)

    def reconcile_error(self) -> None:
        """A reconcile pass raised instead of returning a result."""
        self._reconcile.failed_syncs.inc()
        self._reconcile.converged.set(0)

    def firewall_sync(self, repaired: bool) -> None:
        """A firewall sync (SyncResult.repaired): a repair counts as kind "rule"."""
        if repaired:
            self._reconcile.changes.labels("rule").inc()
            self._reconcile.repairs.labels("rule").inc()

    # -- store ------------------------------------------------------------------------

    def store_error(self, kind: str) -> None:
        """A failed store request; kind is short snake_case ("unavailable",
        "permission_denied", ... see store_error_kind)."""
        self._store.errors.labels(_label(kind)).inc()

    def watch_restart(self, reason: str) -> None:
        """The lease watch re-listed: "compacted", "unavailable", "malformed" or "error"."""
        self._store.watch_restarts.labels(_label(reason, WATCH_RESTART_REASONS)).inc()

    def rejected_lease(self, reason: str) -> None:
        """A peer lease was ignored (a reason of :mod:`flannelpy.subnet.validate`)."""
        self._store.rejected.labels(_label(reason, REJECTION_REASONS)).inc()

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
        values = (
            1.0 if reachable else 0.0,
            _gauge_value(rtt_seconds),
            _gauge_value(loss_ratio),
            _gauge_value(mtu_ok),
        )
        self._probe.set(peer, _family(peer), values)

    def agent_event(self, kind: str) -> None:
        """The agent's writer handled one event (kind: one of AGENT_EVENT_KINDS)."""
        self._agent_events.labels(_label(kind, AGENT_EVENT_KINDS)).inc()

    # -- wireguard --------------------------------------------------------------------

    def wireguard_implementation(self, implementation: str) -> None:
        for name in WIREGUARD_IMPLEMENTATIONS:
            self._wireguard.implementation.labels(name).set(1 if name == implementation else 0)

    def wireguard_unencrypted_peers(self, count: int) -> None:
        self._wireguard.unencrypted.set(count)

    def wireguard_repair(self, kind: str, count: int = 1) -> None:
        self._wireguard.repairs.labels(_label(kind, WIREGUARD_REPAIR_KINDS)).inc(count)

    # -- disruption policy ------------------------------------------------------------

    def blocked_operation(self, kind: str) -> None:
        """A disruptive operation refused by the policy (kind: short snake_case)."""
        self._blocked.labels(_label(kind)).inc()

    # -- NetworkPolicy ----------------------------------------------------------------

    def policy_refused(self, kind: str) -> None:
        """An API object the policy compiler cannot represent (kind: POLICY_OBJECT_KINDS)."""
        self._policy_refused.labels(_label(kind, POLICY_OBJECT_KINDS)).inc()

    # -- output -----------------------------------------------------------------------

    def exposition(self) -> bytes:
        """The registry in Prometheus text format (what /metrics serves)."""
        return self._renderer.render()

    def _read_links(self) -> Sequence[RoleStats] | None:
        fn = self._link_provider
        return None if fn is None else self._read("links", fn)

    def _read_kernel(self) -> KernelReading | None:
        return self._read_one("kernel", self._kernel_provider)

    def _read_policy(self) -> PolicyReading | None:
        return self._read_one("policy", self._policy_provider)

    def _read_one(self, provider: str, fn: Callable[[], T | None] | None) -> T | None:
        if fn is None:
            return None
        got = self._read(provider, lambda: [fn()])
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
