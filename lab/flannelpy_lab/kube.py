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
import re
import secrets
import shutil
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from ipaddress import IPv4Interface
from typing import Any

from flannelpy_lab import agents, plan, procs
from flannelpy_lab import etcd as lab_etcd
from flannelpy_lab.errors import LabError
from flannelpy_lab.flanneld import repo_root
from flannelpy_lab.state import LabState, NodeInfo

BUILD_SCRIPT = "scripts/build-kube.sh"
PIN_FILE = "tests/peers/kubernetes/go.mod"
BIN_DIR_ENV = "FLANNELPY_KUBE_BIN_DIR"
PEERS_DIR_ENV = "FLANNELPY_PEERS_DIR"
BINARIES = ("kube-apiserver", "kube-controller-manager", "kubectl", "kube-proxy")
STATE_KEY = "kube"  # in LabState.extra: the control plane's record
API_PORT = 6443
SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"  # the "kubernetes" Service's ClusterIP: the range's first address
SERVICE_NAMES = (
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)
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
_PROXY_VARS = re.compile(r"(?i)^(https?|all|no)_proxy$")

Save = Callable[[], None]
Progress = Callable[[str], None]


def bin_dir(build: bool = False) -> str:
    """The directory holding the built control plane; LabError naming the build script.
    With ``build`` (a lab coming up), a missing pinned build is made first."""
    explicit = os.environ.get(BIN_DIR_ENV)
    directory = explicit or _pinned_dir()
    missing = [b for b in BINARIES if not os.access(os.path.join(directory, b), os.X_OK)]
    if missing and build and not explicit:
        _build(directory)
        missing = [b for b in BINARIES if not os.access(os.path.join(directory, b), os.X_OK)]
    if missing:
        raise LabError(
            f"the Kubernetes control plane is not built in {directory} (no "
            f"{', '.join(missing)}); run {BUILD_SCRIPT}"
            + (f" or unset {BIN_DIR_ENV}" if explicit else "")
        )
    return directory


def _build(directory: str) -> None:
    """First use: build the pinned control plane; the script says what and how long."""
    script = os.path.join(repo_root(), BUILD_SCRIPT)
    if os.path.isfile(script):
        say = f"flannelpy-lab: Kubernetes is not built in {directory}; building it now with "
        print(say + f"{BUILD_SCRIPT} (the first build takes about 10 minutes)", file=sys.stderr)
        subprocess.run(["bash", script], stdout=subprocess.DEVNULL, check=False)


def _required_version(line: str) -> str | None:
    """The version in "require k8s.io/kubernetes vX", alone or as a line of a require
    block; None for any other line (an indirect one has a comment after it)."""
    words = line.split()
    if words[:1] == ["require"]:
        words = words[1:]
    if len(words) == 2 and words[0] == "k8s.io/kubernetes" and words[1].startswith("v"):
        return words[1]
    return None


def _pinned_dir() -> str:
    path = os.path.join(repo_root(), PIN_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            pin = next(filter(None, (_required_version(line) for line in f)), None)
    except OSError as e:
        raise LabError(
            f"cannot read the Kubernetes pin {path} ({e.strerror}); "
            f"restore it and run {BUILD_SCRIPT}"
        ) from e
    if pin is None:
        raise LabError(
            f"{path} pins no k8s.io/kubernetes release; restore it and run {BUILD_SCRIPT}"
        )
    peers = os.environ.get(PEERS_DIR_ENV, "/var/cache/flannelpy/peers")
    return os.path.join(peers, f"kubernetes-{pin}")


# -- paths and the record in the state ------------------------------------------------------


def kube_dir(state: LabState) -> str:
    return os.path.join(state.lab_dir, "kube")


def _path(state: LabState, *parts: str) -> str:
    return os.path.join(kube_dir(state), *parts)


def admin_kubeconfig(state: LabState) -> str:
    return _path(state, "admin.kubeconfig")


def agent_kubeconfig(state: LabState) -> str:
    """The kubeconfig every agent gets: the flannelpy ServiceAccount's token."""
    return _path(state, "flannelpy.kubeconfig")


def host_ip(state: LabState) -> str:
    return str(IPv4Interface(state.host_address).ip)


def api_url(state: LabState) -> str:
    return f"https://{host_ip(state)}:{API_PORT}"


def record(state: LabState) -> dict[str, Any]:
    doc: dict[str, Any] = state.extra.setdefault(STATE_KEY, {})
    return doc


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


# -- kubectl --------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    # The API server is on the lab's address: a proxy from the environment would not reach it.
    return {k: v for k, v in os.environ.items() if not _PROXY_VARS.match(k)}


def kubectl(
    state: LabState,
    *args: str,
    stdin: str | None = None,
    check: bool = True,
    timeout: float = 30.0,
) -> subprocess.CompletedProcess[str]:
    """The real kubectl as cluster admin; with ``check``, a failure is a LabError."""
    binary = os.path.join(record(state).get("bin_dir") or bin_dir(), "kubectl")
    argv = [binary, "--kubeconfig", admin_kubeconfig(state), *args]
    try:
        proc = subprocess.run(
            argv,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=_env(),
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        raise LabError(f"`kubectl {' '.join(args)}` did not finish within {timeout:g} s") from e
    if check and proc.returncode != 0:
        raise LabError(f"`kubectl {' '.join(args)}` failed: {proc.stderr.strip()[-400:]}")
    return proc


def kubectl_json(state: LabState, *args: str) -> Any:
    return json.loads(kubectl(state, *args, "-o", "json").stdout)


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


def _openssl(*args: str) -> None:
    proc = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise LabError(f"`openssl {args[0]}` failed: {proc.stderr.strip()[-300:]}")


def _make_pki(state: LabState) -> None:
    """A CA, kube-apiserver's serving certificate, the ServiceAccount signing key and
    static tokens for the admin and the controller-manager."""
    pki = _path(state, "pki")
    os.makedirs(pki, exist_ok=True)
    p = lambda name: os.path.join(pki, name)  # noqa: E731
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        f"/CN=fpl-{state.name}-ca",
        "-keyout",
        p("ca.key"),
        "-out",
        p("ca.crt"),
    )
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=kube-apiserver",
        "-keyout",
        p("apiserver.key"),
        "-out",
        p("apiserver.csr"),
    )
    with open(p("apiserver.ext"), "w", encoding="utf-8") as f:
        # As a cluster's: also the "kubernetes" Service's address and names, which pods
        # (CoreDNS, the e2e specs' clients) reach it by through kube-proxy.
        names = ",".join(f"DNS:{n}" for n in SERVICE_NAMES)
        f.write(
            f"subjectAltName=IP:{host_ip(state)},IP:127.0.0.1,IP:{SERVICE_IP},"
            f"DNS:localhost,{names}\n"
        )
    _openssl(
        "x509",
        "-req",
        "-in",
        p("apiserver.csr"),
        "-CA",
        p("ca.crt"),
        "-CAkey",
        p("ca.key"),
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        p("apiserver.ext"),
        "-out",
        p("apiserver.crt"),
    )
    _openssl("genrsa", "-out", p("sa.key"), "2048")
    _openssl("rsa", "-in", p("sa.key"), "-pubout", "-out", p("sa.pub"))
    admin, kcm = secrets.token_hex(16), secrets.token_hex(16)
    with open(p("tokens.csv"), "w", encoding="utf-8") as f:
        f.write(
            f"{admin},fpl-admin,uid-admin,system:masters\n"
            f"{kcm},system:kube-controller-manager,uid-kcm\n"
        )
    os.chmod(p("tokens.csv"), 0o600)
    _write_kubeconfig(state, admin_kubeconfig(state), api_url(state), admin)
    _write_kubeconfig(state, _path(state, "kcm.kubeconfig"), api_url(state), kcm)
    # kube-apiserver's client certificate to the kubelets (exec, logs, port-forward).
    client_cert(state, "apiserver-kubelet-client", "kube-apiserver-kubelet-client")


def client_cert(state: LabState, name: str, cn: str, org: str | None = None) -> tuple[str, str]:
    """A client certificate signed by the lab's CA (user ``cn``, group ``org``); returns
    the certificate's and the key's paths."""
    p = lambda ext: _path(state, "pki", f"{name}.{ext}")  # noqa: E731
    subject = f"/CN={cn}" + (f"/O={org}" if org else "")
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        subject,
        "-keyout",
        p("key"),
        "-out",
        p("csr"),
    )
    _openssl(
        "x509",
        "-req",
        "-in",
        p("csr"),
        "-CA",
        _path(state, "pki", "ca.crt"),
        "-CAkey",
        _path(state, "pki", "ca.key"),
        "-CAcreateserial",
        "-days",
        "2",
        "-out",
        p("crt"),
    )
    return p("crt"), p("key")


def _write_kubeconfig(state: LabState, path: str, server: str, token: str) -> None:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "lab",
        "clusters": [
            {
                "name": "lab",
                "cluster": {
                    "server": server,
                    "certificate-authority": _path(state, "pki", "ca.crt"),
                },
            }
        ],
        "users": [{"name": "lab", "user": {"token": token}}],
        "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": "lab"}}],
    }
    tmp = path + ".tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def cert_kubeconfig(server: str, ca: str, cert: str, key: str) -> dict[str, Any]:
    """A kubeconfig authenticating with a client certificate (kubelets, the scheduler,
    kube-proxy)."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "lab",
        "clusters": [{"name": "lab", "cluster": {"server": server, "certificate-authority": ca}}],
        "users": [{"name": "lab", "user": {"client-certificate": cert, "client-key": key}}],
        "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": "lab"}}],
    }


def write_file(path: str, text: str, mode: int = 0o644) -> None:
    """``text`` into ``path`` atomically, its directory made, with ``mode``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


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


def _admin_token(state: LabState) -> str:
    with open(admin_kubeconfig(state), encoding="utf-8") as f:
        token: str = json.load(f)["users"][0]["user"]["token"]
        return token


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


def node_manifest(name: str, internal_ip: str) -> dict[str, Any]:
    """A Node as a kubelet registers it (status included: create keeps it for Nodes)."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
            },
            # A kubelet always sets this one. flanneld v0.28.9 needs some annotation: on a
            # Node with none it panics writing its own (a nil map in AcquireLease).
            "annotations": {"volumes.kubernetes.io/controller-managed-attach-detach": "true"},
        },
        "status": {
            "addresses": [
                {"type": "InternalIP", "address": internal_ip},
                {"type": "Hostname", "address": name},
            ],
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "registered by the lab",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
            ],
        },
    }


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


# -- reading Nodes, and the faults of a real server (restarts, a re-created Node) -----------

ANNOTATION_PREFIX = "flannel.alpha.coreos.com/"


def api_json(state: LabState, path: str, timeout: float = 5.0) -> Any:
    """GET ``path`` from kube-apiserver as cluster admin (no kubectl process: cheap enough
    to poll); LabError when it does not answer."""
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}),
        urllib.request.HTTPSHandler(
            context=ssl.create_default_context(cafile=_path(state, "pki", "ca.crt"))
        ),
    )
    request = urllib.request.Request(api_url(state) + path)
    request.add_header("Authorization", f"Bearer {_admin_token(state)}")
    try:
        with opener.open(request, timeout=timeout) as resp:
            return json.load(resp)
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise LabError(
            f"kube-apiserver GET {path} failed ({e}); is the control plane "
            "running (`flannelpy-lab status`)?"
        ) from e


def node_lease(node: dict[str, Any]) -> dict[str, Any] | None:
    """A Node as the lab's lease record (``status`` lists these): its podCIDR and Flannel's
    annotations, whoever wrote them; None until it has both."""
    annotations = (node.get("metadata") or {}).get("annotations") or {}
    cidr = (node.get("spec") or {}).get("podCIDR")
    public_ip = annotations.get(ANNOTATION_PREFIX + "public-ip")
    # IPv6-only, Flannel writes the IPv6 annotations alone (and the podCIDR is IPv6).
    public_ipv6 = annotations.get(ANNOTATION_PREFIX + "public-ipv6")
    if not cidr or not (public_ip or public_ipv6):
        return None
    name = (node.get("metadata") or {}).get("name")
    return {
        "key": name,
        "subnet": cidr,
        "public_ip": public_ip,
        "public_ipv6": public_ipv6,
        "backend": annotations.get(ANNOTATION_PREFIX + "backend-type"),
        "node_name": name,
        "error": None,
    }


def node_leases(state: LabState) -> list[dict[str, Any]]:
    items = api_json(state, "/api/v1/nodes").get("items") or []
    return [lease for lease in map(node_lease, items) if lease]


def node_has_lease(state: LabState, node: NodeInfo) -> bool:
    """Has ``node``'s agent published its lease on its Node (a flanneld node's readiness)?"""
    try:
        doc = api_json(state, f"/api/v1/nodes/{node.name}", timeout=2.0)
    except LabError:  # the API briefly unreachable: not ready yet
        return False
    lease = node_lease(doc)
    if lease is None:
        return False
    if plan.ipv6_only(state):
        return lease["public_ipv6"] == plan.ipv6_underlay_ip(node)
    return lease["public_ip"] == str(node.ip)


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


def pod_manifest(
    namespace: str,
    name: str,
    node: str,
    labels: dict[str, str],
    ports: dict[str, int] | None = None,
) -> dict[str, Any]:
    """A Pod bound to ``node`` as the lab's NetworkPolicy tests and benches write it: no
    kubelet runs it (the lab's pods are made through the CNI executable), so its status is
    written apart (:func:`pod_running_status`); ``ports``: container port names -> numbers."""
    container: dict[str, Any] = {"name": "c", "image": "none"}
    if ports:
        container["ports"] = [{"name": n, "containerPort": p} for n, p in ports.items()]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {
            "nodeName": node,
            "automountServiceAccountToken": False,
            "containers": [container],
        },
    }


def pod_running_status(ip: str) -> dict[str, Any]:
    """The status patch a kubelet writes once a pod runs with one address."""
    return {"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}}
