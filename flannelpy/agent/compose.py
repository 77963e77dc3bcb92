"""The composition root: build every adapter and hand them to a NodeAgent.

Everything that can be refused is refused here, before anything on the host
changes. The etcd/Kubernetes choice is made once, by ``open_store``; the rest
of the agent sees only the subnet manager and node control it is given.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Sequence
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from pathlib import Path
from typing import TYPE_CHECKING

from flannelpy.agent.firewall import FirewallFactory, PodNet
from flannelpy.agent.live_config import load_applied
from flannelpy.agent.node import NodeAgent
from flannelpy.agent.vtep import load_vtep_mac
from flannelpy.agent.writer import AgentParts, ProbeTransport
from flannelpy.backend.base import NodeContext
from flannelpy.backend.registry import get_backend
from flannelpy.cni.pods import PodAttachments, PodSide
from flannelpy.config.netconf import NetworkConfig
from flannelpy.config.settings import AgentSettings
from flannelpy.control.change import wanted_config
from flannelpy.dataplane.adopt import FlannelRouteShape
from flannelpy.dataplane.kernel import ForeignRoute, Kernel
from flannelpy.dataplane.state import UnderlayInterface
from flannelpy.errors import ConfigError, DataplaneError, FlannelpyError, StoreUnavailable
from flannelpy.ipam.capacity import CapacitySettings, parse_capacity
from flannelpy.observe.metrics import AgentMetrics, LinkProvider
from flannelpy.subnet.etcd.kv import Store
from flannelpy.subnet.etcd.pools import PoolStore
from flannelpy.subnet.keys import config_key
from flannelpy.subnet.manager import SubnetManager
from flannelpy.subnet.open_store import OpenedStore, open_store
from flannelpy.subnet.survey import check_no_overlap

if TYPE_CHECKING:
    from flannelpy.control.node_control import NodeControl
    from flannelpy.dataplane.firewall import IptablesFirewall, SyncResult
    from flannelpy.dataplane.nftables import NftablesFirewall
    from flannelpy.subnet.kube.manager import KubeSubnetManager

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
    opened: OpenedStore | None = None,
    kernel: Kernel | None = None,
    metrics: AgentMetrics | None = None,
) -> NodeAgent:
    """Wire the parts together (``opened``, ``kernel``: already built ones, for tests)."""
    metrics = metrics or AgentMetrics()
    if opened is None:
        opened = open_store(
            settings, on_error=metrics.store_error, on_watch_restart=metrics.watch_restart
        )
    manager, kube = opened.manager, opened.kube
    try:
        config = _read_config_patiently(
            manager, settings.startup_timeout, opened.etcd, settings.etcd_prefix
        )
        # A restart keeps the backend this node last applied: a change that arrived
        # meanwhile still goes through the disruption policy, like any live change.
        applied = load_applied(settings.state_dir)
        if applied is not None:
            config = wanted_config(json.dumps(config.raw).encode(), applied)
        ipv6_only = not config.enable_ipv4 or config.network is None
        if ipv6_only:
            _check_ipv6_only(config)
        if config.backend_defaulted:
            raise ConfigError(NO_BACKEND)
        backend = get_backend(config.backend.type)
        if kernel is None:
            from flannelpy.dataplane.netlink import NetlinkKernel

            kernel = NetlinkKernel()
        # Kubernetes mode: the node-public-ip annotation replaces --public-ip, as in
        # flanneld (it also picks the interface when no --iface is given).
        public_ip = (kube.node_public_ip() if kube else None) or settings.public_ip
        if ipv6_only:
            underlay = kernel.find_underlay(settings.iface, settings.iface_regex, ipv6_only=True)
        else:
            underlay = kernel.find_underlay(
                settings.iface, settings.iface_regex,
                _ip_or_none(settings.iface_can_reach), public_ip,
            )  # fmt: skip
        public_ipv6 = _public_ipv6(config, settings, underlay, kube)
        ctx = NodeContext(
            config=config,
            underlay=underlay,
            public_ip=None if ipv6_only else (public_ip or underlay.ip),
            public_ipv6=public_ipv6,
            node_name=kube.node_name if kube else node_name_default(settings),
            blackhole_own_subnets=settings.ip_blackhole_route,
            wireguard_confirmed=frozenset(),  # pairs wait for their handshake (none yet)
        )
        _prepare_wireguard(settings, config, metrics, now=backend.type_name == "wireguard")
        ours = {*_all_backend_devices(ctx), "cni0"}
        # Routes a Flannel that ran here before left for its peers are ours to take over
        # (dataplane.adopt), not an overlap.
        # The overlap check and the take-over read IPv4 routes: nothing to do IPv6-only.
        if config.network is not None:
            shape = FlannelRouteShape(
                config.network, config.subnet_len, _all_backend_devices(ctx)[0], underlay.name
            )
            foreign = [r for r in kernel.survey(ours) if not _left_by_flannel(r, shape)]
            check_no_overlap(config.network, foreign, settings.allow_overlap)
            kernel.adopt_routes(shape)
        vtep_mac = None
        if backend.type_name == "vxlan" or kube:
            vtep_mac = load_vtep_mac(
                kernel, settings.state_dir, backend.device_names(ctx)[0],
                advertised=kube.own_vtep_mac() if kube else None,
            )  # fmt: skip
        if config.enable_ipv6 and not ipv6_only:
            log.info(
                "dual stack: address pools beyond Network, the warm-capacity count, the "
                "rollout's verification and wireguard stay IPv4-only for now"
            )
        log.info(
            "starting node=%s backend=%s iface=%s public_ip=%s public_ipv6=%s mtu=%s",
            ctx.node_name, backend.type_name, underlay.name, ctx.public_ip, ctx.public_ipv6,
            backend.mtu(ctx),
        )  # fmt: skip
    except BaseException:
        manager.close()
        raise

    capacity = parse_capacity(config.raw)
    pools = None
    if ipv6_only:
        pass  # _check_ipv6_only refused the IPv4-only features: no pools, no warm capacity
    elif opened.etcd is not None:
        pools = PoolStore(opened.etcd, settings.etcd_prefix).list_pools(config)
    elif capacity.max_leases_per_node > 1:
        log.warning("MaxLeasesPerNode and MinFreeAddresses do not apply in Kubernetes mode "
                    "(one podCIDR per node); ignoring them")  # fmt: skip
        capacity = CapacitySettings()
    if kube is not None:
        from flannelpy.control.node_control import KubeNodeControl
        from flannelpy.subnet.kube.node_status import LeasePublisher, agent_namespace

        # The status record: this node's Lease in the agent's namespace.
        publisher = LeasePublisher(
            kube.api_client, agent_namespace(os.environ, lambda p: Path(p).read_text())
        )
        control: NodeControl = KubeNodeControl(kube, settings.net_config_path, publisher)
    else:
        from flannelpy.control.node_control import EtcdNodeControl

        assert opened.etcd is not None
        control = EtcdNodeControl(opened.etcd, settings.etcd_prefix, ctx.node_name)

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
            control=control,
            vtep_mac=vtep_mac,
            firewall_factory=_firewall_factory(settings, metrics, nftables=config.enable_nftables),
            applied_generation=(applied.generation or None) if applied else None,
            pools=pools,
            capacity=capacity,
            probe_transport=_icmp_transport,
            link_stats=_link_stats,
        )
    )


IPV6_ONLY_BACKENDS = ("vxlan", "host-gw", "wireguard")


def _check_ipv6_only(config: NetworkConfig) -> None:
    """IPv6-only mode (EnableIPv4 false) runs vxlan, host-gw and wireguard, in etcd and
    Kubernetes mode, without the features that stay IPv4-only: refuse the rest with one
    sentence each."""
    if config.backend.type not in IPV6_ONLY_BACKENDS:
        raise ConfigError(
            f"net-conf.json: IPv6-only (EnableIPv4 false) runs the vxlan, host-gw and "
            f"wireguard backends, not {config.backend.type}; choose one of them or enable IPv4"
        )
    capacity = parse_capacity(config.raw)
    if capacity.max_leases_per_node > 1 or capacity.min_free_addresses:
        raise ConfigError(
            "net-conf.json: MaxLeasesPerNode and MinFreeAddresses (warm capacity) are "
            "IPv4-only; remove them for IPv6-only (EnableIPv4 false)"
        )
    log.info("IPv6-only: address pools, warm capacity and the rollout's verification "
             "are IPv4-only and stay off")  # fmt: skip


def _public_ipv6(
    config: NetworkConfig,
    settings: AgentSettings,
    underlay: UnderlayInterface,
    kube: KubeSubnetManager | None,
) -> IPv6Address | None:
    """The IPv6 address peers reach us at (dual stack): the node-public-ipv6 annotation,
    else --public-ipv6, else the underlay interface's global IPv6 address (Flannel's
    order); None without IPv6."""
    if not config.enable_ipv6:
        return None
    given = (kube.node_public_ipv6() if kube else None) or (
        IPv6Address(settings.public_ipv6) if settings.public_ipv6 else None
    )
    if given is not None:
        return given
    if underlay.ip6 is None:
        raise ConfigError(
            f"net-conf.json enables IPv6, but {underlay.name} has no global IPv6 address; "
            "add one, or choose another interface with --iface, or give --public-ipv6"
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
        agent.run_until_stopped()
    except FlannelpyError as e:
        log.error("%s", e)
        agent.shutdown()
        return e.exit_code
    finally:
        _stop_wireguard()  # as flanneld, the device goes with the agent; the key stays
    return 0


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


def _prepare_wireguard(settings: AgentSettings, config: NetworkConfig,
                       metrics: AgentMetrics, now: bool) -> None:  # fmt: skip
    """The node's WireGuard runtime, for wireguard now or after a live switch to it. With
    ``now``, check the options, choose kernel or userspace and load the key before anything
    on the host changes: "Implementation": "kernel" without the module stops here."""
    from flannelpy.backend import wireguard_runtime as wireguard
    from flannelpy.backend.wireguard_config import parse_wireguard_config

    runtime = wireguard.WireguardRuntime(
        wireguard.default_key_file(settings.state_dir),
        os.path.join(settings.run_dir, "wireguard"),
        on_repair=metrics.wireguard_repair,
        on_prepared=metrics.wireguard_implementation,
        on_unencrypted=metrics.wireguard_unencrypted_peers,
    )
    wireguard.set_runtime(runtime)
    if now:
        runtime.prepare(parse_wireguard_config(config.backend))


def _stop_wireguard() -> None:
    from flannelpy.backend import wireguard_runtime as wireguard

    runtime = wireguard.current_runtime()
    if runtime is not None:
        runtime.stop()


def _read_config_patiently(
    manager: SubnetManager,
    timeout: float,
    etcd: Store | None = None,
    prefix: str = "",
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
            return manager.get_network_config()
        except StoreUnavailable as e:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("store unavailable, retrying in %.1fs: %s", delay, e)
            sleep(delay)
            delay = min(delay * 2, 5.0)
        except ConfigError as e:
            if etcd is None or etcd.get(config_key(prefix)) is not None:
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


def _firewall_factory(
    settings: AgentSettings,
    metrics: AgentMetrics,
    firewall: IptablesFirewall | None = None,
    nft: NftablesFirewall | None = None,
    *,
    nftables: bool = False,
) -> FirewallFactory | None:
    """The masq and forward rules in iptables mode, or Flannel's nftables tables with
    ``EnableNFTables``. Before the first sync the other mode's rules are removed, as
    flanneld does at start, so a node switched between modes keeps one set. Tests pass
    the adapters; a mode whose adapter is not passed is then left alone."""
    if not nftables and not settings.ip_masq and not settings.iptables_forward_rules:
        return None
    from flannelpy.dataplane import nftables as nft_rules
    from flannelpy.dataplane.firewall import IptablesFirewall, forward_rules, masq_rules
    from flannelpy.dataplane.nftables import NftablesFirewall

    firewall6 = None
    if firewall is None and nft is None:
        firewall, nft = IptablesFirewall(), NftablesFirewall()
        firewall6 = IptablesFirewall(ipv6=True)
    worked = [False]  # some sync has succeeded: the firewall works on this host
    other_mode_cleaned = [False]

    def clean_other_mode() -> None:
        # nftables mode removes the ip6tables chains too, as flanneld's clean-up does.
        others = (firewall, firewall6) if nftables else (nft,)
        other_mode_cleaned[0] = True
        for other in others:
            if other is None:
                continue
            try:
                other.remove()
            except DataplaneError as e:  # e.g. nft not installed: nothing of it to remove
                log.info("rules of the unused firewall mode not removed: %s", e)

    def iptables_steps(
        fw: IptablesFirewall, networks: Sequence[PodNet], subnets: Sequence[PodNet]
    ) -> list[Callable[[], SyncResult]]:
        """One family's iptables (or ip6tables) chains: masq, then forward."""
        steps: list[Callable[[], SyncResult]] = []
        if settings.ip_masq:
            random_fully = fw.random_fully and not settings.ip_masq_fully_random_disable
            masq = masq_rules(networks, subnets, random_fully)
            steps.append(lambda: fw.sync(masq))
        if settings.iptables_forward_rules:
            forward = forward_rules(networks)
            steps.append(lambda: fw.sync(forward))
        return steps

    def make(all_nets: Sequence[PodNet], all_subnets: Sequence[PodNet]) -> Callable[[], bool]:
        # --ip-masq-fully-random-disable: flanneld's opt-out of --random-fully.
        steps: list[Callable[[], SyncResult]] = []
        # Dual stack: the IPv6 ranges get the same rules in ip6tables, or in nftables'
        # ip6 flannel-ipv6 table.
        networks6 = [n for n in all_nets if isinstance(n, IPv6Network)]
        subnets6 = [n for n in all_subnets if isinstance(n, IPv6Network)]
        networks = [n for n in all_nets if isinstance(n, IPv4Network)]
        subnets = [n for n in all_subnets if isinstance(n, IPv4Network)]
        if nftables:
            assert nft is not None
            nft_fw = nft
            postrtg = None
            random_fully = nft_fw.random_fully and not settings.ip_masq_fully_random_disable
            if settings.ip_masq and networks:  # IPv6-only: no IPv4 table
                postrtg = nft_rules.masq_rules(networks, subnets, random_fully)
            postrtg6 = None
            if settings.ip_masq and networks6:
                postrtg6 = nft_rules.masq_rules(networks6, subnets6, random_fully)
            forward_chain = forward_chain6 = None
            if settings.iptables_forward_rules:
                if networks:
                    forward_chain = nft_rules.forward_rules(networks)
                if networks6:
                    forward_chain6 = nft_rules.forward_rules(networks6)
            desired = nft_rules.NftRules(postrtg, forward_chain, postrtg6, forward_chain6)
            steps.append(lambda: nft_fw.sync(desired))
        else:
            assert firewall is not None
            if networks:  # IPv6-only: ip6tables alone
                steps.extend(iptables_steps(firewall, networks, subnets))
        if networks6 and firewall6 is not None and not nftables:
            steps.extend(iptables_steps(firewall6, networks6, subnets6))

        def sync() -> bool:
            """True once every chain is as desired. Before the first success a failure
            raises (start-up refuses a host where the firewall does not work); after it, a
            failure is passing (the xtables lock held past the wait, e.g. by kube-proxy
            while a lease is recovered): False, and the firewall timer tries again."""
            try:
                if not other_mode_cleaned[0]:
                    clean_other_mode()
                for step in steps:
                    result = step()  # logs what it repaired
                    metrics.firewall_sync(result.repaired)
            except DataplaneError as e:
                if not worked[0]:
                    raise
                log.warning("firewall rules not in place yet, retrying on the firewall "
                            "timer: %s", e)  # fmt: skip
                return False
            worked[0] = True
            return True

        return sync

    return make
