"""The one place that chooses the lease store: etcd, or the Kubernetes API.

Each client is imported only when chosen, so an etcd-mode agent never imports
the Kubernetes client and a Kubernetes-mode agent never imports gRPC.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flannelpy.config.settings import AgentSettings
from flannelpy.subnet.manager import SubnetManager

if TYPE_CHECKING:
    from flannelpy.subnet.etcd.kv import Store
    from flannelpy.subnet.kube.manager import KubeSubnetManager


@dataclass(frozen=True)
class OpenedStore:
    """The subnet manager, and the handle it runs on: the raw etcd store (etcd mode,
    for pools and the control keys) or the Kubernetes manager itself (Kubernetes mode,
    for the Node's identity, annotations and the net-conf.json file)."""

    manager: SubnetManager
    etcd: Store | None = None
    kube: KubeSubnetManager | None = None


def open_store(
    settings: AgentSettings,
    on_error: Callable[[str], None] | None = None,
    on_watch_restart: Callable[[str], None] | None = None,
) -> OpenedStore:
    """Connect (lazily) per ``--kube-subnet-mgr``; ``on_error(kind)`` counts failed etcd
    requests, ``on_watch_restart(reason)`` re-listed watches."""
    if settings.kube_subnet_mgr:
        from flannelpy.subnet.kube.manager import KubeSubnetManager

        kube = KubeSubnetManager(settings)
        return OpenedStore(manager=kube, kube=kube)
    from flannelpy.subnet.etcd.client import connect_etcd
    from flannelpy.subnet.etcd.manager import EtcdSubnetManager

    store = connect_etcd(settings, on_error=on_error)
    manager = EtcdSubnetManager(store, settings, on_watch_restart=on_watch_restart)
    return OpenedStore(manager=manager, etcd=store)
