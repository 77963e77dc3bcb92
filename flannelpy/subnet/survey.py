"""Does the overlay Network collide with what is already on this node? (pure)

The kernel adapter's ``survey`` lists routes and addresses that are not ours;
this module only decides. An overlap means pod traffic would be routed to the
wrong place, so the agent refuses to start unless ``--allow-overlap`` is given.
"""

from __future__ import annotations

from collections.abc import Sequence
from ipaddress import IPv4Network

from flannelpy.dataplane.kernel import ForeignRoute
from flannelpy.errors import ConfigError


def find_overlaps(network: IPv4Network, foreign: Sequence[ForeignRoute]) -> list[ForeignRoute]:
    """The entries of ``foreign`` that overlap ``network``, in their given order.

    A default route (prefix length 0) overlaps everything by definition and says
    nothing about a conflict, so it never counts.
    """
    return [
        entry
        for entry in foreign
        if entry.network.prefixlen > 0 and entry.network.overlaps(network)
    ]


def check_no_overlap(
    network: IPv4Network, foreign: Sequence[ForeignRoute], allow_overlap: bool
) -> None:
    """Raise ConfigError naming the first overlap, unless ``allow_overlap``."""
    if allow_overlap:
        return
    overlaps = find_overlaps(network, foreign)
    if not overlaps:
        return
    more = len(overlaps) - 1
    also = f" (and {more} more)" if more else ""
    raise ConfigError(
        f"Network {network} overlaps {overlaps[0].description} on this node{also}; "
        "choose another Network or pass --allow-overlap"
    )
