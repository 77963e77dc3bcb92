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
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from ipaddress import IPv4Address
from typing import Any

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
from flannelpy.errors import DataplaneError, FlannelpyError, StoreError, StoreUnavailable
from flannelpy.fsutil import atomic_write
from flannelpy.subnet.lease import Lease
from flannelpy.subnet.manager import SubnetManager

STATUS_FILE = "status.json"
SNAPSHOT_FILE = "doctor-last.json"
STORE_TIMEOUT = 3.0  # seconds per etcd request: the doctor is run by a person waiting
STORE_SNAPSHOT_TIMEOUT = 15.0  # seconds for the first lease list in Kubernetes mode
FIREWALL_CHAINS = (
    ("nat", "POSTROUTING"),
    ("nat", "FLANNEL-POSTRTG"),
    ("filter", "FORWARD"),
    ("filter", "FLANNEL-FWD"),
)


def gather(settings: AgentSettings, clock: Callable[[], float] = time.time) -> NodeFacts:
    """Every fact diagnose() needs, about the node (network namespace) we run in.
    Failures become ``*_error`` fields, never exceptions, so that one broken source
    still leaves a report on the others."""
    facts = NodeFacts(settings=settings, now=clock())
    facts = replace(facts, **_agent_files(settings.run_dir))
    with _Store(settings) as store:
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
        if facts.underlay is not None:
            v4 = config is None or config.enable_ipv4
            own = own_lease(
                facts, (settings.public_ip or facts.underlay.ip) if v4 else None, facts.underlay.ip6
            )
            if own is not None and own.store_lease_id is not None:
                facts = replace(facts, own_lease_ttl=store.ttl(own.store_lease_id))
    return facts


class _Store:
    """The lease store, read-only: etcd (the agent's --etcd-* flags) or, with
    --kube-subnet-mgr, the Kubernetes API. Errors end up in ``store_error``."""

    def __init__(self, settings: AgentSettings) -> None:
        self.settings = settings
        self.store: Any = None  # the EtcdStore, for lease time-to-live
        self.manager: Any = None

    def __enter__(self) -> _Store:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.manager is not None:
            self.manager.close()
        if self.store is not None:
            self.store.close()

    def read(self) -> dict[str, Any]:
        try:
            if self.settings.kube_subnet_mgr:
                from flannelpy.subnet.kube.manager import KubeSubnetManager

                self.manager = KubeSubnetManager(self.settings)
                config = self.manager.get_network_config()
                leases = first_snapshot(self.manager, STORE_SNAPSHOT_TIMEOUT)
            else:
                from flannelpy.subnet.etcd.client import connect_etcd
                from flannelpy.subnet.etcd.manager import EtcdSubnetManager

                self.store = connect_etcd(self.settings, timeout=STORE_TIMEOUT)
                self.manager = EtcdSubnetManager(self.store, self.settings)
                config = self.manager.get_network_config()
                leases, _ = self.manager.list_leases()
                from flannelpy.subnet.etcd.pools import PoolStore

                # Pools are IPv4 ranges: none IPv6-only (the agent turns them off too).
                pools = (
                    PoolStore(self.store, self.settings.etcd_prefix).list_pools(config)
                    if config.network is not None
                    else []
                )
                return {
                    "config": config,
                    "leases": tuple(leases.values()),
                    "pool_networks": tuple(p.network for p in pools if not p.primary),
                }
        except FlannelpyError as e:
            return {"store_error": str(e)}
        return {"config": config, "leases": tuple(leases.values())}

    def ttl(self, lease_id: int) -> float | None:
        """Seconds left on an etcd lease; None when unknown."""
        if self.store is None:
            return None

        def op(client: Any) -> int:
            return int(client.get_lease_info(lease_id).TTL)

        try:
            # EtcdStore has no public time-to-live call; its _call gives us failover
            # and the same error mapping as every other request.
            ttl = self.store._call(f"lease time-to-live {lease_id:x}", op)
        except StoreError:
            return None
        return float(max(ttl, 0))


def first_snapshot(manager: SubnetManager, timeout: float) -> Mapping[str, Lease]:
    """Every lease, from the first callback of ``watch_leases`` (all a manager promises)."""
    leases: dict[str, Lease] = {}
    got = threading.Event()
    stop = threading.Event()
    failure: list[BaseException] = []

    def on_leases(snapshot: Mapping[str, Lease], _revision: int) -> None:
        if not got.is_set():
            leases.update(snapshot)
            got.set()
        stop.set()

    def watch() -> None:
        try:
            manager.watch_leases(on_leases, stop)
        except BaseException as e:  # handed to the caller
            failure.append(e)
            got.set()

    thread = threading.Thread(target=watch, name="doctor-leases", daemon=True)
    thread.start()
    got.wait(timeout)
    stop.set()
    thread.join(timeout)
    if failure:
        raise failure[0]
    if not leases and not got.is_set():
        raise StoreUnavailable(
            f"no lease list from the store within {timeout:g} s; check that it is reachable"
        )
    return leases


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
