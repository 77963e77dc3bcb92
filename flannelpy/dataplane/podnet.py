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
     up (ENOTCONN), hence step 3. A second datagram, once the link is ours, sets
     the host end's alias (its owner, see below) and hairpin mode when asked.
pod namespace (a short-lived thread that ``setns()`` into it: a socket opened
there costs ~0.3 ms, where pyroute2's ``IPRoute(netns=...)`` forks a helper, ~6 ms)
  3. One datagram: the pod end up, its address, the default route via the gateway.

MACs, the host end's name and its owner come from :mod:`.podnames`; IPv6's sysctls
and the wait for its addresses to leave tentative, from :mod:`.podipv6`.

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

Everything goes through :mod:`.nlbatch` (raw rtnetlink) with :mod:`.rtnl`'s
requests: one ADD is a handful of messages, and pyroute2's per-call overhead
(~0.5 ms) would be most of the budget.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from flannelpy.dataplane import linkdelete, podipv6, rtnl
from flannelpy.dataplane import nlbatch as nl
from flannelpy.dataplane.netns import CannotEnterNetns, run_in_netns, visiting_netns
from flannelpy.dataplane.podnames import (
    IPAddress,
    IPInterface,
    PodRoute,
    interface_of,
    pod_mac,
    random_mac,
    veth_owner,
)
from flannelpy.errors import DataplaneError

log = logging.getLogger(__name__)

BRIDGE_RECHECK_SECONDS = 5.0  # how stale ensure_bridge's knowledge of the addresses may get
# How long a bridge found as wanted is used without asking the kernel again: a burst of
# ADDs asks once, not once per pod (a GETLINK of a bridge with 100 ports, decoded).
BRIDGE_TRUST_SECONDS = 1.0

_GONE = {errno.ENODEV, errno.ENOENT, errno.ESRCH}


def _answered() -> None:
    """Nothing left to wait for."""


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


@dataclass(frozen=True)
class LinkInfo:
    """A link as pod plumbing reads it (:class:`.rtnl.LinkRow`, its flags read)."""

    index: int
    name: str
    up: bool
    mtu: int
    mac: str | None
    kind: str | None
    master: int  # 0: none
    alias: str | None = None


def get_link(sock: nl.NetlinkSocket, name: str) -> LinkInfo | None:
    """One link by name, or None; the kernel's refusal is a DataplaneError."""
    try:
        row = nl.get_link(sock, name)
    except nl.KernelRefused as e:
        raise DataplaneError(f"cannot read link {name}: {_why(e.reply)}") from e
    if row is None:
        return None
    up = bool(row.flags & rtnl.IFF_UP)
    return LinkInfo(row.index, row.name, up, row.mtu, row.mac, row.kind, row.master, row.alias)


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
        # bridge name -> (ifindex, gateways present, monotonic time of the next full check,
        # MTU, monotonic time until which it is used without asking the kernel)
        self._bridges: dict[str, tuple[int, frozenset[IPInterface], float, int, float]] = {}
        # bridge ifindex -> its IPv6 gateways seen usable (not tentative) after an ADD
        self._settled: dict[int, set[IPAddress]] = {}

    # -- the bridge

    def ensure_bridge(self, gateways: Sequence[IPInterface], mtu: int, bridge: str = "cni0") -> int:
        """Make ``bridge`` exist, up, with ``mtu`` and every gateway address; return its index.

        Every ADD calls this, so the common case asks the kernel nothing: a bridge found
        as wanted less than BRIDGE_TRUST_SECONDS ago is used as it was (a veth that
        cannot be created ends that trust: the runtime's retry looks again). Else one
        GETLINK: the addresses are re-read only when the link changed, a gateway is new,
        or the last full check is older than BRIDGE_RECHECK_SECONDS (someone may have
        removed one).
        """
        wanted = frozenset(gateways)
        known = self._bridges.get(bridge)
        now = time.monotonic()
        if known is not None and wanted <= known[1] and known[3] == mtu and now < known[4]:
            return known[0]
        with nl.NetlinkSocket() as sock:
            link = get_link(sock, bridge)
            if (
                link is not None
                and known is not None
                and known[0] == link.index
                and link.up
                and link.mtu == mtu
                and wanted <= known[1]
                and now < known[2]
            ):
                self._bridges[bridge] = (*known[:4], now + BRIDGE_TRUST_SECONDS)
                return link.index
            with self._bridge_lock:
                index = self._ensure_bridge(sock, bridge, gateways, mtu)
                now = time.monotonic()
                expires = now + BRIDGE_RECHECK_SECONDS
                self._bridges[bridge] = (index, wanted, expires, mtu, now + BRIDGE_TRUST_SECONDS)
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
            replies = sock.batch([rtnl.address_request(link.index, gateway, delete=True)])
            if replies[0].error not in (0, errno.EADDRNOTAVAIL):
                _check(replies, [f"remove gateway address {gateway} from {bridge}"])

    def _ensure_bridge(
        self, sock: nl.NetlinkSocket, bridge: str, gateways: Sequence[IPInterface], mtu: int
    ) -> int:
        link = get_link(sock, bridge)
        if link is None:
            mac = pod_mac(gateways[0].ip) if gateways else random_mac()
            replies = sock.batch([rtnl.bridge_request(bridge, mtu, mac)])
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
            fixes.append(rtnl.link_set_request(link.index, up=True, mtu=mtu))
            labels.append(f"set {bridge} up with MTU {mtu}")
        have = {interface_of(a) for a in nl.dump_link_addresses(sock, link.index)}
        if any(gw.version == 6 for gw in gateways):
            podipv6.enable_on_bridge(bridge)
        for gw in gateways:
            if gw not in have:
                self._settled.pop(link.index, None)
                fixes.append(rtnl.address_request(link.index, gw))
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
        host_mac: str | None = None,
    ) -> PodLink:
        """Create and configure the pod's veth pair: ``addresses`` (one per family, the
        first names the MAC), ``routes`` (destination, gateway) in the pod, hairpin mode
        on the host port when ``hairpin``. ``owner`` (``veth_owner``) becomes the host
        end's alias; ``host_mac`` (default: a random one) the host end's MAC. Returns once
        every IPv6 address of the pod interface and every IPv6 gateway on the bridge is
        usable (not tentative). All or nothing: on failure nothing is left."""
        link = PodLink(host_veth, host_mac or random_mac(), ifname, pod_mac(addresses[0].ip))
        owner = owner or veth_owner(netns, "", ifname)
        try:
            self._create_veth(netns, netns_fd, link, bridge_index, mtu, hairpin, owner)
        except DataplaneError:
            self._bridges.clear()  # the bridge may be gone: the next ADD asks the kernel
            raise
        try:
            self._configure_pod_side(netns, netns_fd, ifname, addresses, routes)
            v6_gateways = {gw for _, gw in routes if gw.version == 6}
            if v6_gateways - self._settled.get(bridge_index, set()):
                with nl.NetlinkSocket() as sock:
                    rows = nl.dump_link_addresses(sock, bridge_index)
                    wanted = [interface_of(a) for a in rows if a.address in v6_gateways]
                    podipv6.settle(sock, bridge_index, "the bridge's IPv6 gateway", wanted)
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
            create = rtnl.veth_request(
                link.host_veth, link.host_mac, link.ifname, link.pod_mac, fd, mtu, bridge_index
            )
            # The alias and hairpin go in a second datagram, once the link is ours: sent
            # with the create, they would also apply to another pod's link of that name.
            # Hairpin off is the kernel's default for a new port: nothing to send.
            settle = [rtnl.link_alias_request(link.host_veth, owner)]
            if hairpin:
                settle.append(rtnl.hairpin_request(link.host_veth, True))
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
                    _check(
                        sock.batch([rtnl.link_delete_index_request(stale.index)]),
                        ["delete stale veth"],
                    )
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
                    sock.batch([rtnl.link_delete_request(link.host_veth)])
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
                if v6:
                    podipv6.prepare_pod_interface(ifname)
                replies = sock.batch(
                    [
                        rtnl.link_set_request(link.index, up=True),
                        *(rtnl.address_request(link.index, a) for a in addresses),
                        *(rtnl.route_add_request(link.index, gw, dst) for dst, gw in routes),
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
                    podipv6.settle(sock, link.index, f"{ifname} in {netns}")

        _visiting(netns, netns_fd, inside)

    def delete_host_veth(self, host_veth: str, owner: str | None = None) -> bool:
        """Delete a pod's veth pair by its host end; already gone is success. With
        ``owner``, a link whose alias names another owner is left alone (False); one
        without an alias predates aliases and is taken as ours."""
        with nl.NetlinkSocket() as sock:
            if owner is None:
                reply = sock.batch([rtnl.link_delete_request(host_veth)])[0]
            else:
                link = get_link(sock, host_veth)
                if link is None:
                    return True
                if link.alias is not None and link.alias != owner:
                    log.warning(
                        "not deleting a veth of another pod veth=%s alias=%s", host_veth, link.alias
                    )
                    return False
                reply = sock.batch([rtnl.link_delete_index_request(link.index)])[0]
        if reply.error and reply.error not in _GONE:
            raise DataplaneError(f"cannot delete veth {host_veth}: {_why(reply)}")
        return True

    def start_delete_host_veth(
        self, host_veth: str, owner: str | None = None
    ) -> Callable[[], None]:
        """``delete_host_veth`` that returns as soon as the pair has left both namespaces,
        before the kernel's answer (:func:`linkdelete.delete_link`: about 16 ms sooner);
        call what it returns to wait for that answer, which raises as
        ``delete_host_veth`` does. An answer that came first (an error) raises here."""
        with nl.NetlinkSocket() as sock:
            link = get_link(sock, host_veth)
        if link is None:
            return _answered
        if owner is not None and link.alias is not None and link.alias != owner:
            log.warning(
                "not deleting a veth of another pod veth=%s alias=%s", host_veth, link.alias
            )
            return _answered
        gone, pending = linkdelete.delete_link(link.index)

        def answer() -> None:
            reply = pending.wait()
            if reply.error and reply.error not in _GONE:
                raise DataplaneError(f"cannot delete veth {host_veth}: {_why(reply)}")

        if not gone:
            answer()
            return _answered
        return answer

    def delete_in_netns(self, netns: str, ifname: str, netns_fd: int | None = None) -> None:
        """Delete ``ifname`` inside ``netns``; a missing namespace or link is success."""

        def inside() -> None:
            with nl.NetlinkSocket() as sock:
                reply = sock.batch([rtnl.link_delete_request(ifname)])[0]
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
                have = {a.address for a in nl.dump_link_addresses(sock, br.index)}
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
        have = {interface_of(a): a for a in nl.dump_link_addresses(sock, link.index)}
        for address in addresses:
            found = have.get(address)
            if found is None:
                problems.append(f"{ifname} lacks address {address} in {netns}")
            elif (state := podipv6.dad_state(found)) is not None:
                problems.append(f"address {address} of {ifname} in {netns} is {state}")
        rows = nl.dump_routes(sock) + nl.dump_routes(sock, family=rtnl.AF_INET6)
        have_routes = {(r.dst, r.dst_len, r.gateway) for r in rows if r.oif == link.index}
        for dst, gateway in routes:
            if (dst.network_address, dst.prefixlen, gateway) not in have_routes:
                what = "default route" if dst.prefixlen == 0 else f"route to {dst}"
                problems.append(f"{netns} has no {what} via {gateway} on {ifname}")
        return problems


def _visiting(netns: str, netns_fd: int | None, fn: Callable[[], None]) -> None:
    """Run ``fn`` with the calling thread inside the namespace (``netns_fd`` if given, else
    the path ``netns``) and back (:func:`.netns.visiting_netns`): ADD's pod side, where a
    thread started and joined per pod cost two scheduler waits under load; a namespace
    we cannot enter raises NetnsMissing."""
    fd = _open_netns(netns) if netns_fd is None else netns_fd
    try:
        with visiting_netns(fd):
            fn()
    except CannotEnterNetns as e:
        raise NetnsMissing(
            f"network namespace {netns} cannot be entered ({e}); the container is gone"
            " or CNI_NETNS is wrong"
        ) from e
    finally:
        if netns_fd is None:
            os.close(fd)


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
