"""Real flanneld nodes in the lab, beside our agents, for mixed-cluster tests.

``flannelpy-lab up --flanneld-nodes K`` runs the pinned upstream flanneld (built by
``scripts/build-peers.sh``) on the last K nodes, against the lab's etcd and
``net-conf.json``, with per-node paths for everything it writes.

Pods on a flanneld node are NOT made by the upstream flannel CNI plugin: its Go
module is not available to the build here. They are made by the real reference
``bridge`` + ``host-local`` plugins, configured from that node's subnet.env exactly
as the flannel plugin builds its delegate config (``delegate_conf``) at every ADD.
"""

from __future__ import annotations

import os
import subprocess
from ipaddress import IPv4Interface
from typing import TYPE_CHECKING, Any

from flannelpy_lab import etcd
from flannelpy_lab.errors import LabError
from flannelpy_lab.state import LabState, NodeInfo

if TYPE_CHECKING:
    from flannelpy_lab.agents import SubnetEnv

BINARY_ENV = "FLANNELPY_FLANNELD"  # an explicit flanneld binary, instead of the pinned build
BUILD_SCRIPT = "scripts/build-peers.sh"
CNI_VERSION = "1.0.0"


def repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def binary() -> str:
    """The flanneld to run: ``$FLANNELPY_FLANNELD``, else the pinned build (built if missing)."""
    explicit = os.environ.get(BINARY_ENV)
    if explicit:
        if not os.access(explicit, os.X_OK):
            raise LabError(f"{BINARY_ENV}={explicit} is not an executable; "
                           f"unset it or run {BUILD_SCRIPT}")  # fmt: skip
        return explicit
    script = os.path.join(repo_root(), BUILD_SCRIPT)
    if not os.path.isfile(script):
        raise LabError(f"flanneld is not available: {BUILD_SCRIPT} is missing from "
                       f"{repo_root()}; set {BINARY_ENV} to a flanneld binary")  # fmt: skip
    proc = subprocess.run(["bash", script], capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines or not os.access(lines[-1], os.X_OK):
        why = proc.stderr.strip()[-400:]
        raise LabError(
            f"flanneld is not built and {BUILD_SCRIPT} failed ({why}); run {BUILD_SCRIPT}"
        )
    return lines[-1]


def argv(state: LabState, node: NodeInfo) -> list[str]:
    """flanneld's command line, run inside the node namespace; every path it writes is
    the node's own (the lab's nodes share one filesystem)."""
    flanneld = state.extra.get("flanneld_binary") or binary()
    return [
        flanneld,
        "--etcd-endpoints", ",".join(state.etcd_endpoints),
        "--etcd-prefix", state.etcd_prefix,
        "--iface", node.underlay_iface,
        "--ip-masq",
        "--subnet-file", node.subnet_env,
        "--healthz-port", "0",
        "-v", "2",  # klog level 2: flanneld logs each peer it adds or removes
    ]  # fmt: skip


def has_lease(state: LabState, node: NodeInfo) -> bool:
    """Is the node's lease (PublicIP = its underlay address) in the lab's etcd?"""
    try:
        leases = etcd.read_leases(state.etcd_endpoints, state.etcd_prefix)
    except Exception:  # etcd briefly unreachable: not ready yet
        return False
    return any(lease["public_ip"] == str(node.ip) for lease in leases)


def host_local_dir(node: NodeInfo) -> str:
    """host-local's data dir for the node; its default /var/lib/cni/networks is host-wide."""
    return os.path.join(node.node_dir, "cni", "networks")


def host_local_network_dir(node: NodeInfo, network: str = "cbr0") -> str:
    """Where host-local keeps the node's allocations of the network ``network``."""
    return os.path.join(host_local_dir(node), network)


def delegate_conf(node: NodeInfo, env: SubnetEnv, name: str) -> dict[str, Any]:
    """The ``bridge`` config the flannel CNI plugin hands on, from subnet.env and the upstream
    conflist's delegate (``hairpinMode``, ``isDefaultGateway``): bridge cni0 (the plugin's
    default name), isGateway, mtu = FLANNEL_MTU, ipMasq = not FLANNEL_IPMASQ, host-local over
    the subnet's network with a route to FLANNEL_NETWORK. ``ipam.dataDir`` is the lab's
    addition, passed through as a user's ``ipam`` in the flannel conflist would be."""
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
            # The plugin parses FLANNEL_SUBNET with net.ParseCIDR: the network, not .1
            "ranges": [[{"subnet": str(IPv4Interface(env.subnet).network)}]],
            "routes": [{"dst": env.network}],
        },
    }


def conflist_doc(node: NodeInfo, env: SubnetEnv, name: str) -> dict[str, Any]:
    """The conflist a runtime on a flanneld node would run: the flannel plugin's delegate
    (rendered from the node's current subnet.env, as the plugin does at each ADD), then
    portmap."""
    return {
        "cniVersion": CNI_VERSION,
        "name": name,
        "plugins": [
            delegate_conf(node, env, name),
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }
