"""The cluster on top of a kubelet lab's nodes: its network, routes and DNS, and the
waits for Nodes, agent pods and test pods.

The network is the manifests' DaemonSet (``apply_with_daemonset``) or Flannel's
flanneld (``start_flannel``); everything here talks to the API server or the nodes'
routes, after ``flannelpy_lab.kubelet`` has started each node's containerd and kubelet.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

from flannelpy_lab import dns, kubeflannel, plan, procs, topology
from flannelpy_lab import kube as control_plane
from flannelpy_lab.errors import LabError
from flannelpy_lab.kubelet_config import kustomization
from flannelpy_lab.kubelet_state import (
    READY_TIMEOUT,
    REFERENCE_DIR,
    WORKLOAD,
    Save,
    host_source,
    node_base,
    record,
    runs_daemonset,
)
from flannelpy_lab.state import LabState


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
