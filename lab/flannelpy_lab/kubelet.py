"""Real kubelets and containerds on the lab's nodes (``lab up --kubelet``).

On top of the control plane of ``flannelpy_lab.kube`` (which then runs the controllers a
cluster needs and authorizes kubelets with the Node authorizer), the lab starts
kube-scheduler on the host, and on every node namespace:

- a containerd (Debian's 1.6) with its own root, state dir, socket and configuration,
  its CRI plugin reading the node's ``/etc/cni/net.d`` and ``/opt/cni/bin``;
- a real kubelet with its own root dir, cgroup root (``/fpl-<lab>-<node>``), the node's
  underlay address, a client certificate for ``system:node:<name>`` signed by the lab's
  CA, the cgroupfs driver and ``failCgroupV1: false`` (this host has cgroup v1).

Both run in the node's network namespace and in one mount namespace of the node's own
(slave of the host's, so nothing they mount shows on the host and it all goes with
their last process), where the node's host paths (``/opt/cni/bin``, ``/etc/cni/net.d``,
``/run/flannel``, ``/run/flannelpy``, ``/var/lib/flannelpy``, ``/var/log/pods``, ...)
are bind mounts of directories under the node's lab directory: the DaemonSet's hostPath
volumes land there, as on a machine of its own. Settings this host needs: containerd
clamps oom_score_adj to its own (root lacks CAP_SYS_RESOURCE; the DaemonSet's
system-node-critical pods would ask for -997) and has AppArmor off; the kubelet keeps
its own oom_score_adj and does not account local storage.

Beside them each node runs a real kube-proxy (``flannelpy_lab.proxy``), in iptables or
nftables mode, and the controller-manager runs the endpoints and EndpointSlice
controllers, so Services carry traffic over the overlay.

The images come without a registry (``flannelpy_lab.images``) and are imported into
every containerd. The manifests are applied through a kustomization of the lab's that
only sets the image and, on the agent's container, ``KUBERNETES_SERVICE_HOST`` and
``KUBERNETES_SERVICE_PORT`` (the API server's address, as Flannel's docs describe for
clusters without kube-proxy: the agent must reach the API server before any Service
carries traffic; other pods reach it through the ``kubernetes`` Service, whose endpoint
the API server keeps) and ``FLANNELD_IFACE`` (lab nodes have no default route to pick the
interface from).

With ``network_agent`` "flanneld" (``lab up --kubelet --network-agent flanneld``) the
network is Flannel's instead of the DaemonSet's: flanneld and Flannel's CNI plugin as
kube-flannel.yml deploys them (``flannelpy_lab.kubeflannel``), the reference cluster of
``scripts/conformance.sh --cni flanneld``; with ``network_policy``, kube-network-policies
beside flanneld on every node, as Flannel's chart runs it (``flannelpy_lab.kube_netpol``),
stopped with the node's processes (``stop_node``) and by ``down``.

Opt-in, for the upstream e2e specs (``scripts/conformance.sh``): more images imported
(``image_archives``), CoreDNS as the cluster DNS (``flannelpy_lab.dns``), and routes on
the host to every podCIDR (``route_host_to_pods``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from flannelpy.dataplane.netns import netns_path
from flannelpy_lab import dns, images, kube_netpol, kubeflannel, plan, procs, proxy, topology
from flannelpy_lab import kube as control_plane
from flannelpy_lab.errors import LabError
from flannelpy_lab.state import LabState, NodeInfo

STATE_KEY = "kubelet"  # in LabState.extra: {"nodes": {node: {...}}, "image": ref, ...}
CGROUP_ROOT = "/sys/fs/cgroup"
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


def validate_image_archives(paths: Sequence[str], kubelets: bool) -> None:
    """Before anything is built: one sentence for an archive the lab cannot import."""
    if paths and not kubelets:
        raise LabError("--image-archive needs --kubelet: only the kubelet lab runs containerd")
    for path in paths:
        images.archive_image(path)  # a LabError naming what the file lacks


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


def _hierarchies() -> list[str]:
    """The cgroup v1 hierarchies (directories under /sys/fs/cgroup that are mounts)."""
    out = []
    for name in sorted(os.listdir(CGROUP_ROOT)):
        path = os.path.join(CGROUP_ROOT, name)
        if name != "unified" and not os.path.islink(path) and os.path.ismount(path):
            out.append(path)
    return out


# -- configuration (pure) -------------------------------------------------------------------


def containerd_config(
    base: str, cni_bin_dir: str = "/opt/cni/bin", cni_conf_dir: str = "/etc/cni/net.d"
) -> str:
    """containerd's config.toml with all its state under ``base``. The CNI directories
    are paths in the node's mount namespace (the defaults are what the DaemonSet
    installs into); the CRI tests, which run without one, point them at theirs."""

    def path(*parts: str) -> str:
        return json.dumps(os.path.join(base, *parts))  # a JSON string is a TOML basic string

    cri = '[plugins."io.containerd.grpc.v1.cri"'
    return f"""\
version = 2
root = {path("root")}
state = {path("state")}
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.tracing.processor.v1.otlp"]

[grpc]
  address = {path("containerd.sock")}

[plugins."io.containerd.internal.v1.opt"]
  path = {path("opt")}

{cri}]
  sandbox_image = {json.dumps(images.PAUSE_IMAGE)}
  netns_mounts_under_state_dir = true
  disable_apparmor = true
  restrict_oom_score_adj = true
  enable_selinux = false
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false

{cri}.cni]
  bin_dir = {json.dumps(cni_bin_dir)}
  conf_dir = {json.dumps(cni_conf_dir)}
  max_conf_num = 1
"""


def kubelet_config(
    node_ip: str,
    socket_path: str,
    ca_file: str,
    cgroup_root: str,
) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": node_ip,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": ca_file},
        },
        "authorization": {"mode": "Webhook"},
        "containerRuntimeEndpoint": f"unix://{socket_path}",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root,
        "cgroupsPerQOS": True,
        "failCgroupV1": False,
        "failSwapOn": False,
        # Root here lacks CAP_SYS_RESOURCE: the kubelet cannot lower its own score.
        "oomScoreAdj": 0,
        # A pod's own ephemeral-storage limit is enforced (its writable layer and logs are
        # measured, as the Services spec on evicted pods needs), but no node-level disk
        # eviction: the lab's nodes share the host's one filesystem.
        "localStorageCapacityIsolation": True,
        "evictionHard": {"memory.available": "100Mi"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "registerNode": True,
        "rotateCertificates": False,
        "resolvConf": "/etc/resolv.conf",
        "staticPodPath": "",
        "podLogsDir": "/var/log/pods",
        "maxPods": 110,
        "nodeStatusUpdateFrequency": "4s",
        "syncFrequency": "10s",
    }


def kustomization(
    manifests: str,
    image_ref: str,
    api_host: str,
    api_port: int,
    iface: str,
    components: list[str] | None = None,
) -> str:
    """The lab's overlay of ``manifests/``: the image, and the agent's way to the API
    server without kube-proxy; nothing else changes but the ``components`` added."""
    name, _, tag = image_ref.rpartition(":")
    patch = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": DAEMONSET, "namespace": control_plane.NAMESPACE},
        "spec": {
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "kube-flannelpy",
                            "env": [
                                {"name": "KUBERNETES_SERVICE_HOST", "value": api_host},
                                {"name": "KUBERNETES_SERVICE_PORT", "value": str(api_port)},
                                {"name": "FLANNELD_IFACE", "value": iface},
                            ],
                        }
                    ]
                }
            }
        },
    }
    doc = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [manifests],
        "images": [{"name": "flannelpy", "newName": name, "newTag": tag}],
        "patches": [{"patch": json.dumps(patch)}],
        **({"components": components} if components else {}),
    }
    return json.dumps(doc, indent=1)


def workload(replicas: int) -> dict[str, Any]:
    """The test Deployment: busybox pods spread one per node by the scheduler."""
    labels = {"app": WORKLOAD}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": WORKLOAD, "namespace": "default"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "topologySpreadConstraints": [
                        {
                            "maxSkew": 1,
                            "topologyKey": "kubernetes.io/hostname",
                            "whenUnsatisfiable": "DoNotSchedule",
                            # A cordoned or tainted node is no domain to spread over.
                            "nodeTaintsPolicy": "Honor",
                            "labelSelector": {"matchLabels": labels},
                        }
                    ],
                    "terminationGracePeriodSeconds": 1,
                    "containers": [
                        {
                            "name": "main",
                            "image": images.BUSYBOX_IMAGE,
                            "imagePullPolicy": "Never",
                            "command": ["/bin/sleep", "2147483647"],
                        }
                    ],
                },
            },
        },
    }


# -- start ----------------------------------------------------------------------------------


def _spawn(state: LabState, key: str, argv: list[str], log: str, save: Save) -> procs.ProcessRef:
    ref = procs.spawn_detached(argv, log)
    record(state).setdefault("processes", {})[key] = [ref.pid, ref.start_ticks]
    save()
    return ref


def start(state: LabState, save: Save, say: Progress) -> None:
    """Scheduler, then per node containerd (images imported) and kubelet, then the
    manifests with the DaemonSet and the test Deployment; waits until every node is
    Ready, every agent pod Ready and every test pod Running."""
    rec = record(state)
    t0 = time.monotonic()
    _start_scheduler(state, save)
    say(f"      building the images (cached: {images.images_dir()})")
    image_dir = os.path.join(state.lab_dir, "images")
    os.makedirs(image_dir, exist_ok=True)
    to_import = [
        *images.busybox_images(image_dir),
        *(images.archive_image(path) for path in rec.get("image_archives", ())),
    ]
    if runs_daemonset(state):  # Flannel's processes need no image
        flannelpy_image = images.flannelpy_image()
        rec["image"] = flannelpy_image.ref
        to_import.append(flannelpy_image)
    if rec.get("coredns_binary"):
        coredns_image = dns.image(image_dir, rec["coredns_binary"])
        rec["coredns_image"] = coredns_image.ref
        to_import.append(coredns_image)
    save()
    for p in HOST_PATHS:
        os.makedirs(p, exist_ok=True)  # a mount point for the node's bind mount
    say(
        f"      starting containerd on {len(state.nodes)} nodes, importing "
        f"{', '.join(i.ref for i in to_import)}"
    )
    for node in state.nodes:
        _start_containerd(state, node, save)

    # One import per node at a time, the nodes side by side (it is disk-bound).
    def import_all(node: NodeInfo) -> None:
        for image in to_import:
            images.import_image(containerd_socket(node), image)

    with ThreadPoolExecutor(max_workers=len(state.nodes)) as pool:
        list(pool.map(import_all, state.nodes))
    rec["images_seconds"] = round(time.monotonic() - t0, 1)
    say(f"      starting the kubelets ({rec['images_seconds']} s)")
    for node in state.nodes:
        _start_kubelet(state, node, save)
    control_plane.kubectl(
        state,
        "create",
        "clusterrolebinding",
        "fpl-apiserver-kubelet",
        "--clusterrole",
        "system:kubelet-api-admin",
        "--user",
        "kube-apiserver-kubelet-client",
    )
    wait_nodes_registered(state)
    control_plane.wait_pod_cidrs(state)
    if rec.get("host_pod_routes"):
        route_host_to_pods(state)
    rec["nodes_registered_seconds"] = round(time.monotonic() - t0, 1)
    route_services(state)
    say(f"      starting kube-proxy ({rec.get('proxy_mode', proxy.DEFAULT_MODE)} mode)")
    proxy.start(state, rec.setdefault("processes", {}), node_base, save)
    rec["proxy_seconds"] = round(time.monotonic() - t0, 1)
    if runs_daemonset(state):
        say("      applying manifests/ with the DaemonSet")
        apply_with_daemonset(state)
    else:
        say("      starting flanneld on every node, as kube-flannel.yml deploys it")
        start_flannel(state, save)
        if kube_netpol.enabled(state):
            say("      starting kube-network-policies beside flanneld, as Flannel's chart does")
            kube_netpol.start_all(state, save, kube_netpol.cluster_role_objects())
    wait_ready(state)
    rec["ready_seconds"] = round(time.monotonic() - t0, 1)
    control_plane.kubectl(state, "apply", "-f", "-", stdin=json.dumps(workload(len(state.nodes))))
    if rec.get("coredns_image"):
        say("      starting CoreDNS as the cluster DNS")
        start_cluster_dns(state, rec["coredns_image"])
    wait_workload(state, len(state.nodes))
    rec["workload_seconds"] = round(time.monotonic() - t0, 1)
    save()
    say(
        f"      images in {rec['images_seconds']} s, Nodes registered at "
        f"{rec['nodes_registered_seconds']} s, kube-proxy healthy at {rec['proxy_seconds']} s, "
        f"Ready with every {'agent pod' if runs_daemonset(state) else 'flanneld'} at "
        f"{rec['ready_seconds']} s, test pods Running at {rec['workload_seconds']} s"
    )


def _start_scheduler(state: LabState, save: Save) -> None:
    cert, key = control_plane.client_cert(state, "scheduler", "system:kube-scheduler")
    kubeconfig = control_plane._path(state, "scheduler.kubeconfig")
    ca = control_plane._path(state, "pki", "ca.crt")
    control_plane.write_file(
        kubeconfig,
        json.dumps(control_plane.cert_kubeconfig(control_plane.api_url(state), ca, cert, key)),
        0o600,
    )
    argv = [
        os.path.join(control_plane.record(state)["bin_dir"], "kube-scheduler"),
        "--kubeconfig",
        kubeconfig,
        "--leader-elect=false",
        "--bind-address",
        control_plane.host_ip(state),
        "--secure-port",
        str(control_plane.SCHEDULER_PORT),
    ]
    log = control_plane._path(state, "kube-scheduler.log")
    ref = procs.spawn_detached(argv, log)
    control_plane.record(state)["processes"]["kube-scheduler"] = [ref.pid, ref.start_ticks]
    save()


def _start_containerd(state: LabState, node: NodeInfo, save: Save) -> None:
    base = node_base(node)
    for d in ("root", "state", "opt"):
        os.makedirs(os.path.join(base, d), exist_ok=True)
    for p in HOST_PATHS:
        os.makedirs(host_source(node, p), exist_ok=True)
    for plugin in REFERENCE_PLUGINS:
        shutil.copy(os.path.join(REFERENCE_DIR, plugin), host_source(node, "/opt/cni/bin"))
    control_plane.write_file(os.path.join(base, "config.toml"), containerd_config(base))
    _make_cgroups(cgroup_parent(state, node))
    binds = " && ".join(f"mount --bind {host_source(node, p)} {p}" for p in HOST_PATHS)
    script = f"{binds} && exec containerd --config {os.path.join(base, 'config.toml')}"
    log = os.path.join(base, "containerd.log")
    ref = _spawn(
        state,
        f"containerd/{node.name}",
        [
            "nsenter",
            f"--net=/run/netns/{node.namespace}",
            "unshare",
            "--mount",
            "--propagation",
            "slave",
            "sh",
            "-c",
            script,
        ],
        log,
        save,
    )
    procs.wait_started(f"containerd of {node.name}", ref, log, lambda: _ctr_ok(node), READY_TIMEOUT)


def _ctr_ok(node: NodeInfo) -> bool:
    if not os.path.exists(containerd_socket(node)):
        return False
    proc = subprocess.run(
        ["ctr", f"--address={containerd_socket(node)}", "version"],
        capture_output=True,
        timeout=10,
        check=False,
    )
    return proc.returncode == 0


def _make_cgroups(parent: str) -> None:
    """The node's cgroup root in every v1 hierarchy (cpuset's with the root's cpus and
    mems, which a new cpuset cgroup lacks)."""
    for hierarchy in _hierarchies():
        path = os.path.join(hierarchy, parent.lstrip("/"))
        os.makedirs(path, exist_ok=True)
        if os.path.basename(hierarchy) == "cpuset":
            for knob in ("cpuset.cpus", "cpuset.mems"):
                with open(os.path.join(hierarchy, knob), encoding="utf-8") as f:
                    value = f.read().strip()
                with open(os.path.join(path, knob), "w", encoding="utf-8") as f:
                    f.write(value)


def _start_kubelet(state: LabState, node: NodeInfo, save: Save) -> None:
    base = node_base(node)
    ca = control_plane._path(state, "pki", "ca.crt")
    cert, key = control_plane.client_cert(
        state, f"node-{node.name}", f"system:node:{node.name}", "system:nodes"
    )
    kubeconfig = os.path.join(base, "kubelet.kubeconfig")
    control_plane.write_file(
        kubeconfig,
        json.dumps(control_plane.cert_kubeconfig(control_plane.api_url(state), ca, cert, key)),
        0o600,
    )
    config = os.path.join(base, "kubelet.yaml")
    control_plane.write_file(
        config,
        json.dumps(
            {
                **kubelet_config(
                    str(node.ip), containerd_socket(node), ca, cgroup_parent(state, node)
                ),
                **(dns.kubelet_settings() if record(state).get("coredns_binary") else {}),
            }
        ),
    )
    containerd_pid = record(state)["processes"][f"containerd/{node.name}"][0]
    log = os.path.join(base, "kubelet.log")
    binary = os.path.join(control_plane.record(state)["bin_dir"], "kubelet")
    _spawn(
        state,
        f"kubelet/{node.name}",
        [
            "nsenter",
            f"--target={containerd_pid}",
            "--mount",
            "--net",
            binary,
            "--config",
            config,
            "--kubeconfig",
            kubeconfig,
            "--root-dir",
            os.path.join(base, "kubelet"),
            "--cert-dir",
            os.path.join(base, "pki"),
            "--hostname-override",
            node.name,
            "--node-ip",
            str(node.ip),
            "--v",
            "1",
        ],
        log,
        save,
    )


def _nodes(state: LabState) -> dict[str, Any]:
    return {
        n["metadata"]["name"]: n for n in control_plane.kubectl_json(state, "get", "nodes")["items"]
    }


def node_ready(node: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in node.get("status", {}).get("conditions", [])
    )


def _poll(what: str, check: Callable[[], str | None], timeout: float, logs: list[str]) -> None:
    """Poll ``check`` (None: done, else what is missing) until done or ``timeout``."""
    deadline = time.monotonic() + timeout
    while (missing := check()) is not None:
        if time.monotonic() > deadline:
            tails = "\n".join(f"{log}:\n{procs.log_tail(log)}" for log in logs)
            raise LabError(f"{what} within {timeout:g} s: {missing}\n{tails}")
        time.sleep(0.5)


def _kubelet_logs(state: LabState) -> list[str]:
    return [os.path.join(node_base(n), "kubelet.log") for n in state.nodes]


def wait_nodes_registered(state: LabState, timeout: float = READY_TIMEOUT) -> None:
    def check() -> str | None:
        missing = sorted(set(n.name for n in state.nodes) - set(_nodes(state)))
        return f"not registered: {', '.join(missing)}" if missing else None

    _poll("the kubelets did not register their Nodes", check, timeout, _kubelet_logs(state))


def apply_with_daemonset(state: LabState) -> None:
    """``manifests/`` through the lab's kustomization: the ConfigMap is given the lab's
    net-conf.json before the DaemonSet exists, so its pods read the lab's from the start."""
    overlay = os.path.join(control_plane.kube_dir(state), "kustomize")
    os.makedirs(overlay, exist_ok=True)
    iface = state.nodes[0].underlay_iface
    text = kustomization(
        os.path.relpath(control_plane.manifests_dir(), overlay),
        record(state)["image"],
        control_plane.host_ip(state),
        control_plane.API_PORT,
        iface,
        control_plane.components(state, overlay),
    )
    control_plane.write_file(os.path.join(overlay, "kustomization.yaml"), text)
    rendered = control_plane.kubectl_json(state, "apply", "-k", overlay, "--dry-run=client")
    items = rendered.get("items", [rendered])
    rest = [o for o in items if o.get("kind") != "DaemonSet"]
    ds = [o for o in items if o.get("kind") == "DaemonSet"]
    control_plane.kubectl(
        state,
        "apply",
        "-f",
        "-",
        stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": rest}),
    )
    control_plane.set_net_conf(
        state,
        plan.net_conf_json(
            state.network, state.backend, state.direct_routing, state.extra.get("net_conf_extra")
        ),
    )
    control_plane.kubectl(
        state,
        "apply",
        "-f",
        "-",
        stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": ds}),
    )


def start_flannel(state: LabState, save: Save) -> None:
    """Flannel as the network (``flannelpy_lab.kubeflannel``): its objects applied, on
    every node its CNI plugins installed and flanneld started; each node's conflist
    installed once its flanneld has published the node's lease."""
    processes = record(state).setdefault("processes", {})
    kubeflannel.apply(
        state,
        plan.net_conf_json(
            state.network, state.backend, state.direct_routing, state.extra.get("net_conf_extra")
        ),
    )
    for node in state.nodes:
        kubeflannel.install_plugins(state, host_source(node, "/opt/cni/bin"), REFERENCE_DIR)
        runtime_pid = processes[f"containerd/{node.name}"][0]
        kubeflannel.start(state, node, runtime_pid, processes, save)
    pending = {n.name for n in state.nodes}

    def check() -> str | None:
        for node in state.nodes:
            if node.name not in pending:
                continue
            subnet_env = os.path.join(host_source(node, "/run/flannel"), "subnet.env")
            env = kubeflannel.check_ready(state, node, subnet_env)
            if env is not None:
                kubeflannel.install_conflist(host_source(node, "/etc/cni/net.d"))
                node.overlay_address = env.subnet
                pending.discard(node.name)
        return f"no lease published by the flanneld of {sorted(pending)}" if pending else None

    logs = [n.agent_log for n in state.nodes]
    _poll("flanneld did not start", check, kubeflannel.READY_TIMEOUT, logs)
    save()


def _pods(state: LabState, namespace: str, selector: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = control_plane.kubectl_json(
        state, "get", "pods", "-n", namespace, "-l", selector
    )["items"]
    return items


def pod_ready(pod: dict[str, Any]) -> bool:
    return any(
        c.get("type") == "Ready" and c.get("status") == "True"
        for c in pod.get("status", {}).get("conditions", [])
    )


def wait_ready(state: LabState, timeout: float = READY_TIMEOUT) -> None:
    """Every Node Ready and, when the DaemonSet is the network, every agent pod Ready."""
    names = {n.name for n in state.nodes}
    daemonset = runs_daemonset(state)

    def check() -> str | None:
        nodes = _nodes(state)
        not_ready = sorted(n for n in names if not node_ready(nodes.get(n, {})))
        pending: list[str] = []
        if daemonset:
            pods = _pods(state, control_plane.NAMESPACE, "app.kubernetes.io/component=agent")
            ready = {p["spec"].get("nodeName") for p in pods if pod_ready(p)}
            pending = sorted(names - ready)
        if not not_ready and not pending:
            return None
        return f"Nodes not Ready: {not_ready}; no Ready agent pod on: {pending}"

    _poll("the cluster was not ready", check, timeout, _kubelet_logs(state))


def route_services(state: LabState) -> None:
    """A route on every node for the Service range, out of its underlay link. A node's
    own connection to a ClusterIP (a hostNetwork pod's, the kubelet's) is routed before
    kube-proxy's DNAT in OUTPUT re-routes it to a pod; lab nodes have no default route,
    so without one it failed with "network unreachable". On-link, not via the host: a
    ClusterIP without endpoints stays on the lab's switch."""
    for node in state.nodes:
        service_range = control_plane.SERVICE_CIDR
        topology.ip("route", "add", service_range, "dev", node.underlay_iface, ns=node.namespace)


def route_host_to_pods(state: LabState) -> None:
    """Routes on the host to each node's podCIDR through that node, as a control-plane
    node in the overlay has: kube-apiserver, on the host, connects to pod addresses for
    ``pods/proxy`` and ``services/proxy``. Kept in ``host_routes``: ``down`` removes them.
    Opt-in: labs side by side share the default pod network, and the host one route each."""
    for name, cidr in control_plane.pod_cidrs(state).items():
        node = next((n for n in state.nodes if n.name == name and n.segment == 1), None)
        if node is None or cidr is None:
            continue  # a node behind the router is not on the host's link
        state.host_routes.append({"dst": cidr, "via": str(node.ip)})
        topology.ip("route", "add", cidr, "via", str(node.ip), "dev", state.host_link)


def start_cluster_dns(state: LabState, image_ref: str, timeout: float = READY_TIMEOUT) -> None:
    """CoreDNS's objects applied, then wait until its pod is Ready (it has read the
    Services and Endpoints through the API server)."""
    control_plane.kubectl(
        state,
        "apply",
        "-f",
        "-",
        stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": dns.manifests(image_ref)}),
    )
    selector = ",".join(f"{k}={v}" for k, v in dns.LABELS.items())

    def check() -> str | None:
        pods = _pods(state, dns.NAMESPACE, selector)
        return None if any(pod_ready(p) for p in pods) else "no Ready CoreDNS pod"

    _poll("CoreDNS did not start", check, timeout, _kubelet_logs(state))


def wait_workload(state: LabState, replicas: int, timeout: float = READY_TIMEOUT) -> None:
    def check() -> str | None:
        pods = _pods(state, "default", f"app={WORKLOAD}")
        running = [
            p
            for p in pods
            if p.get("status", {}).get("phase") == "Running" and p["status"].get("podIP")
        ]
        if len(running) >= replicas:
            return None
        return f"{len(running)} of {replicas} test pods Running"

    _poll("the test Deployment was not running", check, timeout, _kubelet_logs(state))


# -- stop -----------------------------------------------------------------------------------


def stop(state: LabState | None, name: str) -> None:
    """Stop every kubelet, then every containerd, then whatever still runs in the nodes'
    cgroups (pod processes, shims); remove the cgroups. Works from the cgroup names alone
    when there is no state."""
    rec = state.extra.get(STATE_KEY, {}) if state else {}
    started = rec.get("processes", {})
    for prefix in (kubeflannel.PROCESS_PREFIX, proxy.PROCESS_PREFIX, "kubelet/", "containerd/"):
        refs = [procs.ref_of(*v) for k, v in started.items() if k.startswith(prefix)]
        procs.stop([r for r in refs if r])
    if state is None:  # no record: first whatever runs in the nodes' network namespaces
        pids = [
            p for ns in topology.lab_namespaces(name) for p in procs.pids_in_netns(netns_path(ns))
        ]
        procs.stop([r for r in map(procs.current_ref, pids) if r])
    parents = {
        f"/{d}" for h in _hierarchies() for d in os.listdir(h) if d.startswith(f"fpl-{name}-")
    }
    for parent in parents:
        _kill_cgroup(parent)
    bases = [node_base(n) for n in state.nodes] if state else []
    procs.stop([r for r in map(procs.current_ref, _pids_naming(bases)) if r], grace=2.0)
    for parent in parents:
        _remove_cgroups(parent)
    # The host paths made as mount points stay (empty): removing one would detach the bind
    # mounts another kubelet lab's nodes hold on it.


def stop_node(state: LabState, node: NodeInfo) -> None:
    """Take one node's machine away: its kubelet, containerd and every pod on it (the
    agent's too); its network namespace stays. Its Node object is left to the caller."""
    started = record(state).get("processes", {})
    procs.stop([r for r in [kube_netpol.ref(state, node)] if r])  # the flanneld pod's sidecar
    for key in (
        kubeflannel.PROCESS_PREFIX + node.name,
        proxy.PROCESS_PREFIX + node.name,
        f"kubelet/{node.name}",
        f"containerd/{node.name}",
    ):
        ref = procs.ref_of(*started[key]) if key in started else None
        if ref:
            procs.stop([ref])
    parent = cgroup_parent(state, node)
    _kill_cgroup(parent)
    procs.stop([r for r in map(procs.current_ref, _pids_naming([node_base(node)])) if r], grace=2.0)
    _remove_cgroups(parent)


def _pids_naming(bases: list[str]) -> list[int]:
    """Processes whose command line names one of ``bases`` (containerd's shims do)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if any((b + os.sep).encode() in cmdline for b in bases):
            found.append(int(entry))
    return found


def _cgroup_pids(parent: str) -> set[int]:
    found: set[int] = set()
    for hierarchy in _hierarchies():
        for dirpath, _, files in os.walk(os.path.join(hierarchy, parent.lstrip("/"))):
            if "cgroup.procs" in files:
                with contextlib.suppress(OSError), open(os.path.join(dirpath, "cgroup.procs")) as f:
                    found.update(int(line) for line in f if line.strip())
    return found


def _kill_cgroup(parent: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (pids := _cgroup_pids(parent)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def _remove_cgroups(parent: str, timeout: float = 10.0) -> None:
    """Remove ``parent`` and every cgroup below it, bottom up (a cgroup stays busy for a
    moment after its last process is killed)."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for hierarchy in _hierarchies():
            top = os.path.join(hierarchy, parent.lstrip("/"))
            if not os.path.isdir(top):
                continue
            for dirpath, _, _ in sorted(os.walk(top), key=lambda w: -w[0].count(os.sep)):
                try:
                    os.rmdir(dirpath)
                except OSError:
                    left.append(dirpath)
        if not left:
            return
        if time.monotonic() > deadline:
            raise LabError(
                f"cannot remove the cgroups {', '.join(left[:3])}: processes "
                "still run in them; kill them and run down again"
            )
        time.sleep(0.2)


# -- inspection -----------------------------------------------------------------------------


def component_rss(state: LabState) -> dict[str, int]:
    """RSS in KiB of every process of the cluster: the control plane's, each kubelet and
    containerd, each agent pod's (found in its node's cgroups)."""
    started = dict(control_plane.record(state).get("processes", {}))
    started.update(record(state).get("processes", {}))
    out = {name: rss_kib(pid) for name, (pid, _) in started.items()}
    for node in state.nodes:
        for pid in _cgroup_pids(cgroup_parent(state, node)):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if b"flannelpy\0agent" in f.read():
                        out[f"agent/{node.name}"] = rss_kib(pid)
            except OSError:
                continue
    return out


def rss_kib(pid: int) -> int:
    """VmRSS of ``pid`` in KiB (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0
