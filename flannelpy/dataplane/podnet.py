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
(locally administered, unique per address on the node), the host end's random.

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
from ipaddress import IPv4Address, IPv4Interface, IPv4Network
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


def pod_mac(ip: IPv4Address) -> str:
    """``0a:58:`` + the address: locally administered, unicast, stable for an IP."""
    return "0a:58:" + ip.packed.hex(":")


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


def address_request(index: int, address: IPv4Interface, delete: bool = False) -> rtnl.Request:
    net = address.network
    body = (
        rtnl.IFADDR.pack(socket.AF_INET, net.prefixlen, 0, rtnl.RT_SCOPE_UNIVERSE, index)
        + rtnl.attr(rtnl.IFA_LOCAL, address.ip.packed)
        + rtnl.attr(rtnl.IFA_ADDRESS, address.ip.packed)
    )
    if net.prefixlen < 31:
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


def pod_route_request(index: int, gateway: IPv4Address, dst: IPv4Network) -> rtnl.Request:
    """A route in the pod via the gateway, created only if none exists for ``dst``:
    a route the plugin did not add (another interface's default) is never replaced."""
    route = rtnl.route_request(
        False, rtnl.RTPROT_BOOT, dst.network_address.packed, dst.prefixlen, gateway, index
    )
    return rtnl.Request(route.msg_type, rtnl.NLM_F_CREATE | rtnl.NLM_F_EXCL, route.body)


DEFAULT_ROUTE = IPv4Network("0.0.0.0/0")


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
        self._bridges: dict[str, tuple[int, frozenset[IPv4Interface], float]] = {}

    # -- the bridge

    def ensure_bridge(
        self, gateways: Sequence[IPv4Interface], mtu: int, bridge: str = "cni0"
    ) -> int:
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

    def remove_gateway(self, gateway: IPv4Interface, bridge: str = "cni0") -> None:
        """Take a released lease's gateway off the bridge. Its on-link route goes with
        it, so the node no longer takes that subnet (soon another node's) for local."""
        with nl.NetlinkSocket() as sock, self._bridge_lock:
            self._bridges.pop(bridge, None)
            link = get_link(sock, bridge)
            if link is None:
                return
            replies = sock.batch([address_request(link.index, gateway, delete=True)])
            if replies[0].error not in (0, errno.EADDRNOTAVAIL):
                _check(replies, [f"remove gateway address {gateway} from {bridge}"])

    def _ensure_bridge(
        self, sock: nl.NetlinkSocket, bridge: str, gateways: Sequence[IPv4Interface], mtu: int
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
        have = {
            IPv4Interface(f"{a.address}/{a.prefixlen}")
            for a in nl.dump_addresses(sock)
            if a.ifindex == link.index
        }
        for gw in gateways:
            if gw not in have:
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
        address: IPv4Interface,
        gateway: IPv4Address,
        mtu: int,
        hairpin: bool = True,
        owner: str | None = None,
        routes: Sequence[IPv4Network] = (DEFAULT_ROUTE,),
        netns_fd: int | None = None,
    ) -> PodLink:
        """Create and configure the pod's veth pair, with ``routes`` via the gateway in
        the pod (the default route unless told otherwise) and hairpin mode on the host
        port when ``hairpin``. ``owner`` (``veth_owner``) becomes the host end's alias.
        All or nothing: on failure nothing is left."""
        link = PodLink(host_veth, random_mac(), ifname, pod_mac(address.ip))
        owner = owner or veth_owner(netns, "", ifname)
        self._create_veth(netns, netns_fd, link, bridge_index, mtu, hairpin, owner)
        try:
            self._configure_pod_side(netns, netns_fd, ifname, address, gateway, routes)
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
        address: IPv4Interface,
        gateway: IPv4Address,
        routes: Sequence[IPv4Network],
    ) -> None:
        def inside() -> None:
            with nl.NetlinkSocket() as sock:
                link = get_link(sock, ifname)
                if link is None:
                    raise DataplaneError(f"{ifname} did not appear in the pod namespace {netns}")
                replies = sock.batch(
                    [
                        link_set_request(link.index, up=True),
                        address_request(link.index, address),
                        *(pod_route_request(link.index, gateway, dst) for dst in routes),
                    ]
                )
                for reply, dst in zip(replies[2:], routes, strict=True):
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
                        f"add address {address} to {ifname} in {netns}",
                        *(f"add the route to {dst} via {gateway} in {netns}" for dst in routes),
                    ],
                )

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
        address: IPv4Interface,
        gateway: IPv4Address,
        mtu: int | None = None,
        routes: Sequence[IPv4Network] = (DEFAULT_ROUTE,),
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
        problems += _in_netns(
            netns, netns_fd, _pod_problems, netns, ifname, address, gateway, mtu, routes
        )
        return problems


def _pod_problems(
    netns: str,
    ifname: str,
    address: IPv4Interface,
    gateway: IPv4Address,
    mtu: int | None,
    routes: Sequence[IPv4Network],
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
        have = {
            IPv4Interface(f"{a.address}/{a.prefixlen}")
            for a in nl.dump_addresses(sock)
            if a.ifindex == link.index
        }
        if address not in have:
            problems.append(f"{ifname} lacks address {address} in {netns}")
        have_routes = {
            (str(r.dst), r.dst_len)
            for r in nl.dump_routes(sock)
            if r.oif == link.index and r.gateway == gateway
        }
        for dst in routes:
            if (str(dst.network_address), dst.prefixlen) not in have_routes:
                what = "default route" if dst == DEFAULT_ROUTE else f"route to {dst}"
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


def gateway_of(subnet: IPv4Network) -> IPv4Interface:
    """The gateway address of a lease: its first address, with the lease's prefix."""
    return IPv4Interface(f"{subnet.network_address + 1}/{subnet.prefixlen}")
