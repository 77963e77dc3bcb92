"""The host around our entries: its interfaces and routes, read to choose the underlay
and to survey the routes that are not ours, and its sysctls.
"""

from __future__ import annotations

from collections.abc import Iterable
from ipaddress import IPv4Address, IPv4Interface, IPv4Network, IPv6Address, IPv6Interface

from flannelpy.dataplane import nlbatch as nl
from flannelpy.dataplane import rtnl
from flannelpy.dataplane.kernel import ForeignRoute
from flannelpy.dataplane.state import UnderlayInterface
from flannelpy.dataplane.underlay import Interface, choose_underlay, choose_underlay_v6
from flannelpy.errors import DataplaneError


def find_underlay(
    ifaces: Iterable[str] = (),
    iface_regexes: Iterable[str] = (),
    can_reach: IPv4Address | None = None,
    public_ip: IPv4Address | None = None,
    ipv6_only: bool = False,
) -> UnderlayInterface:
    """:meth:`~flannelpy.dataplane.kernel.Kernel.find_underlay` on this namespace's links."""
    with nl.NetlinkSocket(strict=True) as sock:
        interfaces = _interfaces(sock)
        if ipv6_only:
            return choose_underlay_v6(interfaces, tuple(ifaces), tuple(iface_regexes))
        reach_route = None
        if can_reach is not None:
            row = nl.route_get(sock, can_reach)
            src = row.prefsrc if row is not None else None
            src4 = src if isinstance(src, IPv4Address) else None
            reach_route = (row.oif, src4) if row is not None and row.oif else None
        default_oif = next(
            (
                r.oif
                for r in nl.dump_routes(sock)
                if r.dst_len == 0 and r.oif and r.route_type == rtnl.RTN_UNICAST
            ),
            None,
        )
    return choose_underlay(
        interfaces,
        tuple(ifaces),
        tuple(iface_regexes),
        can_reach,
        reach_route,
        default_oif,
        public_ip,
    )


def _interfaces(sock: nl.NetlinkSocket) -> list[Interface]:
    addrs: dict[int, list[IPv4Interface]] = {}
    for row in nl.dump_addresses(sock):
        addrs.setdefault(row.ifindex, []).append(IPv4Interface(f"{row.address}/{row.prefixlen}"))
    addrs6: dict[int, list[IPv6Interface]] = {}
    unstable6: dict[int, set[IPv6Address]] = {}
    for row6 in nl.dump_addresses6(sock):
        addrs6.setdefault(row6.ifindex, []).append(
            IPv6Interface(f"{row6.address}/{row6.prefixlen}")
        )
        if row6.flags & rtnl.IFA_F_UNSTABLE:
            unstable6.setdefault(row6.ifindex, set()).add(row6.address)
    return [
        Interface(
            link.name,
            link.index,
            link.mtu,
            tuple(addrs.get(link.index, ())),
            tuple(addrs6.get(link.index, ())),
            frozenset(unstable6.get(link.index, ())),
        )
        for link in sorted(nl.dump_links(sock), key=lambda r: r.index)
    ]


def survey(protocol: int, ignore_devices: Iterable[str]) -> list[ForeignRoute]:
    """:meth:`~flannelpy.dataplane.kernel.Kernel.survey`: ``protocol`` is ours."""
    ignored = set(ignore_devices)
    found: list[ForeignRoute] = []
    with nl.NetlinkSocket(strict=True) as sock:
        names = {link.index: link.name for link in nl.dump_links(sock)}
        for r in nl.dump_routes(sock):
            dev = names.get(r.oif, "")
            if r.protocol == protocol or r.dst_len == 0 or (dev and dev in ignored):
                continue
            net = IPv4Network(f"{r.dst}/{r.dst_len}", strict=False)
            via = f" via {r.gateway}" if r.gateway else ""
            where = f" dev {dev}" if dev else ""
            gw = r.gateway if isinstance(r.gateway, IPv4Address) else None
            found.append(ForeignRoute(net, f"route {net}{via}{where}", r.protocol, gw or None, dev))
        for a in nl.dump_addresses(sock):
            dev = names.get(a.ifindex, str(a.ifindex))
            if dev in ignored:
                continue
            iface = IPv4Interface(f"{a.address}/{a.prefixlen}")
            found.append(
                ForeignRoute(
                    iface.network, f"address {iface} on {dev}", device=dev, is_address=True
                )
            )
    return found


def sysctl_path(name: str) -> str:
    """``net.ipv4.ip_forward`` → /proc/sys/net/ipv4/ip_forward. Names holding a device
    with dots (``flannel.1``) must be given with slashes, as sysctl(8) accepts them."""
    return "/proc/sys/" + (name if "/" in name else name.replace(".", "/"))


def set_sysctl(name: str, value: str) -> None:
    """Write the sysctl only when it differs: in an unprivileged container (the DaemonSet's)
    /proc/sys is read-only, and a node set up for Kubernetes has most of ours on already."""
    path = sysctl_path(name)
    try:
        with open(path) as f:
            if f.read().strip() == value:
                return
    except OSError:
        pass  # unreadable or missing: the write below says why
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError as e:
        raise DataplaneError(f"cannot set sysctl {name} to {value} ({path}): {e.strerror}") from e
