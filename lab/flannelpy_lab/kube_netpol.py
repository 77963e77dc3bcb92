"""kube-network-policies beside flanneld: Flannel's own NetworkPolicy answer, as its Helm
chart's ``netpol`` option runs it (``lab up --kube --flanneld-nodes K
--enable-network-policy``).

The chart adds a second container to the flanneld pod: sigs.k8s.io/kube-network-policies
(pinned and built by ``scripts/build-peers.sh kube-network-policies``) with the chart's
arguments, ``--hostname-override=$(MY_NODE_NAME) --v=2``, and nothing else, so its own
defaults hold (v0.8.0: NFQUEUE 100, ``--fail-open=false``, NRI on, which finds no socket
here as in the chart's pod, which mounts none). Its nftables table sends the first packet
of every connection from or to a local pod that a policy selects to the queue; it reads
the packet in userspace and gives the verdict; the rest of the connection is accepted by
conntrack. The chart gives the container flanneld's ServiceAccount, whose ClusterRole then
adds networkpolicies and the admin network policies (list, watch) to pods, nodes,
namespaces (get, list, watch): the lab creates that ServiceAccount and ClusterRole as the
chart renders them.

On a kubelet lab whose network is Flannel (``lab up --kubelet --network-agent flanneld
--enable-network-policy``) every node runs it the same way, once every flanneld has
published its lease: the node's namespace is the one its kubelet and flanneld run in.

Its main knows only ``rest.InClusterConfig()``: ``KUBERNETES_SERVICE_HOST``/``PORT`` (here
the API server on the host's lab address) and the token and CA at
``/var/run/secrets/kubernetes.io/serviceaccount``. It runs in the node's namespace, in a
mount namespace of its own where a small tmpfs over ``/run`` holds those files (copied from
``<node dir>/kube-network-policies/``), so the host's ``/run`` is never touched. Its log is
``<node dir>/kube-network-policies.log``; ``down`` stops it with the node's processes.

The build carries one patch (tests/peers/kube-network-policies/patches): this machine's
kernel has no nft ``queue`` expression (CONFIG_NFT_QUEUE unset), so the queue rule uses the
x_tables NFQUEUE target through nft_compat, as ``iptables-nft -j NFQUEUE`` does here.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

from flannelpy_lab import flanneld, procs, topology
from flannelpy_lab import kube as control_plane
from flannelpy_lab.errors import LabError
from flannelpy_lab.state import LabState, NodeInfo

BINARY_ENV = "FLANNELPY_KUBE_NETWORK_POLICIES"  # an explicit binary, instead of the pinned build
PEER = "kube-network-policies"  # build-peers.sh's argument
STATE_KEY = "kube_network_policies"  # in LabState.extra: node name -> [pid, start ticks]
BINARY_KEY = "kube_network_policies_binary"  # in LabState.extra: the binary the nodes run
NAMESPACE = "kube-flannel"  # the chart's namespace and ServiceAccount
SERVICE_ACCOUNT = "flannel"
CLUSTER_ROLE = "flannel-netpol"  # the chart's "flannel" ClusterRole with netpol.enabled
TABLE = "kube-network-policies"  # its nftables table (inet family)
QUEUE = 100  # its --nfqueue-id default
READY_TIMEOUT = 60.0
SECRETS = "/var/run/secrets/kubernetes.io/serviceaccount"
_PROXY_VARS = re.compile(r"(?i)^(https?|all|no)_proxy$")

# Inside the node's namespace: a private mount namespace, the in-cluster files on a tmpfs
# over /run (read first: the tmpfs hides the lab directory), then the program.
IN_CLUSTER = """set -eu
src=$1; shift
token=$(cat "$src/token"); ca=$(cat "$src/ca.crt"); ns=$(cat "$src/namespace")
mount -t tmpfs -o mode=0755,size=1m kube-network-policies /run
mkdir -p /run/secrets/kubernetes.io/serviceaccount
cd /run/secrets/kubernetes.io/serviceaccount
printf '%s' "$token" >token; printf '%s\\n' "$ca" >ca.crt; printf '%s' "$ns" >namespace
cd /
exec "$@"
"""


def binary() -> str:
    """``$FLANNELPY_KUBE_NETWORK_POLICIES``, else the pinned build (built if missing)."""
    return flanneld.explicit_or_built(BINARY_ENV, "kube-network-policies", (PEER,))


def enabled(state: LabState) -> bool:
    """NetworkPolicy is on and the lab has Nodes: a --kube lab once its control plane has
    registered them, or a kubelet lab (its kubelets register them)."""
    kube = control_plane.STATE_KEY in state.extra
    has_nodes = bool(state.extra.get("kube_kubeconfig")) or (
        kube and bool(control_plane.record(state).get(control_plane.KUBELETS_KEY))
    )
    return has_nodes and control_plane.network_policy(state)


def rbac_objects() -> list[dict[str, Any]]:
    """The chart's Namespace, ServiceAccount, ClusterRole (netpol.enabled) and binding."""
    rules = [
        {"apiGroups": [""], "resources": ["pods", "nodes", "namespaces"],
         "verbs": ["get", "list", "watch"]},
        {"apiGroups": [""], "resources": ["nodes/status"], "verbs": ["patch"]},
        {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"],
         "verbs": ["list", "watch"]},
        {"apiGroups": ["policy.networking.k8s.io"],
         "resources": ["adminnetworkpolicies", "baselineadminnetworkpolicies"],
         "verbs": ["list", "watch"]},
    ]  # fmt: skip
    subject = {"kind": "ServiceAccount", "name": SERVICE_ACCOUNT, "namespace": NAMESPACE}
    role_ref = {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole"}
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
        {"apiVersion": "v1", "kind": "ServiceAccount",
         "metadata": {"name": SERVICE_ACCOUNT, "namespace": NAMESPACE}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
         "metadata": {"name": CLUSTER_ROLE}, "rules": rules},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
         "metadata": {"name": CLUSTER_ROLE}, "roleRef": {**role_ref, "name": CLUSTER_ROLE},
         "subjects": [subject]},
    ]  # fmt: skip


def secrets_dir(node: NodeInfo) -> str:
    return os.path.join(node.node_dir, PEER)


def log_path(node: NodeInfo) -> str:
    return os.path.join(node.node_dir, f"{PEER}.log")


def prepare(state: LabState, objects: list[dict[str, Any]] | None = None) -> None:
    """Apply the RBAC (``objects``, default all of ``rbac_objects()``) and give every
    flanneld node the in-cluster files: a token of the ServiceAccount, the API server's CA
    and the namespace."""
    items = rbac_objects() if objects is None else objects
    doc = {"apiVersion": "v1", "kind": "List", "items": items}
    control_plane.kubectl(state, "apply", "-f", "-", stdin=json.dumps(doc))
    token = control_plane.kubectl(
        state, "create", "token", SERVICE_ACCOUNT, "-n", NAMESPACE,
        "--duration", control_plane.TOKEN_DURATION,
    ).stdout.strip()  # fmt: skip
    with open(os.path.join(control_plane.kube_dir(state), "pki", "ca.crt"), encoding="utf-8") as f:
        ca = f.read()
    for node in state.nodes:
        if not node.runs_flanneld:
            continue
        directory = secrets_dir(node)
        os.makedirs(directory, mode=0o700, exist_ok=True)
        for name, text in (("token", token), ("ca.crt", ca), ("namespace", NAMESPACE)):
            control_plane.write_file(os.path.join(directory, name), text, 0o600)


def argv(state: LabState, node: NodeInfo) -> list[str]:
    """Its command line in the node's namespace: the chart's arguments."""
    program = [state.extra.get(BINARY_KEY) or binary(),
               f"--hostname-override={node.name}", "--v=2"]  # fmt: skip
    inner = ["unshare", "--mount", "--propagation", "private", "sh", "-c", IN_CLUSTER, "sh"]
    return topology.exec_argv(node.namespace, [*inner, secrets_dir(node), *program])


def environ(state: LabState, node: NodeInfo) -> dict[str, str]:
    """What a pod's container gets: the in-cluster Service variables and MY_NODE_NAME."""
    env = {k: v for k, v in os.environ.items() if not _PROXY_VARS.match(k)}
    env.update(
        KUBERNETES_SERVICE_HOST=control_plane.host_ip(state),
        KUBERNETES_SERVICE_PORT=str(control_plane.API_PORT),
        MY_NODE_NAME=node.name,
    )
    return env


def start(state: LabState, node: NodeInfo) -> procs.ProcessRef:
    procs.mark_start(log_path(node), PEER)
    ref = procs.spawn_detached(argv(state, node), log_path(node), environ(state, node))
    state.extra.setdefault(STATE_KEY, {})[node.name] = [ref.pid, ref.start_ticks]
    return ref


def ref(state: LabState, node: NodeInfo) -> procs.ProcessRef | None:
    started = state.extra.get(STATE_KEY, {}).get(node.name)
    return procs.ref_of(*started) if started else None


def refs(state: LabState) -> list[procs.ProcessRef]:
    return [r for r in (ref(state, n) for n in state.nodes) if r]


def is_ready(node: NodeInfo) -> bool:
    """Its table is in the node's namespace and it listens on its queue."""
    table = topology.run_in(node.namespace, ["nft", "list", "table", "inet", TABLE], 10.0)
    if table.returncode != 0:
        return False
    queues = topology.run_in(node.namespace, ["cat", "/proc/net/netfilter/nfnetlink_queue"], 10.0)
    return any(line.split()[:1] == [str(QUEUE)] for line in queues.stdout.splitlines())


def wait_ready(state: LabState, nodes: list[NodeInfo], timeout: float = READY_TIMEOUT) -> None:
    pending = list(nodes)
    deadline = time.monotonic() + timeout
    while pending:
        for node in list(pending):
            if not procs.alive(ref(state, node)):
                raise LabError(
                    f"{PEER} on {node.name} exited; last lines of {log_path(node)}:\n"
                    f"{procs.log_tail(log_path(node))}"
                )
            if is_ready(node):
                pending.remove(node)
        if pending and time.monotonic() > deadline:
            node = pending[0]
            raise LabError(
                f"{PEER} on {node.name} set up no table {TABLE} and queue {QUEUE} within "
                f"{timeout:g} s; last lines of {log_path(node)}:\n{procs.log_tail(log_path(node))}"
            )
        if pending:
            time.sleep(0.3)


def cluster_role_objects() -> list[dict[str, Any]]:
    """The ClusterRole and its binding alone: for a lab that applied kube-flannel.yml's
    Namespace and ServiceAccount already (``flannelpy_lab.kubeflannel``), which applying
    the Namespace again without its labels would strip of them."""
    return [o for o in rbac_objects() if o["kind"] not in ("Namespace", "ServiceAccount")]


def start_all(
    state: LabState, save: control_plane.Save, objects: list[dict[str, Any]] | None = None
) -> list[NodeInfo]:
    """Start it beside flanneld on every flanneld node (applying ``objects`` as
    ``prepare`` does, recording each process with ``save``) and wait until each
    enforces."""
    nodes = [n for n in state.nodes if n.runs_flanneld]
    if not nodes:
        return []
    prepare(state, objects)
    for node in nodes:
        start(state, node)
        save()
    wait_ready(state, nodes)
    return nodes
