"""kube-proxy on the kubelet lab's nodes (``lab up --kubelet [--proxy-mode nftables]``).

One real kube-proxy per node, built with the rest of the control plane by
``scripts/build-kube.sh``, runs as a process in the node's network namespace and mount
namespace, as the kubelet does (no image: a DaemonSet of it would only add an image to
build). It authenticates as ``system:kube-proxy`` with a client certificate of the lab's
CA, which the API server's default ``system:node-proxier`` binding authorizes, and reads
its ``KubeProxyConfiguration`` from the node's directory:

- ``mode``: ``iptables`` (the default, as in most clusters) or ``nftables``;
- ``clusterCIDR``: the lab's pod network, so traffic from outside it to a Service is
  masqueraded and pod traffic keeps its source;
- ``conntrack.maxPerCore: 0`` and ``min: 0``: ``nf_conntrack_max`` is not per network
  namespace (a namespace cannot write it); the per-namespace TCP timeouts are set as usual;
- ``healthzBindAddress``: the node's underlay address, so the lab polls it from the host;
- ``oomScoreAdj: 0``: root here may not lower a score (as for the kubelet).

The lab waits until every kube-proxy answers its ``/healthz`` (its rules are synced).
``down`` stops them with the kubelets (``flannelpy_lab.kubelet.stop``).
"""

from __future__ import annotations

import functools
import json
import os
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from flannelpy_lab import kube as control_plane
from flannelpy_lab import procs
from flannelpy_lab.errors import LabError
from flannelpy_lab.state import LabState, NodeInfo

MODES = ("iptables", "nftables")
DEFAULT_MODE = "iptables"
HEALTHZ_PORT = 10256
READY_TIMEOUT = 60.0  # seconds for each kube-proxy to answer /healthz
PROCESS_PREFIX = "kube-proxy/"  # its key in the kubelet record's processes: kube-proxy/<node>


def validate_mode(mode: str, kubelets: bool) -> None:
    """One sentence for a mode the lab cannot run."""
    if mode not in MODES:
        raise LabError(f"kube-proxy mode {mode!r} is not one of {', '.join(MODES)}; pick one")
    if mode != DEFAULT_MODE and not kubelets:
        raise LabError("--proxy-mode needs --kubelet: only the kubelet lab runs kube-proxy")


def proxy_config(
    mode: str, node_name: str, node_ip: str, kubeconfig: str, cluster_cidr: str
) -> dict[str, Any]:
    """The node's KubeProxyConfiguration (see the module doc)."""
    return {
        "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
        "kind": "KubeProxyConfiguration",
        "clientConnection": {"kubeconfig": kubeconfig},
        "mode": mode,
        "hostnameOverride": node_name,
        "clusterCIDR": cluster_cidr,
        "detectLocalMode": "ClusterCIDR",
        "healthzBindAddress": f"{node_ip}:{HEALTHZ_PORT}",
        "metricsBindAddress": "127.0.0.1:10249",
        "conntrack": {"maxPerCore": 0, "min": 0},
        "oomScoreAdj": 0,  # root here lacks CAP_SYS_RESOURCE to lower it (as the kubelet's)
    }


def healthz_url(node: NodeInfo) -> str:
    return f"http://{node.ip}:{HEALTHZ_PORT}/healthz"


def healthy(node: NodeInfo) -> bool:
    """Does the node's kube-proxy answer /healthz with 200 (its rules synced)?"""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(healthz_url(node), timeout=2.0) as resp:
            return int(resp.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def argv(binary: str, config: str, namespace_pid: int) -> list[str]:
    """kube-proxy in the network and mount namespaces of the process ``namespace_pid``
    (the node's containerd), as the kubelet runs."""
    return [
        "nsenter",
        f"--target={namespace_pid}",
        "--mount",
        "--net",
        binary,
        "--config",
        config,
        "--v",
        "1",
    ]


def start(
    state: LabState,
    processes: dict[str, list[int]],
    base_of: Callable[[NodeInfo], str],
    save: Callable[[], None],
) -> None:
    """A kube-proxy on every node, recorded in ``processes`` (``kube-proxy/<node>``, saved
    after each start so that ``down`` stops what a partial start left); returns once
    every one answers /healthz."""
    mode = state.extra.get("kubelet", {}).get("proxy_mode", DEFAULT_MODE)
    cert, key = control_plane.client_cert(state, "kube-proxy", "system:kube-proxy")
    kubeconfig = control_plane._path(state, "kube-proxy.kubeconfig")
    ca = control_plane._path(state, "pki", "ca.crt")
    doc = control_plane.cert_kubeconfig(control_plane.api_url(state), ca, cert, key)
    control_plane.write_file(kubeconfig, json.dumps(doc), 0o600)
    binary = os.path.join(control_plane.record(state)["bin_dir"], "kube-proxy")
    refs, logs = {}, {}
    for node in state.nodes:
        config = os.path.join(base_of(node), "kube-proxy.yaml")
        doc = proxy_config(mode, node.name, str(node.ip), kubeconfig, state.network)
        control_plane.write_file(config, json.dumps(doc, indent=1))
        logs[node.name] = os.path.join(base_of(node), "kube-proxy.log")
        containerd_pid = processes[f"containerd/{node.name}"][0]
        ref = procs.spawn_detached(argv(binary, config, containerd_pid), logs[node.name])
        processes[PROCESS_PREFIX + node.name] = [ref.pid, ref.start_ticks]
        refs[node.name] = ref
        save()
    wait_healthy(state, refs, logs)


def wait_healthy(state: LabState, refs: dict[str, procs.ProcessRef], logs: dict[str, str]) -> None:
    """Until every node's kube-proxy answers /healthz; LabError with its log if one exits
    or stays unhealthy."""
    for node in state.nodes:
        if node.name in refs:
            procs.wait_started(
                f"kube-proxy of {node.name}",
                refs[node.name],
                logs[node.name],
                functools.partial(healthy, node),
                READY_TIMEOUT,
            )
