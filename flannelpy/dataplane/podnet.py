"""The pod network in the kernel: the ``cni0`` bridge and one veth pair per pod.

The recipe, as the reference ``bridge`` plugin does it, in fewer round trips:

node namespace (the calling thread's; the agent runs there)
  1. ``cni0``: a bridge, up, MTU = the overlay MTU, its MAC pinned (a bridge
     otherwise takes the lowest MAC of its ports, so a new pod could change the
     gateway's MAC under every other pod's ARP cache), holding the gateway
     address (the lease's first address) of every lease.
  2. One RTM_NEWLINK creates the veth pair: the host end (up, MTU, master
     ``cni0``) and the pod end created directly inside the pod namespace
     (``rtnl.IFLA_NET_NS_FD`` in the peer): ~1 ms, where moving an existing device
     to another namespace costs ~20 ms. The kernel refuses to create the peer
     up (ENOTCONN), hence step 3. The same datagram sets the host end's alias
     (its owner, see below) and hairpin mode when asked.
pod namespace (a short-lived thread that ``setns()`` into it: a socket opened
there costs ~0.3 ms, where pyroute2's ``IPRoute(netns=...)`` forks a helper, ~6 ms)
  3. One datagram: the pod end up, its address, the default route via the gateway.

MACs are chosen here rather than read back: the pod's is ``0a:58:<its IPv4>``
(locally administered, unique per address on the node; an IPv6-only pod's takes its
address's last four bytes), the host end's random.

IPv6, as the reference ``bridge`` plugin does it: the bridge gets the first address
of the node's IPv6 pod subnet and ``accept_ra=0`` (it owns its routes), and
``net.ipv6.conf.all.forwarding=1`` is set; in the pod, ``accept_dad=0`` (and
``keep_addr_on_down=1``) is written for the interface before its address goes on,
then ADD waits until no address of
the pod interface is tentative (the reference's ``SettleAddresses``) and the bridge's
gateway neither, so the address is usable when ADD returns. Both the gateway and the
pod address are also added with ``IFA_F_NODAD``: a gateway address on a bridge that
has no carrier yet would otherwise sit tentative for a DAD round after the first
port comes up.

Deleting either end of a veth deletes both, so DEL removes the host end from
the node namespace and never needs the pod namespace. The host name is a hash
(44 bits, the most IFNAMSIZ leaves), so two pods could share one: a delete
first reads the link's alias, the full hash of (netns, container, ifname)
written at ADD, and leaves a link that belongs to another pod alone; it then
deletes by ifindex, so a link re-created under that name meanwhile is spared.

The pod namespace is named by ``netns`` (the CNI_NETNS string: messages and
identity) and reached through ``netns_fd`` when given, an open descriptor the
CNI executable passed from the runtime's mount namespace, where the path may
mean nothing to the agent (see :mod:`flannelpy.cni.server`). Without it the
path is opened here, as for ``ip netns`` names in tests and tools.

Everything goes through :mod:`flannelpy.dataplane.nlbatch` (raw rtnetlink):
one ADD is a handful of messages, and pyroute2's per-call overhead (~0.5 ms)
would be most of the budget.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from ipaddress import (
    IPv4Address,
    IPv4Interface,
    IPv4Network,
    IPv6Address,
    IPv6Interface,
    IPv6Network,
    ip_address,
)
from typing import Any, TypeVar

from flannelpy.dataplane import nlbatch as nl
from flannelpy.dataplane import rtnl
from flannelpy.dataplane.netns import run_in_netns
from flannelpy.errors import DataplaneError

log = logging.getLogger(__name__)

IFNAMSIZ = 15  # bytes, without the NUL
BRIDGE_RECHECK_SECONDS = 5.0  # how stale ensure_bridge's knowledge of the addresses may get

_GONE = {errno.ENODEV, errno.ENOENT, errno.ESRCH}

HOST_VETH_PREFIX = "veth"
SETTLE_SECONDS = 5.0  # the longest ADD waits for IPv6 addresses to leave tentative (as bridge's)

IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network
IPInterface = IPv4Interface | IPv6Interface
PodRoute = tuple[IPNetwork, IPAddress]  # (destination, gateway) in the pod

_AF_INET6 = socket.AF_INET6
_IFA_FLAGS = 8  # u32 flags attribute (the header's byte holds only the low 8 bits)
_IFA_F_NODAD = 0x02
_IFA_F_TENTATIVE = 0x40
_IFA_F_DADFAILED = 0x08
_RTA_DST = 1
_RTA_OIF = 4
_RTA_GATEWAY = 5
_RTM_GETADDR = 22
_RTM_NEWADDR = 20
_RTM_GETROUTE = 26
_RTM_NEWROUTE = 24

T = TypeVar("T")


class NetnsMissing(DataplaneError):
    """The pod's network namespace path does not exist (or is not a namespace)."""


class PodInterfaceExists(DataplaneError):
    """The pod namespace already has an interface with the requested name."""


@dataclass(frozen=True)
class PodLink:
    """What ADD created: both ends of the veth pair and their MACs."""

    host_veth: str
    host_mac: str
    ifname: str
    pod_mac: str


# --- pure helpers ---------------------------------------------------------------


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


def _ifinfo(index: int = 0, flags: int = 0, change: int = 0) -> bytes:
    return rtnl.IFINFO.pack(socket.AF_UNSPEC, 0, index, flags, change)


def _name_attr(name: str) -> bytes:
    return rtnl.attr(rtnl.IFLA_IFNAME, name.encode() + b"\0")


def _u32(attr_type: int, value: int) -> bytes:
    return rtnl.attr(attr_type, rtnl.U32.pack(value))


def bridge_request(name: str, mtu: int, mac: str) -> rtnl.Request:
    body = (
        _ifinfo(flags=rtnl.IFF_UP, change=rtnl.IFF_UP)
        + _name_attr(name)
        + _u32(rtnl.IFLA_MTU, mtu)
        + rtnl.attr(rtnl.IFLA_ADDRESS, rtnl.mac_bytes(mac))
        + rtnl.attr(rtnl.IFLA_LINKINFO, rtnl.attr(rtnl.IFLA_INFO_KIND, b"bridge"))
    )
    return rtnl.Request(rtnl.RTM_NEWLINK, rtnl.NLM_F_CREATE | rtnl.NLM_F_EXCL, body)


def veth_request(
    host: str, host_mac: str, peer: str, peer_mac: str, netns_fd: int, mtu: int, master: int
) -> rtnl.Request:
    peer_msg = (
        _ifinfo()
        + _name_attr(peer)
        + _u32(rtnl.IFLA_NET_NS_FD, netns_fd)
        + _u32(rtnl.IFLA_MTU, mtu)
        + rtnl.attr(rtnl.IFLA_ADDRESS, rtnl.mac_bytes(peer_mac))
    )
    info = rtnl.attr(rtnl.IFLA_INFO_KIND, b"veth") + rtnl.attr(
        rtnl.IFLA_INFO_DATA, rtnl.attr(rtnl.VETH_INFO_PEER, peer_msg)
    )
    body = (
        _ifinfo(flags=rtnl.IFF_UP, change=rtnl.IFF_UP)
        + _name_attr(host)
        + _u32(rtnl.IFLA_MTU, mtu)
        + rtnl.attr(rtnl.IFLA_ADDRESS, rtnl.mac_bytes(host_mac))
        + _u32(rtnl.IFLA_MASTER, master)
        + rtnl.attr(rtnl.IFLA_LINKINFO, info)
    )
    return rtnl.Request(rtnl.RTM_NEWLINK, rtnl.NLM_F_CREATE | rtnl.NLM_F_EXCL, body)


def hairpin_request(port: str, on: bool) -> rtnl.Request:
    """``ip link set <port> type bridge_slave hairpin on``, addressed by name."""
    info = rtnl.attr(rtnl.IFLA_INFO_SLAVE_KIND, b"bridge") + rtnl.attr(
        rtnl.IFLA_INFO_SLAVE_DATA, rtnl.attr(rtnl.IFLA_BRPORT_MODE, bytes([int(on)]))
    )
    return rtnl.Request(
        rtnl.RTM_NEWLINK, 0, _ifinfo() + _name_attr(port) + rtnl.attr(rtnl.IFLA_LINKINFO, info)
    )


def address_request(index: int, address: IPInterface, delete: bool = False) -> rtnl.Request:
    """Add (replace) or delete an address; an IPv6 one skips DAD (module doc)."""
    net = address.network
    v6 = address.version == 6
    family = _AF_INET6 if v6 else socket.AF_INET
    body = (
        rtnl.IFADDR.pack(family, net.prefixlen, 0, rtnl.RT_SCOPE_UNIVERSE, index)
        + rtnl.attr(rtnl.IFA_LOCAL, address.ip.packed)
        + rtnl.attr(rtnl.IFA_ADDRESS, address.ip.packed)
    )
    if v6 and not delete:
        body += _u32(_IFA_FLAGS, _IFA_F_NODAD)
    elif not v6 and net.prefixlen < 31:
        body += rtnl.attr(rtnl.IFA_BROADCAST, net.broadcast_address.packed)
    if delete:
        return rtnl.Request(rtnl.RTM_DELADDR, 0, body)
    return rtnl.Request(rtnl.RTM_NEWADDR, rtnl.NLM_F_CREATE | rtnl.NLM_F_REPLACE, body)


def link_set_request(index: int, up: bool | None = None, mtu: int | None = None) -> rtnl.Request:
    flags = change = 0
    if up is not None:
        flags, change = (rtnl.IFF_UP if up else 0), rtnl.IFF_UP
    body = _ifinfo(index, flags, change) + (_u32(rtnl.IFLA_MTU, mtu) if mtu else b"")
    return rtnl.Request(rtnl.RTM_NEWLINK, 0, body)


def delete_request(name: str) -> rtnl.Request:
    return rtnl.Request(rtnl.RTM_DELLINK, 0, _ifinfo() + _name_attr(name))


def delete_index_request(index: int) -> rtnl.Request:
    return rtnl.Request(rtnl.RTM_DELLINK, 0, _ifinfo(index))


def alias_request(name: str, alias: str) -> rtnl.Request:
    body = _ifinfo() + _name_attr(name) + rtnl.attr(rtnl.IFLA_IFALIAS, alias.encode())
    return rtnl.Request(rtnl.RTM_NEWLINK, 0, body)


def pod_route_request(index: int, gateway: IPAddress, dst: IPNetwork) -> rtnl.Request:
    """A route in the pod via the gateway, created only if none exists for ``dst``:
    a route the plugin did not add (another interface's default) is never replaced."""
    if dst.version == 4 and isinstance(gateway, IPv4Address):
        route = rtnl.route_request(
            False, rtnl.RTPROT_BOOT, dst.network_address.packed, dst.prefixlen, gateway, index
        )
        return rtnl.Request(route.msg_type, rtnl.NLM_F_CREATE | rtnl.NLM_F_EXCL, route.body)
    if dst.version != gateway.version:
        raise ValueError(f"route to {dst} via {gateway}: the families differ")
    head = rtnl.RTMSG.pack(
        _AF_INET6, dst.prefixlen, 0, 0, rtnl.RT_TABLE_MAIN, rtnl.RTPROT_BOOT,
        rtnl.RT_SCOPE_UNIVERSE, rtnl.RTN_UNICAST, 0,
    )  # fmt: skip
    body = (
        head
        + rtnl.attr(_RTA_DST, dst.network_address.packed)
        + _u32(_RTA_OIF, index)
        + rtnl.attr(_RTA_GATEWAY, gateway.packed)
    )
    return rtnl.Request(rtnl.RTM_NEWROUTE, rtnl.NLM_F_CREATE | rtnl.NLM_F_EXCL, body)


DEFAULT_ROUTE = IPv4Network("0.0.0.0/0")
DEFAULT_ROUTE6 = IPv6Network("::/0")


def default_route(family: int) -> IPNetwork:
    return DEFAULT_ROUTE6 if family == 6 else DEFAULT_ROUTE


# --- reading addresses and routes of both families ----------------------------------


@dataclass(frozen=True)
class AddrInfo:
    ifindex: int
    address: IPInterface
    flags: int  # IFA_F_*

    @property
    def tentative(self) -> bool:
        return bool(self.flags & _IFA_F_TENTATIVE)

    @property
    def dad_failed(self) -> bool:
        return bool(self.flags & _IFA_F_DADFAILED)


def dump_addresses(sock: nl.NetlinkSocket, ifindex: int = 0) -> list[AddrInfo]:
    """Addresses of both families (of one link when ``ifindex``), with their flags."""
    rows = []
    for buf, offset, length, msg_type in sock.dump(
        _RTM_GETADDR, rtnl.IFADDR.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
    ):
        if msg_type != _RTM_NEWADDR:
            continue
        head = rtnl.IFADDR.unpack_from(buf, offset + rtnl.HDR.size)
        family, prefixlen, flags, _scope, index = head
        if ifindex and index != ifindex:
            continue
        attrs = rtnl.parse_attrs(buf, offset + rtnl.HDR.size + rtnl.IFADDR.size, offset + length)
        raw = attrs.get(rtnl.IFA_LOCAL) or attrs.get(rtnl.IFA_ADDRESS)
        if raw is None or family not in (socket.AF_INET, _AF_INET6):
            continue
        if _IFA_FLAGS in attrs:
            flags = rtnl.U32.unpack(attrs[_IFA_FLAGS])[0]
        interface: IPInterface = (
            IPv6Interface((IPv6Address(raw), prefixlen))
            if family == _AF_INET6
            else IPv4Interface((IPv4Address(raw), prefixlen))
        )
        rows.append(AddrInfo(index, interface, flags))
    return rows


@dataclass(frozen=True)
class RouteInfo:
    dst: IPNetwork
    gateway: IPAddress | None
    oif: int


def dump_routes(sock: nl.NetlinkSocket) -> list[RouteInfo]:
    """Main-table routes of both families: destination, gateway, device."""
    rows = []
    for family in (socket.AF_INET, _AF_INET6):
        head = rtnl.RTMSG.pack(family, 0, 0, 0, 0, 0, 0, 0, 0)
        for buf, offset, length, msg_type in sock.dump(_RTM_GETROUTE, head):
            if msg_type != _RTM_NEWROUTE:
                continue
            fam, dst_len, _s, _t, table, _p, _sc, _rt, _f = rtnl.RTMSG.unpack_from(
                buf, offset + rtnl.HDR.size
            )
            if fam != family or table != rtnl.RT_TABLE_MAIN:
                continue
            attrs = rtnl.parse_attrs(buf, offset + rtnl.HDR.size + rtnl.RTMSG.size, offset + length)
            size = 16 if family == _AF_INET6 else 4
            raw_dst = attrs.get(_RTA_DST, bytes(size))
            raw_gw = attrs.get(_RTA_GATEWAY)
            oif = rtnl.U32.unpack(attrs[_RTA_OIF])[0] if _RTA_OIF in attrs else 0
            dst: IPNetwork = (
                IPv6Network((IPv6Address(raw_dst), dst_len))
                if family == _AF_INET6
                else IPv4Network((IPv4Address(raw_dst), dst_len))
            )
            gw = ip_address(raw_gw) if raw_gw and len(raw_gw) == size else None
            rows.append(RouteInfo(dst, gw, oif))
    return rows


def write_sysctl(path: str, value: str) -> None:
    """Write ``/proc/sys/<path>`` in the calling thread's network namespace."""
    try:
        with open(f"/proc/sys/{path}", "w", encoding="ascii") as f:
            f.write(value)
    except OSError as e:
        raise DataplaneError(
            f"cannot set {path.replace('/', '.')}={value} ({e.strerror}); the agent needs"
            " write access to /proc/sys/net"
        ) from e


def read_sysctl(path: str) -> str | None:
    try:
        with open(f"/proc/sys/{path}", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


def _settle(
    sock: nl.NetlinkSocket, ifindex: int, what: str, wanted: Sequence[IPInterface] = ()
) -> None:
    """Wait until no IPv6 address of ``ifindex`` (only those in ``wanted``, if given) is
    tentative; fail at once on DADFAILED, after SETTLE_SECONDS otherwise."""
    deadline = time.monotonic() + SETTLE_SECONDS
    pause = 0.001
    while True:
        pending = [
            a for a in dump_addresses(sock, ifindex)
            if a.address.version == 6 and (not wanted or a.address in wanted)
            and (a.tentative or a.dad_failed)
        ]  # fmt: skip
        failed = [a for a in pending if a.dad_failed]
        if failed:
            raise DataplaneError(
                f"{what}: address {failed[0].address} failed duplicate address detection;"
                " another host on the link uses it"
            )
        if not pending:
            return
        if time.monotonic() > deadline:
            raise DataplaneError(
                f"{what}: address {pending[0].address} is still tentative after"
                f" {SETTLE_SECONDS:g} s; check that the link is up"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.05)


# --- reading links ----------------------------------------------------------------


@dataclass(frozen=True)
class LinkInfo:
    index: int
    name: str
    up: bool
    mtu: int
    mac: str | None
    kind: str | None
    master: int  # 0: none
    alias: str | None = None


def get_link(sock: nl.NetlinkSocket, name: str) -> LinkInfo | None:
    body = _ifinfo() + _u32(rtnl.IFLA_EXT_MASK, rtnl.RTEXT_FILTER_SKIP_STATS) + _name_attr(name)
    reply, answers = sock.request(rtnl.Request(rtnl.RTM_GETLINK, 0, body))
    for buf, offset, length, msg_type in answers:
        if msg_type != rtnl.RTM_NEWLINK:
            continue
        row = rtnl.decode_link(buf, offset, length)
        attrs = rtnl.parse_attrs(buf, offset + rtnl.HDR.size + rtnl.IFINFO.size, offset + length)
        master = rtnl.U32.unpack(attrs[rtnl.IFLA_MASTER])[0] if rtnl.IFLA_MASTER in attrs else 0
        raw_alias = attrs.get(rtnl.IFLA_IFALIAS)
        alias = raw_alias.rstrip(b"\0").decode(errors="replace") if raw_alias else None
        return LinkInfo(
            row.index, row.name, bool(row.flags & rtnl.IFF_UP), row.mtu, row.mac, row.kind,
            master, alias,
        )  # fmt: skip
    if reply.error in (0, errno.ENODEV):
        return None
    raise DataplaneError(f"cannot read link {name}: {_why(reply)}")


def _why(reply: rtnl.Reply) -> str:
    name = errno.errorcode.get(reply.error, str(reply.error))
    return f"{reply.message or os.strerror(reply.error)} ({name})"


def _check(replies: Sequence[rtnl.Reply], what: Sequence[str]) -> None:
    for reply, label in zip(replies, what, strict=True):
        if reply.error:
            raise DataplaneError(f"cannot {label}: {_why(reply)}")


def _open_netns(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise NetnsMissing(
            f"network namespace {path} cannot be opened ({e.strerror}); the container is gone"
            " or CNI_NETNS is wrong"
        ) from e


# --- the adapter --------------------------------------------------------------------


class PodNetwork:
    """Pod plumbing for the network namespace of the calling thread (the node's).

    Thread-safe: every call opens its own raw netlink socket (~20 µs); only the
    bridge's creation is serialised.
    """

    def __init__(self) -> None:
        self._bridge_lock = threading.Lock()
        # bridge name -> (ifindex, gateways present, monotonic time of the next full check)
        self._bridges: dict[str, tuple[int, frozenset[IPInterface], float]] = {}
        # bridge ifindex -> its IPv6 gateways seen usable (not tentative) after an ADD
        self._settled: dict[int, set[IPAddress]] = {}

    # -- the bridge

    def ensure_bridge(self, gateways: Sequence[IPInterface], mtu: int, bridge: str = "cni0") -> int:
        """Make ``bridge`` exist, up, with ``mtu`` and every gateway address; return its index.

        Every ADD calls this, so the common case is one GETLINK: the addresses are
        re-read only when the link changed, a gateway is new, or the last full
        check is older than BRIDGE_RECHECK_SECONDS (someone may have removed one).
        """
        wanted = frozenset(gateways)
        with nl.NetlinkSocket() as sock:
            link = get_link(sock, bridge)
            known = self._bridges.get(bridge)
            if (
                link is not None
                and known is not None
                and known[0] == link.index
                and link.up
                and link.mtu == mtu
                and wanted <= known[1]
                and time.monotonic() < known[2]
            ):
                return link.index
            with self._bridge_lock:
                index = self._ensure_bridge(sock, bridge, gateways, mtu)
                expires = time.monotonic() + BRIDGE_RECHECK_SECONDS
                self._bridges[bridge] = (index, wanted, expires)
                return index

    def remove_gateway(self, gateway: IPInterface, bridge: str = "cni0") -> None:
        """Take a released lease's gateway off the bridge. Its on-link route goes with
        it, so the node no longer takes that subnet (soon another node's) for local."""
        with nl.NetlinkSocket() as sock, self._bridge_lock:
            self._bridges.pop(bridge, None)
            link = get_link(sock, bridge)
            if link is None:
                return
            self._settled.pop(link.index, None)
            replies = sock.batch([address_request(link.index, gateway, delete=True)])
            if replies[0].error not in (0, errno.EADDRNOTAVAIL):
                _check(replies, [f"remove gateway address {gateway} from {bridge}"])

    def _ensure_bridge(
        self, sock: nl.NetlinkSocket, bridge: str, gateways: Sequence[IPInterface], mtu: int
    ) -> int:
        link = get_link(sock, bridge)
        if link is None:
            mac = pod_mac(gateways[0].ip) if gateways else random_mac()
            replies = sock.batch([bridge_request(bridge, mtu, mac)])
            if replies[0].error not in (0, errno.EEXIST):
                _check(replies, [f"create bridge {bridge}"])
            link = get_link(sock, bridge)
            if link is None:
                raise DataplaneError(f"bridge {bridge} vanished right after its creation")
        if link.kind != "bridge":
            raise DataplaneError(
                f"{bridge} exists but is a {link.kind or 'plain'} device, not a bridge;"
                ' delete it or set another "bridge" in the CNI config'
            )
        fixes: list[rtnl.Request] = []
        labels: list[str] = []
        if not link.up or link.mtu != mtu:
            fixes.append(link_set_request(link.index, up=True, mtu=mtu))
            labels.append(f"set {bridge} up with MTU {mtu}")
        have = {a.address for a in dump_addresses(sock, link.index)}
        if any(gw.version == 6 for gw in gateways):
            # As the reference bridge plugin: the bridge owns its routes (no RA), and the
            # node forwards IPv6 for its pods.
            write_sysctl(f"net/ipv6/conf/{bridge}/accept_ra", "0")
            if read_sysctl(f"net/ipv6/conf/{bridge}/disable_ipv6") == "1":
                write_sysctl(f"net/ipv6/conf/{bridge}/disable_ipv6", "0")
            if read_sysctl("net/ipv6/conf/all/forwarding") != "1":
                write_sysctl("net/ipv6/conf/all/forwarding", "1")
        for gw in gateways:
            if gw not in have:
                self._settled.pop(link.index, None)
                fixes.append(address_request(link.index, gw))
                labels.append(f"add gateway address {gw} to {bridge}")
        if fixes:
            _check(sock.batch(fixes), labels)
        return link.index

    # -- pods

    def add_pod(
        self,
        netns: str,
        ifname: str,
        host_veth: str,
        bridge_index: int,
        addresses: Sequence[IPInterface],
        routes: Sequence[PodRoute],
        mtu: int,
        hairpin: bool = True,
        owner: str | None = None,
        netns_fd: int | None = None,
    ) -> PodLink:
        """Create and configure the pod's veth pair: ``addresses`` (one per family, the
        first names the MAC), ``routes`` (destination, gateway) in the pod, hairpin mode
        on the host port when ``hairpin``. ``owner`` (``veth_owner``) becomes the host
        end's alias. Returns once every IPv6 address of the pod interface and every IPv6
        gateway on the bridge is usable (not tentative). All or nothing: on failure
        nothing is left."""
        link = PodLink(host_veth, random_mac(), ifname, pod_mac(addresses[0].ip))
        owner = owner or veth_owner(netns, "", ifname)
        self._create_veth(netns, netns_fd, link, bridge_index, mtu, hairpin, owner)
        try:
            self._configure_pod_side(netns, netns_fd, ifname, addresses, routes)
            v6_gateways = {gw for _, gw in routes if gw.version == 6}
            if v6_gateways - self._settled.get(bridge_index, set()):
                with nl.NetlinkSocket() as sock:
                    wanted = [
                        a.address for a in dump_addresses(sock, bridge_index)
                        if a.address.ip in v6_gateways
                    ]  # fmt: skip
                    _settle(sock, bridge_index, "the bridge's IPv6 gateway", wanted)
                # Added without DAD, a gateway never turns tentative again; a re-added one
                # (ensure_bridge) is checked again.
                self._settled.setdefault(bridge_index, set()).update(v6_gateways)
        except BaseException:
            self.delete_host_veth(host_veth, owner)
            raise
        return link

    def _create_veth(
        self,
        netns: str,
        netns_fd: int | None,
        link: PodLink,
        bridge_index: int,
        mtu: int,
        hairpin: bool,
        owner: str,
    ) -> None:
        fd = _open_netns(netns) if netns_fd is None else netns_fd
        try:
            create = veth_request(
                link.host_veth, link.host_mac, link.ifname, link.pod_mac, fd, mtu, bridge_index
            )
            # The alias and hairpin go in a second datagram, once the link is ours: sent
            # with the create, they would also apply to another pod's link of that name.
            # Hairpin off is the kernel's default for a new port: nothing to send.
            settle = [alias_request(link.host_veth, owner)]
            if hairpin:
                settle.append(hairpin_request(link.host_veth, True))
            with nl.NetlinkSocket() as sock:
                replies = sock.batch([create])
                stale = get_link(sock, link.host_veth) if replies[0].error == errno.EEXIST else None
                if stale is not None:
                    # No alias: an earlier try of ours that died before setting it.
                    if stale.alias not in (owner, None):
                        raise DataplaneError(
                            f"host veth name {link.host_veth} is taken by another pod's"
                            f" interface (alias {stale.alias!r}); delete that pod first"
                        )
                    # Our own leftover (same owner; ADDs of one container are
                    # serialised): a crashed earlier try.
                    _check(sock.batch([delete_index_request(stale.index)]), ["delete stale veth"])
                    replies = sock.batch([create])
                if replies[0].error == errno.EEXIST:
                    raise PodInterfaceExists(
                        f"the pod namespace {netns} already has an interface named {link.ifname};"
                        " pick another CNI_IFNAME or delete the old attachment first"
                    )
                _check(replies, [f"create veth pair {link.host_veth}/{link.ifname}"])
                try:
                    _check(
                        sock.batch(settle),
                        [
                            f"set the alias of {link.host_veth}",
                            f"turn hairpin mode on for {link.host_veth}",
                        ][: len(settle)],
                    )
                except DataplaneError:
                    sock.batch([delete_request(link.host_veth)])
                    raise
        finally:
            if netns_fd is None:  # ours; the caller's fd is the caller's to close
                os.close(fd)

    def _configure_pod_side(
        self,
        netns: str,
        netns_fd: int | None,
        ifname: str,
        addresses: Sequence[IPInterface],
        routes: Sequence[PodRoute],
    ) -> None:
        v6 = any(a.version == 6 for a in addresses)

        def inside() -> None:
            with nl.NetlinkSocket() as sock:
                link = get_link(sock, ifname)
                if link is None:
                    raise DataplaneError(f"{ifname} did not appear in the pod namespace {netns}")
                if v6:  # before the link is up: no DAD for any address (reference bridge)
                    for name in ("lo", ifname):
                        if read_sysctl(f"net/ipv6/conf/{name}/disable_ipv6") == "1":
                            write_sysctl(f"net/ipv6/conf/{name}/disable_ipv6", "0")
                    write_sysctl(f"net/ipv6/conf/{ifname}/accept_dad", "0")
                    # As the reference's IPAM does: the pod may take its link down and up
                    # without losing its IPv6 address.
                    write_sysctl(f"net/ipv6/conf/{ifname}/keep_addr_on_down", "1")
                replies = sock.batch(
                    [
                        link_set_request(link.index, up=True),
                        *(address_request(link.index, a) for a in addresses),
                        *(pod_route_request(link.index, gw, dst) for dst, gw in routes),
                    ]
                )
                for reply, (dst, _) in zip(replies[1 + len(addresses) :], routes, strict=True):
                    if reply.error == errno.EEXIST:
                        raise DataplaneError(
                            f"the pod namespace {netns} already has a route to {dst} that"
                            " flannelpy did not add; set isDefaultGateway to false in one"
                            " of the pod's networks"
                        )
                _check(
                    replies,
                    [
                        f"set {ifname} up in {netns}",
                        *(f"add address {a} to {ifname} in {netns}" for a in addresses),
                        *(f"add the route to {dst} via {gw} in {netns}" for dst, gw in routes),
                    ],
                )
                if v6:
                    _settle(sock, link.index, f"{ifname} in {netns}")

        _in_netns(netns, netns_fd, inside)

    def delete_host_veth(self, host_veth: str, owner: str | None = None) -> bool:
        """Delete a pod's veth pair by its host end; already gone is success. With
        ``owner``, a link whose alias names another owner is left alone (False); one
        without an alias predates aliases and is taken as ours."""
        with nl.NetlinkSocket() as sock:
            if owner is None:
                reply = sock.batch([delete_request(host_veth)])[0]
            else:
                link = get_link(sock, host_veth)
                if link is None:
                    return True
                if link.alias is not None and link.alias != owner:
                    log.warning(
                        "not deleting a veth of another pod veth=%s alias=%s", host_veth, link.alias
                    )
                    return False
                reply = sock.batch([delete_index_request(link.index)])[0]
        if reply.error and reply.error not in _GONE:
            raise DataplaneError(f"cannot delete veth {host_veth}: {_why(reply)}")
        return True

    def delete_in_netns(self, netns: str, ifname: str, netns_fd: int | None = None) -> None:
        """Delete ``ifname`` inside ``netns``; a missing namespace or link is success."""

        def inside() -> None:
            with nl.NetlinkSocket() as sock:
                reply = sock.batch([delete_request(ifname)])[0]
            if reply.error and reply.error not in _GONE:
                raise DataplaneError(f"cannot delete {ifname} in {netns}: {_why(reply)}")

        try:
            _in_netns(netns, netns_fd, inside)
        except NetnsMissing:
            return

    def link(self, name: str) -> LinkInfo | None:
        """A link of the node namespace, or None."""
        with nl.NetlinkSocket() as sock:
            return get_link(sock, name)

    def check_pod(
        self,
        netns: str,
        ifname: str,
        host_veth: str,
        bridge: str,
        addresses: Sequence[IPInterface],
        routes: Sequence[PodRoute],
        mtu: int | None = None,
        netns_fd: int | None = None,
    ) -> list[str]:
        """What is wrong with a pod's plumbing, one sentence each; empty when all is well."""
        problems: list[str] = []
        with nl.NetlinkSocket() as sock:
            br = get_link(sock, bridge)
            host = get_link(sock, host_veth)
        if br is None:
            problems.append(f"bridge {bridge} does not exist")
        if host is None:
            problems.append(f"host veth {host_veth} does not exist")
        elif br is not None and host.master != br.index:
            problems.append(f"host veth {host_veth} is not attached to {bridge}")
        elif not host.up:
            problems.append(f"host veth {host_veth} is down")
        if br is not None:
            with nl.NetlinkSocket() as sock:
                have = {a.address.ip for a in dump_addresses(sock, br.index)}
            for gw in sorted({gw for _, gw in routes}, key=lambda g: (g.version, g)):
                if gw not in have:
                    problems.append(f"bridge {bridge} lacks the gateway address {gw}")
        problems += _in_netns(netns, netns_fd, _pod_problems, netns, ifname, addresses, mtu, routes)
        return problems


def _pod_problems(
    netns: str,
    ifname: str,
    addresses: Sequence[IPInterface],
    mtu: int | None,
    routes: Sequence[PodRoute],
) -> list[str]:
    with nl.NetlinkSocket() as sock:
        link = get_link(sock, ifname)
        if link is None:
            return [f"{ifname} does not exist in {netns}"]
        problems = []
        if not link.up:
            problems.append(f"{ifname} is down in {netns}")
        if mtu and link.mtu != mtu:
            problems.append(f"{ifname} has MTU {link.mtu} in {netns}, expected {mtu}")
        have = {a.address: a for a in dump_addresses(sock, link.index)}
        for address in addresses:
            found = have.get(address)
            if found is None:
                problems.append(f"{ifname} lacks address {address} in {netns}")
            elif found.tentative or found.dad_failed:
                state = "failed duplicate address detection" if found.dad_failed else "tentative"
                problems.append(f"address {address} of {ifname} in {netns} is {state}")
        have_routes = {(r.dst, r.gateway) for r in dump_routes(sock) if r.oif == link.index}
        for dst, gateway in routes:
            if (dst, gateway) not in have_routes:
                what = "default route" if dst.prefixlen == 0 else f"route to {dst}"
                problems.append(f"{netns} has no {what} via {gateway} on {ifname}")
        return problems


def _in_netns(netns: str, netns_fd: int | None, fn: Callable[..., T], *args: Any) -> T:
    """Run ``fn`` in a thread inside the namespace (``netns_fd`` if given, else the path
    ``netns``); a namespace we cannot enter raises NetnsMissing."""
    entered: list[bool] = []

    def target() -> T:
        entered.append(True)
        return fn(*args)

    try:
        return run_in_netns(netns if netns_fd is None else netns_fd, target)
    except DataplaneError as e:
        if entered:
            raise
        raise NetnsMissing(
            f"network namespace {netns} cannot be entered ({e}); the container is gone"
            " or CNI_NETNS is wrong"
        ) from e


def gateway_of(subnet: IPNetwork) -> IPInterface:
    """The gateway address of a lease: its first address, with the lease's prefix."""
    if isinstance(subnet, IPv6Network):
        return IPv6Interface((subnet.network_address + 1, subnet.prefixlen))
    return IPv4Interface((subnet.network_address + 1, subnet.prefixlen))
