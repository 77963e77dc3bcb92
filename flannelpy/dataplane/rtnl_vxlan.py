"""The rtnetlink requests for a VTEP: ``ip link add NAME type vxlan ...`` and the
``ip link set`` of its MAC, in :mod:`.rtnl`'s vocabulary (sent by
:class:`~flannelpy.dataplane.nlbatch.NetlinkSocket`).

The agent made these through pyroute2 before; pyroute2 costs about 13 MiB of memory
and 0.1 s of CPU to import, which every agent paid at its first start for two
messages. The attributes are those ``ip -d link show`` reports and
:func:`~flannelpy.dataplane.rtnl.decode_link` reads back (``linux/if_link.h``).
"""

from __future__ import annotations

import socket

from flannelpy.dataplane.rtnl import (
    BE16,
    IFINFO,
    IFLA_ADDRESS,
    IFLA_IFNAME,
    IFLA_INFO_DATA,
    IFLA_INFO_KIND,
    IFLA_LINKINFO,
    IFLA_MTU,
    IFLA_VXLAN_GBP,
    IFLA_VXLAN_ID,
    IFLA_VXLAN_LEARNING,
    IFLA_VXLAN_LINK,
    IFLA_VXLAN_LOCAL,
    IFLA_VXLAN_LOCAL6,
    IFLA_VXLAN_PORT,
    NLM_F_CREATE,
    NLM_F_EXCL,
    RTM_NEWLINK,
    U32,
    Request,
    attr,
    mac_bytes,
)
from flannelpy.dataplane.state import VxlanLink


def vxlan_request(link: VxlanLink, underlay_index: int) -> Request:
    """Create ``link`` (down; :func:`~flannelpy.dataplane.rtnl.link_set_request` brings it
    up) over the underlay device ``underlay_index``: its VNI, local address (IPv4 or, for
    flannel-v6.<VNI>, IPv6), UDP port, learning, GBP, MTU and, when planned, its MAC."""
    local = IFLA_VXLAN_LOCAL6 if link.local_ip.version == 6 else IFLA_VXLAN_LOCAL
    data = (
        attr(IFLA_VXLAN_ID, U32.pack(link.vni))
        + attr(local, link.local_ip.packed)
        + attr(IFLA_VXLAN_LINK, U32.pack(underlay_index))
        + attr(IFLA_VXLAN_PORT, BE16.pack(link.port))
        + attr(IFLA_VXLAN_LEARNING, bytes([int(link.learning)]))
        + (attr(IFLA_VXLAN_GBP, b"") if link.gbp else b"")
    )
    body = (
        IFINFO.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
        + attr(IFLA_IFNAME, link.name.encode() + b"\0")
        + attr(IFLA_MTU, U32.pack(link.mtu))
        + (attr(IFLA_ADDRESS, mac_bytes(link.mac)) if link.mac else b"")
        + attr(IFLA_LINKINFO, attr(IFLA_INFO_KIND, b"vxlan") + attr(IFLA_INFO_DATA, data))
    )
    return Request(RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL, body)


def link_mac_request(index: int, mac: str) -> Request:
    """``ip link set dev <index> address <mac>``."""
    body = IFINFO.pack(socket.AF_UNSPEC, 0, index, 0, 0) + attr(IFLA_ADDRESS, mac_bytes(mac))
    return Request(RTM_NEWLINK, 0, body)
