"""Node-pair reachability for ``lab status``: what is pinged, and what is judged otherwise.

Each node has, per family, a probe point in its own lease: the lease's address on
``cni0`` while the bridge is up (it is once a pod is attached), else the lease's address
on the backend's device while that device is up (the VTEP ``flannel.<VNI>`` or
``flannel-v6.<VNI>``, ``flannel-wg``). A ``cni0`` that does not exist yet (a flanneld node
before its first pod) or is down (our agent's bridge without pods) is never pinged: no
packet could reach it, and a failed ping would blame the overlay.

A pair whose two ends have a probe point is judged by one ping between them, through the
overlay. A pair with an end that has none (host-gw without pods: no device holds an
address of the lease) is judged on the source's kernel: a route to the peer's lease, and,
when that route goes through a gateway on the underlay, the gateway answering a ping.
Every cell says which way it was judged (``ping`` or ``route``).
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network, ip_address, ip_interface
from typing import Any

from flannelpy_lab import topology
from flannelpy_lab.state import NodeInfo

PING_WORKERS = 32
BRIDGE = "cni0"

Network = IPv4Network | IPv6Network


@dataclass(frozen=True)
class ProbePoint:
    """Where a node is pinged from and at: a device and the lease's address on it."""

    device: str | None = None
    address: str | None = None  # without prefix; None: no device holds the lease up

    def describe(self) -> str:
        if self.address is None:
            return "no lease address up (pairs judged by routes)"
        kind = "bridge" if self.device == BRIDGE else "backend device"
        return f"{self.device} {self.address} ({kind})"


def lease_network(overlay: str | None) -> Network | None:
    """The lease of a node from its subnet.env address (``10.244.3.1/24``)."""
    return ip_interface(overlay).network if overlay else None


def pick(links: list[dict[str, Any]], lease: Network | None) -> ProbePoint:
    """The probe point among ``ip -j addr`` ``links`` (pure): the lease's address on an up
    cni0 first, else on another up device; none when no up device holds one."""
    if lease is None:
        return ProbePoint()
    found: list[tuple[bool, str, str]] = []
    for link in links:
        flags = set(link.get("flags") or [])
        name = str(link.get("ifname"))
        if name == BRIDGE:
            up = link.get("operstate") == "UP" and "LOWER_UP" in flags
        else:
            up = "UP" in flags and "LOWER_UP" in flags
        for info in link.get("addr_info") or []:
            local = ip_address(info.get("local", "::"))
            if up and local.version == lease.version and local in lease:
                found.append((name != BRIDGE, name, str(local)))
    if not found:
        return ProbePoint()
    _, device, address = min(found)
    return ProbePoint(device, address)


def probe_point(node: NodeInfo, lease: Network | None) -> ProbePoint:
    family = "-6" if lease is not None and lease.version == 6 else "-4"
    proc = topology.run_in(node.namespace, ["ip", family, "-j", "addr", "show"], timeout=10)
    try:
        links = json.loads(proc.stdout or "[]") if proc.returncode == 0 else []
    except ValueError:
        links = []
    return pick(links, lease)


def ping(node: NodeInfo, source: str | None, target: str, attempts: int) -> bool:
    argv = ["ping", "-c", "1", "-W", "1", *(["-I", source] if source else []), target]
    return any(
        topology.run_in(node.namespace, argv, timeout=10).returncode == 0 for _ in range(attempts)
    )


def route_reaches(node: NodeInfo, lease: Network | None, attempts: int) -> bool:
    """``node``'s kernel routes ``lease``; a gateway on its underlay answers a ping."""
    if lease is None:
        return False
    family = f"-{lease.version}"
    argv = ["ip", family, "-j", "route", "show", "exact", str(lease)]
    proc = topology.run_in(node.namespace, argv, timeout=10)
    try:
        routes = json.loads(proc.stdout or "[]") if proc.returncode == 0 else []
    except ValueError:
        return False
    if not routes:
        return False
    route = routes[0]
    gateway = route.get("gateway")
    if gateway and route.get("dev") == node.underlay_iface:
        return ping(node, None, str(gateway), attempts)
    return route.get("type", "unicast") == "unicast"


def matrix(
    nodes: list[NodeInfo], overlay: dict[str, str | None], attempts: int = 2
) -> tuple[dict[str, dict[str, bool]], dict[str, dict[str, str]], dict[str, str]]:
    """All ordered pairs in parallel: (reaches[a][b], how[a][b] as ``ping`` or ``route``,
    each node's probe point described)."""
    leases = {n.name: lease_network(overlay.get(n.name)) for n in nodes}
    with ThreadPoolExecutor(max_workers=max(1, min(PING_WORKERS, len(nodes)))) as pool:
        points = dict(
            zip(
                [n.name for n in nodes],
                pool.map(lambda n: probe_point(n, leases[n.name]), nodes),
                strict=True,
            )
        )
    pairs = [(a, b) for a in nodes for b in nodes if a.name != b.name]

    def judge(pair: tuple[NodeInfo, NodeInfo]) -> tuple[bool, str]:
        a, b = pair
        src, dst = points[a.name].address, points[b.name].address
        if src and dst:
            return ping(a, src, dst, attempts), "ping"
        return route_reaches(a, leases[b.name], attempts), "route"

    with ThreadPoolExecutor(max_workers=max(1, min(PING_WORKERS, len(pairs)))) as pool:
        results = list(pool.map(judge, pairs))
    reach: dict[str, dict[str, bool]] = {n.name: {} for n in nodes}
    how: dict[str, dict[str, str]] = {n.name: {} for n in nodes}
    for (a, b), (ok, way) in zip(pairs, results, strict=True):
        reach[a.name][b.name] = ok
        how[a.name][b.name] = way
    return reach, how, {name: p.describe() for name, p in points.items()}
