"""What ``flannelpy doctor`` looks at: a node's facts, read from where the agent keeps them.

It reads the store (etcd with the agent's ``--etcd-*`` settings, or the Kubernetes API
with ``--kube-subnet-mgr``), the kernel (netlink) and iptables of the network namespace
it runs in, ``<run dir>/status.json`` and the drop counters of the previous run; the
judging is :mod:`flannelpy.doctor.checks`. To look at another namespace, run the doctor
inside it (``ip netns exec``).

Store clients and netlink are imported when a fact is gathered, not at import.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import replace
from ipaddress import IPv4Address
from typing import Any, Protocol

from flannelpy.config.netconf import NetworkConfig
from flannelpy.config.settings import AgentSettings
from flannelpy.doctor.facts import (
    BRIDGE,
    LinkCounters,
    LinkInfo,
    NodeFacts,
    WireguardFacts,
    parse_snapshot,
)
from flannelpy.doctor.plan import own_lease
from flannelpy.errors import DataplaneError, FlannelpyError
from flannelpy.fsutil import atomic_write
from flannelpy.subnet.lease import Lease
from flannelpy.subnet.manager import SubnetManager
from flannelpy.subnet.pools import Pool

STATUS_FILE = "status.json"
SNAPSHOT_FILE = "doctor-last.json"
STORE_SNAPSHOT_TIMEOUT = 15.0  # seconds for the first lease list in Kubernetes mode
FIREWALL_CHAINS = (
    ("nat", "POSTROUTING"),
    ("nat", "FLANNEL-POSTRTG"),
    ("filter", "FORWARD"),
    ("filter", "FLANNEL-FWD"),
)


class DoctorStore(Protocol):
    """What the doctor reads of the store (``flannelpy.store.open_store.ClusterStore``)."""

    manager: SubnetManager

    def all_leases(self, timeout: float) -> tuple[Lease, ...]: ...
    def list_pools(self, config: NetworkConfig) -> list[Pool]: ...
    def lease_seconds_left(self, lease_id: int) -> float | None: ...
    def close(self) -> None: ...


StoreOpener = Callable[[AgentSettings], DoctorStore]


def gather(
    settings: AgentSettings, open_store: StoreOpener, clock: Callable[[], float] = time.time
) -> NodeFacts:
    """Every fact diagnose() needs, about the node (network namespace) we run in.
    Failures become ``*_error`` fields, never exceptions, so that one broken source
    still leaves a report on the others."""
    facts = NodeFacts(settings=settings, now=clock())
    facts = replace(facts, **_agent_files(settings.run_dir))
    with _Store(settings, open_store) as store:
        facts = replace(facts, **store.read())
        facts = replace(facts, **_kernel_facts(settings, facts))
        config = facts.config
        if config is not None and config.backend.type == "wireguard":
            if config.enable_ipv4:
                facts = replace(facts, wireguard=_wireguard_facts(settings))
            if config.enable_ipv6:
                facts = replace(facts, wireguard_v6=_wireguard_facts(settings, v6=True))
        nftables = facts.config is not None and facts.config.enable_nftables
        facts = replace(facts, **(_nft_facts() if nftables else _firewall_facts()))
        facts = replace(facts, policy_table_present=_policy_table_present())
        if facts.underlay is not None:
            v4 = config is None or config.enable_ipv4
            own = own_lease(
                facts, (settings.public_ip or facts.underlay.ip) if v4 else None, facts.underlay.ip6
            )
            if own is not None and own.store_lease_id is not None:
                facts = replace(facts, own_lease_ttl=store.ttl(own.store_lease_id))
    return facts


class _Store:
    """The lease store, read-only, opened by ``open_store`` (the caller's: the store
    layer sits above the doctor). Errors end up in ``store_error``."""

    def __init__(self, settings: AgentSettings, open_store: StoreOpener) -> None:
        self.settings = settings
        self.open_store = open_store
        self.store: DoctorStore | None = None

    def __enter__(self) -> _Store:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.store is not None:
            self.store.close()

    def read(self) -> dict[str, Any]:
        try:
            self.store = store = self.open_store(self.settings)
            config = store.manager.get_network_config()
            leases = store.all_leases(STORE_SNAPSHOT_TIMEOUT)
            pools = store.list_pools(config)
        except FlannelpyError as e:
            return {"store_error": str(e)}
        return {
            "config": config,
            "leases": leases,
            "pool_networks": tuple(p.network for p in pools if not p.primary),
        }

    def ttl(self, lease_id: int) -> float | None:
        """Seconds left on a store lease; None when unknown."""
        return None if self.store is None else self.store.lease_seconds_left(lease_id)


def _wireguard_facts(settings: AgentSettings, v6: bool = False) -> WireguardFacts:
    """The device (``flannel-wg``, or ``flannel-wg-v6``) through wireguard-go's socket in
    the agent's run dir, else the kernel."""
    import os

    from flannelpy.backend import wireguard_config as wireguard
    from flannelpy.dataplane.uapi import uapi_get
    from flannelpy.dataplane.wgnetlink import KernelConfigurator

    device = wireguard.DEVICE_V6 if v6 else wireguard.DEVICE
    sock_dir = os.path.join(settings.run_dir, "wireguard")
    sock = os.path.join(sock_dir, f"{device}.sock")
    if os.path.exists(sock):
        pid = None
        try:
            with open(os.path.join(sock_dir, f"{device}.pid")) as f:
                pid = int(f.read().strip())
        except (OSError, ValueError):
            pass
        try:
            return WireguardFacts("userspace", uapi_get(sock), pid)
        except DataplaneError as e:
            return WireguardFacts("userspace", None, pid, str(e))
    kinds = {link.name: link.kind for link in read_links()}
    if kinds.get(device) == "wireguard":
        try:
            return WireguardFacts("kernel", KernelConfigurator(device).get())
        except (DataplaneError, OSError) as e:
            return WireguardFacts("kernel", None, error=str(e))
    return WireguardFacts(None, error=f"no {device} device and no wireguard-go socket {sock}")


def _kernel_facts(settings: AgentSettings, facts: NodeFacts) -> dict[str, Any]:
    """Links, our routes/neighbours/FDB, foreign routes and the underlay, in one namespace."""
    from flannelpy.backend.vxlan import device_name
    from flannelpy.config.netconf import BackendConfig
    from flannelpy.dataplane.netlink import NetlinkKernel

    kernel = NetlinkKernel()
    vni = (facts.config.backend if facts.config else BackendConfig()).vni
    device = device_name(vni)
    devices = vtep_devices(vni)
    try:
        links = read_links()
        observed = kernel.observe(devices, devices)
        foreign = kernel.survey({*devices, BRIDGE, "flannel-wg", "flannel-wg-v6"})
        vtep_mac = kernel.link_mac(device)
    except (DataplaneError, OSError) as e:
        return {"kernel_error": str(e)}
    found: dict[str, Any] = {
        "links": tuple(links),
        "observed": observed,
        "foreign": tuple(foreign),
        "vtep_mac": vtep_mac,
    }
    try:
        can_reach = IPv4Address(settings.iface_can_reach) if settings.iface_can_reach else None
        found["underlay"] = kernel.find_underlay(
            settings.iface, settings.iface_regex, can_reach, settings.public_ip
        )
    except DataplaneError as e:
        found["underlay_error"] = str(e)
    return found


def vtep_devices(vni: int) -> tuple[str, ...]:
    """The VTEPs whose addresses, neighbours and FDB entries the doctor reads: IPv4's
    and IPv6's (dual stack and IPv6-only put the IPv6 peers on ``flannel-v6.<VNI>``)."""
    from flannelpy.backend.ipv6 import device_name_v6
    from flannelpy.backend.vxlan import device_name

    return (device_name(vni), device_name_v6(vni))


def read_links() -> list[LinkInfo]:
    """Every link with its MTU, state, master and drop/error counters (``ip -d -s link``)."""
    from flannelpy.dataplane import nlbatch as nl
    from flannelpy.dataplane.rtnl import IFF_LOWER_UP, IFF_UP

    with nl.NetlinkSocket(strict=True) as sock:
        rows = nl.dump_links(sock)
        stats = {row.name: row for row in nl.dump_link_stats(sock)}  # names are unique
    names = {row.index: row.name for row in rows}
    links = []
    for row in rows:
        st = stats.get(row.name)
        counters = LinkCounters()
        master = None
        if st is not None:
            counters = LinkCounters(
                st.stats.rx_dropped, st.stats.tx_dropped, st.stats.rx_errors, st.stats.tx_errors
            )
            master = names.get(st.master)
        links.append(
            LinkInfo(
                row.name,
                row.kind,
                row.mtu,
                bool(row.flags & IFF_UP),
                master,
                counters,
                carrier=bool(row.flags & IFF_LOWER_UP),
            )
        )
    return links


def _firewall_facts() -> dict[str, Any]:
    from flannelpy.dataplane.firewall import IptablesFirewall

    firewall = IptablesFirewall()
    try:
        chains = {
            f"{table}/{chain}": tuple(firewall.list_rules(table, chain))
            for table, chain in FIREWALL_CHAINS
        }
        random_fully = firewall.random_fully
    except DataplaneError as e:
        return {"firewall_error": str(e)}
    return {"chains": chains, "random_fully": random_fully}


def _nft_facts() -> dict[str, Any]:
    from flannelpy.dataplane.nftables import NftablesFirewall

    firewall = NftablesFirewall()
    try:
        return {"nft_tables": firewall.listing(), "random_fully": firewall.random_fully}
    except DataplaneError as e:
        return {"firewall_error": str(e)}


def _policy_table_present() -> bool | None:
    """Whether the kernel holds NetworkPolicy's table; None when nft cannot tell."""
    from flannelpy.dataplane.policy_table import PolicyTable
    from flannelpy.netpol.nft import PREFIX

    try:
        return PolicyTable(timeout=5.0).listing(PREFIX) is not None
    except DataplaneError:
        return None


def _agent_files(run_dir: str) -> dict[str, Any]:
    """The agent's status.json and our previous counters, both in the run dir."""
    found: dict[str, Any] = {}
    path = os.path.join(run_dir, STATUS_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        found["status_mtime"] = os.stat(path).st_mtime
        if isinstance(doc, dict):
            found["status"] = doc
        else:
            found["status_error"] = f"{path} holds no JSON object"
    except FileNotFoundError:
        found["status_error"] = (
            f"{path} does not exist (the agent is not running, or uses another --run-dir)"
        )
    except (OSError, ValueError) as e:
        found["status_error"] = f"{path} cannot be read: {e}"
    try:
        with open(os.path.join(run_dir, SNAPSHOT_FILE), encoding="utf-8") as f:
            found["previous"] = parse_snapshot(f.read())
    except OSError:
        pass  # first run: no baseline yet
    return found


def save_snapshot(run_dir: str, text: str) -> None:
    """Write this run's counters for the next run, atomically; raises OSError."""
    atomic_write(os.path.join(run_dir, SNAPSHOT_FILE), text, durable=False)
