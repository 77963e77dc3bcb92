"""``lab status``: leases, per-node backend and overlay address, and a ping matrix.

Collecting does I/O (etcd, ping in namespaces); rendering is pure and works
on the JSON document, which is also what ``--json`` prints and what
``Lab.status()`` returns.
"""

from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from flannelpy_lab import agents, etcd, kube, plan, pods, procs, prometheus, topology
from flannelpy_lab.errors import LabError
from flannelpy_lab.state import LabState, NodeInfo

PING_WORKERS = 32


def ping(node: NodeInfo, source: str | None, target: str | None, attempts: int = 1) -> bool:
    """One-packet ping from ``source`` (an address on ``node``) to ``target``, in its namespace."""
    if not source or not target:
        return False
    for _ in range(attempts):
        argv = ["ping", "-c", "1", "-W", "1", "-I", source, target]
        if topology.run_in(node.namespace, argv, timeout=10).returncode == 0:
            return True
    return False


def overlay_address(node: NodeInfo) -> str | None:
    """The node's overlay address: FLANNEL_SUBNET's address from its subnet.env."""
    env = agents.read_subnet_env(node)
    return env.subnet if env else None


def overlay_address6(node: NodeInfo) -> str | None:
    """The node's IPv6 overlay address (dual stack): FLANNEL_IPV6_SUBNET's address."""
    env = agents.read_subnet_env(node)
    return env.ipv6_subnet if env else None


def matrix(
    nodes: list[NodeInfo], overlay: dict[str, str | None], attempts: int = 2
) -> dict[str, dict[str, bool]]:
    """All ordered pairs pinged in parallel: result[a][b] is True when a reaches b."""
    pairs = [(a, b) for a in nodes for b in nodes if a.name != b.name]

    def probe(pair: tuple[NodeInfo, NodeInfo]) -> bool:
        a, b = pair
        src, dst = overlay[a.name], overlay[b.name]
        return ping(
            a, src.split("/")[0] if src else None, dst.split("/")[0] if dst else None, attempts
        )

    with ThreadPoolExecutor(max_workers=max(1, min(PING_WORKERS, len(pairs)))) as pool:
        results = list(pool.map(probe, pairs))
    out: dict[str, dict[str, bool]] = {n.name: {} for n in nodes}
    for (a, b), ok in zip(pairs, results, strict=True):
        out[a.name][b.name] = ok
    return out


def collect(state: LabState) -> dict[str, Any]:
    """The status document (see module doc); never raises for an unreachable etcd."""
    etcd_error = None
    if state.extra.get("kube_api_url"):  # Kubernetes mode: the Node objects, flanneld's
        try:  # as well as ours; with the API server down, what our agents report
            leases = kube.node_leases(state)
        except LabError as e:
            leases, etcd_error = leases_from_agents(state), str(e)
    else:
        try:
            leases = etcd.read_leases(state.etcd_endpoints, state.etcd_prefix)
        except Exception as e:  # pyetcd's errors share no base worth naming; report any
            where = ", ".join(state.etcd_endpoints)
            leases, etcd_error = [], f"etcd at {where} did not answer: {e}"
    overlay = {n.name: overlay_address(n) for n in state.nodes}
    nodes = []
    for node in state.nodes:
        lease = lease_of(node, leases)
        nodes.append(
            {
                "name": node.name,
                "namespace": node.namespace,
                "underlay_iface": node.underlay_iface,
                "underlay_address": node.underlay_address,
                "lease": lease["subnet"] if lease else None,
                "backend": lease["backend"] if lease else None,
                "overlay_address": overlay[node.name] or overlay_address6(node),
                "segment": node.segment,
                "agent_kind": node.agent_kind,  # "flannelpy" (ours) or "flanneld" (upstream)
                "agent_pid": node.agent_pid,
                "agent_running": procs.alive(agents.agent_ref(node)),
                # What a container runtime on this node would use: point any CNI tool here.
                "conflist": node.conflist,
                "cni_path": state.cni_path,
                "cni_socket": node.cni_socket,
                "pods": [
                    {
                        "name": p.name,
                        "namespace": p.namespace,
                        "address": p.address,
                        "container_id": p.container_id,
                    }
                    for p in state.pods
                    if p.node == node.name
                ],
            }
        )
    # One node-pair and one pod-pair matrix per family the lab runs: IPv4 unless it is
    # IPv6-only, IPv6 (over the IPv6 underlay) in dual stack and IPv6-only.
    reach = pod_reach = reach6 = pod_reach6 = None
    if not plan.ipv6_only(state):
        reach = matrix(state.nodes, overlay)
        pod_reach = pods.pod_matrix(state.pods)
    if plan.ipv6_enabled(state):
        reach6 = matrix(state.nodes, {n.name: overlay_address6(n) for n in state.nodes})
        pod_reach6 = pods.pod_matrix(state.pods, family=6)
    return {
        "name": state.name,
        "backend": state.backend,
        "direct_routing": state.direct_routing,
        "network": plan.pod_networks(state),
        "etcd_endpoint": state.etcd_endpoint,
        "etcd_endpoints": state.etcd_endpoints,
        "etcd_error": etcd_error,
        "etcd_members": etcd.cluster_status(state),  # empty: one etcd on the host
        "nodes": nodes,
        "matrix": reach,
        "matrix_ipv6": reach6,
        "pod_matrix": pod_reach,
        "pod_matrix_ipv6": pod_reach6,
        "cni_exec": state.extra.get("cni_exec"),
        "leases": leases,
        "prometheus": prometheus_status(state),
        "ok": all(all_reach(r or {}) for r in (reach, pod_reach, reach6, pod_reach6)),
    }


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
            with open(os.path.join(node.run_dir, "status.json"), encoding="utf-8") as f:
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
    endpoint = ",".join(doc.get("etcd_endpoints") or [doc.get("etcd_endpoint") or "?"])
    lines = [f"lab {doc['name']}: {mode}, network {network}, etcd {endpoint}"]
    if doc.get("etcd_error"):
        lines.append(f"warning: {doc['etcd_error']}")
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
                (f"pid {n['agent_pid']}" if n.get("agent_running") else "down"),
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
    lines += ["", f"leases in etcd: {len(doc['leases'])}", *_table(rows)]
    node_matrices = _per_family(doc, "matrix")
    for i, (family, reach) in enumerate(node_matrices):
        title = (
            "reachability over the overlay"
            if family == "IPv4"
            else "IPv6 (over the IPv6 underlay)"
            if i
            else "reachability over the overlay in IPv6 (over the IPv6 underlay)"
        )
        lines += ["", f"{title} (ping from row to column):", *render_matrix(reach)]
    lines += ["", _verdict("node", node_matrices)]
    pod_matrices = _per_family(doc, "pod_matrix")
    if any(reach for _, reach in pod_matrices):
        rows = [["POD", "NODE", "ADDRESS", "NAMESPACE"]]
        for n in doc["nodes"]:
            for p in n.get("pods", []):
                rows.append([p["name"], n["name"], p["address"] or "-", p["namespace"]])
        lines += ["", f"pods ({doc.get('cni_exec') or '?'} CNI executable):", *_table(rows)]
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


def render_matrix(reach: dict[str, dict[str, bool]]) -> list[str]:
    names = list(reach)
    rows = [["", *names]]
    for a in names:
        rows.append([a, *("." if a == b else ("ok" if reach[a].get(b) else "--") for b in names)])
    return _table(rows)
