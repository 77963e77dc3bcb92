"""The IPv6 underlay address is a stable one: never temporary, deprecated or DAD-failed
(Flannel #2295). The kernel's flags are read in tests/integration/test_netlink.py."""

from __future__ import annotations

from ipaddress import IPv4Interface, IPv6Address, IPv6Interface

import pytest

from flannelpy.dataplane.underlay import Interface, choose_underlay, choose_underlay_v6
from flannelpy.errors import InterfaceNotFound

# Kernel order: IPv6 addresses newest first, so the unstable ones come before.
ADDRESSES6 = (
    IPv6Interface("fd00:50::99/64"),  # deprecated (preferred_lft 0)
    IPv6Interface("fd00:51::8d32:e498:ad50:9d3f/64"),  # temporary (privacy)
    IPv6Interface("fd00:51::5/64"),  # stable
    IPv6Interface("fe80::1/64"),
)
UNSTABLE = frozenset(a.ip for a in ADDRESSES6[:2])


def _eth0(unstable: frozenset[IPv6Address] = UNSTABLE) -> Interface:
    return Interface("eth0", 2, 1500, (IPv4Interface("192.168.1.5/24"),), ADDRESSES6, unstable)


def test_dual_stack_takes_the_stable_ipv6_address() -> None:
    chosen = choose_underlay([_eth0()], default_oif=2)
    assert chosen.ip6 == IPv6Address("fd00:51::5")
    # Every prefix on the link still counts as on-link for direct routes.
    assert {str(n) for n in chosen.networks6} == {"fd00:50::/64", "fd00:51::/64"}


def test_ipv6_only_takes_the_stable_address_or_says_why_none() -> None:
    assert choose_underlay_v6([_eth0()], ["eth0"]).ip6 == IPv6Address("fd00:51::5")
    only_unstable = Interface("eth0", 2, 1500, (), ADDRESSES6[:2], UNSTABLE)
    with pytest.raises(InterfaceNotFound, match="neither temporary nor deprecated"):
        choose_underlay_v6([only_unstable], ["eth0"])
    assert (
        choose_underlay(
            [
                Interface(
                    "eth0", 2, 1500, (IPv4Interface("192.168.1.5/24"),), ADDRESSES6[:2], UNSTABLE
                )
            ],
            default_oif=2,
        ).ip6
        is None
    )
