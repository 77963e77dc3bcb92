"""The composition root: build every adapter and hand them to a NodeAgent.

Everything that can be refused is refused here, before anything on the host
changes. The etcd/Kubernetes choice is made once, by ``open_store``; the rest
of the agent sees only the store's face (``ClusterStore``): the subnet manager, the
node control, pools and what the store says of this node.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable
from dataclasses import replace
from ipaddress import IPv4Address, IPv6Address
from typing import TYPE_CHECKING

from flannelpy.agent.firewall_sync import firewall_factory
from flannelpy.agent.live_config import load_applied
from flannelpy.agent.node import NodeAgent
from flannelpy.agent.vtep import load_vtep_mac
from flannelpy.agent.writer import AgentParts, ProbeTransport
from flannelpy.backend.base import Backend, NodeContext
from flannelpy.backend.registry import get_backend
from flannelpy.backend.wireguard_config import parse_wireguard_config
from flannelpy.backend.wireguard_runtime import WireguardRuntime, default_key_file
from flannelpy.cni.pods import PodAttachments, PodSide
from flannelpy.config.netconf import NetworkConfig
from flannelpy.config.settings import NETWORK_POLICY_NEEDS_KUBE, AgentSettings
from flannelpy.control.change import wanted_config
from flannelpy.control.records import NodeOverride
from flannelpy.dataplane.adopt import FlannelRouteShape
from flannelpy.dataplane.kernel import ForeignRoute, Kernel
from flannelpy.dataplane.reconciler import PolicyRules
from flannelpy.dataplane.state import UnderlayInterface
from flannelpy.errors import ConfigError, DataplaneError, FlannelpyError, StoreUnavailable
from flannelpy.heap import release_free_memory
from flannelpy.ipam.capacity import CapacitySettings, parse_capacity
from flannelpy.observe.metrics import AgentMetrics, LinkProvider
from flannelpy.store.open_store import ClusterStore, NodeIdentity, open_store
from flannelpy.subnet.pools import Pool
from flannelpy.subnet.survey import check_no_overlap

if TYPE_CHECKING:
    from flannelpy.store.policy_inputs import PolicySource

log = logging.getLogger("flannelpy.agent.compose")
CONFIG_WAIT = 1.0  # seconds between two looks for a network config not written yet (flanneld's)
# flanneld v0.28 runs udp without a Backend key (its docs say vxlan), which we do not
# speak: guessing either way would split a mixed cluster in two.
NO_BACKEND = (
    'net-conf.json has no "Backend": flanneld would run udp and flannelpy cannot, so they '
    'would not reach each other; add "Backend": {"Type": "vxlan"} (or the one you use)'
)


def node_name_default(settings: AgentSettings) -> str:
    return settings.node_name or os.environ.get("NODE_NAME") or socket.gethostname()


def build_agent(
    settings: AgentSettings,
    store: ClusterStore | None = None,
    kernel: Kernel | None = None,
    metrics: AgentMetrics | None = None,
) -> NodeAgent:
    """Wire the parts together (``store``, ``kernel``: already built ones, for tests)."""
    metrics = metrics or AgentMetrics()
    if store is None:
        store = open_store(
            settings, on_error=metrics.store_error, on_watch_restart=metrics.watch_restart
        )
    manager = store.manager
    try:
        config, applied = _network_config(settings, store)
        identity = store.node_identity()
        backend = get_backend(config.backend.type)
        if kernel is None:
            from flannelpy.dataplane.netlink import NetlinkKernel

            kernel = NetlinkKernel()
        ctx = _node_context(settings, config, kernel, identity)
        wireguard = _wireguard_runtime(settings, metrics)
        if backend.type_name == "wireguard":
            # The options checked, kernel or userspace chosen and the key loaded before
            # anything on the host changes: "Implementation": "kernel" without the module
            # stops here.
            keys = wireguard.prepare(parse_wireguard_config(config.backend))
            ctx = replace(ctx, wireguard_identity=keys)
        _take_over_flannel_routes(settings, kernel, ctx)
        vtep_mac = None
        if backend.type_name == "vxlan" or identity.publishes_vtep_mac:
            vtep_mac = load_vtep_mac(
                kernel,
                settings.state_dir,
                backend.device_names(ctx)[0],
                advertised=identity.advertised_vtep_mac,
            )
        _log_start(ctx, backend)
    except BaseException:
        manager.close()
        raise
    capacity, pools = _capacity_and_pools(config, store)
    policy_source, policy_table = _network_policy(settings, store, metrics)
    network = config.network  # never changed live: a new Network needs a restart
    ipv6_network = config.ipv6_network  # nor a new IPv6Network

    def pods(mtu: Callable[[], int], ready: Callable[[], bool]) -> PodSide:
        return PodAttachments(settings, mtu, ready, metrics, network, ipv6_network)

    return NodeAgent(
        AgentParts(
            settings=settings,
            manager=manager,
            kernel=kernel,
            backend=backend,
            ctx=ctx,
            pods=pods,
            metrics=metrics,
            control=store.node_control(settings, ctx.node_name),
            store_traits=store.traits,
            vtep_mac=vtep_mac,
            firewall=firewall_factory(settings, metrics, nftables=config.enable_nftables),
            applied_generation=(applied.generation or None) if applied else None,
            pools=pools,
            capacity=capacity,
            probe_transport=_icmp_transport,
            link_stats=_link_stats,
            wireguard=wireguard,
            policy_source=policy_source,
            policy_table=policy_table,
        )
    )


def _network_policy(
    settings: AgentSettings, store: ClusterStore, metrics: AgentMetrics
) -> tuple[PolicySource | None, PolicyRules | None]:
    """--enable-network-policy: the store's policy inputs and the nftables table."""
    if not settings.enable_network_policy:
        return None, None
    source = store.policy_source(metrics.policy_refused)
    if source is None:
        store.close()
        raise ConfigError(f"--enable-network-policy {NETWORK_POLICY_NEEDS_KUBE}")
    from flannelpy.dataplane.libnft import LibNftables
    from flannelpy.dataplane.nfgen import RulesetGeneration
    from flannelpy.dataplane.policy_table import PolicyTable

    log.info("network policy on: table inet flannelpy-policy, kept as it is until synced")
    run = LibNftables.load() or subprocess.run
    return source, PolicyTable(run=run, generation=RulesetGeneration())


def _log_start(ctx: NodeContext, backend: Backend) -> None:
    log.info(
        "starting node=%s backend=%s iface=%s public_ip=%s public_ipv6=%s mtu=%s",
        ctx.node_name,
        backend.type_name,
        ctx.underlay.name,
        ctx.public_ip,
        ctx.public_ipv6,
        backend.mtu(ctx),
    )


def _is_ipv6_only(config: NetworkConfig) -> bool:
    return not config.enable_ipv4 or config.network is None


def _network_config(
    settings: AgentSettings, store: ClusterStore
) -> tuple[NetworkConfig, NodeOverride | None]:
    """The network config to start with, checked, and the backend this node last applied."""
    config = _read_config_patiently(store, settings.startup_timeout)
    # A restart keeps the backend this node last applied: a change that arrived
    # meanwhile still goes through the disruption policy, like any live change.
    applied = load_applied(settings.state_dir)
    if applied is not None:
        config = wanted_config(json.dumps(config.raw).encode(), applied)
    if _is_ipv6_only(config):
        _check_ipv6_only(config)
    if config.backend_defaulted:
        raise ConfigError(NO_BACKEND)
    return config, applied


def _node_context(
    settings: AgentSettings,
    config: NetworkConfig,
    kernel: Kernel,
    identity: NodeIdentity,
) -> NodeContext:
    """Who this node is on the network: its underlay interface and public addresses."""
    ipv6_only = _is_ipv6_only(config)
    # Kubernetes mode: the node-public-ip annotation replaces --public-ip, as in
    # flanneld (it also picks the interface when no --iface is given).
    public_ip = identity.public_ip or settings.public_ip
    if ipv6_only:
        underlay = kernel.find_underlay(settings.iface, settings.iface_regex, ipv6_only=True)
    else:
        underlay = kernel.find_underlay(
            settings.iface,
            settings.iface_regex,
            _ip_or_none(settings.iface_can_reach),
            public_ip,
        )
    return NodeContext(
        config=config,
        underlay=underlay,
        public_ip=None if ipv6_only else (public_ip or underlay.ip),
        public_ipv6=_public_ipv6(config, settings, underlay, identity),
        node_name=identity.node_name or node_name_default(settings),
        blackhole_own_subnets=settings.ip_blackhole_route,
        vtep_tx_checksum_off=settings.vxlan_tx_checksum_off,
        wireguard_confirmed=frozenset(),  # pairs wait for their handshake (none yet)
        wireguard_confirmed_v6=frozenset(),
    )


def _take_over_flannel_routes(settings: AgentSettings, kernel: Kernel, ctx: NodeContext) -> None:
    """Refuse a Network that overlaps routes of others; take over the routes a Flannel
    that ran here before left for its peers (dataplane.adopt): those are no overlap. Both
    read IPv4 routes: nothing to do IPv6-only."""
    config = ctx.config
    if config.network is None:
        return
    ours = {*_all_backend_devices(ctx), "cni0"}
    shape = FlannelRouteShape(
        config.network, config.subnet_len, _all_backend_devices(ctx)[0], ctx.underlay.name
    )
    foreign = [r for r in kernel.survey(ours) if not _left_by_flannel(r, shape)]
    check_no_overlap(config.network, foreign, settings.allow_overlap)
    kernel.adopt_routes(shape)


def _capacity_and_pools(
    config: NetworkConfig, store: ClusterStore
) -> tuple[CapacitySettings, list[Pool] | None]:
    """Warm capacity and the address pools (a store with several leases per node)."""
    capacity = parse_capacity(config.raw)
    if store.traits.several_leases_per_node:
        return capacity, store.list_pools(config)
    if capacity.max_leases_per_node > 1:
        log.warning(
            "MaxLeasesPerNode and MinFreeAddresses do not apply in Kubernetes mode "
            "(one podCIDR per node); ignoring them"
        )
        capacity = CapacitySettings()
    return capacity, None


IPV6_ONLY_BACKENDS = ("vxlan", "host-gw", "wireguard")


def _check_ipv6_only(config: NetworkConfig) -> None:
    """IPv6-only mode (EnableIPv4 false) runs vxlan, host-gw and wireguard, in etcd and
    Kubernetes mode: refuse the rest with one sentence."""
    if config.backend.type not in IPV6_ONLY_BACKENDS:
        raise ConfigError(
            f"net-conf.json: IPv6-only (EnableIPv4 false) runs the vxlan, host-gw and "
            f"wireguard backends, not {config.backend.type}; choose one of them or enable IPv4"
        )
    log.info("IPv6-only: the rollout's verification is IPv4-only and stays off")


def _public_ipv6(
    config: NetworkConfig,
    settings: AgentSettings,
    underlay: UnderlayInterface,
    identity: NodeIdentity,
) -> IPv6Address | None:
    """The IPv6 address peers reach us at (dual stack): the node-public-ipv6 annotation,
    else --public-ipv6, else the underlay interface's global IPv6 address (Flannel's
    order); None without IPv6."""
    if not config.enable_ipv6:
        return None
    given = identity.public_ipv6 or (
        IPv6Address(settings.public_ipv6) if settings.public_ipv6 else None
    )
    if given is not None:
        return given
    if underlay.ip6 is None:
        raise ConfigError(
            f"net-conf.json enables IPv6, but {underlay.name} has no global IPv6 address "
            "that is neither temporary nor deprecated; add a stable one, or choose another "
            "interface with --iface, or give --public-ipv6"
        )
    return underlay.ip6


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
        settle_heap()
        agent.run_until_stopped()
    except FlannelpyError as e:
        log.error("%s", e)
        agent.shutdown()
        return e.exit_code
    finally:
        if agent.parts.wireguard is not None:
            agent.parts.wireguard.stop()  # as flanneld's, the devices go; the key stays
    return 0


def settle_heap() -> None:
    """Once the agent is ready: what start-up built (imports, clients, the lease list, the
    first plan) lives as long as the process. Collect the garbage once, then keep the rest
    out of the collector's sight, so that its periodic full collections no longer walk
    every object of the start (CPython's gc.freeze). What the collection freed goes back
    to the kernel."""
    gc.collect()
    gc.freeze()
    release_free_memory()


def _icmp_transport() -> ProbeTransport:
    from flannelpy.dataplane.icmp import DualTransport, Icmp6Transport, IcmpTransport

    v4 = IcmpTransport()
    try:
        v6: IcmpTransport | None = Icmp6Transport()
    except DataplaneError as e:  # a kernel without IPv6: IPv4 probes still run
        log.warning("IPv6 probes disabled: %s", e)
        v6 = None
    return DualTransport(v4, v6)


def _link_stats(underlay: str) -> LinkProvider:
    from flannelpy.dataplane.linkstats import NetlinkLinkStats

    return NetlinkLinkStats(underlay=underlay)


def _all_backend_devices(ctx: NodeContext) -> tuple[str, ...]:
    from flannelpy.backend.vxlan import device_name
    from flannelpy.backend.wireguard_config import DEVICE, DEVICE_V6

    return (device_name(ctx.config.backend.vni), DEVICE, DEVICE_V6)


def _wireguard_runtime(settings: AgentSettings, metrics: AgentMetrics) -> WireguardRuntime:
    """The node's WireGuard key and devices, for wireguard now or after a live switch to
    it. Nothing on the host changes until the key is loaded or a device planned."""
    return WireguardRuntime(
        default_key_file(settings.state_dir),
        os.path.join(settings.run_dir, "wireguard"),
        on_repair=metrics.wireguard_repair,
        on_prepared=metrics.wireguard_implementation,
    )


def _read_config_patiently(
    store: ClusterStore,
    timeout: float,
    sleep: Callable[[float], None] = time.sleep,
) -> NetworkConfig:
    """The network config, retrying an unreachable store for up to ``timeout`` seconds.

    Many agents start at once after a cluster-wide restart; a store slow to answer
    the first request is normal then, and crash-looping would only add load. In etcd
    mode a config key not written yet is waited for, every second and without end, as
    flanneld does (the operator may write it after starting the nodes); a config that
    is there but invalid still stops the agent with its sentence.
    """
    deadline = time.monotonic() + timeout
    delay = 0.2
    waiting = False
    while True:
        try:
            return store.manager.get_network_config()
        except StoreUnavailable as e:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("store unavailable, retrying in %.1fs: %s", delay, e)
            sleep(delay)
            delay = min(delay * 2, 5.0)
        except ConfigError as e:
            if store.config_written():
                raise
            if not waiting:  # once: the wait may be long, and it is expected
                log.warning("waiting for the network config: %s", e)
                waiting = True
            sleep(CONFIG_WAIT)
            deadline = time.monotonic() + timeout  # the store answered: it is reachable


def _left_by_flannel(entry: ForeignRoute, shape: FlannelRouteShape) -> bool:
    return not entry.is_address and shape.adoptable(
        entry.network, entry.gateway, entry.device, entry.protocol
    )


def _ip_or_none(value: str | None) -> IPv4Address | None:
    return IPv4Address(value) if value else None
