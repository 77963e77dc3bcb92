"""Flannel itself as a kubelet lab's network (``lab up --kubelet --network-agent flanneld``).

The reference cluster the upstream e2e specs judge flannelpy against: the same kubelet
lab (control plane, per-node containerd, kubelet and kube-proxy, CoreDNS) with the pinned
upstream flanneld and Flannel's CNI plugin instead of the manifests' DaemonSet. It is
deployed as Flannel's ``Documentation/kube-flannel.yml`` (v0.28.9) deploys it, its
DaemonSet played by processes:

- the manifest's objects but the DaemonSet: Namespace ``kube-flannel``, the ClusterRole
  and ClusterRoleBinding ``flannel``, the ServiceAccount ``flannel``, the ConfigMap
  ``kube-flannel-cfg`` (its ``cni-conf.json``, and ``net-conf.json`` set to the lab's);
- per node, what the init containers do: the flannel CNI plugin (containernetworking/
  plugins v0.9.1 ``plugins/meta/flannel``) copied into the node's ``/opt/cni/bin`` beside
  the reference ``bridge``, ``host-local``, ``portmap`` and ``loopback``, and
  ``cni-conf.json`` as ``/etc/cni/net.d/10-flannel.conflist``, unchanged: every path the
  plugins use by default (``/run/flannel/subnet.env``, ``/var/lib/cni``) is the node's own
  in its mount namespace;
- per node, the container: ``flanneld --ip-masq --kube-subnet-mgr --healthz-port=8081``
  in the node's network and mount namespaces (the kubelet's), with the DaemonSet's
  ``POD_NAMESPACE``, ``EVENT_QUEUE_DEPTH`` and ``CONT_WHEN_CACHE_NOT_READY``, and three
  things a pod would have had otherwise: ``NODE_NAME`` (flanneld finds its node from its
  own pod, ``POD_NAME``, when it is unset), a kubeconfig with the ServiceAccount's token
  (the in-cluster credentials), and ``--iface`` (lab nodes have no default route to pick
  the interface from; the lab's flannelpy DaemonSet gets ``FLANNELD_IFACE`` likewise).
  ``net-conf.json`` is the ConfigMap's, written where ``--net-config-path`` reads it.

The conflist is installed once flanneld has written ``subnet.env`` and its lease is on
its Node, so a Node turns Ready (its runtime sees a network config) when its network is.

With ``--enable-network-policy`` every node also runs kube-network-policies, the second
container Flannel's chart adds to the flanneld pod with ``netpol.enabled``, started by
``flannelpy_lab.kube_netpol`` once every flanneld has published its lease: in the node's
network namespace (the kubelet's: ``/run/netns/<node namespace>``), in a private mount
namespace of its own holding the in-cluster files.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

from flannelpy_lab import flanneld, kube_files, plan, procs
from flannelpy_lab import kube as control_plane
from flannelpy_lab.agents import SubnetEnv, read_subnet_env
from flannelpy_lab.errors import LabError
from flannelpy_lab.state import LabState, NodeInfo

NAMESPACE = "kube-flannel"  # kube-flannel.yml's names
SERVICE_ACCOUNT = "flannel"
CONFIG_MAP = "kube-flannel-cfg"
LABELS = {"k8s-app": "flannel"}
CONFLIST_FILE = "10-flannel.conflist"  # where kube-flannel.yml's install-cni puts it
HEALTHZ_PORT = 8081
# kube-flannel.yml's cni-conf.json, as its ConfigMap holds it.
CNI_CONF: dict[str, Any] = {
    "name": "cbr0",
    "cniVersion": flanneld.CNI_VERSION,
    "plugins": [
        {
            "type": flanneld.CNI_PLUGIN_TYPE,
            "delegate": {"hairpinMode": True, "isDefaultGateway": True},
        },
        {"type": "portmap", "capabilities": {"portMappings": True}},
    ],
}
# Beside the flannel plugin: what its delegate runs, from the reference plugins.
DELEGATE_PLUGINS = ("bridge", "host-local")
READY_TIMEOUT = 120.0  # seconds for every flanneld to write subnet.env and its lease
PROCESS_PREFIX = "flanneld/"  # in the kubelet record's "processes": flanneld/<node>

Save = Callable[[], None]


def validate(network_agent: str, kubelets: bool, flanneld_nodes: int) -> None:
    """Before anything is built: one sentence for a combination the lab cannot run."""
    if network_agent not in plan.NETWORK_AGENTS:
        raise LabError(
            f"--network-agent {network_agent!r} is unknown; use one of "
            f"{', '.join(plan.NETWORK_AGENTS)}"
        )
    if kubelets and flanneld_nodes:
        raise LabError(
            "--flanneld-nodes does not apply to a kubelet lab, which runs one network on "
            "every node; use --network-agent flanneld to run Flannel on all of them"
        )
    if network_agent == "flannelpy":
        return
    if not kubelets:
        raise LabError(
            "--network-agent flanneld needs --kubelet; on an etcd or --kube lab run flanneld "
            "with --flanneld-nodes K"
        )


def _core_rule(resource: str, *verbs: str) -> dict[str, Any]:
    return {"apiGroups": [""], "resources": [resource], "verbs": list(verbs)}


def manifests(net_conf: str) -> list[dict[str, Any]]:
    """kube-flannel.yml's objects but its DaemonSet, its ConfigMap with ``net_conf``."""
    meta = {"labels": dict(LABELS)}
    return [
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {
                "name": NAMESPACE,
                "labels": {**LABELS, "pod-security.kubernetes.io/enforce": "privileged"},
            },
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "flannel", **meta},
            "rules": [
                _core_rule("pods", "get"),
                _core_rule("nodes", "get", "list", "watch"),
                _core_rule("nodes/status", "patch"),
            ],
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "flannel", **meta},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "flannel",
            },
            "subjects": [
                {"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": NAMESPACE}
            ],
        },
        {
            "apiVersion": "v1",
            "kind": "ServiceAccount",
            "metadata": {"name": SERVICE_ACCOUNT, "namespace": NAMESPACE, **meta},
        },
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": CONFIG_MAP,
                "namespace": NAMESPACE,
                "labels": {"tier": "node", "app": "flannel", **LABELS},
            },
            "data": {"cni-conf.json": json.dumps(CNI_CONF, indent=2), "net-conf.json": net_conf},
        },
    ]


def argv(state: LabState, node: NodeInfo, runtime_pid: int, binary: str) -> list[str]:
    """flanneld's command line, entering the network and mount namespaces of the node's
    containerd (pid ``runtime_pid``) as its kubelet does: the DaemonSet container's
    arguments, plus the credentials, the ConfigMap's net-conf.json and the interface."""
    return [
        "nsenter", f"--target={runtime_pid}", "--mount", "--net",
        binary,
        "--ip-masq",
        "--kube-subnet-mgr",
        f"--healthz-port={HEALTHZ_PORT}",
        "--kubeconfig-file", kubeconfig_path(state),
        "--net-config-path", net_conf_path(state),
        "--iface", node.underlay_iface,
    ]  # fmt: skip


def environ(node: NodeInfo) -> dict[str, str]:
    """The DaemonSet container's environment, with the node's name (see module doc)."""
    env = flanneld.environ_without_proxies()
    env.update(
        POD_NAMESPACE=NAMESPACE,
        EVENT_QUEUE_DEPTH="5000",
        CONT_WHEN_CACHE_NOT_READY="false",
        NODE_NAME=node.name,
    )
    return env


def kubeconfig_path(state: LabState) -> str:
    return os.path.join(control_plane.kube_dir(state), "flannel.kubeconfig")


def net_conf_path(state: LabState) -> str:
    return os.path.join(control_plane.kube_dir(state), "kube-flannel", "net-conf.json")


def apply(state: LabState, net_conf: str) -> None:
    """The manifest's objects, the ServiceAccount's token in flanneld's kubeconfig and the
    ConfigMap's net-conf.json in flanneld's file."""
    doc = {"apiVersion": "v1", "kind": "List", "items": manifests(net_conf)}
    control_plane.kubectl(state, "apply", "-f", "-", stdin=json.dumps(doc))
    token = control_plane.kubectl(
        state,
        "create",
        "token",
        SERVICE_ACCOUNT,
        "-n",
        NAMESPACE,
        "--duration",
        control_plane.TOKEN_DURATION,
    ).stdout.strip()
    kube_files.write_token_kubeconfig(
        state, kubeconfig_path(state), control_plane.api_url(state), token
    )
    os.makedirs(os.path.dirname(net_conf_path(state)), exist_ok=True)
    control_plane.write_file(net_conf_path(state), net_conf)


def install_plugins(state: LabState, bin_dir: str, reference_dir: str) -> None:
    """The init container install-cni-plugin's copy, and the delegate's plugins."""
    plugin = state.extra.get("flannel_cni_binary") or flanneld.cni_plugin_binary()
    shutil.copy(plugin, os.path.join(bin_dir, flanneld.CNI_PLUGIN_TYPE))
    for name in DELEGATE_PLUGINS:
        shutil.copy(os.path.join(reference_dir, name), bin_dir)


def install_conflist(conf_dir: str) -> None:
    """The init container install-cni's copy (atomic: the runtime watches the directory)."""
    control_plane.write_file(
        os.path.join(conf_dir, CONFLIST_FILE), json.dumps(CNI_CONF, indent=2) + "\n"
    )


def start(
    state: LabState,
    node: NodeInfo,
    runtime_pid: int,
    processes: dict[str, list[int]],
    save: Save,
) -> procs.ProcessRef:
    """Start the node's flanneld detached; record it as the kubelet's processes are and
    as the node's agent (``status`` and ``down`` find it there)."""
    binary = state.extra.get("flanneld_binary") or flanneld.binary()
    started_at = time.time()
    os.makedirs(os.path.dirname(node.agent_log), exist_ok=True)
    procs.mark_start(node.agent_log, "flanneld")
    ref = procs.spawn_detached(
        argv(state, node, runtime_pid, binary), node.agent_log, environ(node)
    )
    processes[PROCESS_PREFIX + node.name] = [ref.pid, ref.start_ticks]
    node.agent_pid, node.agent_start_ticks = ref.pid, ref.start_ticks
    node.agent_started_at = started_at
    save()
    return ref


def check_ready(state: LabState, node: NodeInfo, subnet_env: str) -> SubnetEnv | None:
    """The fresh subnet.env at ``subnet_env`` once the node's lease is on its Node too;
    a LabError with flanneld's last lines when it has exited."""
    env = read_subnet_env(node, newer_than=node.agent_started_at, path=subnet_env)
    if env is not None and control_plane.node_has_lease(state, node):
        return env
    if not procs.alive(procs.ref_of(node.agent_pid, node.agent_start_ticks)):
        raise LabError(
            f"flanneld of node {node.name} exited before publishing its lease; last lines "
            f"of {node.agent_log}:\n{procs.log_tail(node.agent_log)}"
        )
    return None
