"""Pure planning for a netns lab: names, address plan, segment split, net-conf.

Nothing here touches the host. ``plan_lab`` turns the user's request plus the
address ranges already in use into a complete :class:`LabState`; the I/O
modules then build exactly that and record process ids into it.

Address plan, per lab: one /24 per underlay segment, taken from 100.64.0.0/10
(shared address space, never a real destination for these hosts). In each
segment node ``nI`` gets host number I, the router .253 and the host's own
attachment .254 (segment 1 only). Re-created nodes take numbers from 100 up,
so a new address never collides with a planned one.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable
from ipaddress import IPv4Interface, IPv4Network
from typing import Any

from flannelpy.errors import ConfigError
from flannelpy_lab.state import (
    KIND_FLANNELD,
    KIND_FLANNELPY,
    EtcdMemberInfo,
    LabState,
    NodeInfo,
    SegmentInfo,
)

NAME_PATTERN = re.compile(r"[a-z0-9]{1,6}")
LAB_SPACE = IPv4Network("100.64.0.0/10")
SEGMENT_PREFIXLEN = 24
ROUTER_HOST = 253
HOST_HOST = 254
RECREATE_FIRST_HOST = 100
ETCD_MEMBER_FIRST_HOST = 241  # member eJ is .240+J; re-created nodes stay below
ETCD_MEMBER_COUNTS = (1, 3, 5)  # odd: a majority survives any one partition
MAX_NODES = 99
IFNAMSIZ = 15  # Linux interface names are at most 15 bytes
BACKENDS = ("vxlan", "host-gw", "wireguard")
# A kubelet lab's network (--network-agent): the manifests' DaemonSet, or Flannel itself.
NETWORK_AGENTS = ("flannelpy", "flanneld")
DEFAULT_NETWORK = "10.244.0.0/16"
DEFAULT_ETCD_PREFIX = "/coreos.com/network"
LAB_ROOT = "/run/flannelpy-lab"
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
UNDERLAY_IFACE = "eth0"
SWITCH_BRIDGE = "br0"
OVERLAY_BRIDGE = "cni0"
ROUTER_LEGS = ("eth1", "eth2")  # router interface on segment 1, segment 2
ROUTER_PORT = "rtr"  # the router's port on each switch bridge
HOST_PORT = "host"  # the host attachment's port on the segment-1 bridge


def validate_name(name: str) -> str:
    if not NAME_PATTERN.fullmatch(name):
        raise ConfigError(f"lab name {name!r} is invalid; use 1 to 6 lower-case letters or digits")
    return name


def namespace(lab: str, role: str) -> str:
    """``fpl-<lab>-<role>``; role is sw1, sw2, rtr or a node name."""
    return f"fpl-{lab}-{role}"


def namespace_prefix(lab: str) -> str:
    return f"fpl-{lab}-"


def is_etcd_member_namespace(lab: str, ns: str) -> bool:
    """``fpl-<lab>-eJ``: an etcd member's namespace (nodes are nI, switches swI)."""
    return re.fullmatch(re.escape(namespace_prefix(lab)) + r"e[0-9]+", ns) is not None


def host_link(lab: str) -> str:
    return checked_ifname(f"fpl{lab}h")


def checked_ifname(name: str) -> str:
    if not 0 < len(name.encode()) <= IFNAMSIZ:
        raise ConfigError(f"interface name {name!r} is longer than {IFNAMSIZ} bytes")
    return name


def node_names(count: int) -> list[str]:
    return [f"n{i}" for i in range(1, count + 1)]


def segment_of(index: int, nodes: int, segments: int) -> int:
    """Segment (1 or 2) of the node numbered ``index`` (1-based): the first ceil(N/2) on 1."""
    if segments == 1:
        return 1
    return 1 if index <= math.ceil(nodes / 2) else 2


def choose_subnets(used: Iterable[IPv4Network], count: int) -> list[IPv4Network]:
    """The first ``count`` /24s of LAB_SPACE that overlap nothing in ``used``.

    ``used`` holds the host's routes and addresses and other labs' segments;
    default routes must be left out by the caller (they overlap everything).
    """
    taken = [n for n in used if n.prefixlen > 0]
    chosen: list[IPv4Network] = []
    for candidate in LAB_SPACE.subnets(new_prefix=SEGMENT_PREFIXLEN):
        if any(candidate.overlaps(n) for n in taken):
            continue
        chosen.append(candidate)
        if len(chosen) == count:
            return chosen
    raise ConfigError(
        f"no free /{SEGMENT_PREFIXLEN} left in {LAB_SPACE} for the lab's underlay; "
        "run `flannelpy-lab down` on labs you no longer need"
    )


def address(subnet: IPv4Network, host: int) -> IPv4Interface:
    return IPv4Interface(f"{subnet.network_address + host}/{subnet.prefixlen}")


def next_free_host(used_hosts: Iterable[int]) -> int:
    """Host number for a re-created node: the lowest free one from RECREATE_FIRST_HOST."""
    used = set(used_hosts)
    for host in range(RECREATE_FIRST_HOST, ETCD_MEMBER_FIRST_HOST):
        if host not in used:
            return host
    raise ConfigError("no free underlay address left in the segment; re-create fewer nodes")


def pinned_mac(lab: str, role: str) -> str:
    """A stable locally administered unicast MAC for a bridge (see design.md, trap 1)."""
    digest = hashlib.sha256(f"{lab}/{role}".encode()).digest()
    octets = [0x02, *digest[:5]]
    return ":".join(f"{o:02x}" for o in octets)


# Dual stack (``lab up --ip-family dual``): a ULA underlay per segment, never routed out
# (no node has an IPv6 default route and the host leg carries no IPv6), and a ULA pod
# network. Node I on segment S gets fd00:64:S::I/64 beside 100.64.S.I/24.
IPV6_UNDERLAY = "fd00:64:{segment}::{host}/64"
DEFAULT_IPV6_NETWORK = "fd10:244::/56"
IP_FAMILIES = ("ipv4", "dual", "ipv6")


def ip_family_net_conf(family: str) -> dict[str, Any]:
    """The net-conf.json keys of ``--ip-family`` (none for ipv4)."""
    if family not in IP_FAMILIES:
        raise ConfigError(f"--ip-family {family!r} is unknown; use one of {', '.join(IP_FAMILIES)}")
    if family == "dual":
        return {"EnableIPv6": True, "IPv6Network": DEFAULT_IPV6_NETWORK}
    if family == "ipv6":
        # IPv6-only: the pod network and the overlay are IPv6; etcd stays on the
        # nodes' IPv4 lab addresses (the control plane, not the data path).
        return {"EnableIPv4": False, "EnableIPv6": True, "IPv6Network": DEFAULT_IPV6_NETWORK}
    return {}


def ipv6_only(state: LabState) -> bool:
    return (state.extra.get("net_conf_extra") or {}).get("EnableIPv4") is False


def pod_networks(state: LabState) -> str:
    """The pod network(s) the lab runs, for its one-line summaries."""
    v6 = (state.extra.get("net_conf_extra") or {}).get("IPv6Network")
    if ipv6_only(state):
        return str(v6)
    return f"{state.network}, {v6}" if ipv6_enabled(state) and v6 else state.network


def ipv6_enabled(state: LabState) -> bool:
    return bool((state.extra.get("net_conf_extra") or {}).get("EnableIPv6"))


def ipv6_underlay_address(node: NodeInfo) -> str:
    """The node's IPv6 underlay address (dual-stack labs), with its /64."""
    return IPV6_UNDERLAY.format(segment=node.segment, host=host_number(node))


def ipv6_underlay_ip(node: NodeInfo) -> str:
    return ipv6_underlay_address(node).split("/")[0]


def net_conf(network: str, backend: str, direct_routing: bool) -> dict[str, Any]:
    """Flannel's net-conf.json for the lab."""
    backend_doc: dict[str, Any] = {"Type": backend}
    if direct_routing:
        backend_doc["DirectRouting"] = True
    return {"Network": network, "Backend": backend_doc}


def net_conf_json(
    network: str, backend: str, direct_routing: bool, extra: dict[str, Any] | None = None
) -> str:
    """``extra``: more top-level keys (``lab up --enable-nftables``: EnableNFTables)."""
    doc = {**net_conf(network, backend, direct_routing), **(extra or {})}
    return json.dumps(doc, separators=(",", ":"))


def validate_request(
    name: str,
    nodes: int,
    backend: str,
    direct_routing: bool,
    segments: int,
    network: str,
    flanneld_nodes: int = 0,
    etcd_members: int = 1,
) -> None:
    validate_name(name)
    if etcd_members not in ETCD_MEMBER_COUNTS:
        raise ConfigError(
            f"--etcd-members {etcd_members} is invalid; use one of "
            f"{', '.join(map(str, ETCD_MEMBER_COUNTS))}"
        )
    if not 1 <= nodes <= MAX_NODES:
        raise ConfigError(f"--nodes {nodes} is out of range; use 1 to {MAX_NODES}")
    if not 0 <= flanneld_nodes <= nodes:
        raise ConfigError(f"--flanneld-nodes {flanneld_nodes} is out of range; use 0 to {nodes}")
    if backend not in BACKENDS:
        raise ConfigError(f"--backend {backend!r} is unknown; use one of {', '.join(BACKENDS)}")
    if direct_routing and backend != "vxlan":
        raise ConfigError("--direct-routing needs --backend vxlan")
    if segments not in (1, 2):
        raise ConfigError(f"--segments {segments} is invalid; use 1 or 2")
    if segments == 2 and nodes < 2:
        raise ConfigError("--segments 2 needs at least 2 nodes")
    try:
        net = IPv4Network(network)
    except ValueError as e:
        raise ConfigError(f"--network {network!r} is not an IPv4 CIDR such as 10.244.0.0/16") from e
    if net.overlaps(LAB_SPACE):
        raise ConfigError(
            f"--network {network} overlaps the lab underlay {LAB_SPACE}; pick another"
        )


def plan_lab(
    name: str,
    nodes: int,
    backend: str,
    *,
    direct_routing: bool,
    segments: int,
    network: str,
    etcd_prefix: str,
    subnets: list[IPv4Network],
    overlay_bridge: bool,
    lab_root: str = LAB_ROOT,
    flanneld_nodes: int = 0,
    etcd_members: int = 1,
) -> LabState:
    """The full description of a lab before anything is built; the last ``flanneld_nodes``
    nodes run the real flanneld instead of our agent. One etcd member runs in the host
    namespace; more each get a namespace on segment 1 (see :func:`etcd_member_plan`)."""
    validate_request(
        name, nodes, backend, direct_routing, segments, network, flanneld_nodes, etcd_members
    )
    if len(subnets) != segments:
        raise ValueError("one subnet per segment is needed")
    lab_dir = f"{lab_root}/{name}"
    segs = [
        SegmentInfo(
            index=i,
            subnet=str(subnet),
            switch_namespace=namespace(name, f"sw{i}"),
            bridge_mac=pinned_mac(name, f"sw{i}"),
            router_address=str(address(subnet, ROUTER_HOST)) if segments == 2 else None,
        )
        for i, subnet in enumerate(subnets, start=1)
    ]
    node_list = []
    for i, node in enumerate(node_names(nodes), start=1):
        seg = segment_of(i, nodes, segments)
        node_dir = f"{lab_dir}/nodes/{node}"
        node_list.append(
            NodeInfo(
                name=node,
                namespace=namespace(name, node),
                segment=seg,
                underlay_iface=UNDERLAY_IFACE,
                underlay_address=str(address(subnets[seg - 1], i)),
                switch_port=checked_ifname(node),
                node_dir=node_dir,
                subnet_env=f"{node_dir}/run/flannel/subnet.env",
                agent_log=f"{node_dir}/agent.log",
                agent_kind=KIND_FLANNELD if i > nodes - flanneld_nodes else KIND_FLANNELPY,
            )
        )
    host_ip = address(subnets[0], HOST_HOST)
    members = etcd_member_plan(name, lab_dir, subnets[0], etcd_members)
    host_routes = []
    if segments == 2:
        host_routes.append(
            {"dst": str(subnets[1]), "via": str(address(subnets[0], ROUTER_HOST).ip)}
        )
    return LabState(
        name=name,
        backend=backend,
        direct_routing=direct_routing,
        network=network,
        etcd_prefix=etcd_prefix.rstrip("/") or "/",
        lab_dir=lab_dir,
        segments=segs,
        router_namespace=namespace(name, "rtr") if segments == 2 else None,
        host_link=host_link(name),
        host_address=str(host_ip),
        host_routes=host_routes,
        etcd_endpoint=(
            members[0].client_url if members else f"http://{host_ip.ip}:{ETCD_CLIENT_PORT}"
        ),
        etcd_data_dir=f"{lab_dir}/etcd",
        etcd_log=f"{lab_dir}/etcd.log",
        overlay_bridge=overlay_bridge,
        nodes=node_list,
        etcd_members=members,
    )


def etcd_member_plan(
    lab: str, lab_dir: str, subnet: IPv4Network, count: int
) -> list[EtcdMemberInfo]:
    """Members ``e1``..``eN`` of a static cluster; none for a one-member lab (its etcd
    stays in the host namespace, as it always was)."""
    if count == 1:
        return []
    members = []
    for j in range(1, count + 1):
        role = f"e{j}"
        ip = address(subnet, ETCD_MEMBER_FIRST_HOST + j - 1)
        members.append(
            EtcdMemberInfo(
                name=namespace(lab, role),
                namespace=namespace(lab, role),
                switch_port=checked_ifname(role),
                underlay_iface=UNDERLAY_IFACE,
                underlay_address=str(ip),
                client_url=f"http://{ip.ip}:{ETCD_CLIENT_PORT}",
                peer_url=f"http://{ip.ip}:{ETCD_PEER_PORT}",
                data_dir=f"{lab_dir}/etcd/{role}",
                log=f"{lab_dir}/etcd-{role}.log",
            )
        )
    return members


def initial_cluster(members: Iterable[EtcdMemberInfo]) -> str:
    """etcd's ``--initial-cluster``: ``name=peer-url`` for every member."""
    return ",".join(f"{m.name}={m.peer_url}" for m in members)


def other_segment_route(state: LabState, node: NodeInfo) -> tuple[str, str] | None:
    """(destination, gateway) a node needs to reach the other segment, if there is one."""
    if len(state.segments) < 2:
        return None
    own = state.segments[node.segment - 1]
    other = state.segments[2 - node.segment]
    assert own.router_address is not None
    return other.subnet, str(IPv4Interface(own.router_address).ip)


def host_number(node: NodeInfo) -> int:
    iface = IPv4Interface(node.underlay_address)
    return int(iface.ip) - int(iface.network.network_address)
