"""The node agent: the composition root and the loops that keep the node in shape.

Start-up order matters and is the whole of ``NodeAgent.start``: validate
everything before touching the host; acquire our lease; wait for the first
full lease snapshot (never program an empty peer set over a live one); one
synchronous reconcile; only then write subnet.env and report ready. After
that, threads keep it so: lease watch, reconciler, kernel event watch,
firewall resync and lease renewal, all under one stop event.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from ipaddress import IPv4Address, IPv4Interface, IPv4Network
from pathlib import Path

from flannelpy.backend.base import Backend, NodeContext
from flannelpy.backend.registry import get_backend
from flannelpy.config.netconf import NetworkConfig
from flannelpy.config.settings import AgentSettings
from flannelpy.control.change import ChangeDecision, decide_change, wanted_config
from flannelpy.control.node_control import ControlSnapshot, NodeControl
from flannelpy.control.policy import ETCD_REMEDY, KUBE_REMEDY
from flannelpy.control.records import (
    BackendSummary,
    BlockedChange,
    NodeOverride,
    NodeStatus,
    PeerProbe,
)
from flannelpy.dataplane.ethtool import set_tx_checksum
from flannelpy.dataplane.kernel import Kernel
from flannelpy.dataplane.reconciler import Reconciler, ReconcileResult
from flannelpy.dataplane.state import Unreachable
from flannelpy.errors import (
    ConfigError,
    DataplaneError,
    FlannelpyError,
    PoolExhausted,
    StoreError,
    StoreUnavailable,
)
from flannelpy.ipam.capacity import (
    CapacitySettings,
    parse_capacity,
    plan_capacity,
    update_empty_since,
)
from flannelpy.observe.health import HealthServer, Heartbeats, readiness
from flannelpy.observe.metrics import AgentMetrics, NetlinkLinkStats
from flannelpy.observe.mtu import MtuReport, describe_mismatch, describe_unknown, mtu_mismatches
from flannelpy.observe.prober import IcmpTransport, Prober, ProbeResult
from flannelpy.subnet.choose import lease_fits_pools
from flannelpy.subnet.etcd.pools import PoolStore, records_to_pools
from flannelpy.subnet.lease import Lease, LeaseAttrs
from flannelpy.subnet.manager import SubnetManager
from flannelpy.subnet.pools import Pool, eligibility
from flannelpy.subnet.pools import capacity as pool_capacity
from flannelpy.subnet.subnet_env import SubnetEnv, read_previous_subnet, write_subnet_env
from flannelpy.subnet.survey import check_no_overlap

log = logging.getLogger("flannelpy.agent.node")

# (pod ranges, our lease subnets) -> a sync that returns True once the rules are in place
FirewallFactory = Callable[[Sequence[IPv4Network], Sequence[IPv4Network]], Callable[[], bool]]

FIRST_SNAPSHOT_TIMEOUT = 30.0  # seconds to wait for the first lease list after acquiring
RENEW_RETRY_SECONDS = 60.0  # Flannel's retry interval for a failed renewal
THREAD_GRACE_SECONDS = 5.0
STATUS_INTERVAL_SECONDS = 2.0  # how often <run-dir>/status.json is refreshed
BLOCKED_RECHECK_SECONDS = 30.0  # a blocked change is looked at again this often (windows open)
CONTROL_RETRY_SECONDS = 5.0  # a config change whose application failed is retried this often
TRANSITION_SECONDS = 60.0  # after a change, the store status follows every probe round
APPLIED_FILE = "applied-backend.json"  # in --state-dir: the Backend this node last applied
CAPACITY_TICK = 5.0  # seconds: drained leases empty and hold-downs end without an event


def node_name_default(settings: AgentSettings) -> str:
    return settings.node_name or os.environ.get("NODE_NAME") or socket.gethostname()


class NodeAgent:
    def __init__(
        self,
        settings: AgentSettings,
        manager: SubnetManager,
        kernel: Kernel,
        backend: Backend,
        ctx: NodeContext,
        vtep_mac: str | None,
        firewall_factory: FirewallFactory | None,
        metrics: AgentMetrics | None = None,
        control: NodeControl | None = None,
        applied_generation: int | None = None,
        pools: list[Pool] | None = None,
        capacity: CapacitySettings | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or AgentMetrics()
        self.beats = Heartbeats()
        self.manager = manager
        self.kernel = kernel
        self.backend = backend
        self.ctx = ctx
        self.vtep_mac = vtep_mac  # loaded once a VTEP is wanted (always with vxlan)
        self._vtep_advertised = False  # whether our lease carries our VTEP
        self._known_devices: set[str] = set(backend.device_names(ctx))
        self.control = control
        self._control: ControlSnapshot | None = None
        self._control_pending = False
        self._applied_generation = applied_generation
        self._applied_at = time.time()
        self._blocked: BlockedChange | None = None
        self._blocked_counted: set[tuple[int | None, tuple[str, ...]]] = set()
        self._said_once: set[str] = set()
        self._probe_at: dict[str, float] = {}
        self._published: tuple[str, float] = ("", 0.0)  # status without time, when
        self._wake = threading.Event()  # work for the main loop
        self._attrs_dirty = False
        self._firewall_factory = firewall_factory
        self._firewall_sync: Callable[[], bool] | None = None
        self._rules_in_place = firewall_factory is None
        self._subnet_env_written = False
        self.stop = threading.Event()
        self._lease_lock = threading.Lock()
        self._own: list[Lease] = []  # our leases, oldest first
        self._leases: Mapping[str, Lease] = {}  # every lease in the store, ours included
        assert ctx.config.network is not None  # build_agent refuses a config without it
        self._pools: list[Pool] = list(pools or [Pool(ctx.config.network, primary=True)])
        self._capacity: CapacitySettings = capacity or CapacitySettings()
        self._capacity_due = True
        self._empty_since: dict[IPv4Network, float] = {}
        self._ipam_view: tuple[tuple[IPv4Network, ...], ...] = ()
        self._firewall_view: tuple[tuple[IPv4Network, ...], ...] = ()
        self._first_snapshot = threading.Event()
        self._lease_lost = threading.Event()
        self._unreachable: frozenset[Unreachable] = frozenset()
        self.reconciler = Reconciler(
            kernel, settings.resync_interval, self._on_reconciled, self.metrics.reconcile_error
        )
        self.cni = PodAttachments(
            settings, lambda: self.backend.mtu(self.ctx), lambda: self.ready, self.metrics
        )
        self._servers: list[HealthServer] = []
        self._loops_running = False
        self._threads: list[threading.Thread] = []
        self.prober: Prober | None = None
        self._probe_transport: IcmpTransport | None = None
        self._mtu_report: MtuReport | None = None
        self._failure: BaseException | None = None
        self.ready = False

    @property
    def config(self) -> NetworkConfig:
        return self.ctx.config

    # -- leases ---------------------------------------------------------------------------
    #
    # A node holds an ordered set of leases, oldest first: the one acquired at start
    # (Flannel's order), then those added for warm capacity or a new pool. Only the
    # main loop (start, then run_until_stopped) changes the set.

    @property
    def lease(self) -> Lease | None:
        """Our first lease (what subnet.env and Flannel's single-lease view show)."""
        with self._lease_lock:
            return self._own[0] if self._own else None

    def own_leases(self) -> list[Lease]:
        with self._lease_lock:
            return list(self._own)

    def _peers(self) -> list[Lease]:
        with self._lease_lock:
            own_keys = {lease.key for lease in self._own}
            return [p for k, p in self._leases.items() if k not in own_keys]

    def _lease_attrs(self) -> LeaseAttrs:
        mac = self._vtep_mac_if_needed(self._peers())
        self._vtep_advertised = mac is not None
        return self.backend.lease_attrs(self.ctx, mac)

    def _vtep_mac_if_needed(self, peers: list[Lease]) -> str | None:
        """Our VTEP MAC if we keep a VTEP now (always with vxlan; with host-gw while a
        peer may still encapsulate to us), else None."""
        if not self.backend.needs_vtep(self.ctx, peers):
            return None
        if self.vtep_mac is None:
            from flannelpy.backend.vxlan import device_name

            self.vtep_mac = load_vtep_mac(
                self.kernel, self.settings.state_dir, device_name(self.config.backend.vni)
            )
        return self.vtep_mac

    def _acquire(self, previous: IPv4Network | None) -> Lease:
        attrs = self._lease_attrs()
        lease = self.manager.acquire_lease(
            attrs, previous, self._pools_for_leasing(), self.settings.cluster_name
        )
        self.metrics.lease(lease.subnet, lease.expiration)
        log.info(
            "lease acquired subnet=%s public_ip=%s backend=%s",
            lease.subnet, attrs.public_ip, attrs.backend_type,
        )
        return lease

    def _pools_for_leasing(self) -> list[Pool] | None:
        """The pools to lease from; None (the config's Network alone, Flannel's way)
        while no pool beyond the primary exists and the primary is untagged."""
        pools = self._pools
        if len(pools) == 1 and pools[0].primary and not pools[0].tags:
            return None
        return pools

    def _on_leases(self, leases: Mapping[str, Lease], revision: int) -> None:
        with self._lease_lock:
            self._leases = dict(leases)
            own = list(self._own)
        for lease in own:
            current = leases.get(lease.key)
            if current is None or current.attrs.public_ip != lease.attrs.public_ip:
                self._lease_lost.set()
                self._wake.set()
        self._replan()
        self._first_snapshot.set()

    def _replan(self) -> None:
        own = self.own_leases()
        if not own:
            return
        peers = self._peers()
        self.metrics.peers(peers)
        self._check_mtu(peers)
        if self.prober is not None:
            # Each lease's overlay address is its first address (on the owner's cni0).
            self.prober.set_peers(
                {str(p.subnet): (p.gateway, p.attrs.node_name or str(p.attrs.public_ip))
                 for p in peers}
            )
        vtep_mac = self._vtep_mac_if_needed(peers)
        if (vtep_mac is not None) != self._vtep_advertised and not self._attrs_dirty:
            self._attrs_dirty = True  # the main loop rewrites our lease
            self._wake.set()
        desired = self.backend.plan(self.ctx, own, peers, vtep_mac)
        stale_links = frozenset(
            self._known_devices - {link.name for link in desired.links}
        )
        if desired.unreachable != self._unreachable:
            for peer in sorted(desired.unreachable - self._unreachable, key=lambda u: u.subnet):
                log.warning("peer unreachable subnet=%s reason=%s", peer.subnet, peer.reason)
            self._unreachable = desired.unreachable
        self.reconciler.set_desired(desired, stale_links)

    def _check_mtu(self, peers: list[Lease]) -> None:
        """Peers must agree on the overlay MTU, or large packets vanish silently between them.

        Between nodes on different backends (a backend switch under way) the MTUs differ
        by design; that is said once at info level, not warned per peer."""
        report = mtu_mismatches(self.backend.mtu(self.ctx), peers)
        if self._mtu_report is None or report.mismatched != self._mtu_report.mismatched:
            backend_of = {p.subnet: p.attrs.backend_type for p in peers}
            mixed = [p for p in report.mismatched
                     if backend_of.get(p.subnet) != self.backend.type_name]  # fmt: skip
            for peer in report.mismatched:
                if peer not in mixed:
                    log.warning("MTU mismatch: %s", describe_mismatch(report.own_mtu, peer))
            for peer in report.unknown:
                log.warning("MTU mismatch: %s", describe_unknown(peer))
            if mixed:
                log.info(
                    "overlay MTU differs from %d peer lease(s) on another backend, as expected "
                    "while backends are mixed; pods keep their MTU until re-created", len(mixed),
                )  # fmt: skip
        self._mtu_report = report

    def _own_subnets(self) -> list[IPv4Network]:
        return [lease.subnet for lease in self.own_leases()]

    def _is_ours(self, lease: Lease) -> bool:
        """A lease advertising our address under our name (or no name): ours from an
        earlier run, e.g. a second lease the node held before a restart."""
        attrs = lease.attrs
        return attrs.public_ip == self.ctx.public_ip and attrs.node_name in (
            None, self.ctx.node_name,
        )  # fmt: skip

    def _adopt_own_leases(self) -> None:
        """After the first snapshot: take back every other lease that is ours. Its pods
        keep their addresses (IPAM state is on disk); an empty one is released later."""
        with self._lease_lock:
            own_keys = {lease.key for lease in self._own}
            found = sorted(
                (lease for key, lease in self._leases.items()
                 if key not in own_keys and self._is_ours(lease)),
                key=lambda lease: lease.subnet,
            )  # fmt: skip
            self._own.extend(found)
        for lease in found:
            self.metrics.lease(lease.subnet, lease.expiration)
            log.info("kept a lease this node already held subnet=%s", lease.subnet)

    def _recover_lost_leases(self) -> None:
        """Our lease keys vanished (deleted by hand, expired while the store was away)
        or were taken over: re-create what is still free, else let go."""
        with self._lease_lock:
            current = dict(self._leases)
        for index, lease in enumerate(self.own_leases()):
            now = current.get(lease.key)
            if now is not None and now.attrs.public_ip == lease.attrs.public_ip:
                continue
            if index == 0:
                self._reacquire_first(lease)
                continue
            log.warning("own lease disappeared from the store; re-creating subnet=%s",
                        lease.subnet)  # fmt: skip
            try:
                renewed = self.manager.renew_lease(lease)
            except StoreError as e:
                log.error("lease lost to another node; pods on it lose connectivity "
                          "subnet=%s error=%s", lease.subnet, e)  # fmt: skip
                self._forget_lease(lease)
                continue
            self._replace_own(renewed)

    def _reacquire_first(self, old: Lease) -> None:
        log.warning("own lease disappeared from the store; re-acquiring subnet=%s", old.subnet)
        lease = self._acquire(old.subnet)
        with self._lease_lock:
            self._own = [lease, *(x for x in self._own[1:] if x.key != lease.key)]
        self._replan()
        if lease.subnet != old.subnet:
            log.warning("lease changed old=%s new=%s", old.subnet, lease.subnet)
            self.metrics.drop_lease(old.subnet)
            # Pods on the old subnet keep their addresses on disk; new pods use the new one.
            self._capacity_due = True
            self._write_subnet_env()
            self._setup_firewall()

    def _replace_own(self, renewed: Lease) -> None:
        with self._lease_lock:
            self._own = [renewed if x.key == renewed.key else x for x in self._own]
        self.metrics.lease(renewed.subnet, renewed.expiration)

    def _forget_lease(self, lease: Lease) -> None:
        with self._lease_lock:
            self._own = [x for x in self._own if x.key != lease.key]
        self.metrics.drop_lease(lease.subnet)
        self._replan()
        self._capacity_due = True
        self._setup_firewall()

    def _renew_loop(self, stop: threading.Event) -> None:
        margin = self.settings.subnet_lease_renew_margin * 60.0
        retry_at: dict[str, float] = {}
        while not stop.is_set():

            def due(lease: Lease) -> float:
                expiration = lease.expiration or (time.time() + RENEW_RETRY_SECONDS + margin)
                return max(expiration - margin, retry_at.get(lease.key, 0.0))

            own = self.own_leases()
            if not own:
                if stop.wait(RENEW_RETRY_SECONDS):
                    return
                continue
            lease = min(own, key=due)
            # Wake at least every minute: the set of leases may have changed meanwhile.
            if stop.wait(min(RENEW_RETRY_SECONDS, max(0.0, due(lease) - time.time()))):
                return
            # The main loop may have rewritten the lease (new attrs) while we waited:
            # renew the current version, or the renewal would write the old attrs back.
            lease = next((x for x in self.own_leases() if x.key == lease.key), lease)
            if time.time() < due(lease) or lease.key not in {x.key for x in self.own_leases()}:
                continue
            try:
                renewed = self.manager.renew_lease(lease)
            except StoreError as e:
                self.metrics.renewal("failure")
                retry_at[lease.key] = time.time() + RENEW_RETRY_SECONDS
                log.warning("lease renewal failed, retrying in %ss subnet=%s: %s",
                            RENEW_RETRY_SECONDS, lease.subnet, e)  # fmt: skip
                continue
            retry_at.pop(lease.key, None)
            self.metrics.renewal("success")
            with self._lease_lock:
                still_ours = any(x.key == renewed.key for x in self._own)
            if still_ours:
                self._replace_own(renewed)
            log.info("lease renewed subnet=%s expires=%s", renewed.subnet, renewed.expiration)

    # -- capacity: several leases, pools, warm spare addresses ------------------------------

    def _lease_serves(self, lease: Lease) -> bool:
        """May new pods get addresses here? Per the lease's pool tags (field notes §3);
        a lease in no known pool keeps serving (reconciliation fails open)."""
        pool = lease_fits_pools(self.config, self._pools, lease.subnet, lease.ipv6_subnet)
        return pool is None or eligibility(pool, self.settings.cluster_name).allocate_addresses

    def _sync_ipam(self) -> None:
        """Hand IPAM and the bridge the current leases and which of them serve."""
        own = self.own_leases()
        subnets = [lease.subnet for lease in own]
        serving = [lease.subnet for lease in own if self._lease_serves(lease)]
        view = (tuple(subnets), tuple(serving))
        if view == self._ipam_view:
            return
        first_serving_before = self._ipam_view[1][:1] if self._ipam_view else ()
        self.cni.use_leases(subnets, serving)
        self._ipam_view = view
        self.metrics.lease_counts(len(serving), len(subnets) - len(serving))
        self.metrics.lease_limit(self._capacity.max_leases_per_node)
        if self._subnet_env_written and tuple(serving[:1]) != first_serving_before:
            self._write_subnet_env()

    def _manage_capacity(self) -> None:
        """Add a lease before the node runs dry, release what is drained or surplus."""
        self._capacity_due = False
        self._sync_ipam()
        if self.settings.kube_subnet_mgr:
            return  # the controller-manager owns pod CIDRs: one lease, its podCIDR
        usage = self.cni.ipam.usage()
        now = time.time()
        self._empty_since = update_empty_since(usage, self._empty_since, now)
        plan = plan_capacity(usage, self._capacity, now, self._empty_since)
        if plan.acquire:
            self._add_lease(plan.reason)
        for subnet in plan.release:
            self._release_lease(subnet, plan.reason)
        self._pool_metrics()

    def _add_lease(self, reason: str) -> None:
        attrs = self._lease_attrs()
        try:
            lease = self.manager.create_lease(attrs, self._pools, self.settings.cluster_name)
        except (PoolExhausted, ConfigError) as e:
            self._say_once(f"capacity:{e}", "cannot add a lease: %s", e)
            return
        except StoreError as e:
            log.warning("adding a lease failed, retrying: %s", e)
            self._capacity_due = True
            return
        with self._lease_lock:
            self._own.append(lease)
        self.metrics.lease(lease.subnet, lease.expiration)
        log.info("lease added subnet=%s reason=%r", lease.subnet, reason)
        self._sync_ipam()
        self._replan()
        self._setup_firewall()

    def _release_lease(self, subnet: IPv4Network, reason: str) -> None:
        lease = next((x for x in self.own_leases() if x.subnet == subnet), None)
        if lease is None or not self.cni.ipam.remove_lease_if_empty(subnet):
            return  # a pod landed meanwhile: it stays
        # IPAM first (no ADD can land now), then the bridge, then peers learn it is gone.
        self.cni.pods.remove_gateway(IPv4Interface(f"{lease.gateway}/{subnet.prefixlen}"))
        try:
            self.manager.release_lease(lease)
        except StoreError as e:
            log.warning("releasing a lease failed; it expires by itself subnet=%s error=%s",
                        subnet, e)  # fmt: skip
        self._empty_since.pop(subnet, None)
        self._forget_lease(lease)
        self._sync_ipam()
        log.info("lease released subnet=%s reason=%r", subnet, reason)

    def _pool_metrics(self) -> None:
        with self._lease_lock:
            leases = list(self._leases.values())
        self.metrics.pool_utilisation(
            {c.pool.network: c.utilisation for c in pool_capacity(self.config, self._pools, leases)}
        )

    def _on_low_free(self, free: int) -> None:
        """IPAM's warning, from a CNI request's thread: only wake the main loop."""
        self._capacity_due = True
        self._wake.set()

    # -- outputs --------------------------------------------------------------------------

    def _write_subnet_env(self) -> None:
        """Flannel's subnet.env names one subnet: our first lease that takes new pods."""
        own = self.own_leases()
        assert own and self.config.network is not None
        lease = next((x for x in own if self._lease_serves(x)), own[0])
        env = SubnetEnv(
            network=self.config.network,
            subnet=IPv4Interface(f"{lease.gateway}/{lease.subnet.prefixlen}"),
            mtu=self.backend.mtu(self.ctx),
            ipmasq=self.settings.ip_masq,
        )
        write_subnet_env(self.settings.subnet_file, env)
        self._subnet_env_written = True

    def _setup_firewall(self) -> None:
        """masq and forward rules for every pod range (all pools) and every lease we hold."""
        own = self._own_subnets()
        if self._firewall_factory is None or not own:
            return
        networks = [pool.network for pool in self._pools]
        if self.config.network is not None and self.config.network not in networks:
            networks.insert(0, self.config.network)
        # Pools without leases of ours still need rules: our pods talk to theirs.
        view = (tuple(networks), tuple(own))
        if view == self._firewall_view and self._firewall_sync is not None:
            return
        self._firewall_view = view
        self._firewall_sync = self._firewall_factory(networks, own)
        self._rules_in_place = self._firewall_sync()

    def _firewall_loop(self, stop: threading.Event) -> None:
        while not stop.wait(self.settings.iptables_resync):
            self.beats.beat("firewall")
            if self._firewall_sync is not None:
                try:
                    self._rules_in_place = self._firewall_sync()
                except FlannelpyError as e:
                    self._rules_in_place = False
                    log.warning("firewall resync failed: %s", e)

    def _on_reconciled(self, result: ReconcileResult) -> None:
        self.metrics.observe_reconcile(result)
        if self._loops_running:  # the start reconcile comes before the heartbeats exist
            self.beats.beat("reconciler")
        if self.settings.vxlan_tx_checksum_off and result.changes.links_to_create:
            # A (re-)created device starts with offload on again.
            for link in result.changes.links_to_create:
                set_tx_checksum(link.name, False)
        self._write_status(result)

    def _status_loop(self, stop: threading.Event) -> None:
        while not stop.wait(STATUS_INTERVAL_SECONDS):
            self.beats.beat("status")
            self._write_status(self.reconciler.last_result)
            self._publish_status()

    # -- health -----------------------------------------------------------------------------

    def readiness(self) -> tuple[bool, str]:
        desired = self.reconciler.desired
        return readiness(
            lease_held=bool(self.own_leases()),
            subnet_env_written=self._subnet_env_written,
            last_reconcile=self.reconciler.last_result,
            rules_in_place=self._rules_in_place,
            unprogrammed_peers=len(desired.unreachable) if desired else 0,
        )

    def _start_servers(self) -> None:
        """/metrics, /healthz and /readyz: on --metrics-addr, and on Flannel's
        --healthz-ip/--healthz-port when set (what the DaemonSet's probes use). Up before
        the lease, so liveness holds while we wait for the store or a podCIDR."""
        addrs = []
        if self.settings.metrics_addr:  # None: --metrics-addr=off
            addrs.append(self.settings.metrics_addr)
        if self.settings.healthz_port:
            addrs.append(f"{self.settings.healthz_ip}:{self.settings.healthz_port}")
        for addr in addrs:
            server = HealthServer(addr, self.metrics.registry, self.readiness, self.beats.live)
            server.start()
            self._servers.append(server)

    def _write_status(self, result: ReconcileResult | None) -> None:
        """A small JSON file for `lab status` and operators: what this node holds and lacks."""
        own = self.own_leases()
        with self._lease_lock:
            peers = len(self._leases) - len(own)
        doc = {
            "node": self.ctx.node_name,
            "backend": self.backend.type_name,
            "lease": str(own[0].subnet) if own else None,
            "leases": [str(x.subnet) for x in own],
            "public_ip": str(self.ctx.public_ip),
            "mtu": self.backend.mtu(self.ctx),
            "peers": max(peers, 0),
            "unreachable": [
                {"subnet": str(u.subnet), "public_ip": str(u.public_ip), "reason": u.reason}
                for u in sorted(self._unreachable, key=lambda u: u.subnet)
            ],
            "converged": result.converged if result else None,
            "failures": list(result.failures[:20]) if result else [],
            "last_reconcile": result.finished_at if result else None,
            "ready": self.ready,
            "ip_masq": self.settings.ip_masq,
            "iptables_forward_rules": self.settings.iptables_forward_rules,
            "probes": (
                {key: r.as_status() for key, r in self.prober.results().items()}
                if self.prober is not None else {}
            ),
            "backend_config": _backend_doc(self.config),
            "applied_generation": self._applied_generation,
            "blocked": [
                {"change": b.change, "sentence": b.sentence, "since": b.since,
                 "generation": b.generation}
                for b in ([self._blocked] if self._blocked else [])
            ],
            "vtep": self._vtep_advertised,
            "mtu_mismatch": [
                {"subnet": str(p.subnet), "public_ip": str(p.public_ip), "mtu": p.advertised}
                for p in (self._mtu_report.mismatched if self._mtu_report else [])
            ],
        }
        path = Path(self.settings.run_dir) / "status.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1))
        os.replace(tmp, path)

    # -- lifecycle --------------------------------------------------------------------------

    def _spawn(self, name: str, target: Callable[[threading.Event], None]) -> None:
        def supervised() -> None:
            try:
                target(self.stop)
            except BaseException as e:  # a root task died: stop them all
                if not self.stop.is_set():
                    log.exception("task failed task=%s", name)
                    self._failure = e
                    self.stop.set()

        thread = threading.Thread(target=supervised, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def start(self) -> None:
        self.metrics.overlay_mtu(self.backend.mtu(self.ctx))
        self._link_stats = NetlinkLinkStats(underlay=self.ctx.underlay.name)
        self.metrics.set_link_provider(self._link_stats)
        self.metrics.set_ipam_provider(self.cni.ipam.accounting)
        self._start_servers()
        previous = read_previous_subnet(self.settings.subnet_file)
        lease = self._acquire(previous)
        with self._lease_lock:
            self._own = [lease]
        ensure_ip_forwarding(self.kernel)
        self._sync_ipam()
        self._spawn("lease-watch", lambda stop: self.manager.watch_leases(self._on_leases, stop))
        if self.control is not None:
            control = self.control
            self._spawn("control-watch", lambda stop: control.watch(self._on_control, stop))
        if not self._first_snapshot.wait(FIRST_SNAPSHOT_TIMEOUT):
            raise StoreError(
                f"no lease list from the store within {FIRST_SNAPSHOT_TIMEOUT:.0f} s; "
                "check that the store is reachable and healthy"
            )
        if not self.settings.kube_subnet_mgr:
            self._adopt_own_leases()
            self._replan()
        self._manage_capacity()  # may add a lease (warm capacity, a drained pool)
        self.cni.ipam.set_low_free_watch(self._capacity.min_free_addresses, self._on_low_free)
        result = self.reconciler.reconcile_once("start")
        if result is not None and not result.converged:
            log.warning("initial reconcile incomplete failures=%d", len(result.failures))
        self._setup_firewall()
        # Liveness: each loop must turn within a few of its periods.
        self.beats.register("reconciler", self.settings.resync_interval * 3 + 5)
        self.beats.register("status", STATUS_INTERVAL_SECONDS * 5 + 5)
        if self._firewall_factory is not None:
            self.beats.register("firewall", self.settings.iptables_resync * 3 + 5)
        self._loops_running = True
        self._spawn("reconciler", self.reconciler.run)
        self._spawn("kernel-watch", lambda stop: self.kernel.watch(self.reconciler.trigger, stop))
        self._spawn("renew", self._renew_loop)
        if self._firewall_factory is not None:
            self._spawn("firewall", self._firewall_loop)
        self._start_prober()
        self._spawn("status", self._status_loop)
        self.cni.start()
        # Ready before subnet.env appears: runtimes (and the lab) take subnet.env as the
        # sign that ADD works, so nothing may be left to do once it is written.
        self.ready = True
        self._write_subnet_env()
        self._write_status(result)
        self._publish_status(force=True)
        log.info(
            "agent ready subnet=%s mtu=%s program_seconds=%.3f",
            lease.subnet, self.backend.mtu(self.ctx), result.duration_seconds if result else 0.0,
        )

    def _start_prober(self) -> None:
        try:
            transport = IcmpTransport()
        except DataplaneError as e:
            log.warning("peer prober disabled: %s", e)
            return
        self._probe_transport = transport
        self.prober = Prober(
            transport,
            mtu_provider=lambda: self.backend.mtu(self.ctx),
            own_address_provider=lambda: (lease.gateway if (lease := self.lease) else None),
            interval_seconds=self.settings.probe_interval,
            timeout_seconds=min(1.0, self.settings.probe_interval / 2),
            on_result=self._on_probe,
        )
        self._replan()  # hands it the peers known so far
        self._spawn("prober", self.prober.run)

    def run_until_stopped(self) -> None:
        """The main loop: the one thread that changes our lease and our running config."""
        last_control_check = last_capacity_check = time.monotonic()
        control_failed = False
        while not self.stop.is_set():
            self._wake.wait(0.5)
            self._wake.clear()
            if self._lease_lost.is_set():
                self._lease_lost.clear()
                try:
                    self._recover_lost_leases()
                except StoreError as e:
                    log.warning("re-acquiring the lease failed, retrying: %s", e)
                    self._lease_lost.set()
                    self.stop.wait(1.0)
                    continue
            since_check = time.monotonic() - last_control_check
            recheck = (self._blocked is not None and since_check >= BLOCKED_RECHECK_SECONDS) or (
                control_failed and since_check >= CONTROL_RETRY_SECONDS
            )
            if self._control_pending or recheck:
                self._control_pending = False
                last_control_check = time.monotonic()
                try:
                    self._evaluate_control()
                    control_failed = False
                except Exception:
                    # Like a failed reconcile pass: the node keeps what it runs, a retry
                    # follows, and the log has the cause.
                    log.exception("applying the network config failed; keeping the current one")
                    control_failed = True
            if self._attrs_dirty:
                self._attrs_dirty = False
                self._rewrite_lease_attrs()
            if self._capacity_due or time.monotonic() - last_capacity_check >= CAPACITY_TICK:
                last_capacity_check = time.monotonic()
                try:
                    self._manage_capacity()
                except (StoreError, DataplaneError, OSError) as e:
                    log.warning("lease capacity check failed, retrying: %s", e)
                    self._capacity_due = True
                    self.stop.wait(1.0)
        self.shutdown()
        if self._failure is not None:
            raise self._failure

    # -- live config ----------------------------------------------------------------------

    def _on_control(self, snapshot: ControlSnapshot) -> None:
        self._control = snapshot
        self._control_pending = True
        self._wake.set()

    def _say_once(self, key: str, message: str, *args: object) -> None:
        if key not in self._said_once:
            self._said_once.add(key)
            log.warning(message, *args)

    def _evaluate_control(self) -> None:
        """Compare what we are told to run with what we run, and act per the policy."""
        snap = self._control
        if snap is None or snap.config is None:
            return
        if snap.override_error:
            self._say_once(snap.override_error, "ignoring this node's override: %s",
                           snap.override_error)  # fmt: skip
        self._take_pools(snap)
        try:
            wanted = wanted_config(snap.config, snap.override)
            backend = get_backend(wanted.backend.type)
            if wanted.enable_ipv6 or wanted.network is None:
                raise ConfigError("EnableIPv6 is not supported and Network is required")
        except (ConfigError, ValueError) as e:
            self._say_once(f"config:{e}", "not applying the new network config: %s", e)
            return
        ctx = replace(self.ctx, config=wanted)
        generation = snap.override.generation if snap.override else None
        try:
            decision = decide_change(
                self.config, self.backend.mtu(self.ctx), wanted, backend.mtu(ctx),
                snap.override, snap.rollout, datetime.now(UTC),
                KUBE_REMEDY if self.settings.kube_subnet_mgr else ETCD_REMEDY,
            )  # fmt: skip
        except ConfigError as e:  # e.g. a DisruptionPolicy that does not parse
            self._say_once(f"config:{e}", "not applying the new network config: %s", e)
            return
        if decision.action == "restart-needed":
            self._say_once(f"restart:{wanted.raw}", "%s", decision.sentence)
            return
        if decision.action == "block":
            self._block(decision, generation)
            return
        if self._blocked is not None:
            log.info("blocked change no longer pending change=%s", self._blocked.change)
            self._blocked = None
        if decision.action == "apply":
            self._apply_config(wanted, ctx, backend, decision, snap.override)
        if generation != self._applied_generation:
            self._applied_generation = generation
            self._applied_at = time.time()
            self._publish_status(force=True)

    def _take_pools(self, snap: ControlSnapshot) -> None:
        """Pool records and warm-capacity settings apply at once (never disruptive)."""
        if self.settings.kube_subnet_mgr:
            return
        pools, ignored = records_to_pools(self.config, snap.pools, self.settings.etcd_prefix)
        for problem in ignored:
            self._say_once(f"pool:{problem}", "ignoring an address pool record: %s", problem)
        capacity = self._capacity
        if snap.config is not None:
            try:
                capacity = parse_capacity(json.loads(snap.config))
            except (ConfigError, ValueError) as e:
                self._say_once(f"capacity:{e}", "keeping the warm-capacity settings: %s", e)
        if pools != self._pools or capacity != self._capacity:
            if pools != self._pools:
                log.info("address pools changed pools=%s", _pool_summary(pools))
            self._pools = pools
            self._capacity = capacity
            self.metrics.lease_limit(capacity.max_leases_per_node)
            self.cni.ipam.set_low_free_watch(capacity.min_free_addresses, self._on_low_free)
            self._capacity_due = True
            self._setup_firewall()

    def _block(self, decision: ChangeDecision, generation: int | None) -> None:
        change = ", ".join(decision.changes)
        key = (generation, decision.changes)
        if key not in self._blocked_counted:
            self._blocked_counted.add(key)
            self.metrics.blocked_operation("backend_change")
            log.warning("%s", decision.sentence)
        if self._blocked is None or self._blocked.change != change:
            self._blocked = BlockedChange(generation, change, decision.sentence or "", time.time())
            self._write_status(self.reconciler.last_result)
            self._publish_status(force=True)

    def _apply_config(
        self,
        wanted: NetworkConfig,
        ctx: NodeContext,
        backend: Backend,
        decision: ChangeDecision,
        override: NodeOverride | None,
    ) -> None:
        before = BackendSummary.of(self.config.backend, self.backend.mtu(self.ctx))
        if decision.forced is not None:
            log.warning(
                "disruptive change forced past the disruption policy change=%r reason=%r by=%s",
                ", ".join(decision.changes), decision.forced.reason, decision.forced.by,
            )  # fmt: skip
            if self.control is not None:
                try:
                    self.control.record_forced(
                        self.ctx.node_name, ", ".join(decision.changes), decision.forced
                    )
                except StoreError as e:
                    log.warning("could not record the forced change in the store: %s", e)
        with self._lease_lock:
            self.backend = backend
            self.ctx = ctx
        self._known_devices.update(backend.device_names(ctx))
        self._replan()
        result = self.reconciler.reconcile_once("config change")
        self._rewrite_lease_attrs()
        mtu = backend.mtu(ctx)
        self.metrics.overlay_mtu(mtu)
        self._ipam_view = ()  # hand IPAM and the bridge (its new MTU) the leases again
        self._sync_ipam()
        self._write_subnet_env()
        generation = override.generation if override else None
        self._applied_generation = generation
        self._applied_at = time.time()
        _save_applied(self.settings.state_dir, wanted, generation)
        after = BackendSummary.of(wanted.backend, mtu)
        if decision.changes:
            log.info(
                "backend changed from=%s to=%s generation=%s converged=%s",
                before.describe(), after.describe(), generation,
                result.converged if result else None,
            )  # fmt: skip
        else:
            log.info("network config change applied backend=%s", after.describe())
        self._publish_status(force=True)

    def _rewrite_lease_attrs(self) -> None:
        """Advertise what we now are (backend, VTEP) on every lease; peers follow it."""
        attrs = self._lease_attrs()
        for lease in self.own_leases():
            if lease.attrs == attrs:
                continue
            try:
                renewed = self.manager.renew_lease(replace(lease, attrs=attrs))
            except StoreError as e:
                log.warning("could not update our lease, retrying: %s", e)
                self._attrs_dirty = True
                self.stop.wait(1.0)
                self._wake.set()
                return
            self._replace_own(renewed)
            log.info("lease updated subnet=%s backend=%s vtep=%s", renewed.subnet,
                     attrs.backend_type, attrs.vtep_mac is not None)  # fmt: skip

    # -- status in the store ----------------------------------------------------------------

    def _on_probe(self, key: str, r: ProbeResult) -> None:
        self._probe_at[key] = time.time()
        self.metrics.probe(key, r.reachable, r.rtt_seconds, r.loss_ratio, r.mtu_ok)

    def _node_status(self) -> NodeStatus:
        own = self.own_leases()
        with self._lease_lock:
            backend, ctx = self.backend, self.ctx
        results = self.prober.results() if self.prober is not None else {}
        return NodeStatus(
            node=ctx.node_name,
            at=time.time(),
            ready=self.ready,
            public_ip=str(ctx.public_ip),
            underlay_networks=tuple(str(n) for n in ctx.underlay.networks),
            backend=BackendSummary.of(ctx.config.backend, backend.mtu(ctx)),
            vtep=self._vtep_advertised,
            applied_generation=self._applied_generation,
            applied_at=self._applied_at,
            blocked=self._blocked,
            subnets=tuple(str(x.subnet) for x in own),
            probes={
                key: PeerProbe(
                    reachable=r.reachable, mtu_ok=r.mtu_ok,
                    ok=r.reachable and r.last_error is None and r.mtu_ok is not False,
                    probes=r.probes, at=self._probe_at.get(key, 0.0),
                )
                for key, r in results.items()
            },
        )

    def _publish_status(self, force: bool = False) -> None:
        """Write our status record: at once when something an operator acts on changed,
        after every probe round while a change settles, else every publish interval."""
        if self.control is None:
            return
        status = self._node_status()
        doc = json.loads(status.to_json())
        doc.pop("At")
        for probe in doc["Probes"].values():
            probe.pop("At")
        fingerprint = json.dumps(doc, sort_keys=True)
        last, when = self._published
        now = time.monotonic()
        settling = time.time() - self._applied_at < TRANSITION_SECONDS
        due = now - when >= self.settings.status_publish_interval
        if not (force or settling or due or fingerprint != last):
            return
        try:
            self.control.publish_status(status)
        except StoreError as e:
            log.debug("status not published: %s", e)
            return
        self._published = (fingerprint, now)

    def shutdown(self) -> None:
        """Stop loops; leave the data plane and the lease in place (a restart must not
        disturb traffic, and the lease is reused by PublicIP)."""
        self.stop.set()
        self.reconciler.trigger("stopping")  # wakes its loop, which then sees stop
        self.cni.stop()
        if self._probe_transport is not None:
            self._probe_transport.close()
        for server in self._servers:
            server.stop()
        deadline = time.monotonic() + THREAD_GRACE_SECONDS
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("task did not stop in time task=%s", thread.name)
        self.manager.close()


def ensure_ip_forwarding(kernel: Kernel) -> None:
    """Pods' traffic is routed through the node. Write the sysctl only when needed: in an
    unprivileged container /proc/sys is read-only, and kubeadm requires it on anyway."""
    path = "/proc/sys/net/ipv4/ip_forward"
    try:
        with open(path) as f:
            if f.read().strip() == "1":
                return
    except OSError:
        pass
    try:
        kernel.set_sysctl("net.ipv4.ip_forward", "1")
    except DataplaneError as e:
        raise DataplaneError(
            "IPv4 forwarding is off on this node and cannot be turned on from here "
            f"({e}); set net.ipv4.ip_forward=1 on the node"
        ) from e


class PodAttachments:
    """The agent's CNI side: node IPAM, the pod bridge and the socket the executable calls."""

    def __init__(
        self,
        settings: AgentSettings,
        mtu: Callable[[], int],
        ready: Callable[[], bool],
        metrics: AgentMetrics,
    ) -> None:
        from flannelpy.cni.handler import CniHandler, CniSettings
        from flannelpy.cni.records import RecordStore
        from flannelpy.cni.server import CniServer
        from flannelpy.dataplane.podnet import PodNetwork
        from flannelpy.ipam.manager import NodeIpam

        self._mtu = mtu
        self.ipam = NodeIpam(os.path.join(settings.state_dir, "ipam"))
        self.pods = PodNetwork()
        records = RecordStore(os.path.join(settings.state_dir, "cni"))
        self.handler = CniHandler(
            self.ipam, self.pods, records, CniSettings(mtu_provider=mtu, ready=ready)
        )
        self.socket_path = os.path.join(settings.run_dir, "cni.sock")
        self._metrics = metrics
        self.server = CniServer(self.socket_path, self._handle)
        self._started = False

    def _handle(self, env: Mapping[str, str], stdin: bytes) -> tuple[int, bytes]:
        started = time.monotonic()
        exit_code, out = self.handler.handle(env, stdin)
        code = 0
        if exit_code:
            try:
                code = int(json.loads(out).get("code", 999))
            except (ValueError, AttributeError):
                code = 999
        self._metrics.cni_request(
            env.get("CNI_COMMAND", "?"), code, time.monotonic() - started
        )
        return exit_code, out

    def use_leases(
        self, subnets: Sequence[IPv4Network], serving: Sequence[IPv4Network] | None = None
    ) -> None:
        """Allocate from ``serving`` (default: all), in the order of ``subnets``; the
        bridge carries each lease's gateway from now on, so the node has an address in
        a lease before the first pod lands there."""
        self.ipam.set_leases(subnets, serving)
        gateways = [IPv4Interface(f"{net.network_address + 1}/{net.prefixlen}") for net in subnets]
        self.pods.ensure_bridge(gateways, self._mtu())

    def start(self) -> None:
        released = self.handler.gc_dead()
        if released:
            log.info("released addresses of pods that are gone count=%d", len(released))
        self.server.start()
        self._started = True
        log.info("CNI server listening socket=%s", self.socket_path)

    def stop(self) -> None:
        if self._started:
            self.server.stop()
            self._started = False


def _all_backend_devices(ctx: NodeContext) -> tuple[str, ...]:
    from flannelpy.backend.vxlan import device_name

    return (device_name(ctx.config.backend.vni),)


def load_vtep_mac(
    kernel: Kernel, state_dir: str, device: str, advertised: str | None = None
) -> str:
    """A stable VTEP MAC: the live device's, else the one we last advertised (our Node's
    backend-data annotation in Kubernetes mode), else the one we recorded, else a new one.

    Peers hold our MAC in their neighbour and FDB tables; a new MAC after a
    restart would leave them stale until they see our lease change.
    """
    path = Path(state_dir) / f"vtep-mac-{device}"
    mac = kernel.link_mac(device) or advertised
    if mac is None and path.exists():
        mac = path.read_text().strip().lower() or None
    if mac is None:
        octets = [random.randrange(256) for _ in range(6)]
        octets[0] = (octets[0] & 0xFE) | 0x02  # unicast, locally administered
        mac = ":".join(f"{o:02x}" for o in octets)
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists() or path.read_text().strip() != mac:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(mac + "\n")
        os.replace(tmp, path)
    return mac


def build_agent(settings: AgentSettings) -> NodeAgent:
    """Wire the parts together. Everything that can be refused is refused here, before
    anything on the host changes."""
    from flannelpy.dataplane.netlink import NetlinkKernel

    metrics = AgentMetrics()
    kube = None
    manager: SubnetManager
    store = None
    if settings.kube_subnet_mgr:
        from flannelpy.subnet.kube.manager import KubeSubnetManager

        manager = kube = KubeSubnetManager(settings)
    else:
        from flannelpy.subnet.etcd.client import EtcdSubnetManager, connect_etcd

        store = connect_etcd(settings, on_error=metrics.store_error)
        manager = EtcdSubnetManager(
            store, settings, on_watch_restart=metrics.watch_restart,
        )
    try:
        config = _read_config_patiently(manager, settings.startup_timeout)
        # A restart keeps the backend this node last applied: a change that arrived
        # meanwhile still goes through the disruption policy, like any live change.
        applied = _load_applied(settings.state_dir)
        if applied is not None:
            config = wanted_config(json.dumps(config.raw).encode(), applied)
        if config.enable_ipv6:
            raise ConfigError(
                "net-conf.json: EnableIPv6 is not supported by flannelpy yet; set it to false"
            )
        if not config.enable_ipv4 or config.network is None:
            raise ConfigError("net-conf.json: EnableIPv4 must be true and Network set")
        if config.backend_defaulted:
            log.warning("net-conf.json has no Backend; using vxlan")
        backend = get_backend(config.backend.type)
        kernel = NetlinkKernel()
        underlay = kernel.find_underlay(
            settings.iface, settings.iface_regex,
            _ip_or_none(settings.iface_can_reach), settings.public_ip,
        )
        ctx = NodeContext(
            config=config,
            underlay=underlay,
            # Kubernetes mode: the node-public-ip annotation acts as --public-ip.
            public_ip=settings.public_ip or (kube and kube.node_public_ip()) or underlay.ip,
            node_name=kube.node_name if kube else node_name_default(settings),
        )
        ours = {*_all_backend_devices(ctx), "cni0"}
        check_no_overlap(config.network, kernel.survey(ours), settings.allow_overlap)
        vtep_mac = None
        if backend.type_name == "vxlan" or kube:
            vtep_mac = load_vtep_mac(
                kernel, settings.state_dir, backend.device_names(ctx)[0],
                advertised=kube.own_vtep_mac() if kube else None,
            )
        log.info(
            "starting node=%s backend=%s iface=%s public_ip=%s mtu=%s",
            ctx.node_name, backend.type_name, underlay.name, ctx.public_ip, backend.mtu(ctx),
        )
    except BaseException:
        manager.close()
        raise

    firewall_factory = _firewall_factory(settings, metrics)
    pools = None
    capacity = parse_capacity(config.raw)
    if store is not None:
        pools = PoolStore(store, settings.etcd_prefix).list_pools(config)
    elif capacity.max_leases_per_node > 1:
        log.warning("MaxLeasesPerNode and MinFreeAddresses do not apply in Kubernetes mode "
                    "(one podCIDR per node); ignoring them")  # fmt: skip
        capacity = CapacitySettings()
    control: NodeControl
    if kube is not None:
        from flannelpy.control.node_control import KubeNodeControl

        control = KubeNodeControl(kube, settings.net_config_path)
    else:
        from flannelpy.control.node_control import EtcdNodeControl

        assert store is not None
        control = EtcdNodeControl(store, settings.etcd_prefix, ctx.node_name)
    return NodeAgent(
        settings, manager, kernel, backend, ctx, vtep_mac, firewall_factory, metrics,
        control=control, applied_generation=(applied.generation or None) if applied else None,
        pools=pools, capacity=capacity,
    )


def _backend_doc(config: NetworkConfig) -> Mapping[str, object]:
    """The Backend object of a config, as written (``{}`` when it was left out)."""
    return next((v for k, v in config.raw.items() if k.lower() == "backend"), None) or {}


def _save_applied(state_dir: str, config: NetworkConfig, generation: int | None) -> None:
    backend = _backend_doc(config)
    path = Path(state_dir) / APPLIED_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"Backend": backend, "Generation": generation or 0}))
    os.replace(tmp, path)


def _load_applied(state_dir: str) -> NodeOverride | None:
    """The Backend this node last applied, in the form of an override."""
    try:
        return NodeOverride.from_json((Path(state_dir) / APPLIED_FILE).read_bytes())
    except FileNotFoundError:
        return None
    except ValueError as e:
        log.warning("ignoring %s: %s", APPLIED_FILE, e)
        return None


def _read_config_patiently(manager: SubnetManager, timeout: float) -> NetworkConfig:
    """The network config, retrying an unreachable store for up to ``timeout`` seconds.

    Many agents start at once after a cluster-wide restart; a store slow to answer
    the first request is normal then, and crash-looping would only add load.
    """
    deadline = time.monotonic() + timeout
    delay = 0.2
    while True:
        try:
            return manager.get_network_config()
        except StoreUnavailable as e:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("store unavailable, retrying in %.1fs: %s", delay, e)
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


def _ip_or_none(value: str | None) -> IPv4Address | None:
    return IPv4Address(value) if value else None


def _firewall_factory(settings: AgentSettings, metrics: AgentMetrics) -> FirewallFactory | None:
    if not settings.ip_masq and not settings.iptables_forward_rules:
        return None
    from flannelpy.dataplane.firewall import IptablesFirewall, forward_rules, masq_rules

    firewall = IptablesFirewall()

    def make(
        networks: Sequence[IPv4Network], subnets: Sequence[IPv4Network]
    ) -> Callable[[], bool]:
        rule_sets = []
        if settings.ip_masq:
            rule_sets.append(masq_rules(networks, subnets, firewall.random_fully))
        if settings.iptables_forward_rules:
            rule_sets.append(forward_rules(networks))

        def sync() -> bool:
            """True once every chain is as desired (sync raises when it cannot repair)."""
            for rules in rule_sets:
                result = firewall.sync(rules)  # logs what it repaired
                metrics.firewall_sync(result.repaired)
            return True

        return sync

    return make


def run_agent(settings: AgentSettings) -> int:
    """Run until SIGTERM/SIGINT. Returns the exit code; errors become one sentence."""
    try:
        agent = build_agent(settings)
    except FlannelpyError as e:
        log.error("%s", e)
        return e.exit_code

    def on_signal(signum: int, _frame: object) -> None:
        log.info("stopping signal=%s", signal.Signals(signum).name)
        agent.stop.set()
        if not agent.ready:
            # Still acquiring (e.g. waiting for the controller-manager to assign a
            # podCIDR): closing the manager ends that wait.
            agent.manager.close()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        agent.start()
        agent.run_until_stopped()
    except FlannelpyError as e:
        log.error("%s", e)
        agent.shutdown()
        return e.exit_code
    return 0


def _pool_summary(pools: Sequence[Pool]) -> str:
    return ", ".join(
        f"{p.network}" + (f"[{','.join(f'{k}={v}' for k, v in sorted(p.tags.items()))}]"
                          if p.tags else "")
        for p in pools
    )  # fmt: skip
