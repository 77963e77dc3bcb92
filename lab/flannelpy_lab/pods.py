"""Pods in the lab: network namespaces attached through the real CNI executable.

Each node gets a conflist (Flannel's shape: ``cbr0``, our plugin, then the
reference ``portmap``) naming its own agent's socket, since the lab's agents
share one filesystem. The executable is installed once per lab; it is the
static build (no Python needed on the "host") when it can be built here, else
the Python launcher.

On a flanneld node the conflist is Flannel's own (kube-flannel.yml's): the real
flannel CNI plugin, installed beside ours, delegating to the reference ``bridge``
and ``host-local`` plugins (see ``flannelpy_lab.flanneld``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from ipaddress import ip_interface
from typing import Any

import flannelpy
from flannelpy_lab import agents, flanneld, procs, topology
from flannelpy_lab.errors import LabError
from flannelpy_lab.runtime import Attachment, CniRuntime
from flannelpy_lab.state import LabState, NodeInfo, PodInfo

PLUGIN_NAME = "flannelpy"  # the conflist "type", i.e. the file name in CNI_PATH
NETWORK_NAME = "cbr0"  # Flannel's conflist name
PING_WORKERS = 32
CNI_READY_TIMEOUT = 30.0  # seconds for a running agent to start serving ADD


def source_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(flannelpy.__file__)))


def static_build() -> str | None:
    """The static executable, built (idempotently) from this source tree if possible."""
    root = source_root()
    script = os.path.join(root, "scripts", "build-cni.sh")
    binary = os.path.join(root, "build", "flannelpy-cni")
    if os.path.exists(script):
        proc = subprocess.run(["bash", script], capture_output=True, text=True)
        if proc.returncode != 0:
            return None
    return binary if os.access(binary, os.X_OK) else None


def install_executable(state: LabState, form: str = "auto") -> str:
    """Put the CNI executable into the lab's CNI bin dir; returns the form installed."""
    os.makedirs(state.cni_bin_dir, exist_ok=True)
    dest = os.path.join(state.cni_bin_dir, PLUGIN_NAME)
    binary = static_build() if form in ("auto", "static") else None
    if binary is not None:
        _install_file(binary, dest)
        return "static"
    if form == "static":
        raise LabError("the static CNI executable could not be built; run scripts/build-cni.sh")
    from cni_plugin.client import write_launcher

    write_launcher(dest)
    return "python"


def install_flannel_plugin(state: LabState) -> None:
    """Put the flannel CNI plugin into the lab's CNI bin dir, for its flanneld nodes."""
    binary = state.extra.get("flannel_cni_binary") or flanneld.cni_plugin_binary()
    os.makedirs(state.cni_bin_dir, exist_ok=True)
    _install_file(binary, os.path.join(state.cni_bin_dir, flanneld.CNI_PLUGIN_TYPE))


def _install_file(binary: str, dest: str) -> None:
    tmp = dest + ".tmp"
    shutil.copyfile(binary, tmp)
    os.chmod(tmp, 0o755)
    os.replace(tmp, dest)  # a plugin being run meanwhile is never half written


def conflist_doc(node: NodeInfo) -> dict[str, Any]:
    return {
        "cniVersion": "1.0.0",
        "name": NETWORK_NAME,
        "plugins": [
            {
                "type": PLUGIN_NAME,
                "agentSocket": node.cni_socket,
                "hairpinMode": True,
                "isDefaultGateway": True,
            },
            {"type": "portmap", "capabilities": {"portMappings": True}},
        ],
    }


def write_conflist(node: NodeInfo) -> None:
    """The node's conflist; on a flanneld node only once its subnet.env exists."""
    if node.runs_flanneld:
        if agents.read_subnet_env(node) is None:
            return
        doc = flanneld.conflist_doc(node, NETWORK_NAME)
    else:
        doc = conflist_doc(node)
    os.makedirs(os.path.dirname(node.conflist), exist_ok=True)
    tmp = node.conflist + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
    os.replace(tmp, node.conflist)


def prepare_flanneld_node(node: NodeInfo) -> None:
    """Write the node's flannel conflist; fail if flanneld has written no subnet.env yet
    (the plugin's ADD would fail on it)."""
    if agents.read_subnet_env(node) is None:
        raise LabError(
            f"node {node.name} has no subnet.env at {node.subnet_env}: its "
            f"flanneld is not ready; see {node.agent_log}"
        )
    write_conflist(node)


def runtime_for(state: LabState, node: NodeInfo) -> CniRuntime:
    return CniRuntime(node.conflist, state.cni_path, node.cni_cache_dir, node.namespace)


def _attachment(pod: PodInfo, port_mappings: list[dict[str, Any]] | None = None) -> Attachment:
    return Attachment(
        pod.container_id,
        pod.netns_path,
        pod.ifname,
        {"portMappings": port_mappings} if port_mappings else {},
        _kube_args(pod),
    )


def _kube_args(pod: PodInfo) -> str:
    """The CNI_ARGS a kubelet passes (containerd's form), for a pod named as a Kubernetes one."""
    if pod.kube_pod is None:
        return ""
    namespace, _, name = pod.kube_pod.partition("/")
    return (
        f"IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={name};"
        f"K8S_POD_INFRA_CONTAINER_ID={pod.container_id}"
    )


def next_pod_name(state: LabState, node: str) -> str:
    taken = {p.name for p in state.pods}
    i = 1
    while f"{node}-p{i}" in taken:
        i += 1
    return f"{node}-p{i}"


def cni_status(state: LabState, node: NodeInfo) -> subprocess.CompletedProcess[bytes]:
    """CNI STATUS of our plugin on ``node`` (exit 0: it serves ADD)."""
    conf = {
        "cniVersion": "1.1.0",
        "name": NETWORK_NAME,
        "type": PLUGIN_NAME,
        "agentSocket": node.cni_socket,
    }
    env = {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        "CNI_COMMAND": "STATUS",
        "CNI_PATH": state.cni_path,
    }
    binary = os.path.join(state.cni_bin_dir, PLUGIN_NAME)
    return subprocess.run(
        topology.exec_argv(node.namespace, [binary]),
        env=env,
        input=json.dumps(conf).encode(),
        capture_output=True,
        timeout=30,
    )


def wait_cni_ready(state: LabState, node: NodeInfo, timeout: float = CNI_READY_TIMEOUT) -> None:
    """Wait while the node's running agent answers STATUS "not ready", as a CNI 1.1
    runtime does before creating pods (the agent writes subnet.env a moment before it
    serves ADD). A stopped agent is not waited for: ADD then reports it."""
    deadline = time.monotonic() + timeout
    while procs.alive(agents.agent_ref(node)):
        proc = cni_status(state, node)
        if proc.returncode == 0:
            return
        if time.monotonic() > deadline:
            raise LabError(
                f"the agent of node {node.name} does not serve CNI requests after {timeout:g} s "
                f"(STATUS: {proc.stdout.decode(errors='replace').strip()}); see {node.agent_log}"
            )
        time.sleep(0.05)


def add_pod(
    state: LabState,
    node_name: str,
    name: str | None = None,
    port_mappings: list[dict[str, Any]] | None = None,
    kube_pod: str | None = None,
) -> PodInfo:
    """Create a pod namespace and run CNI ADD for it, as a runtime on ``node_name`` would;
    ``kube_pod`` (namespace/name) passes the kubelet's CNI_ARGS naming it."""
    node = state.node(node_name)
    if node.runs_flanneld:
        prepare_flanneld_node(node)
    else:
        wait_cni_ready(state, node)
    name = name or next_pod_name(state, node_name)
    pod = PodInfo(
        name=name,
        node=node_name,
        namespace=f"fpl-{state.name}-{name}",
        container_id=f"{state.name}-{name}",
        kube_pod=kube_pod,
    )
    topology.ip("netns", "add", pod.namespace)
    try:
        topology.ip("link", "set", "lo", "up", ns=pod.namespace)
        result = runtime_for(state, node).add(_attachment(pod, port_mappings))
        pod.address, pod.address6 = result_addresses(result)
    except BaseException:
        topology.ip("netns", "del", pod.namespace, check=False)
        raise
    state.pods.append(pod)
    return pod


def delete_pod(state: LabState, name: str) -> None:
    """CNI DEL (the cached result, in reverse plugin order), then remove the namespace."""
    pod = state.pod(name)
    runtime_for(state, state.node(pod.node)).delete(_attachment(pod))
    topology.ip("netns", "del", pod.namespace, check=False)
    state.pods.remove(pod)


def result_addresses(result: dict[str, Any]) -> tuple[str | None, str | None]:
    """The pod's IPv4 and IPv6 address (CIDR) from an ADD result; None for a family it
    has none of (an IPv4-only or IPv6-only node)."""
    found: dict[int, str] = {}
    for entry in result.get("ips") or []:
        address = entry.get("address") if isinstance(entry, dict) else None
        if isinstance(address, str):
            try:
                found.setdefault(ip_interface(address).version, address)
            except ValueError:
                continue
    return found.get(4), found.get(6)


def ping_pod(src: PodInfo, dst: PodInfo, attempts: int = 2, family: int = 4) -> bool:
    """``src`` reaches ``dst`` in ``family`` (4 or 6); False when ``dst`` has no address
    of that family."""
    target = dst.ip6 if family == 6 else dst.ip
    if target is None:
        return False
    for _ in range(attempts):
        argv = ["ping", f"-{family}", "-c", "1", "-W", "1", str(target)]
        if topology.run_in(src.namespace, argv, timeout=10).returncode == 0:
            return True
    return False


def pod_matrix(pods: list[PodInfo], family: int = 4) -> dict[str, dict[str, bool]]:
    """Every ordered pair of pods, pinged in ``family`` from inside the source pod, in
    parallel."""
    pairs = [(a, b) for a in pods for b in pods if a.name != b.name]
    out: dict[str, dict[str, bool]] = {p.name: {} for p in pods}
    if not pairs:
        return out
    with ThreadPoolExecutor(max_workers=min(PING_WORKERS, len(pairs))) as pool:
        results = list(pool.map(lambda pair: ping_pod(pair[0], pair[1], family=family), pairs))
    for (a, b), ok in zip(pairs, results, strict=True):
        out[a.name][b.name] = ok
    return out
