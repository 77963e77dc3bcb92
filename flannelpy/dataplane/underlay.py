"""Which interface carries the overlay: Flannel's choice (``--iface``, ``--iface-regex``,
``--iface-can-reach``, else the default route's device), without I/O.

:func:`~flannelpy.dataplane.netlink_host.find_underlay` reads the interfaces and routes
and hands them to :func:`choose_underlay`; unit tests pass their own.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Interface, IPv6Address, IPv6Interface

from flannelpy.dataplane.state import UnderlayInterface
from flannelpy.errors import InterfaceNotFound


@dataclass(frozen=True)
class Interface:
    """What the underlay choice needs to know about one interface."""

    name: str
    index: int
    mtu: int
    addresses: tuple[IPv4Interface, ...]  # IPv4 only, kernel order (primary first)
    addresses6: tuple[IPv6Interface, ...] = ()  # IPv6, kernel order
    # Of addresses6, those flagged temporary, deprecated or DAD-failed (IFA_F_*): they
    # rotate or are going away, so no endpoint is built on them.
    unstable6: frozenset[IPv6Address] = frozenset()


def global_ipv6(iface: Interface) -> IPv6Interface | None:
    """The interface's first IPv6 address usable as a VXLAN/route endpoint: global scope
    (ULA included), not link-local, multicast or loopback, and neither temporary (a
    privacy address, replaced every few hours) nor deprecated (preferred lifetime 0:
    on its way out) nor DAD-failed. Flannel's IPv6 auto-detection skips the same
    (its #2295); peers would otherwise be given an address that soon stops working."""
    for addr in iface.addresses6:
        ip = addr.ip
        if ip in iface.unstable6:
            continue
        if not (ip.is_link_local or ip.is_multicast or ip.is_loopback or ip.is_unspecified):
            return addr
    return None


def _underlay(
    iface: Interface, ip: IPv4Address | None, public_ip: IPv4Address | None
) -> UnderlayInterface:
    networks = tuple(dict.fromkeys(a.network for a in iface.addresses))
    v6 = global_ipv6(iface)
    networks6 = tuple(
        dict.fromkeys(
            a.network for a in iface.addresses6 if not a.ip.is_link_local and a.network.prefixlen
        )
    )
    return UnderlayInterface(
        name=iface.name,
        index=iface.index,
        ip=ip,
        networks=networks,
        mtu=iface.mtu,
        ip6=v6.ip if v6 is not None else None,
        networks6=networks6,
    )


def _names(interfaces: Sequence[Interface]) -> str:
    return ", ".join(i.name for i in interfaces) or "no interfaces"


def _match_explicit(
    spec: str, interfaces: Sequence[Interface]
) -> tuple[Interface, IPv4Address] | str:
    """An ``--iface`` value (a name or an IPv4 address) → (interface, its IP), or why not."""
    try:
        wanted: IPv4Address | None = IPv4Address(spec)
    except ValueError:
        wanted = None
    for iface in interfaces:
        if wanted is not None:
            if any(a.ip == wanted for a in iface.addresses):
                return iface, wanted
        elif iface.name == spec:
            if not iface.addresses:
                return f"{spec} has no IPv4 address"
            return iface, iface.addresses[0].ip
    # A missing name needs no explanation: the error lists the names there are.
    return f"no interface has address {spec}" if wanted else ""


def _compile_iface_regex(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise InterfaceNotFound(
            f"--iface-regex {pattern!r} is not a valid regular expression: {e}"
        ) from e


def _match_regex(
    pattern: str, interfaces: Sequence[Interface]
) -> tuple[Interface, IPv4Address] | None:
    """Flannel's order: the regex is tried against every IPv4 address, then every name."""
    regex = _compile_iface_regex(pattern)
    for iface in interfaces:
        for addr in iface.addresses:
            if regex.search(str(addr.ip)):
                return iface, addr.ip
    for iface in interfaces:
        if iface.addresses and regex.search(iface.name):
            return iface, iface.addresses[0].ip
    return None


def choose_underlay(
    interfaces: Sequence[Interface],
    ifaces: Sequence[str] = (),
    iface_regexes: Sequence[str] = (),
    can_reach: IPv4Address | None = None,
    reach_route: tuple[int, IPv4Address | None] | None = None,
    default_oif: int | None = None,
    public_ip: IPv4Address | None = None,
) -> UnderlayInterface:
    """Flannel's interface choice, without I/O.

    ``reach_route`` is the kernel's (oif, preferred source) towards ``can_reach``;
    ``default_oif`` the device of the first default route. When --iface or
    --iface-regex are given and none matches, that is an error: falling back to
    the default route would silently put the overlay on the wrong network.
    """
    if ifaces or iface_regexes:
        return _choose_explicit(interfaces, ifaces, iface_regexes, public_ip)
    by_index = {i.index: i for i in interfaces}
    if can_reach is not None:
        if reach_route is None or reach_route[0] not in by_index:
            raise InterfaceNotFound(
                f"no route to --iface-can-reach {can_reach} leaves through an interface;"
                f" the node has {_names(interfaces)}"
            )
        iface = by_index[reach_route[0]]
        ip = reach_route[1] or (iface.addresses[0].ip if iface.addresses else None)
        if ip is None:
            raise InterfaceNotFound(
                f"{iface.name}, the interface towards {can_reach}, has no IPv4 address"
            )
        return _underlay(iface, ip, public_ip)
    if default_oif is None or default_oif not in by_index:
        raise InterfaceNotFound(
            "there is no IPv4 default route to choose the interface from;"
            f" pass --iface or --iface-regex (the node has {_names(interfaces)})"
        )
    iface = by_index[default_oif]
    if not iface.addresses:
        raise InterfaceNotFound(f"{iface.name}, the default route's interface, has no IPv4 address")
    return _underlay(iface, iface.addresses[0].ip, public_ip)


def _choose_explicit(
    interfaces: Sequence[Interface],
    ifaces: Sequence[str],
    iface_regexes: Sequence[str],
    public_ip: IPv4Address | None,
) -> UnderlayInterface:
    reasons: list[str] = []
    for spec in ifaces:
        found = _match_explicit(spec, interfaces)
        if isinstance(found, str):
            reasons += [found] if found else []
            continue
        return _underlay(found[0], found[1], public_ip)
    for pattern in iface_regexes:
        match = _match_regex(pattern, interfaces)
        if match is not None:
            return _underlay(match[0], match[1], public_ip)
    asked = [f"--iface {s}" for s in ifaces] + [f"--iface-regex {p}" for p in iface_regexes]
    why = f" ({'; '.join(reasons)})" if reasons else ""
    raise InterfaceNotFound(
        f"no interface matches {' or '.join(asked)}{why}; the node has {_names(interfaces)}"
    )


def choose_underlay_v6(
    interfaces: Sequence[Interface],
    ifaces: Sequence[str] = (),
    iface_regexes: Sequence[str] = (),
    default_oif6: int | None = None,
) -> UnderlayInterface:
    """The IPv6-only choice: ``--iface`` (a name or an IPv6 address), ``--iface-regex``
    (against names), else the IPv6 default route's device; the interface needs a
    global IPv6 address, and has no IPv4 one to use (``ip`` is None)."""
    candidates: list[Interface] = []
    for spec in ifaces:
        try:
            wanted: IPv6Address | None = IPv6Address(spec)
        except ValueError:
            wanted = None
        candidates += [
            i
            for i in interfaces
            if i.name == spec or (wanted is not None and any(a.ip == wanted for a in i.addresses6))
        ]
    for pattern in iface_regexes:
        regex = _compile_iface_regex(pattern)
        candidates += [i for i in interfaces if regex.search(i.name)]
    if not ifaces and not iface_regexes:
        candidates = [i for i in interfaces if i.index == default_oif6]
    for iface in candidates:
        if global_ipv6(iface) is not None:
            return _underlay(iface, None, None)
    raise InterfaceNotFound(
        "IPv6-only: no interface with a stable global IPv6 address (neither temporary "
        "nor deprecated) matches "
        + (
            " or ".join(
                [f"--iface {s}" for s in ifaces] + [f"--iface-regex {p}" for p in iface_regexes]
            )
            or "the IPv6 default route"
        )
        + f"; pass --iface with one of {_names(interfaces)}"
    )
