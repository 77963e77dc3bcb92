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

The module holds the start and stop of the nodes' processes; the record and paths are in
``flannelpy_lab.kubelet_state``, the configuration documents in
``flannelpy_lab.kubelet_config``, the cgroups in ``flannelpy_lab.cgroups`` and the cluster
objects and waits in ``flannelpy_lab.kubelet_cluster``, all re-exported here.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from flannelpy.dataplane.netns import netns_path
from flannelpy_lab import cgroups, dns, images, kube_netpol, kubeflannel, procs, proxy, topology
from flannelpy_lab import kube as control_plane
from flannelpy_lab.cgroups import CGROUP_ROOT
from flannelpy_lab.errors import LabError
from flannelpy_lab.kubelet_cluster import (
    apply_with_daemonset,
    node_ready,
    pod_ready,
    route_host_to_pods,
    route_services,
    start_cluster_dns,
    start_flannel,
    wait_nodes_registered,
    wait_ready,
    wait_workload,
)
from flannelpy_lab.kubelet_config import containerd_config, kubelet_config, kustomization, workload
from flannelpy_lab.kubelet_state import (
    DAEMONSET,
    HOST_PATHS,
    READY_TIMEOUT,
    REFERENCE_DIR,
    REFERENCE_PLUGINS,
    STATE_KEY,
    WORKLOAD,
    Progress,
    Save,
    cgroup_parent,
    containerd_socket,
    enabled,
    host_source,
    network_agent,
    node_base,
    record,
    runs_daemonset,
)
from flannelpy_lab.state import LabState, NodeInfo

__all__ = [
    "CGROUP_ROOT",
    "DAEMONSET",
    "HOST_PATHS",
    "READY_TIMEOUT",
    "REFERENCE_DIR",
    "REFERENCE_PLUGINS",
    "STATE_KEY",
    "WORKLOAD",
    "Progress",
    "Save",
    "apply_with_daemonset",
    "cgroup_parent",
    "component_rss",
    "containerd_config",
    "containerd_socket",
    "enabled",
    "host_source",
    "kubelet_config",
    "kustomization",
    "network_agent",
    "node_base",
    "node_ready",
    "pod_ready",
    "record",
    "route_host_to_pods",
    "route_services",
    "rss_kib",
    "runs_daemonset",
    "start",
    "start_cluster_dns",
    "start_flannel",
    "stop",
    "stop_node",
    "validate_image_archives",
    "wait_nodes_registered",
    "wait_ready",
    "wait_workload",
    "workload",
]


def validate_image_archives(paths: Sequence[str], kubelets: bool) -> None:
    """Before anything is built: one sentence for an archive the lab cannot import."""
    if paths and not kubelets:
        raise LabError("--image-archive needs --kubelet: only the kubelet lab runs containerd")
    for path in paths:
        images.archive_image(path)  # a LabError naming what the file lacks


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
    cgroups.make_cgroups(cgroup_parent(state, node))
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
        f"/{d}"
        for h in cgroups.hierarchies()
        for d in os.listdir(h)
        if d.startswith(f"fpl-{name}-")
    }
    for parent in parents:
        cgroups.kill_cgroup(parent)
    bases = [node_base(n) for n in state.nodes] if state else []
    procs.stop([r for r in map(procs.current_ref, _pids_naming(bases)) if r], grace=2.0)
    for parent in parents:
        cgroups.remove_cgroups(parent)
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
    cgroups.kill_cgroup(parent)
    procs.stop([r for r in map(procs.current_ref, _pids_naming([node_base(node)])) if r], grace=2.0)
    cgroups.remove_cgroups(parent)


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


# -- inspection -----------------------------------------------------------------------------


def component_rss(state: LabState) -> dict[str, int]:
    """RSS in KiB of every process of the cluster: the control plane's, each kubelet and
    containerd, each agent pod's (found in its node's cgroups)."""
    started = dict(control_plane.record(state).get("processes", {}))
    started.update(record(state).get("processes", {}))
    out = {name: rss_kib(pid) for name, (pid, _) in started.items()}
    for node in state.nodes:
        for pid in cgroups.cgroup_pids(cgroup_parent(state, node)):
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
