"""What a kubelet lab records and where its nodes keep their files.

The record in ``LabState.extra``, the settings every part of the kubelet lab shares and
the paths of a node's containerd, kubelet and host directories: separate so that the
start and stop of the nodes (``flannelpy_lab.kubelet``), the cluster objects and waits
on top of them (``flannelpy_lab.kubelet_cluster``) and the configuration documents
(``flannelpy_lab.kubelet_config``) all read them without importing each other.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from flannelpy_lab.state import LabState, NodeInfo

STATE_KEY = "kubelet"  # in LabState.extra: {"nodes": {node: {...}}, "image": ref, ...}
# The node's host paths, each a bind mount of <node dir>/k8s/host/<path with dashes>.
HOST_PATHS = (
    "/opt/cni/bin",
    "/etc/cni/net.d",
    "/run/flannel",
    "/run/flannelpy",
    "/var/lib/flannelpy",
    "/var/log/pods",
    "/var/log/containers",
    "/run/containerd",
    "/var/lib/cni",
)
REFERENCE_PLUGINS = ("loopback", "portmap")  # what a node's CNI package leaves in /opt/cni/bin
REFERENCE_DIR = "/usr/lib/cni"
READY_TIMEOUT = 120.0  # seconds for containerd, then the Nodes, then the DaemonSet
WORKLOAD = "pinger"  # the test Deployment, in namespace default
DAEMONSET = "kube-flannelpy-ds"

Save = Callable[[], None]
Progress = Callable[[str], None]


def record(state: LabState) -> dict[str, Any]:
    doc: dict[str, Any] = state.extra.setdefault(STATE_KEY, {})
    return doc


def enabled(state: LabState) -> bool:
    return STATE_KEY in state.extra


def network_agent(state: LabState) -> str:
    """What runs the network of a kubelet lab: "flannelpy" (the manifests' DaemonSet) or
    "flanneld" (Flannel's processes, ``flannelpy_lab.kubeflannel``)."""
    agent: str = record(state).get("network_agent", "flannelpy")
    return agent


def runs_daemonset(state: LabState) -> bool:
    """Is the network the manifests' DaemonSet (its pods are the nodes' agents)?"""
    return enabled(state) and network_agent(state) == "flannelpy"


# -- paths ----------------------------------------------------------------------------------


def node_base(node: NodeInfo) -> str:
    return os.path.join(node.node_dir, "k8s")


def _p(node: NodeInfo, *parts: str) -> str:
    return os.path.join(node_base(node), *parts)


def containerd_socket(node: NodeInfo) -> str:
    return _p(node, "containerd.sock")


def host_source(node: NodeInfo, path: str) -> str:
    """The directory of ``node`` that is ``path`` in the node's mount namespace."""
    return _p(node, "host", path.strip("/").replace("/", "-"))


def cgroup_parent(state: LabState, node: NodeInfo) -> str:
    return f"/fpl-{state.name}-{node.name}"
