"""flanneld nodes in a rollout (pure): who they are and which targets would cut them off.

A rollout moves only nodes of ours: it writes overrides, which flanneld never reads.
flanneld keeps running the Backend it read from the network config at its start, and it
ignores every peer lease whose BackendType differs from its own (vxlan, host-gw and
wireguard alike), so a node of ours moved to another type is unreachable from every
flanneld node, silently. Its VXLAN device also carries one VNI and one UDP port, so a
vxlan target with another VNI or port cuts them off too.

A flanneld node is known only by its lease: one without our ``Flannelpy`` extension
(:func:`flannelpy.backend.paths.is_flanneld_lease`) whose subnet no node status claims.
A target that changes nothing flanneld runs or sees (its type, VNI, port and
DirectRouting stay the config's) is planned around: say, nodes of ours on host-gw
overrides brought back to the config's vxlan. DirectRouting counts because a flanneld
lease cannot say whether it routes directly: our nodes take the config's word for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network

from flannelpy.backend.paths import is_flanneld_lease
from flannelpy.config.netconf import BackendConfig
from flannelpy.control.records import NodeStatus
from flannelpy.subnet.lease import Lease


@dataclass(frozen=True)
class FlanneldNode:
    subnet: IPv4Network
    public_ip: IPv4Address
    backend_type: str  # lower-cased, as its lease says
    vni: int | None  # from its lease's BackendData (vxlan), None when absent

    @property
    def label(self) -> str:
        return f"{self.subnet} ({self.public_ip})"


def flanneld_nodes(
    leases: Iterable[Lease], statuses: Mapping[str, NodeStatus]
) -> list[FlanneldNode]:
    """The leases held by flanneld, by subnet. A lease some node status lists among its
    subnets is ours even without the extension (an older flannelpy wrote it)."""
    claimed = {subnet for status in statuses.values() for subnet in status.subnets}
    found = []
    for lease in leases:
        if not is_flanneld_lease(lease) or str(lease.subnet) in claimed:
            continue
        if lease.subnet is None or lease.attrs.public_ip is None:
            continue  # IPv6-only: the rollout is IPv4-only
        vni = (lease.attrs.backend_data or {}).get("VNI")
        found.append(
            FlanneldNode(
                subnet=lease.subnet,
                public_ip=lease.attrs.public_ip,
                backend_type=lease.attrs.backend_type.lower(),
                vni=vni if isinstance(vni, int) and not isinstance(vni, bool) else None,
            )
        )
    return sorted(found, key=lambda node: node.subnet)


def _on_off(flag: bool) -> str:
    return "on" if flag else "off"


def why_cut_off(node: FlanneldNode, current: BackendConfig, target: BackendConfig) -> str | None:
    """What about ``node`` keeps it from following ``target``; None when nothing does."""
    if node.backend_type != target.type:
        return f"runs {node.backend_type or 'an unknown backend'}"
    if target.type != "vxlan":
        return None
    vni = node.vni if node.vni is not None else current.vni
    if vni != target.vni:
        return f"has VNI {vni}"
    if current.effective_port != target.effective_port:
        return f"listens on UDP port {current.effective_port}"
    if current.direct_routing != target.direct_routing:
        # Its lease cannot say, so ours take the config's word for it; the rollout's last
        # step rewrites the config while flanneld keeps what it read at start: the two
        # ends of each pair would choose different paths, which strict rp_filter drops.
        return f"runs DirectRouting {_on_off(current.direct_routing)} until it restarts"
    return None


def flanneld_problems(
    nodes: Sequence[FlanneldNode], current: BackendConfig, target: BackendConfig
) -> list[str]:
    """One sentence naming the flanneld nodes the target would cut off, and what to do."""
    cut_off = [(node, why) for node in nodes if (why := why_cut_off(node, current, target))]
    if not cut_off:
        return []
    named = ", ".join(f"{node.label}, which {why}" for node, why in cut_off)
    what = target.type
    if target.type == "vxlan":
        what = (
            f"vxlan (VNI {target.vni}, port {target.effective_port}, DirectRouting "
            f"{_on_off(target.direct_routing)})"
        )
    return [
        f"flanneld node(s) {named} cannot follow a rollout to {what} (flanneld reads no "
        "override, ignores leases of another backend and reads its Backend from "
        "net-conf.json only when it starts): migrate them to flannelpy first, or change "
        "the Backend in net-conf.json for every node at once and restart the flanneld nodes"
    ]


def flanneld_line(nodes: Sequence[FlanneldNode]) -> str | None:
    """The plan's line about flanneld nodes a safe target leaves alone."""
    if not nodes:
        return None
    return (
        f"flanneld nodes (not switched; they keep the network config's Backend): "
        f"{', '.join(str(node.subnet) + ' (' + str(node.public_ip) + ')' for node in nodes)}"
    )
