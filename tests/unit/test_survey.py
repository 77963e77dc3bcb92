"""Overlap survey decisions (flannelpy.survey)."""

from __future__ import annotations

from ipaddress import IPv4Network

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flannelpy.dataplane.kernel import ForeignRoute
from flannelpy.errors import ConfigError
from flannelpy.subnet.survey import check_no_overlap, find_overlaps

NET = IPv4Network("10.244.0.0/16")


def route(cidr: str, dev: str = "eth1") -> ForeignRoute:
    return ForeignRoute(IPv4Network(cidr), f"route {cidr} dev {dev}")


@pytest.mark.parametrize(
    ("foreign", "expected"),
    [
        ([], []),
        (["10.244.0.0/16"], ["10.244.0.0/16"]),
        (["10.244.3.0/24"], ["10.244.3.0/24"]),  # inside Network
        (["10.0.0.0/8"], ["10.0.0.0/8"]),  # contains Network
        (["10.245.0.0/16", "10.243.255.0/24"], []),  # adjacent on both sides
        (["192.168.0.0/16", "10.244.255.255/32"], ["10.244.255.255/32"]),
        (["0.0.0.0/0"], []),  # the default route never counts
        (["0.0.0.0/1"], ["0.0.0.0/1"]),  # half the space is a real overlap
        (["10.244.9.0/24", "0.0.0.0/0", "10.244.1.0/24"], ["10.244.9.0/24", "10.244.1.0/24"]),
    ],
)
def test_find_overlaps(foreign: list[str], expected: list[str]) -> None:
    found = find_overlaps(NET, [route(c) for c in foreign])
    assert [str(r.network) for r in found] == expected


def test_check_names_the_overlap_and_the_way_out() -> None:
    with pytest.raises(ConfigError) as exc:
        check_no_overlap(NET, [route("10.244.0.0/16")], allow_overlap=False)
    assert str(exc.value) == (
        "Network 10.244.0.0/16 overlaps route 10.244.0.0/16 dev eth1 on this node; "
        "choose another Network or pass --allow-overlap"
    )


def test_check_counts_further_overlaps() -> None:
    foreign = [
        route("192.168.0.0/24"),
        ForeignRoute(IPv4Network("10.244.3.0/24"), "address 10.244.3.7/24 on eth0"),
        route("10.244.4.0/24", "eth2"),
        route("10.0.0.0/8", "eth3"),
    ]
    with pytest.raises(ConfigError) as exc:
        check_no_overlap(NET, foreign, allow_overlap=False)
    assert str(exc.value) == (
        "Network 10.244.0.0/16 overlaps address 10.244.3.7/24 on eth0 on this node "
        "(and 2 more); choose another Network or pass --allow-overlap"
    )


@pytest.mark.parametrize(
    ("foreign", "allow"),
    [
        ([], False),
        (["192.168.0.0/16", "0.0.0.0/0"], False),
        (["10.244.0.0/16"], True),
    ],
)
def test_check_passes(foreign: list[str], allow: bool) -> None:
    check_no_overlap(NET, [route(c) for c in foreign], allow_overlap=allow)  # must not raise


networks = st.builds(
    lambda addr, prefix: IPv4Network((addr, prefix), strict=False),
    st.integers(0, 2**32 - 1),
    st.integers(0, 32),
)


@given(networks, st.lists(networks, max_size=8))
def test_find_overlaps_matches_address_range_intersection(
    network: IPv4Network, others: list[IPv4Network]
) -> None:
    foreign = [ForeignRoute(n, f"route {n}") for n in others]

    def intersects(n: IPv4Network) -> bool:
        return int(n.network_address) <= int(network.broadcast_address) and int(
            network.network_address
        ) <= int(n.broadcast_address)

    expected = [f for f in foreign if f.network.prefixlen > 0 and intersects(f.network)]
    assert find_overlaps(network, foreign) == expected
