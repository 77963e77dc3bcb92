"""What ``lab status`` reads from Kubernetes on a kubelet lab (``lab up --kubelet``).

There the agents are the DaemonSet's pods, not processes the lab started, and the pods
are Kubernetes pods, not namespaces the lab made: each node's agent is its DaemonSet pod
(Running and Ready, or not), the pods are the test Deployment's, and the pod matrix is
pinged through ``kubectl exec`` (the kubelet's streaming) as a user would. Each node's
files (subnet.env, the agent's status.json) are under its host paths.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import quote

from flannelpy_lab import kube, kubelet
from flannelpy_lab.errors import LabError
from flannelpy_lab.state import LabState, NodeInfo

AGENT_SELECTOR = "app.kubernetes.io/component=agent"
EXEC_WORKERS = 6


def subnet_env_path(state: LabState, node: NodeInfo) -> str:
    """The subnet.env of ``node``'s agent (the DaemonSet's /run/flannel on a kubelet lab)."""
    if kubelet.enabled(state):
        return os.path.join(kubelet.host_source(node, "/run/flannel"), "subnet.env")
    return node.subnet_env


def run_dir(state: LabState, node: NodeInfo) -> str:
    """The run directory of ``node``'s agent (its status.json)."""
    if kubelet.enabled(state):
        return kubelet.host_source(node, "/run/flannelpy")
    return node.run_dir


def _pods(state: LabState, namespace: str, selector: str) -> list[dict[str, Any]]:
    path = f"/api/v1/namespaces/{namespace}/pods?labelSelector={quote(selector)}"
    items: list[dict[str, Any]] = kube.api_json(state, path).get("items") or []
    return [p for p in items if not (p.get("metadata") or {}).get("deletionTimestamp")]


def agent_pods(state: LabState) -> tuple[dict[str, dict[str, Any]], str | None]:
    """Each node's agent pod ({"name", "phase", "ready"}) and the error reading them."""
    try:
        pods = _pods(state, kube.NAMESPACE, AGENT_SELECTOR)
    except LabError as e:
        return {}, str(e)
    out = {}
    for pod in pods:
        node = (pod.get("spec") or {}).get("nodeName")
        if node:
            out[node] = {
                "name": pod["metadata"]["name"],
                "phase": (pod.get("status") or {}).get("phase"),
                "ready": kubelet.pod_ready(pod),
            }
    return out, None


def workload_pods(state: LabState) -> list[dict[str, Any]]:
    """The test Deployment's Running pods: {"name", "node", "address"}; none when the
    API server does not answer (its error is reported with the leases)."""
    try:
        pods = _pods(state, "default", f"app={kubelet.WORKLOAD}")
    except LabError:
        return []
    return [
        {
            "name": p["metadata"]["name"],
            "node": p["spec"].get("nodeName"),
            "address": p["status"].get("podIP"),
        }
        for p in pods
        if (p.get("status") or {}).get("phase") == "Running" and p["status"].get("podIP")
    ]


def pod_matrix(state: LabState, pods: list[dict[str, Any]]) -> dict[str, dict[str, bool]]:
    """Every ordered pair of ``pods`` pinged through ``kubectl exec``, in parallel."""
    pairs = [(a, b) for a in pods for b in pods if a["name"] != b["name"]]

    def probe(pair: tuple[dict[str, Any], dict[str, Any]]) -> bool:
        a, b = pair
        argv = ("exec", a["name"], "--", "ping", "-c", "1", "-W", "1", b["address"])
        for _ in range(2):
            try:
                if kube.kubectl(state, *argv, check=False, timeout=15).returncode == 0:
                    return True
            except LabError:  # kubectl did not finish: not reached this time
                continue
        return False

    out: dict[str, dict[str, bool]] = {p["name"]: {} for p in pods}
    if not pairs:
        return out
    with ThreadPoolExecutor(max_workers=min(EXEC_WORKERS, len(pairs))) as pool:
        results = list(pool.map(probe, pairs))
    for (a, b), ok in zip(pairs, results, strict=True):
        out[a["name"]][b["name"]] = ok
    return out
