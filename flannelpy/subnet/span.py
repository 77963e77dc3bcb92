"""Overlap and containment of networks, computed on their integers.

``ipaddress``'s own ``overlaps`` and ``subnet_of`` cache the broadcast address and the
host mask in each network they look at (functools.cached_property): two address
objects and a dict entry, about 190 bytes on every peer lease's subnet, kept for as
long as the lease. The lease checks and the planner ask these questions of every peer,
so they use these functions instead, which keep nothing and agree with ``ipaddress``
(the unit tests compare them) for networks of one family.
"""

from __future__ import annotations

from ipaddress import IPv4Network, IPv6Network

Network = IPv4Network | IPv6Network


def span(net: Network) -> tuple[int, int]:
    """The first and the last address of ``net``, as integers."""
    first = int(net.network_address)
    return first, first | ((1 << (net.max_prefixlen - net.prefixlen)) - 1)


def overlaps(a: Network, b: Network) -> bool:
    """Whether ``a`` and ``b`` share an address (never across families)."""
    ends = _ends(a, b)
    return ends is not None and ends[0] <= ends[3] and ends[2] <= ends[1]


def within(a: Network, b: Network) -> bool:
    """Whether ``a`` lies inside ``b`` (``a.subnet_of(b)``); never across families."""
    ends = _ends(a, b)
    return ends is not None and ends[2] <= ends[0] and ends[1] <= ends[3]


def _ends(a: Network, b: Network) -> tuple[int, int, int, int] | None:
    """``a``'s first and last address, then ``b``'s; None across families."""
    if a.version != b.version:
        return None
    return (*span(a), *span(b))
