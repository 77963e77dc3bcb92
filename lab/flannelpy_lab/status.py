"""``lab status``: leases, per-node backend and overlay address, agents, and ping matrices.

The leases come from etcd, or in Kubernetes mode (``--kube``, ``--kubelet``) from the
Nodes (their podCIDR and Flannel's annotations). The agents are the processes the lab
started, or on a kubelet lab the DaemonSet's pods (``flannelpy_lab.kubestatus``). Node
pairs are judged as ``flannelpy_lab.reach`` says (a ping between probe points, else the
routes); pod pairs by a ping from inside each pod (through ``kubectl exec`` on a kubelet
lab).

Collecting does I/O (etcd, the API server, ping in namespaces); rendering is pure and
works on the JSON document, which is also what ``--json`` prints and what
``Lab.status()`` returns.
"""

from __future__ import annotations

import json
import os
from typing import Any

from flannelpy_lab import (
    agents,
    etcd,
    kube,
    kubelet,
    kubestatus,
    plan,
    pods,
    procs,
    prometheus,
    topology,
)
from flannelpy_lab import reach as reachability
from flannelpy_lab.errors import LabError
from flannelpy_lab.state import LabState, NodeInfo


def ping(node: NodeInfo, source: str | None, target: str | None, attempts: int = 1) -> bool:
    """One-packet ping from ``source`` (an address on ``node``) to ``target``, in its namespace."""
    if not source or not target:
        return False
    for _ in range(attempts):
        argv = ["ping", "-c", "1", "-W", "1", "-I", source, target]
        if topology.run_in(node.namespace, argv, timeout=10).returncode == 0:
            return True
    return False


def overlay_address(node: NodeInfo, path: str | None = None) -> str | None:
    """The node's overlay address: FLANNEL_SUBNET's address from its subnet.env (at
    ``path``, by default where the lab's own agent writes it)."""
    env = agents.read_subnet_env(node, path=path)
    return env.subnet if env else None


def overlay_address6(node: NodeInfo, path: str | None = None) -> str | None:
    """The node's IPv6 overlay address (dual stack): FLANNEL_IPV6_SUBNET's address."""
    env = agents.read_subnet_env(node, path=path)
    return env.ipv6_subnet if env else None


def matrix(
    nodes: list[NodeInfo], overlay: dict[str, str | None], attempts: int = 2
) -> dict[str, dict[str, bool]]:
    """All ordered pairs, each judged as ``flannelpy_lab.reach`` says: result[a][b] is
    True when a reaches b."""
    return reachability.matrix(nodes, overlay, attempts)[0]


def _leases(state: LabState) -> tuple[list[dict[str, Any]], str | None]:
    """The leases (from the Nodes in Kubernetes mode, else from etcd) and the error that
    kept them from being read; never raises."""
    if kube.STATE_KEY in state.extra:  # the Node objects, flanneld's as well as ours; with
        try:  # the API server down, what our agents report
            return kube.node_leases(state), None
        except LabError as e:
            return leases_from_agents(state), str(e)
    try:
        return etcd.read_leases(state.etcd_endpoints, state.etcd_prefix), None
    except Exception as e:  # pyetcd's errors share no base worth naming; report any
        return [], f"etcd at {', '.join(state.etcd_endpoints)} did not answer: {e}"


def _agent(node: NodeInfo, agent_pods: dict[str, Any] | None) -> dict[str, Any]:
    """The node's agent: its DaemonSet pod on a kubelet lab, else the process the lab
    started."""
    if agent_pods is None:
        return {
            "agent_pid": node.agent_pid,
            "agent_running": procs.alive(agents.agent_ref(node)),
            "agent_pod": None,
        }
    pod = agent_pods.get(node.name)
    return {
        "agent_pid": None,
        "agent_running": bool(pod and pod["ready"]),
        "agent_pod": pod,
    }


def _node_doc(
    state: LabState,
    node: NodeInfo,
    lease: dict[str, Any] | None,
    overlay: str | None,
    agent: dict[str, Any],
    node_pods: list[dict[str, Any]],
) -> dict[str, Any]:
    return {
        "name": node.name,
        "namespace": node.namespace,
        "underlay_iface": node.underlay_iface,
        "underlay_address": node.underlay_address,
        "lease": lease["subnet"] if lease else None,
        "backend": lease["backend"] if lease else None,
        "overlay_address": overlay,
        "segment": node.segment,
        "agent_kind": node.agent_kind,  # "flannelpy" (ours) or "flanneld" (upstream)
        **agent,
        # What a container runtime on this node would use: point any CNI tool here.
        "conflist": node.conflist,
        "cni_path": state.cni_path,
        "cni_socket": node.cni_socket,
        "pods": node_pods,
    }


def _pods_of(state: LabState) -> list[dict[str, Any]]:
    """The lab's pods ({"name", "node", "namespace", "address", "container_id"}): the test
    Deployment's on a kubelet lab, else those the lab made through the CNI executable."""
    if kubelet.enabled(state):
        return [
            {**p, "namespace": "default", "container_id": None}
            for p in kubestatus.workload_pods(state)
        ]
    return [
        {
            "name": p.name,
            "node": p.node,
            "namespace": p.namespace,
            "address": p.address,
            "container_id": p.container_id,
        }
        for p in state.pods
    ]


def collect(state: LabState) -> dict[str, Any]:
    """The status document (see module doc); never raises for an unreachable store."""
    leases, store_error = _leases(state)
    agent_pods, agent_error = None, None
    if kubelet.runs_daemonset(state):  # else the agents are processes (flanneld's)
        agent_pods, agent_error = kubestatus.agent_pods(state)
    env_paths = {n.name: kubestatus.subnet_env_path(state, n) for n in state.nodes}
    overlay = {n.name: overlay_address(n, env_paths[n.name]) for n in state.nodes}
    overlay6 = {n.name: overlay_address6(n, env_paths[n.name]) for n in state.nodes}
    lab_pods = _pods_of(state)
    nodes = [
        _node_doc(
            state,
            node,
            lease_of(node, leases),
            overlay[node.name] or overlay6[node.name],
            _agent(node, agent_pods),
            [
                {k: v for k, v in p.items() if k != "node"}
                for p in lab_pods
                if p["node"] == node.name
            ],
        )
        for node in state.nodes
    ]
    matrices = _matrices(state, overlay, overlay6, lab_pods)
    return {
        "name": state.name,
        "backend": state.backend,
        "direct_routing": state.direct_routing,
        "network": plan.pod_networks(state),
        "store": "kubernetes" if kube.STATE_KEY in state.extra else "etcd",
        "kube_api_url": kube.api_url(state) if kube.STATE_KEY in state.extra else None,
        "etcd_endpoint": state.etcd_endpoint,
        "etcd_endpoints": state.etcd_endpoints,
        "etcd_error": store_error,
        "agent_error": agent_error,
        "etcd_members": etcd.cluster_status(state),  # empty: one etcd on the host
        "nodes": nodes,
        **matrices,
        "cni_exec": _cni_exec(state),
        "leases": leases,
        "prometheus": prometheus_status(state),
        "ok": all(
            all_reach(matrices[k] or {})
            for k in ("matrix", "pod_matrix", "matrix_ipv6", "pod_matrix_ipv6")
        ),
    }


# What makes a kubelet lab's pods: the DaemonSet's CNI executable, or Flannel's plugin.
KUBELET_CNI = ("DaemonSet", "flannel")


def _cni_exec(state: LabState) -> str | None:
    if kubelet.enabled(state):
        return KUBELET_CNI[0] if kubelet.runs_daemonset(state) else KUBELET_CNI[1]
    cni_exec: str | None = state.extra.get("cni_exec")
    return cni_exec


def _matrices(
    state: LabState,
    overlay: dict[str, str | None],
    overlay6: dict[str, str | None],
    lab_pods: list[dict[str, Any]],
) -> dict[str, Any]:
    """One node-pair and one pod-pair matrix per family the lab runs: IPv4 unless it is
    IPv6-only, IPv6 (over the IPv6 underlay) in dual stack and IPv6-only; with how each
    node pair was judged and each node's probe point (``flannelpy_lab.reach``)."""
    out: dict[str, Any] = {
        "matrix": None,
        "matrix_ipv6": None,
        "pod_matrix": None,
        "pod_matrix_ipv6": None,
        "matrix_judged_by": None,
        "matrix_ipv6_judged_by": None,
        "probe_points": None,
        "probe_points_ipv6": None,
    }
    if not plan.ipv6_only(state):
        out["matrix"], out["matrix_judged_by"], out["probe_points"] = reachability.matrix(
            state.nodes, overlay
        )
        if kubelet.enabled(state):
            out["pod_matrix"] = kubestatus.pod_matrix(state, lab_pods)
        else:
            out["pod_matrix"] = pods.pod_matrix(state.pods)
    if plan.ipv6_enabled(state):
        out["matrix_ipv6"], out["matrix_ipv6_judged_by"], out["probe_points_ipv6"] = (
            reachability.matrix(state.nodes, overlay6)
        )
        out["pod_matrix_ipv6"] = pods.pod_matrix(state.pods, family=6)
    return out


def prometheus_status(state: LabState) -> dict[str, Any] | None:
    """The lab's Prometheus (``up --prometheus``): its address and whether it runs."""
    address = prometheus.url(state)
    if address is None:
        return None
    return {"url": address, "running": procs.alive(prometheus.ref(state))}


def leases_from_agents(state: LabState) -> list[dict[str, Any]]:
    """Each agent's own lease as it reports it in <run dir>/status.json."""
    leases = []
    for node in state.nodes:
        try:
            path = os.path.join(kubestatus.run_dir(state, node), "status.json")
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, ValueError):
            continue
        if doc.get("lease"):
            leases.append(
                {
                    "key": doc["lease"],
                    "subnet": doc["lease"],
                    "public_ip": doc.get("public_ip"),
                    "backend": doc.get("backend"),
                    "node_name": doc.get("node"),
                    "error": None,
                }
            )
    return leases


def lease_of(node: NodeInfo, leases: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The node's lease: by public IP (Flannel's identity of a node), else by node name."""
    for lease in leases:
        if lease["public_ip"] == str(node.ip):
            return lease
    for lease in leases:
        if lease["node_name"] == node.name:
            return lease
    return None


def all_reach(reach: dict[str, dict[str, bool]]) -> bool:
    return all(ok for row in reach.values() for ok in row.values())


def _table(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def render_text(doc: dict[str, Any]) -> str:
    """Human-readable status: nodes, leases, the reachability matrix and a verdict."""
    mode = doc["backend"] + (" (DirectRouting)" if doc.get("direct_routing") else "")
    network = doc.get("network")
    if doc.get("store") == "kubernetes":
        store = f"Kubernetes API {doc.get('kube_api_url')}"
    else:
        store = "etcd " + ",".join(doc.get("etcd_endpoints") or [doc.get("etcd_endpoint") or "?"])
    lines = [f"lab {doc['name']}: {mode}, network {network}, {store}"]
    lines += [f"warning: {doc[k]}" for k in ("etcd_error", "agent_error") if doc.get(k)]
    prom = doc.get("prometheus")
    if prom:
        lines.append(
            f"prometheus {prom['url']} ({'running' if prom['running'] else 'down'}); "
            f"alerts: {prom['url']}/api/v1/alerts"
        )
    rows = [
        ["NODE", "NAMESPACE", "SEG", "UNDERLAY", "LEASE", "BACKEND", "OVERLAY", "RUNS", "AGENT"]
    ]
    for n in doc["nodes"]:
        rows.append(
            [
                n["name"],
                n["namespace"],
                str(n["segment"]),
                f"{n['underlay_iface']} {n['underlay_address']}",
                n["lease"] or "-",
                n["backend"] or "-",
                n["overlay_address"] or "-",
                n.get("agent_kind", "flannelpy"),
                _agent_text(n),
            ]
        )
    lines += ["", *_table(rows)]
    lines += render_members(doc.get("etcd_members") or [])
    rows = [["SUBNET", "PUBLIC IP", "BACKEND", "NODE NAME"]]
    for lease in doc["leases"]:
        rows.append(
            [
                lease["subnet"] or lease["key"],
                lease["public_ip"] or "-",
                lease["backend"] or "-",
                lease["node_name"] or "-",
            ]
        )
    where = "on the Nodes" if doc.get("store") == "kubernetes" else "in etcd"
    lines += ["", f"leases {where}: {len(doc['leases'])}", *_table(rows)]
    node_matrices = _per_family(doc, "matrix")
    for i, (family, reach) in enumerate(node_matrices):
        title = (
            "reachability over the overlay"
            if family == "IPv4"
            else "IPv6 (over the IPv6 underlay)"
            if i
            else "reachability over the overlay in IPv6 (over the IPv6 underlay)"
        )
        suffix = "_ipv6" if family == "IPv6" else ""
        how = doc.get(f"matrix{suffix}_judged_by")
        lines += ["", f"{title} (from row to column):", f"  {_JUDGED}"]
        lines += render_matrix(reach, how)
        points = doc.get(f"probe_points{suffix}") or {}
        lines += [f"  {name}: {point}" for name, point in points.items()]
    lines += ["", _verdict("node", node_matrices)]
    pod_matrices = _per_family(doc, "pod_matrix")
    if any(reach for _, reach in pod_matrices):
        rows = [["POD", "NODE", "ADDRESS", "NAMESPACE"]]
        for n in doc["nodes"]:
            for p in n.get("pods", []):
                rows.append([p["name"], n["name"], p["address"] or "-", p["namespace"]])
        made = (
            "the test Deployment's, pinged through kubectl exec"
            if doc.get("cni_exec") in KUBELET_CNI
            else f"{doc.get('cni_exec') or '?'} CNI executable"
        )
        lines += ["", f"pods ({made}):", *_table(rows)]
        for i, (family, reach) in enumerate(pod_matrices):
            title = (
                "pod-to-pod reachability"
                if family == "IPv4"
                else "pod-to-pod in IPv6"
                if i
                else "pod-to-pod reachability in IPv6"
            )
            lines += ["", f"{title} (ping from row to column):", *render_matrix(reach)]
        lines += ["", _verdict("pod", pod_matrices)]
    return "\n".join(lines)


def _per_family(doc: dict[str, Any], key: str) -> list[tuple[str, dict[str, dict[str, bool]]]]:
    """The document's matrices of one kind, IPv4 first, for the families the lab runs."""
    found = [("IPv4", doc.get(key)), ("IPv6", doc.get(f"{key}_ipv6"))]
    return [(family, reach) for family, reach in found if reach is not None]


def _verdict(kind: str, matrices: list[tuple[str, dict[str, dict[str, bool]]]]) -> str:
    """One line over every family: all pairs reach, or how many do not (and in which)."""
    pairs = len([ok for row in (matrices[0][1] if matrices else {}).values() for ok in row])
    failing = {
        family: sum(not ok for row in reach.values() for ok in row.values())
        for family, reach in matrices
    }
    both = (
        " in both families"
        if len(matrices) > 1
        else (f" in {matrices[0][0]}" if matrices and matrices[0][0] == "IPv6" else "")
    )
    if not any(failing.values()):
        return f"all {pairs} {kind} pairs reach each other{both}"
    if len(matrices) == 1:
        return f"{failing[matrices[0][0]]} of {pairs} {kind} pairs do not reach{both}"
    parts = [f"{n} of {pairs} in {family}" for family, n in failing.items() if n]
    return f"{kind} pairs that do not reach: {', '.join(parts)}"


def render_members(members: list[dict[str, Any]]) -> list[str]:
    """The etcd members table (nothing for a one-member lab), leader marked."""
    if not members:
        return []
    rows = [["ETCD MEMBER", "CLIENT URL", "ID", "ROLE", "TERM", "PROCESS"]]
    for m in members:
        if not m["running"]:
            role = "-"
        elif m["error"]:
            role = f"unreachable ({m['error'][:40]})"
        else:
            role = "leader" if m["leader"] else "follower"
        rows.append(
            [
                m["name"],
                m["client_url"],
                m["id"] or "-",
                role,
                str(m["raft_term"]) if m["raft_term"] is not None else "-",
                f"pid {m['pid']}" if m["running"] else "down",
            ]
        )
    leaders = sum(1 for m in members if m["leader"])
    verdict = "leader elected" if leaders == 1 else "no leader"
    return ["", f"etcd members: {len(members)}, {verdict}", *_table(rows)]


_JUDGED = (
    "ok: a ping between the probe points below answered; rt: an end has no probe point "
    "and the route is in place; --: not reached"
)


def render_matrix(
    reach: dict[str, dict[str, bool]], how: dict[str, dict[str, str]] | None = None
) -> list[str]:
    """The matrix, one row per source; a pair judged by its routes shows ``rt``."""
    names = list(reach)
    rows = [["", *names]]

    def cell(a: str, b: str) -> str:
        if a == b:
            return "."
        if not reach[a].get(b):
            return "--"
        return "rt" if (how or {}).get(a, {}).get(b) == "route" else "ok"

    for a in names:
        rows.append([a, *(cell(a, b) for b in names)])
    return _table(rows)


def _agent_text(node: dict[str, Any]) -> str:
    """The AGENT column: the DaemonSet's pod on a kubelet lab, else the process."""
    pod = node.get("agent_pod")
    if pod:
        return f"pod {pod['name']}" + ("" if pod["ready"] else f" ({pod['phase']}, not ready)")
    return f"pid {node['agent_pid']}" if node.get("agent_running") else "down"
