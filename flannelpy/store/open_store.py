"""The one place that chooses the store: etcd, or the Kubernetes API.

:func:`open_store` returns a :class:`ClusterStore`, one face for both: the subnet
manager (leases), the node's control channel, address pools, what the store knows of
this node, and the few differences a caller must respect, said as capabilities
(``StoreTraits``) rather than as a mode to test. Nothing outside this
module asks which store it runs on.

Each client is imported only when chosen, so an etcd-mode agent never imports
the Kubernetes client and a Kubernetes-mode agent never imports gRPC.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address
from pathlib import Path
from typing import TYPE_CHECKING

from flannelpy.config.netconf import NetworkConfig
from flannelpy.config.settings import AgentSettings
from flannelpy.control.policy import ETCD_REMEDY, KUBE_REMEDY
from flannelpy.errors import StoreError
from flannelpy.subnet.keys import config_key
from flannelpy.subnet.lease import Lease
from flannelpy.subnet.manager import SubnetManager, first_snapshot
from flannelpy.subnet.pools import Pool

if TYPE_CHECKING:
    from flannelpy.control.node_control import NodeControl
    from flannelpy.rollout.storage import RolloutStorage
    from flannelpy.store.etcd.kv import Store
    from flannelpy.store.etcd.manager import EtcdSubnetManager
    from flannelpy.store.kube.manager import KubeSubnetManager
    from flannelpy.store.policy_inputs import PolicySource


@dataclass(frozen=True)
class NodeIdentity:
    """What the store says about this node; ``None`` where it says nothing (the
    agent's flags and the host decide then)."""

    node_name: str | None = None  # Kubernetes: the Node this agent runs for
    public_ip: IPv4Address | None = None  # the node-public-ip annotation
    public_ipv6: IPv6Address | None = None  # the node-public-ipv6 annotation
    advertised_vtep_mac: str | None = None  # the VtepMAC the Node already advertises
    # Kubernetes: the Node's backend-data carries a VtepMAC whatever the backend, so the
    # node keeps one stable MAC even on host-gw.
    publishes_vtep_mac: bool = False


@dataclass(frozen=True)
class StoreTraits:
    """How the stores differ where the agent must care, said as what they can do."""

    # etcd: address pools, warm capacity and leases kept across restarts; Kubernetes:
    # the Node's podCIDR, one per family.
    several_leases_per_node: bool = True
    config_remedy: str = ETCD_REMEDY  # where an operator fixes the network config


class ClusterStore:
    """The store, whichever it is. Subclasses are the two stores; callers use only
    what is declared here."""

    manager: SubnetManager
    traits: StoreTraits

    def config_written(self) -> bool:
        """Whether the network config exists, so an unreadable one is an error and not
        one to wait for (an operator may write etcd's key after starting the nodes)."""
        return True

    def node_identity(self) -> NodeIdentity:
        return NodeIdentity()

    def list_pools(self, config: NetworkConfig) -> list[Pool]:
        """The address pools, primary first; none where a node has one subnet."""
        return []

    def node_control(self, settings: AgentSettings, node_name: str) -> NodeControl:
        raise NotImplementedError

    def all_leases(self, timeout: float) -> tuple[Lease, ...]:
        """Every lease now (the doctor's read; the agent watches instead)."""
        return tuple(first_snapshot(self.manager, timeout).values())

    def lease_seconds_left(self, lease_id: int) -> float | None:
        """Seconds left on a store lease's TTL; ``None`` when unknown."""
        return None

    def policy_source(
        self,
        on_refused: Callable[[str], None] | None = None,
        on_restart: Callable[[str], None] | None = None,
    ) -> PolicySource | None:
        """NetworkPolicy's inputs (policies, pods, namespaces); None where the store has
        none (etcd)."""
        return None

    def close(self) -> None:
        self.manager.close()


class EtcdClusterStore(ClusterStore):
    traits = StoreTraits()

    manager: EtcdSubnetManager

    def __init__(self, settings: AgentSettings, etcd: Store, manager: EtcdSubnetManager) -> None:
        self.etcd = etcd
        self.manager = manager
        self.prefix = settings.etcd_prefix

    def config_written(self) -> bool:
        return self.etcd.get(config_key(self.prefix)) is not None

    def list_pools(self, config: NetworkConfig) -> list[Pool]:
        from flannelpy.store.etcd.pools import PoolStore

        return PoolStore(self.etcd, self.prefix).list_pools(config)

    def node_control(self, settings: AgentSettings, node_name: str) -> NodeControl:
        from flannelpy.store.node_control import EtcdNodeControl

        return EtcdNodeControl(self.etcd, self.prefix, node_name)

    def all_leases(self, timeout: float) -> tuple[Lease, ...]:
        return tuple(self.manager.list_leases()[0].values())  # one list, not a watch

    def lease_seconds_left(self, lease_id: int) -> float | None:
        try:
            left = self.etcd.lease_remaining(lease_id)
        except StoreError:
            return None
        return None if left is None else float(max(left, 0))


class KubeClusterStore(ClusterStore):
    traits = StoreTraits(several_leases_per_node=False, config_remedy=KUBE_REMEDY)

    def __init__(self, manager: KubeSubnetManager) -> None:
        self.manager = manager
        self.kube = manager

    def node_identity(self) -> NodeIdentity:
        kube = self.kube
        return NodeIdentity(
            node_name=kube.node_name,
            public_ip=kube.node_public_ip(),
            public_ipv6=kube.node_public_ipv6(),
            advertised_vtep_mac=kube.own_vtep_mac(),
            publishes_vtep_mac=True,
        )

    def node_control(self, settings: AgentSettings, node_name: str) -> NodeControl:
        from flannelpy.store.kube.node_status import LeasePublisher, agent_namespace
        from flannelpy.store.node_control import KubeNodeControl

        # The status record: this node's Lease in the agent's namespace.
        publisher = LeasePublisher(
            self.kube.api_client, agent_namespace(os.environ, lambda p: Path(p).read_text())
        )
        return KubeNodeControl(self.kube, settings.net_config_path, publisher)

    def policy_source(
        self,
        on_refused: Callable[[str], None] | None = None,
        on_restart: Callable[[str], None] | None = None,
    ) -> PolicySource | None:
        from flannelpy.store.kube.policy_watch import KubePolicySource, kube_resources

        return KubePolicySource(kube_resources(self.kube.api_client), on_refused, on_restart)


def open_store(
    settings: AgentSettings,
    on_error: Callable[[str], None] | None = None,
    on_watch_restart: Callable[[str], None] | None = None,
    timeout: float | None = None,
) -> ClusterStore:
    """Connect (lazily) per ``--kube-subnet-mgr``; ``on_error(kind)`` counts failed etcd
    requests, ``on_watch_restart(reason)`` re-listed watches; ``timeout`` bounds each
    etcd request (the client's default otherwise)."""
    if settings.kube_subnet_mgr:
        from flannelpy.store.kube.manager import KubeSubnetManager

        return KubeClusterStore(KubeSubnetManager(settings))
    from flannelpy.store.etcd.client import connect_etcd
    from flannelpy.store.etcd.manager import EtcdSubnetManager

    extra = {} if timeout is None else {"timeout": timeout}
    etcd = connect_etcd(settings, on_error=on_error, **extra)
    manager = EtcdSubnetManager(etcd, settings, on_watch_restart=on_watch_restart)
    return EtcdClusterStore(settings, etcd, manager)


def open_rollout_store(
    settings: AgentSettings, namespace: str, config_map: str, timeout: float
) -> tuple[RolloutStorage, Callable[[], None]]:
    """The rollout's store and how to close it: etcd's keys, or the Kubernetes
    ConfigMap (``namespace``/``config_map``) and Nodes."""
    if settings.kube_subnet_mgr:
        from flannelpy.store.kube.client import build_api_client
        from flannelpy.store.rollout_kube import KubeRolloutStore

        client = build_api_client(settings)
        store = KubeRolloutStore(client, settings.kube_annotation_prefix, namespace, config_map)

        def close() -> None:
            store.close()  # its watches first: they use the client
            client.close()

        return store, close
    from flannelpy.store.etcd.client import connect_etcd
    from flannelpy.store.rollout_etcd import RolloutStore

    etcd = connect_etcd(settings, timeout=timeout)
    return RolloutStore(etcd, settings.etcd_prefix), etcd.close
