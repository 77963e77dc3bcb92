"""The lab's real Kubernetes control plane (``lab up --kube``), on the host side.

An etcd of its own (loopback, data under ``<lab dir>/kube``), kube-apiserver with RBAC and
ServiceAccount tokens on the host's lab address (the agents in the node namespaces reach
it over the underlay), and kube-controller-manager running only the node IPAM controller,
so every podCIDR is the real controller's. The manifests' objects are applied with the real
kubectl (all but the DaemonSet: the agents run as lab processes), the ConfigMap's
net-conf.json is set to the lab's network config, a projector process
(flannelpy_lab.projector) keeps the file the agents read in step with the ConfigMap as
the kubelet keeps a ConfigMap volume (the ``..data`` symlink swap), and each agent gets a
kubeconfig holding a token of the manifests' ServiceAccount, so the ClusterRole and the
Role there are what is enforced.

Nodes are created as a kubelet registers them (name, hostname label, InternalIP, Ready).
No kubelet renews their Leases, so the node lifecycle controller, which would turn them
Ready=Unknown and taint them unreachable after ~50 s, is not run.

The binaries are the pinned build of scripts/build-kube.sh; ``$FLANNELPY_KUBE_BIN_DIR``
points at another directory holding them.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import ssl
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from flannelpy_lab import agents, plan, procs
from flannelpy_lab import etcd as lab_etcd
from flannelpy_lab.errors import LabError
from flannelpy_lab.flanneld import repo_root
from flannelpy_lab.kube_api import (
    api_json as api_json,
)
from flannelpy_lab.kube_api import (
    kubectl as kubectl,
)
from flannelpy_lab.kube_api import (
    kubectl_json as kubectl_json,
)
from flannelpy_lab.kube_api import (
    node_has_lease as node_has_lease,
)
from flannelpy_lab.kube_api import (
    node_lease as node_lease,
)
from flannelpy_lab.kube_api import (
    node_leases as node_leases,
)
from flannelpy_lab.kube_api import (
    node_manifest as node_manifest,
)
from flannelpy_lab.kube_api import (
    pod_manifest as pod_manifest,
)
from flannelpy_lab.kube_api import (
    pod_running_status as pod_running_status,
)
from flannelpy_lab.kube_api import proxyless_env as _env
from flannelpy_lab.kube_build import BIN_DIR_ENV as BIN_DIR_ENV
from flannelpy_lab.kube_build import PEERS_DIR_ENV as PEERS_DIR_ENV
from flannelpy_lab.kube_build import bin_dir as bin_dir
from flannelpy_lab.kube_files import (
    API_PORT as API_PORT,
)
from flannelpy_lab.kube_files import (
    SERVICE_CIDR as SERVICE_CIDR,
)
from flannelpy_lab.kube_files import (
    STATE_KEY as STATE_KEY,
)
from flannelpy_lab.kube_files import (
    admin_kubeconfig as admin_kubeconfig,
)
from flannelpy_lab.kube_files import admin_token as _admin_token
from flannelpy_lab.kube_files import (
    agent_kubeconfig as agent_kubeconfig,
)
from flannelpy_lab.kube_files import (
    api_url as api_url,
)
from flannelpy_lab.kube_files import (
    cert_kubeconfig as cert_kubeconfig,
)
from flannelpy_lab.kube_files import (
    client_cert as client_cert,
)
from flannelpy_lab.kube_files import (
    host_ip as host_ip,
)
from flannelpy_lab.kube_files import (
    kube_dir as kube_dir,
)
from flannelpy_lab.kube_files import kube_path as _path
from flannelpy_lab.kube_files import make_pki as _make_pki
from flannelpy_lab.kube_files import (
    record as record,
)
from flannelpy_lab.kube_files import (
    write_file as write_file,
)
from flannelpy_lab.kube_files import write_token_kubeconfig as _write_kubeconfig
from flannelpy_lab.state import LabState, NodeInfo

NAMESPACE = "kube-flannelpy"  # the manifests' names
SERVICE_ACCOUNT = "flannelpy"
CLUSTER_ROLE = "flannelpy"
CONFIG_MAP = "kube-flannelpy-cfg"
NET_CONF_KEY = "net-conf.json"
READY_TIMEOUT = 60.0  # seconds for etcd, then kube-apiserver, then every podCIDR
TOKEN_DURATION = "48h"
# Started in this order, stopped in the reverse one.
PROCESSES = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")
KUBELETS_KEY = "kubelets"  # in the record: real kubelets (flannelpy_lab.kubelet) run the nodes
# With real kubelets, the controllers a cluster's workloads and node health need.
KUBELET_CONTROLLERS = (
    "node-ipam-controller",
    "node-lifecycle-controller",
    "taint-eviction-controller",
    "daemonset-controller",
    "deployment-controller",
    "replicaset-controller",
    "serviceaccount-controller",
    "root-ca-certificate-publisher-controller",
    "garbage-collector-controller",
    "pod-garbage-collector-controller",
    # A Service's endpoints, which kube-proxy (flannelpy_lab.proxy) programs.
    "endpoints-controller",
    "endpointslice-controller",
    "endpointslice-mirroring-controller",
)

Save = Callable[[], None]
Progress = Callable[[str], None]


# -- paths and the record in the state ------------------------------------------------------


def process_refs(state: LabState) -> list[procs.ProcessRef]:
    """The control plane's processes, newest first (each stops while what it talks to runs)."""
    started = state.extra.get(STATE_KEY, {}).get("processes", {})
    refs = [procs.ref_of(*started[n]) for n in reversed(PROCESSES) if n in started]
    return [r for r in refs if r]


PROJECTOR = "flannelpy_lab.projector"


def stop(state: LabState | None, lab_dir: str) -> None:
    """Stop the control plane: the projector first (it watches kube-apiserver), then its
    processes newest first. Without a state file (or one that lost a record) they are
    found by their command lines: a program of ours naming a file in ``lab_dir`` (the
    control plane's etcd names its --data-dir, so the lab's etcd sweep takes it)."""
    projector = projector_ref(state) if state else None
    if projector:
        procs.stop([projector])
    for ref in process_refs(state) if state else []:
        procs.stop([ref])
    order = (PROJECTOR, *reversed(PROCESSES[1:]))
    found = procs.pids_of_programs_under(order, lab_dir)
    for program in order:
        refs = [procs.current_ref(pid) for name, pid in found if name == program]
        procs.stop([r for r in refs if r])


# -- start ----------------------------------------------------------------------------------


def start(state: LabState, save: Save, say: Progress) -> None:
    """Start the control plane, apply the manifests, register the Nodes and write the
    agents' kubeconfig and net-conf.json. Records every process in the state (``save``
    after each start) so that ``down`` stops what a partial start left."""
    rec = record(state)
    rec["bin_dir"] = bin_dir(build=True)
    rec["processes"] = {}
    os.makedirs(kube_dir(state), exist_ok=True)
    t0 = time.monotonic()
    _make_pki(state)
    _start_etcd(state, save)
    _start_apiserver(state, save)
    _start_controller_manager(state, save)
    rec["ready_seconds"] = round(time.monotonic() - t0, 1)
    if rec.get(KUBELETS_KEY):  # the kubelets register the Nodes, the DaemonSet runs agents
        save()
        return
    say(
        f"      kube-apiserver at {api_url(state)} ready in {rec['ready_seconds']} s; "
        "applying the manifests"
    )
    apply_manifests(state)
    set_net_conf(
        state,
        plan.net_conf_json(
            state.network, state.backend, state.direct_routing, state.extra.get("net_conf_extra")
        ),
    )
    start_projector(state, save)
    register_nodes(state)
    wait_pod_cidrs(state)
    write_agent_kubeconfig(state)
    rec["pod_cidrs_seconds"] = round(time.monotonic() - t0, 1)
    state.extra["kube_api_url"] = api_url(state)
    state.extra["kube_kubeconfig"] = agent_kubeconfig(state)
    save()


# The control plane's other listeners, on the lab's own host address like the API server:
# fixed ports on an address no other lab has, so labs started side by side never race for a
# port (as a "free" loopback port picked at start would).
ETCD_CLIENT_PORT = 12379
ETCD_PEER_PORT = 12380
CONTROLLER_MANAGER_PORT = 10257
SCHEDULER_PORT = 10259


def _spawn(state: LabState, name: str, argv: list[str], save: Save) -> procs.ProcessRef:
    ref = procs.spawn_detached(argv, _path(state, f"{name}.log"))
    record(state)["processes"][name] = [ref.pid, ref.start_ticks]
    save()
    return ref


def _wait(state: LabState, name: str, ref: procs.ProcessRef, check: Callable[[], bool]) -> None:
    procs.wait_started(name, ref, _path(state, f"{name}.log"), check, READY_TIMEOUT)


def _start_etcd(state: LabState, save: Save) -> None:
    binary = shutil.which("etcd")
    if binary is None:
        raise LabError("etcd is not on PATH; install an etcd server (3.4 or newer)")
    client = f"http://{host_ip(state)}:{ETCD_CLIENT_PORT}"
    peer = f"http://{host_ip(state)}:{ETCD_PEER_PORT}"
    record(state)["etcd_url"] = client
    ref = _spawn(
        state,
        "etcd",
        [
            binary,
            "--name",
            f"fpl-{state.name}-kube",
            "--data-dir",
            _path(state, "etcd"),
            "--listen-client-urls",
            client,
            "--advertise-client-urls",
            client,
            "--listen-peer-urls",
            peer,
            "--initial-advertise-peer-urls",
            peer,
            "--initial-cluster",
            f"fpl-{state.name}-kube={peer}",
            "--logger",
            "zap",
            "--log-outputs",
            "stderr",
            "--log-level",
            "warn",
        ],
        save,
    )
    _wait(state, "etcd", ref, lambda: _http_ok(client + "/health"))


def _http_ok(url: str, ca: str | None = None, token: str | None = None) -> bool:
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}),
        urllib.request.HTTPSHandler(context=ssl.create_default_context(cafile=ca)),
    )
    request = urllib.request.Request(url)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with opener.open(request, timeout=2) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _start_apiserver(state: LabState, save: Save) -> None:
    p = lambda name: _path(state, "pki", name)  # noqa: E731
    ref = _spawn(state, "kube-apiserver", [
        os.path.join(record(state)["bin_dir"], "kube-apiserver"),
        "--etcd-servers", record(state)["etcd_url"],
        # Only the lab address: the agents come over the underlay, the host's own
        # clients (controller-manager, kubectl) to the host's address.
        "--bind-address", host_ip(state), "--advertise-address", host_ip(state),
        "--secure-port", str(API_PORT),
        "--tls-cert-file", p("apiserver.crt"), "--tls-private-key-file", p("apiserver.key"),
        "--client-ca-file", p("ca.crt"), "--token-auth-file", p("tokens.csv"),
        "--authorization-mode", "Node,RBAC",  # Node: what a kubelet may read and write
        "--kubelet-client-certificate", p("apiserver-kubelet-client.crt"),
        "--kubelet-client-key", p("apiserver-kubelet-client.key"),
        "--kubelet-preferred-address-types", "InternalIP",
        # With kubelets, pods reach the API server through the "kubernetes" Service (kube-proxy
        # forwards it to this address), as the e2e specs check; without, no pod runs.
        "--endpoint-reconciler-type",
        "lease" if record(state).get(KUBELETS_KEY) else "none",
        "--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
        "--service-account-key-file", p("sa.pub"),
        "--service-account-signing-key-file", p("sa.key"),
        "--service-cluster-ip-range", SERVICE_CIDR,
    ], save)  # fmt: skip
    token = _admin_token(state)
    _wait(
        state,
        "kube-apiserver",
        ref,
        lambda: _http_ok(api_url(state) + "/readyz", p("ca.crt"), token),
    )


def _subnet_len(state: LabState) -> int:
    conf = json.loads(
        plan.net_conf_json(
            state.network, state.backend, state.direct_routing, state.extra.get("net_conf_extra")
        )
    )
    return int(conf.get("SubnetLen", 24))


def _start_controller_manager(state: LabState, save: Save) -> None:
    # Without kubelets only the node IPAM controller: the lab runs no workloads, and the
    # node lifecycle controller would taint the kubelet-less Nodes unreachable.
    controllers = (
        KUBELET_CONTROLLERS if record(state).get(KUBELETS_KEY) else ("node-ipam-controller",)
    )
    _spawn(state, "kube-controller-manager", [
        os.path.join(record(state)["bin_dir"], "kube-controller-manager"),
        "--kubeconfig", _path(state, "kcm.kubeconfig"),
        "--bind-address", host_ip(state), "--secure-port", str(CONTROLLER_MANAGER_PORT),
        "--leader-elect=false", "--controllers", ",".join(controllers),
        "--use-service-account-credentials",
        "--service-account-private-key-file", _path(state, "pki", "sa.key"),
        "--root-ca-file", _path(state, "pki", "ca.crt"),
        "--allocate-node-cidrs", *_cluster_cidr_args(state),
        "--service-cluster-ip-range", SERVICE_CIDR,
    ], save)  # fmt: skip


def _cluster_cidr_args(state: LabState) -> list[str]:
    """The node IPAM controller's ranges: the IPv4 network, in dual stack the IPv6 one
    beside it (a v4 and a v6 podCIDR per Node), IPv6-only the IPv6 one alone; sized as
    net-conf.json's subnets."""
    conf = json.loads(
        plan.net_conf_json(
            state.network, state.backend, state.direct_routing, state.extra.get("net_conf_extra")
        )
    )
    if not conf.get("EnableIPv6"):
        return ["--cluster-cidr", state.network, "--node-cidr-mask-size", str(_subnet_len(state))]
    if conf.get("EnableIPv4") is False:  # IPv6-only: one IPv6 podCIDR per Node
        return [
            "--cluster-cidr",
            conf["IPv6Network"],
            "--node-cidr-mask-size",
            str(int(conf.get("IPv6SubnetLen", 64))),
        ]
    return [
        "--cluster-cidr",
        f"{state.network},{conf['IPv6Network']}",
        "--node-cidr-mask-size-ipv4",
        str(_subnet_len(state)),
        "--node-cidr-mask-size-ipv6",
        str(int(conf.get("IPv6SubnetLen", 64))),
    ]


def manifests_dir() -> str:
    return os.path.join(repo_root(), "manifests")


NETWORK_POLICY_KEY = "network_policy"  # in LabState.extra: the agents enforce NetworkPolicy


def network_policy(state: LabState) -> bool:
    return bool(state.extra.get(NETWORK_POLICY_KEY))


def components(state: LabState, overlay: str) -> list[str]:
    """The kustomize components of ``manifests/`` the lab adds, relative to ``overlay``:
    NetworkPolicy's (its RBAC and the agent's flag) when the lab enforces it."""
    if not network_policy(state):
        return []
    return [os.path.relpath(os.path.join(manifests_dir(), "network-policy"), overlay)]


def apply_manifests(state: LabState) -> None:
    """``kubectl apply`` of everything ``kustomization.yaml`` lists but the DaemonSet (with
    NetworkPolicy's component when the lab enforces it)."""
    source = manifests_dir()
    if network_policy(state):
        source = os.path.join(kube_dir(state), "kustomize-manifests")
        os.makedirs(source, exist_ok=True)
        doc = {
            "apiVersion": "kustomize.config.k8s.io/v1beta1",
            "kind": "Kustomization",
            "resources": [os.path.relpath(manifests_dir(), source)],
            "components": components(state, source),
        }
        write_file(os.path.join(source, "kustomization.yaml"), json.dumps(doc, indent=1))
    rendered = kubectl_json(state, "apply", "-k", source, "--dry-run=client")
    items = [o for o in rendered.get("items", [rendered]) if o.get("kind") != "DaemonSet"]
    doc = {"apiVersion": "v1", "kind": "List", "items": items}
    kubectl(state, "apply", "-f", "-", stdin=json.dumps(doc))


def set_net_conf(state: LabState, net_conf: str) -> None:
    """Set the ConfigMap's net-conf.json (as an operator edits it)."""
    patch = json.dumps({"data": {NET_CONF_KEY: net_conf}})
    kubectl(
        state, "patch", "configmap", CONFIG_MAP, "-n", NAMESPACE, "--type", "merge", "-p", patch
    )


def projector_ref(state: LabState) -> procs.ProcessRef | None:
    """The ConfigMap projector's process (flannelpy_lab.projector), if it was started."""
    started = state.extra.get(STATE_KEY, {}).get("projector")
    return procs.ref_of(*started) if started else None


def start_projector(state: LabState, save: Save) -> None:
    """Project the ConfigMap into the lab directory as the kubelet projects the agents'
    ConfigMap volume, from now on until ``down``: the agents' net-conf.json is
    ``<lab dir>/net-conf.json -> ..data/net-conf.json``, swapped atomically on every change
    (flannelpy_lab.projector). Returns once the first version is there."""
    path = agents.kube_net_conf_path(state)
    with contextlib.suppress(FileNotFoundError):  # a plain file would shadow the link
        if not os.path.islink(path):
            os.unlink(path)
    argv = [
        sys.executable,
        "-m",
        "flannelpy_lab.projector",
        "--kubeconfig",
        admin_kubeconfig(state),
        "--namespace",
        NAMESPACE,
        "--configmap",
        CONFIG_MAP,
        "--dir",
        os.path.dirname(path),
    ]
    ref = procs.spawn_detached(argv, _path(state, "projector.log"), env=_env())
    record(state)["projector"] = [ref.pid, ref.start_ticks]
    save()
    sync_net_conf(state)


def sync_net_conf(state: LabState, timeout: float = 10.0) -> str:
    """Wait until the agents' net-conf.json shows the ConfigMap's (the projector writes
    it, as the kubelet does; it watches, so this takes well under a second); return it."""
    cm = kubectl_json(state, "get", "configmap", CONFIG_MAP, "-n", NAMESPACE)
    text = cm.get("data", {}).get(NET_CONF_KEY)
    if not text:
        raise LabError(
            f"ConfigMap {NAMESPACE}/{CONFIG_MAP} has no {NET_CONF_KEY}; restore it from manifests/"
        )
    path = agents.kube_net_conf_path(state)
    log = _path(state, "projector.log")
    deadline = time.monotonic() + timeout
    while True:
        with contextlib.suppress(FileNotFoundError), open(path, encoding="utf-8") as f:
            if f.read() == text:
                return str(text)
        if not procs.alive(projector_ref(state)):
            raise LabError(
                f"the ConfigMap projector is not running; last lines of {log}:\n"
                f"{procs.log_tail(log)}"
            )
        if time.monotonic() > deadline:
            raise LabError(
                f"{path} did not show the ConfigMap within {timeout:g} s; last "
                f"lines of {log}:\n{procs.log_tail(log)}"
            )
        time.sleep(0.1)


def register_nodes(state: LabState) -> None:
    items = [node_manifest(n.name, str(n.ip)) for n in state.nodes]
    kubectl(
        state,
        "create",
        "-f",
        "-",
        stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": items}),
    )
    # The API server taints a new Node not-ready; the node lifecycle controller (not run
    # here) lifts it once the Node is Ready, which it is from the start.
    kubectl(state, "taint", "nodes", "--all", "node.kubernetes.io/not-ready:NoSchedule-")


def pod_cidrs(state: LabState) -> dict[str, str | None]:
    """Each Node's spec.podCIDR (None while unassigned)."""
    nodes = kubectl_json(state, "get", "nodes")["items"]
    return {n["metadata"]["name"]: n.get("spec", {}).get("podCIDR") for n in nodes}


def wait_pod_cidrs(state: LabState) -> None:
    deadline = time.monotonic() + READY_TIMEOUT
    while True:
        cidrs = pod_cidrs(state)
        missing = [n.name for n in state.nodes if not cidrs.get(n.name)]
        if not missing:
            return
        if time.monotonic() > deadline:
            log = _path(state, "kube-controller-manager.log")
            raise LabError(
                f"kube-controller-manager gave {', '.join(missing)} no podCIDR "
                f"within {READY_TIMEOUT:g} s; last lines of {log}:\n"
                f"{procs.log_tail(log)}"
            )
        time.sleep(0.3)


def write_agent_kubeconfig(state: LabState) -> None:
    token = kubectl(
        state, "create", "token", SERVICE_ACCOUNT, "-n", NAMESPACE, "--duration", TOKEN_DURATION
    ).stdout.strip()
    _write_kubeconfig(state, agent_kubeconfig(state), api_url(state), token)


# -- the faults of a real server (restarts, a re-created Node) -----------------------------


def _ref(state: LabState, name: str) -> procs.ProcessRef | None:
    started = record(state).get("processes", {}).get(name)
    return procs.ref_of(*started) if started else None


def stop_apiserver(state: LabState, save: Save) -> None:
    """Stop kube-apiserver (SIGTERM, as a restart by an operator or a static-pod update
    does); etcd and the controller-manager keep running."""
    ref = _ref(state, "kube-apiserver")
    if ref:
        procs.stop([ref])
    record(state)["processes"].pop("kube-apiserver", None)
    save()


def start_apiserver(state: LabState, save: Save) -> float:
    """Start kube-apiserver again on the same etcd and certificates; returns the seconds
    until it was ready."""
    t0 = time.monotonic()
    _start_apiserver(state, save)
    return time.monotonic() - t0


def bump_etcd_revision(state: LabState, writes: int = 1) -> None:
    """Write keys outside the API server's prefix straight into its etcd: the revision
    moves on without any Node changing, so a Node watch resumed from before is older than
    what a freshly started watch cache holds (the real server answers 410 Gone)."""
    with lab_etcd.client(record(state)["etcd_url"]) as c:
        for i in range(writes):
            c.put(f"/fpl-lab/revision-bump/{i}", str(time.time()))


def recreate_node(state: LabState, node: NodeInfo, pod_cidr: str) -> None:
    """Delete ``node``'s Node and register it again with ``pod_cidr`` in its spec, as an
    operator moves a node to another podCIDR (the field is immutable once set); the node
    IPAM controller takes the CIDR as allocated. The annotations go with the old object."""
    kubectl(state, "delete", "node", node.name, "--wait=true")
    doc = node_manifest(node.name, str(node.ip))
    doc["spec"] = {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]}
    kubectl(state, "create", "-f", "-", stdin=json.dumps(doc))
    kubectl(
        state, "taint", "nodes", node.name, "node.kubernetes.io/not-ready:NoSchedule-", check=False
    )
