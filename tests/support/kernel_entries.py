"""What a node's kernel holds for its peers, and what the peers' leases ask it to hold.

Both sides are sets of plain tuples, so a test compares them whole ("exactly these
entries, nothing more") and a failure prints the difference. The recipe is
Flannel's (flannel-compat: per vxlan peer a permanent neighbour, an FDB entry and an
onlink route on ``flannel.<VNI>``; per host-gw or direct-routing peer a route via
its public IP on the underlay).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network
from typing import Any

from flannelpy_lab import Lab
from flannelpy_lab.state import NodeInfo

from flannelpy.subnet.keys import key_to_subnet
from flannelpy.subnet.lease import LeaseAttrs

VXLAN_DEVICE = "flannel.1"  # VNI 1, the lab's


@dataclass(frozen=True)
class PeerLease:
    key: str
    subnet: IPv4Network
    attrs: LeaseAttrs
    etcd_lease_id: int  # 0: a key without an etcd lease (a reservation)


@dataclass
class KernelEntries:
    """Routes into the overlay network (own subnet excluded), neighbours and FDB entries
    of the vxlan device."""

    routes: set[tuple[str, str, str]] = field(default_factory=set)  # (dst, via, dev)
    neighbours: set[tuple[str, str]] = field(default_factory=set)  # (ip, lladdr)
    fdb: set[tuple[str, str]] = field(default_factory=set)  # (mac, dst)


def read_leases(lab: Lab) -> list[PeerLease]:
    """Every lease in the lab's etcd, parsed by our reader (``LeaseAttrs.from_json``)."""
    from flannelpy_lab import etcd

    prefix = f"{lab.state.etcd_prefix.rstrip('/')}/subnets/"
    leases = []
    with etcd.client(lab.etcd_endpoint) as c:
        for value, meta in c.get_prefix(prefix):
            key = meta.key.decode()[len(prefix) :]
            subnet, _ = key_to_subnet(key)
            leases.append(PeerLease(key, subnet, LeaseAttrs.from_json(value), meta.lease_id))
    return leases


def _ip_json(lab: Lab, node: str, argv: list[str]) -> list[dict[str, Any]]:
    proc = lab.exec(node, argv, check=False)
    if proc.returncode != 0:  # e.g. no vxlan device on a host-gw node
        return []
    return list(json.loads(proc.stdout or "[]"))


def kernel_entries(lab: Lab, node: NodeInfo) -> KernelEntries:
    network = IPv4Network(lab.state.network)
    own = IPv4Network(node.overlay_address, strict=False) if node.overlay_address else None
    found = KernelEntries()
    for r in _ip_json(lab, node.name, ["ip", "-j", "-4", "route", "show"]):
        dst = r.get("dst", "default")
        if dst == "default":
            continue
        net = IPv4Network(dst if "/" in dst else f"{dst}/32")
        if net.subnet_of(network) and net != own:
            found.routes.add((str(net), r.get("gateway", "-"), r.get("dev", "-")))
    neigh = ["ip", "-j", "-4", "neigh", "show", "dev", VXLAN_DEVICE]
    for n in _ip_json(lab, node.name, neigh):
        found.neighbours.add((n["dst"], n.get("lladdr", "-").lower()))
    for f in _ip_json(lab, node.name, ["bridge", "-j", "fdb", "show", "dev", VXLAN_DEVICE]):
        found.fdb.add((f["mac"].lower(), f.get("dst", "-")))
    return found


def expected_entries(
    node: NodeInfo, leases: list[PeerLease], backend: str, direct: set[IPv4Address]
) -> KernelEntries:
    """What the other nodes' leases ask ``node`` to hold; ``direct``: peers routed on the
    underlay instead of the vxlan device (every on-link peer with DirectRouting)."""
    want = KernelEntries()
    for lease in leases:
        if lease.attrs.public_ip == node.ip:
            continue
        subnet, public_ip = str(lease.subnet), str(lease.attrs.public_ip)
        if backend == "host-gw" or lease.attrs.public_ip in direct:
            want.routes.add((subnet, public_ip, node.underlay_iface))
            continue
        vtep_ip, mac = str(lease.subnet.network_address), lease.attrs.vtep_mac or "?"
        want.routes.add((subnet, vtep_ip, VXLAN_DEVICE))
        want.neighbours.add((vtep_ip, mac))
        want.fdb.add((mac, public_ip))
    return want


def entry_mismatches(
    lab: Lab,
    leases: list[PeerLease],
    backend: str,
    direct: Callable[[NodeInfo], set[IPv4Address]],
) -> dict[str, str]:
    """Per node and kind, how the kernel's entries differ from what ``leases`` ask for
    (empty when every node holds exactly them); ``direct(node)`` as in ``expected_entries``."""
    out = {}
    for node in lab.nodes:
        have = kernel_entries(lab, node)
        want = expected_entries(node, leases, backend, direct(node))
        for kind in ("routes", "neighbours", "fdb"):
            h, w = getattr(have, kind), getattr(want, kind)
            if h != w:
                out[f"{node.name} ({node.agent_kind}) {kind}"] = (
                    f"missing {sorted(w - h)}, extra {sorted(h - w)}"
                )
    return out
