"""What a pod's plumbing is called and addressed, worked out without the kernel.

The host end of a pod's veth is named by a hash of (netns, container, ifname) and
its alias, its owner, is the whole hash (why: :mod:`.podnet`). MACs are chosen here
rather than read back: the pod's is ``0a:58:<its IPv4>`` (locally administered,
unique per address on the node; an IPv6-only pod's takes its address's last four
bytes), the host end's random. A lease's gateway is its first address.
"""

from __future__ import annotations

import hashlib
import os
from ipaddress import (
    IPv4Address,
    IPv4Interface,
    IPv4Network,
    IPv6Address,
    IPv6Interface,
    IPv6Network,
)

from flannelpy.dataplane.rtnl import AddrRow, AddrRow6

IFNAMSIZ = 15  # bytes, without the NUL
HOST_VETH_PREFIX = "veth"

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network
IPInterface = IPv4Interface | IPv6Interface
PodRoute = tuple[IPNetwork, IPAddress]  # (destination, gateway) in the pod

DEFAULT_ROUTE = IPv4Network("0.0.0.0/0")
DEFAULT_ROUTE6 = IPv6Network("::/0")


def _digest(netns: str, container_id: str, ifname: str) -> str:
    return hashlib.sha1(f"{netns}\0{container_id}\0{ifname}".encode()).hexdigest()


def host_veth_name(netns: str, container_id: str, ifname: str) -> str:
    """``veth`` + 11 hex of sha1 (all of IFNAMSIZ): deterministic, so a retried ADD
    finds its leftovers."""
    prefix = HOST_VETH_PREFIX
    return prefix + _digest(netns, container_id, ifname)[: IFNAMSIZ - len(prefix)]


def veth_owner(netns: str, container_id: str, ifname: str) -> str:
    """The alias ADD gives the host end: whose it is, beyond the name's 44 bits."""
    return "flannelpy " + _digest(netns, container_id, ifname)


def pod_mac(ip: IPAddress) -> str:
    """``0a:58:`` + the IPv4 address (an IPv6 one's last 4 bytes): locally administered,
    unicast, stable for an IP."""
    return "0a:58:" + ip.packed[-4:].hex(":")


def random_mac() -> str:
    raw = bytearray(os.urandom(6))
    raw[0] = (raw[0] & 0xFC) | 0x02  # unicast, locally administered
    return bytes(raw).hex(":")


def default_route(family: int) -> IPNetwork:
    return DEFAULT_ROUTE6 if family == 6 else DEFAULT_ROUTE


def gateway_of(subnet: IPNetwork) -> IPInterface:
    """The gateway address of a lease: its first address, with the lease's prefix."""
    if isinstance(subnet, IPv6Network):
        return IPv6Interface((subnet.network_address + 1, subnet.prefixlen))
    return IPv4Interface((subnet.network_address + 1, subnet.prefixlen))


def interface_of(row: AddrRow | AddrRow6) -> IPInterface:
    """An address of a dump, with its prefix."""
    if isinstance(row, AddrRow6):
        return IPv6Interface((row.address, row.prefixlen))
    return IPv4Interface((row.address, row.prefixlen))
