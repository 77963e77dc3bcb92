"""Real flanneld nodes in the lab, beside our agents, for mixed-cluster tests.

``flannelpy-lab up --flanneld-nodes K`` runs the pinned upstream flanneld (built by
``scripts/build-peers.sh``) on the last K nodes, against the lab's etcd and
``net-conf.json``, with per-node paths for everything it writes. With ``--kube`` it
runs with ``--kube-subnet-mgr`` against the lab's kube-apiserver instead, as Flannel's
DaemonSet runs it: the kubeconfig holding the flannelpy ServiceAccount's token (Flannel's
own ClusterRole is a subset of ours: pods get, nodes get/list/watch, nodes/status
patch), the net-conf.json the agents read, NODE_NAME and POD_NAMESPACE from the
downward API, and the DaemonSet's EVENT_QUEUE_DEPTH and CONT_WHEN_CACHE_NOT_READY.

Pods on a flanneld node are made by Flannel's own CNI plugin (``plugins/meta/flannel`` of
containernetworking/plugins v0.9.1, built by ``scripts/build-peers.sh flannel-cni``), with
the conflist of Flannel's kube-flannel.yml and the node's own paths: at each ADD it renders
its delegate config from subnet.env (``delegate_conf``), saves it in its ``dataDir`` under
the container ID for the DEL, and runs the reference ``bridge`` + ``host-local``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from ipaddress import IPv4Interface, IPv6Interface
from typing import TYPE_CHECKING, Any

from flannelpy_lab import etcd, plan
from flannelpy_lab.errors import LabError
from flannelpy_lab.state import LabState, NodeInfo

if TYPE_CHECKING:
    from flannelpy_lab.agents import SubnetEnv

BINARY_ENV = "FLANNELPY_FLANNELD"  # an explicit flanneld binary, instead of the pinned build
CNI_PLUGIN_ENV = "FLANNELPY_FLANNEL_CNI"  # an explicit flannel CNI plugin, likewise
BUILD_SCRIPT = "scripts/build-peers.sh"
CNI_PLUGIN_PEER = "flannel-cni"  # build-peers.sh's argument for the flannel CNI plugin
CNI_PLUGIN_TYPE = "flannel"  # the conflist "type", i.e. the file name in CNI_PATH
# kube-flannel.yml's cniVersion; the v0.9.1 plugin speaks up to 0.4.0, so never 1.0.0 here.
CNI_VERSION = "0.3.1"
KUBE_NAMESPACE = "kube-flannelpy"  # the manifests' namespace, as POD_NAMESPACE
_PROXY_VARS = re.compile(r"(?i)^(https?|all|no)_proxy$")


def repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def binary() -> str:
    """The flanneld to run: ``$FLANNELPY_FLANNELD``, else the pinned build (built if missing)."""
    return explicit_or_built(BINARY_ENV, "flanneld", ())


def cni_plugin_binary() -> str:
    """The flannel CNI plugin: ``$FLANNELPY_FLANNEL_CNI``, else the pinned build (built if
    missing)."""
    return explicit_or_built(CNI_PLUGIN_ENV, "the flannel CNI plugin", (CNI_PLUGIN_PEER,))


def explicit_or_built(env_var: str, what: str, build_args: tuple[str, ...]) -> str:
    explicit = os.environ.get(env_var)
    if explicit:
        if not os.access(explicit, os.X_OK):
            build = " ".join((BUILD_SCRIPT, *build_args))
            raise LabError(f"{env_var}={explicit} is not an executable; unset it or run {build}")
        return explicit
    return built_peer(what, build_args, f"; set {env_var} to its binary")


def built_peer(what: str, args: tuple[str, ...], alternative: str = "") -> str:
    """The path ``scripts/build-peers.sh ARGS`` prints: the pinned build of a Go peer,
    built now if missing; a LabError naming the script when it cannot be."""
    command = " ".join((BUILD_SCRIPT, *args))
    script = os.path.join(repo_root(), BUILD_SCRIPT)
    if not os.path.isfile(script):
        raise LabError(
            f"{what} is not available: {BUILD_SCRIPT} is missing from {repo_root()}{alternative}"
        )
    # The script's own lines (what it builds, about how long) reach the user on stderr.
    proc = subprocess.run(["bash", script, *args], stdout=subprocess.PIPE, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not os.access(lines[-1], os.X_OK):
        raise LabError(
            f"{what} is not built and {command} failed (exit {proc.returncode}, its "
            f"output above); run {command}"
        )
    return lines[-1]


def argv(state: LabState, node: NodeInfo) -> list[str]:
    """flanneld's command line, run inside the node namespace; every path it writes is
    the node's own (the lab's nodes share one filesystem)."""
    flanneld = state.extra.get("flanneld_binary") or binary()
    kubeconfig = state.extra.get("kube_kubeconfig")
    if kubeconfig:
        from flannelpy_lab import agents  # agents imports this module

        store = [
            "--kube-subnet-mgr",
            "--kubeconfig-file",
            kubeconfig,
            "--net-config-path",
            agents.kube_net_conf_path(state),
        ]
    else:
        store = [
            "--etcd-endpoints",
            ",".join(state.etcd_endpoints),
            "--etcd-prefix",
            state.etcd_prefix,
        ]
    return [
        flanneld,
        *store,
        "--iface", node.underlay_iface,
        "--ip-masq",
        "--subnet-file", node.subnet_env,
        "--healthz-port", "0",
        "-v", "2",  # klog level 2: flanneld logs each peer it adds or removes
    ]  # fmt: skip


def environ(state: LabState) -> dict[str, str]:
    """flanneld's environment: ours without proxy variables (the API server is on the
    lab's address), plus what Flannel's DaemonSet gives it in Kubernetes mode."""
    env = environ_without_proxies()
    if state.extra.get("kube_kubeconfig"):
        env.update(
            POD_NAMESPACE=KUBE_NAMESPACE,
            EVENT_QUEUE_DEPTH="5000",
            CONT_WHEN_CACHE_NOT_READY="false",
        )
    return env


def environ_without_proxies() -> dict[str, str]:
    """Our environment without proxy variables: the API server is on a lab address."""
    return {k: v for k, v in os.environ.items() if not _PROXY_VARS.match(k)}


def has_lease(state: LabState, node: NodeInfo) -> bool:
    """Is the node's lease (PublicIP = its underlay address) in the lab's etcd, or in
    Kubernetes mode on its Node (Flannel's public-ip annotation and a podCIDR)?"""
    if state.extra.get("kube_kubeconfig"):
        from flannelpy_lab import kube  # kube imports this module

        return kube.node_has_lease(state, node)
    try:
        leases = etcd.read_leases(state.etcd_endpoints, state.etcd_prefix)
    except Exception:  # etcd briefly unreachable: not ready yet
        return False
    if plan.ipv6_only(state):  # the lease's PublicIP is 0.0.0.0: known by PublicIPv6
        return any(lease.get("public_ipv6") == plan.ipv6_underlay_ip(node) for lease in leases)
    return any(lease["public_ip"] == str(node.ip) for lease in leases)


def host_local_dir(node: NodeInfo) -> str:
    """host-local's data dir for the node; its default /var/lib/cni/networks is host-wide."""
    return os.path.join(node.node_dir, "cni", "networks")


def host_local_network_dir(node: NodeInfo, network: str = "cbr0") -> str:
    """Where host-local keeps the node's allocations of the network ``network``."""
    return os.path.join(host_local_dir(node), network)


def delegate_conf(node: NodeInfo, env: SubnetEnv, name: str) -> dict[str, Any]:
    """The ``bridge`` config the flannel CNI plugin hands on (and saves for its DEL), from
    subnet.env and the conflist's delegate (``hairpinMode``, ``isDefaultGateway``): bridge
    cni0 (the plugin's default name), isGateway, mtu = FLANNEL_MTU, ipMasq = not
    FLANNEL_IPMASQ, host-local over the subnet's network with a route to FLANNEL_NETWORK.
    Dual stack (FLANNEL_IPV6_SUBNET set), as the plugin's getDelegateIPAM: a second range,
    the IPv6 subnet's network, and a route to FLANNEL_IPV6_NETWORK; the pods' default routes
    of both families come from the bridge plugin's isDefaultGateway. ``ipam.dataDir`` is
    the conflist's ``ipam``, which the plugin passes through."""
    # The plugin parses FLANNEL_SUBNET with net.ParseCIDR: the network, not .1. IPv6-only
    # subnet.env has neither FLANNEL_SUBNET nor FLANNEL_NETWORK: the IPv6 range alone.
    ranges = [[{"subnet": str(IPv4Interface(env.subnet).network)}]] if env.subnet else []
    routes = [{"dst": env.network}] if env.network else []
    if env.ipv6_subnet:
        ranges.append([{"subnet": str(IPv6Interface(env.ipv6_subnet).network)}])
    if env.ipv6_network:
        routes.append({"dst": env.ipv6_network})
    return {
        "type": "bridge",
        "name": name,
        "cniVersion": CNI_VERSION,
        "hairpinMode": True,
        "isDefaultGateway": True,
        "isGateway": True,
        "mtu": env.mtu,
        "ipMasq": not env.ipmasq,
        "ipam": {
            "type": "host-local",
            "dataDir": host_local_dir(node),
            "ranges": ranges,
            "routes": routes,
        },
    }


def flannel_data_dir(node: NodeInfo) -> str:
    """The flannel plugin's dataDir for the node (its default /var/lib/cni/flannel is
    host-wide): one file per container, the delegate config its DEL replays."""
    return os.path.join(node.node_dir, "cni", "flannel")


def conflist_doc(node: NodeInfo, name: str) -> dict[str, Any]:
    """The conflist a runtime on a flanneld node runs: kube-flannel.yml's cni-conf.json
    (the flannel plugin with its delegate's hairpinMode and isDefaultGateway, then
    portmap), with the node's subnet.env, dataDir and host-local dataDir (a user's
    ``ipam``, which the plugin completes with the ranges and routes)."""
    return {
        "cniVersion": CNI_VERSION,
        "name": name,
        "plugins": [
            {
                "type": CNI_PLUGIN_TYPE,
                "subnetFile": node.subnet_env,
                "dataDir": flannel_data_dir(node),
                "ipam": {"dataDir": host_local_dir(node)},
                "delegate": {"hairpinMode": True, "isDefaultGateway": True},
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def write_delegate_confs(node: NodeInfo, env: SubnetEnv, name: str, container_ids: set[str]) -> int:
    """Save the delegate config in the flannel plugin's dataDir for each container it has
    none for (pods another plugin added), as its ADD would have, so its DEL of them
    releases their addresses through host-local instead of doing nothing; returns the
    files written."""
    data_dir = flannel_data_dir(node)
    os.makedirs(data_dir, mode=0o700, exist_ok=True)
    conf = json.dumps(delegate_conf(node, env, name)).encode()
    written = 0
    for container_id in sorted(container_ids):
        path = os.path.join(data_dir, container_id)
        if os.path.exists(path):
            continue  # the plugin's own ADD saved it: it knows that pod already
        with open(path + ".tmp", "wb") as f:
            f.write(conf)
        os.chmod(path + ".tmp", 0o600)
        os.replace(path + ".tmp", path)
        written += 1
    return written
