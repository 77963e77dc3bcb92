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
from collections.abc import Callable, Mapping
from ipaddress import IPv4Address, IPv4Interface, IPv4Network
from pathlib import Path

from flannelpy.backend.base import Backend, NodeContext
from flannelpy.backend.registry import get_backend
from flannelpy.config import AgentSettings, NetworkConfig
from flannelpy.dataplane.ethtool import set_tx_checksum
from flannelpy.dataplane.kernel import Kernel
from flannelpy.dataplane.reconciler import Reconciler, ReconcileResult
from flannelpy.dataplane.state import Unreachable
from flannelpy.errors import (
    ConfigError,
    DataplaneError,
    FlannelpyError,
    StoreError,
    StoreUnavailable,
)
from flannelpy.health import HealthServer, Heartbeats, readiness
from flannelpy.metrics import AgentMetrics, NetlinkLinkStats
from flannelpy.ops.mtu import MtuReport, mtu_mismatches
from flannelpy.ops.prober import IcmpTransport, Prober
from flannelpy.subnet.lease import Lease
from flannelpy.subnet.manager import SubnetManager
from flannelpy.subnet_env import SubnetEnv, read_previous_subnet, write_subnet_env
from flannelpy.survey import check_no_overlap

log = logging.getLogger("flannelpy.agent")

FIRST_SNAPSHOT_TIMEOUT = 30.0  # seconds to wait for the first lease list after acquiring
RENEW_RETRY_SECONDS = 60.0  # Flannel's retry interval for a failed renewal
THREAD_GRACE_SECONDS = 5.0
STATUS_INTERVAL_SECONDS = 2.0  # how often <run-dir>/status.json is refreshed


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
        firewall_factory: Callable[[list[IPv4Network]], Callable[[], bool]] | None,
        metrics: AgentMetrics | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics or AgentMetrics()
        self.beats = Heartbeats()
        self.manager = manager
        self.kernel = kernel
        self.backend = backend
        self.ctx = ctx
        self.vtep_mac = vtep_mac
        self._firewall_factory = firewall_factory
        self._firewall_sync: Callable[[], bool] | None = None
        self._rules_in_place = firewall_factory is None
        self._subnet_env_written = False
        self.stop = threading.Event()
        self._lease_lock = threading.Lock()
        self.lease: Lease | None = None
        self._leases: Mapping[str, Lease] = {}
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

    def _acquire(self, previous: IPv4Network | None) -> Lease:
        attrs = self.backend.lease_attrs(self.ctx, self.vtep_mac)
        lease = self.manager.acquire_lease(attrs, previous)
        self.metrics.lease(lease.subnet, lease.expiration)
        log.info(
            "lease acquired subnet=%s public_ip=%s backend=%s",
            lease.subnet, attrs.public_ip, attrs.backend_type,
        )
        return lease

    def _on_leases(self, leases: Mapping[str, Lease], revision: int) -> None:
        with self._lease_lock:
            self._leases = dict(leases)
            own = self.lease
        if own is not None:
            current = leases.get(own.key)
            if current is None or current.attrs.public_ip != own.attrs.public_ip:
                self._lease_lost.set()
        self._replan()
        self._first_snapshot.set()

    def _replan(self) -> None:
        with self._lease_lock:
            own = self.lease
            leases = self._leases
        if own is None:
            return
        peers = [lease for key, lease in leases.items() if key != own.key]
        self.metrics.peers(peers)
        self._check_mtu(peers)
        if self.prober is not None:
            # Each node's overlay address is its lease's first address (on its cni0).
            self.prober.set_peers(
                {str(p.subnet): (p.gateway, p.attrs.node_name or str(p.attrs.public_ip))
                 for p in peers}
            )
        desired = self.backend.plan(self.ctx, [own], peers, self.vtep_mac)
        stale_links = frozenset(
            name for name in _all_backend_devices(self.ctx) if name not in
            {link.name for link in desired.links}
        )
        if desired.unreachable != self._unreachable:
            for peer in sorted(desired.unreachable - self._unreachable, key=lambda u: u.subnet):
                log.warning("peer unreachable subnet=%s reason=%s", peer.subnet, peer.reason)
            self._unreachable = desired.unreachable
        self.reconciler.set_desired(desired, stale_links)

    def _check_mtu(self, peers: list[Lease]) -> None:
        """Peers must agree on the overlay MTU, or large packets vanish silently between them."""
        report = mtu_mismatches(self.backend.mtu(self.ctx), peers)
        if self._mtu_report is None or report.mismatched != self._mtu_report.mismatched:
            for sentence in report.sentences():
                log.warning("MTU mismatch: %s", sentence)
        self._mtu_report = report

    def _own_subnets(self) -> list[IPv4Network]:
        return [self.lease.subnet] if self.lease else []

    def _reacquire(self) -> None:
        with self._lease_lock:
            old = self.lease
        previous = old.subnet if old else None
        log.warning("own lease disappeared from the store; re-acquiring subnet=%s", previous)
        lease = self._acquire(previous)
        with self._lease_lock:
            self.lease = lease
        self._replan()
        if old is None or lease.subnet != old.subnet:
            log.warning("lease changed old=%s new=%s", previous, lease.subnet)
            if old is not None:
                self.metrics.drop_lease(old.subnet)
            # Pods on the old subnet keep their addresses on disk; new pods use the new one.
            self.cni.use_leases(self._own_subnets())
            self._write_subnet_env()
            self._setup_firewall()

    def _renew_loop(self, stop: threading.Event) -> None:
        margin = self.settings.subnet_lease_renew_margin * 60.0
        while not stop.is_set():
            with self._lease_lock:
                lease = self.lease
            assert lease is not None
            expiration = lease.expiration or (time.time() + RENEW_RETRY_SECONDS + margin)
            if stop.wait(max(0.0, expiration - margin - time.time())):
                return
            try:
                renewed = self.manager.renew_lease(lease)
            except StoreError as e:
                self.metrics.renewal("failure")
                log.warning("lease renewal failed, retrying in %ss: %s", RENEW_RETRY_SECONDS, e)
                if stop.wait(RENEW_RETRY_SECONDS):
                    return
                continue
            self.metrics.renewal("success")
            self.metrics.lease(renewed.subnet, renewed.expiration)
            with self._lease_lock:
                if self.lease is not None and self.lease.key == renewed.key:
                    self.lease = renewed
            log.info("lease renewed subnet=%s expires=%s", renewed.subnet, renewed.expiration)

    # -- outputs --------------------------------------------------------------------------

    def _write_subnet_env(self) -> None:
        assert self.lease is not None and self.config.network is not None
        env = SubnetEnv(
            network=self.config.network,
            subnet=IPv4Interface(f"{self.lease.gateway}/{self.lease.subnet.prefixlen}"),
            mtu=self.backend.mtu(self.ctx),
            ipmasq=self.settings.ip_masq,
        )
        write_subnet_env(self.settings.subnet_file, env)
        self._subnet_env_written = True

    def _setup_firewall(self) -> None:
        if self._firewall_factory is None or self.lease is None:
            return
        self._firewall_sync = self._firewall_factory([self.lease.subnet])
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

    # -- health -----------------------------------------------------------------------------

    def readiness(self) -> tuple[bool, str]:
        desired = self.reconciler.desired
        return readiness(
            lease_held=self.lease is not None,
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
        with self._lease_lock:
            lease = self.lease
            peers = len(self._leases) - 1
        doc = {
            "node": self.ctx.node_name,
            "backend": self.backend.type_name,
            "lease": str(lease.subnet) if lease else None,
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
            self.lease = lease
        ensure_ip_forwarding(self.kernel)
        self.cni.use_leases(self._own_subnets())
        self._spawn("lease-watch", lambda stop: self.manager.watch_leases(self._on_leases, stop))
        if not self._first_snapshot.wait(FIRST_SNAPSHOT_TIMEOUT):
            raise StoreError(
                f"no lease list from the store within {FIRST_SNAPSHOT_TIMEOUT:.0f} s; "
                "check that the store is reachable and healthy"
            )
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
            own_address_provider=lambda: self.lease.gateway if self.lease else None,
            on_result=lambda key, r: self.metrics.probe(
                key, r.reachable, r.rtt_seconds, r.loss_ratio, r.mtu_ok
            ),
        )
        self._replan()  # hands it the peers known so far
        self._spawn("prober", self.prober.run)

    def run_until_stopped(self) -> None:
        while not self.stop.is_set():
            if self._lease_lost.wait(0.5):
                self._lease_lost.clear()
                try:
                    self._reacquire()
                except StoreError as e:
                    log.warning("re-acquiring the lease failed, retrying: %s", e)
                    self._lease_lost.set()
                    self.stop.wait(1.0)
        self.shutdown()
        if self._failure is not None:
            raise self._failure

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
        from flannelpy.cni.podnet import PodNetwork
        from flannelpy.cni.records import RecordStore
        from flannelpy.cni.server import CniServer
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

    def use_leases(self, subnets: list[IPv4Network]) -> None:
        """Allocate from ``subnets``; the bridge carries each one's gateway from now on,
        so the node has an address in its lease before the first pod lands."""
        self.ipam.set_leases(subnets)
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
    if settings.kube_subnet_mgr:
        from flannelpy.subnet.kube import KubeSubnetManager

        manager = kube = KubeSubnetManager(settings)
    else:
        from flannelpy.subnet.etcd import EtcdSubnetManager, connect_etcd

        manager = EtcdSubnetManager(
            connect_etcd(settings, on_error=metrics.store_error), settings,
            on_watch_restart=metrics.watch_restart,
        )
    try:
        config = _read_config_patiently(manager, settings.startup_timeout)
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
        if backend.type_name == "vxlan":
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

    firewall_factory = _firewall_factory(settings, config.network, metrics)
    return NodeAgent(
        settings, manager, kernel, backend, ctx, vtep_mac, firewall_factory, metrics
    )


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


def _firewall_factory(
    settings: AgentSettings, network: IPv4Network, metrics: AgentMetrics
) -> Callable[[list[IPv4Network]], Callable[[], bool]] | None:
    if not settings.ip_masq and not settings.iptables_forward_rules:
        return None
    from flannelpy.dataplane.firewall import IptablesFirewall, forward_rules, masq_rules

    firewall = IptablesFirewall()

    def make(subnets: list[IPv4Network]) -> Callable[[], bool]:
        rule_sets = []
        if settings.ip_masq:
            rule_sets.append(masq_rules(network, subnets, firewall.random_fully))
        if settings.iptables_forward_rules:
            rule_sets.append(forward_rules(network))

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
