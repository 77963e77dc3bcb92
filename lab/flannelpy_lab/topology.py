"""Build and remove a lab's underlay: namespaces, switch bridges, router, node veths, host leg.

Every step is an ``ip`` command (iproute2), so what the lab does can be read
and replayed by hand. The layout, for lab ``demo`` with two segments::

    host: fpldemoh 100.64.0.254/24 ──┐            route 100.64.1.0/24 via 100.64.0.253
    fpl-demo-sw1: br0 ── host, rtr, n1, n2        (bridge MAC pinned: design.md trap 1)
    fpl-demo-rtr: eth1 100.64.0.253/24, eth2 100.64.1.253/24, ip_forward=1
    fpl-demo-sw2: br0 ── rtr, n3, n4
    fpl-demo-nI:  eth0 100.64.S.I/24 (+ route to the other segment via .253), ip_forward=1
                  dual stack: also fd00:64:S::I/64 (ULA, one segment only, never routed out)

Nodes have no default route and the host reaches the lab only through its own
leg, so no lab packet can leave the machine through the host's default route.
"""

from __future__ import annotations

import json
import subprocess
from ipaddress import IPv4Interface, IPv4Network, ip_network

from flannelpy.dataplane.netns import run_in_netns
from flannelpy_lab import plan
from flannelpy_lab.errors import LabError
from flannelpy_lab.state import EtcdMemberInfo, LabState, NodeInfo, SegmentInfo


def ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run one ``ip`` command (inside ``ns`` if given); raise LabError naming it on failure."""
    argv = ["ip", *(["-n", ns] if ns else []), *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
    if check and proc.returncode != 0:
        raise LabError(f"`{' '.join(argv)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc


def list_netns() -> list[str]:
    """Names of all named network namespaces (``ip netns list`` prints ``name (id: N)``)."""
    out = ip("netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def lab_namespaces(lab: str) -> list[str]:
    prefix = plan.namespace_prefix(lab)
    return [ns for ns in list_netns() if ns.startswith(prefix)]


def link_exists(name: str, ns: str | None = None) -> bool:
    return ip("link", "show", "dev", name, ns=ns, check=False).returncode == 0


def host_used_networks() -> list[IPv4Network]:
    """Every IPv4 route destination (all tables) and address prefix on the host."""
    used: list[IPv4Network] = []
    for route in json.loads(ip("-j", "-4", "route", "show", "table", "all").stdout or "[]"):
        dst = route.get("dst", "default")
        if dst != "default":
            used.append(IPv4Network(dst, strict=False))
    for link in json.loads(ip("-j", "-4", "addr", "show").stdout or "[]"):
        for a in link.get("addr_info", []):
            net = ip_network(f"{a['local']}/{a['prefixlen']}", strict=False)
            if isinstance(net, IPv4Network):
                used.append(net)
    return used


def set_sysctl(ns: str, key: str, value: str) -> None:
    """Write a net sysctl inside ``ns``: /proc/sys/net follows the writing thread's namespace."""
    path = "/proc/sys/" + key.replace(".", "/")

    def write() -> None:
        with open(path, "w", encoding="ascii") as f:
            f.write(value)

    run_in_netns(ns, write)


def add_namespace(ns: str) -> None:
    ip("netns", "add", ns)
    ip("link", "set", "lo", "up", ns=ns)


def delete_namespace(ns: str) -> None:
    """Delete a namespace; a missing one is success."""
    proc = ip("netns", "delete", ns, check=False)
    if proc.returncode != 0 and ns in list_netns():
        raise LabError(f"cannot delete namespace {ns}: {proc.stderr.strip()}")


def build_switch(seg: SegmentInfo) -> None:
    add_namespace(seg.switch_namespace)
    # Pinned MAC: otherwise the bridge takes its lowest port MAC, which changes
    # as ports come and go and leaves stale ARP entries behind (design.md trap 1).
    ip(
        "link",
        "add",
        plan.SWITCH_BRIDGE,
        "address",
        seg.bridge_mac,
        "type",
        "bridge",
        ns=seg.switch_namespace,
    )
    ip("link", "set", plan.SWITCH_BRIDGE, "up", ns=seg.switch_namespace)


def plug(switch_ns: str, port: str, ns: str | None, iface: str) -> None:
    """A veth from ``iface`` in ``ns`` (None: the host) to ``port`` on the switch's bridge."""
    if ns is None:
        ip("link", "add", iface, "type", "veth", "peer", "name", port, "netns", switch_ns)
    else:
        ip("link", "add", port, "type", "veth", "peer", "name", iface, "netns", ns, ns=switch_ns)
    ip("link", "set", port, "master", plan.SWITCH_BRIDGE, "up", ns=switch_ns)


def build_router(state: LabState) -> None:
    rtr = state.router_namespace
    assert rtr is not None
    add_namespace(rtr)
    for seg, leg in zip(state.segments, plan.ROUTER_LEGS, strict=True):
        assert seg.router_address is not None
        plug(seg.switch_namespace, plan.ROUTER_PORT, rtr, leg)
        ip("addr", "add", seg.router_address, "dev", leg, ns=rtr)
        ip("link", "set", leg, "up", ns=rtr)
    set_sysctl(rtr, "net.ipv4.ip_forward", "1")


def build_node(state: LabState, node: NodeInfo) -> None:
    seg = state.segments[node.segment - 1]
    add_namespace(node.namespace)
    plug(seg.switch_namespace, node.switch_port, node.namespace, node.underlay_iface)
    ip("addr", "add", node.underlay_address, "dev", node.underlay_iface, ns=node.namespace)
    ip("link", "set", node.underlay_iface, "up", ns=node.namespace)
    route = plan.other_segment_route(state, node)
    if route is not None:
        ip("route", "add", route[0], "via", route[1], ns=node.namespace)
    set_sysctl(node.namespace, "net.ipv4.ip_forward", "1")
    if plan.ipv6_enabled(state):
        # The ULA underlay (dual stack); nodad: usable at once, unique by the plan.
        ip(
            "addr",
            "add",
            plan.ipv6_underlay_address(node),
            "dev",
            node.underlay_iface,
            "nodad",
            ns=node.namespace,
        )
        set_sysctl(node.namespace, "net.ipv6.conf.all.forwarding", "1")


def build_etcd_member(state: LabState, member: EtcdMemberInfo) -> None:
    """A member's namespace on segment 1's switch (and a route to segment 2 via the router)."""
    seg = state.segments[0]
    add_namespace(member.namespace)
    plug(seg.switch_namespace, member.switch_port, member.namespace, member.underlay_iface)
    ip("addr", "add", member.underlay_address, "dev", member.underlay_iface, ns=member.namespace)
    ip("link", "set", member.underlay_iface, "up", ns=member.namespace)
    if len(state.segments) == 2:
        assert seg.router_address is not None
        via = str(IPv4Interface(seg.router_address).ip)
        ip("route", "add", state.segments[1].subnet, "via", via, ns=member.namespace)


def delete_node(state: LabState, node: NodeInfo) -> None:
    """Remove a node's namespace and its switch port (the veth dies with the namespace)."""
    delete_namespace(node.namespace)
    seg = state.segments[node.segment - 1]
    # The kernel tears the veth down asynchronously: it may vanish between a look and
    # the delete, so only a port that is still there after a failed delete is an error.
    proc = ip("link", "del", node.switch_port, ns=seg.switch_namespace, check=False)
    if proc.returncode != 0 and link_exists(node.switch_port, ns=seg.switch_namespace):
        raise LabError(
            f"cannot remove switch port {node.switch_port} of node {node.name} "
            f"in {seg.switch_namespace}: {proc.stderr.strip()}"
        )


def attach_host(state: LabState) -> None:
    """The host's leg into segment 1 (and a route to segment 2), so lab addresses are on-link."""
    plug(state.segments[0].switch_namespace, plan.HOST_PORT, None, state.host_link)
    ip("addr", "add", state.host_address, "dev", state.host_link)
    ip("link", "set", state.host_link, "up")


def add_host_routes(state: LabState) -> None:
    for route in state.host_routes:
        ip("route", "add", route["dst"], "via", route["via"], "dev", state.host_link)


def remove_host_leg(state: LabState | None, lab: str) -> None:
    """Delete what the lab added to the host namespace; missing pieces are fine."""
    link = state.host_link if state else plan.host_link(lab)
    for route in state.host_routes if state else []:
        ip("route", "del", route["dst"], "via", route["via"], check=False)
    if link_exists(link):
        ip("link", "del", link)


def destroy(state: LabState | None, lab: str) -> None:
    """Remove every namespace of the lab (named ones, plus any left with its prefix)."""
    names = set(lab_namespaces(lab))
    if state:
        names.update(n.namespace for n in state.nodes)
        names.update(s.switch_namespace for s in state.segments)
        names.update(m.namespace for m in state.etcd_members)
        if state.router_namespace:
            names.add(state.router_namespace)
    remove_host_leg(state, lab)
    for ns in sorted(names):
        delete_namespace(ns)


def ensure_overlay_bridge(
    ns: str, address: str | None, mtu: int, address6: str | None = None
) -> None:
    """Give the node its overlay address: bridge ``cni0`` holding FLANNEL_SUBNET's address
    (and FLANNEL_IPV6_SUBNET's in dual stack; only that one IPv6-only).

    The lab's stand-in for what the CNI plugin does on a node's first pod;
    idempotent, and it replaces a stale address after the lease changed.
    """
    bridge = plan.OVERLAY_BRIDGE
    if not link_exists(bridge, ns=ns):
        ip("link", "add", bridge, "type", "bridge", ns=ns)
    ip("link", "set", bridge, "mtu", str(mtu), ns=ns)
    current = addresses(ns, bridge)
    wanted = IPv4Interface(address) if address is not None else None
    for old in current:
        if old != wanted:
            ip("addr", "del", str(old), "dev", bridge, ns=ns)
    if wanted is not None and wanted not in current:
        ip("addr", "add", str(wanted), "dev", bridge, ns=ns)
    if address6 is not None:
        # nodad: usable at once (a tentative address cannot source the status pings).
        ip("addr", "replace", str(address6), "dev", bridge, "nodad", ns=ns)
    ip("link", "set", bridge, "up", ns=ns)


def addresses(ns: str, dev: str) -> list[IPv4Interface]:
    proc = ip("-j", "-4", "addr", "show", "dev", dev, ns=ns, check=False)
    if proc.returncode != 0:
        return []
    found = []
    for link in json.loads(proc.stdout or "[]"):
        for a in link.get("addr_info", []):
            found.append(IPv4Interface(f"{a['local']}/{a['prefixlen']}"))
    return found


def exec_argv(ns: str, argv: list[str]) -> list[str]:
    return ["ip", "netns", "exec", ns, *argv]


def run_in(ns: str, argv: list[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` inside ``ns`` and capture its output; a timeout becomes a LabError."""
    try:
        return subprocess.run(
            exec_argv(ns, argv), capture_output=True, text=True, timeout=timeout, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise LabError(f"`{' '.join(argv)}` in {ns} did not finish within {timeout:g} s") from e
