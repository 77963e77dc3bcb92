"""Which routes another Flannel left are ours to take over (dataplane.adopt), and the
start-up overlap check that no longer counts them (agent.compose)."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Network

import pytest

from flannelpy.agent.compose import _left_by_flannel
from flannelpy.dataplane.adopt import RTPROT_BOOT, FlannelRouteShape
from flannelpy.dataplane.diff import diff
from flannelpy.dataplane.kernel import ForeignRoute
from flannelpy.dataplane.state import DesiredState, ObservedState, Route
from flannelpy.errors import ConfigError
from flannelpy.subnet.survey import check_no_overlap

SHAPE = FlannelRouteShape(IPv4Network("10.244.0.0/16"), 24, "flannel.1", "eth0")
STATIC = 4  # RTPROT_STATIC


@pytest.mark.parametrize(
    ("dst", "gateway", "dev", "protocol", "adoptable"),
    [
        # flanneld's vxlan route: via the peer's VTEP address on flannel.1
        ("10.244.5.0/24", "10.244.5.0", "flannel.1", RTPROT_BOOT, True),
        # flanneld's host-gw / DirectRouting route: via the peer's public IP on the underlay
        ("10.244.5.0/24", "100.64.0.5", "eth0", RTPROT_BOOT, True),
        # an operator's static route into the Network stays foreign
        ("10.244.5.0/24", "100.64.0.5", "eth0", STATIC, False),
        ("10.244.5.0/25", "100.64.0.5", "eth0", RTPROT_BOOT, False),  # not a lease's length
        ("10.245.5.0/24", "100.64.0.5", "eth0", RTPROT_BOOT, False),  # outside the Network
        ("10.244.5.0/24", "100.64.0.5", "eth1", RTPROT_BOOT, False),  # another device
        ("10.244.5.0/24", "10.244.9.0", "flannel.1", RTPROT_BOOT, False),  # not its VTEP
        ("10.244.5.0/24", "10.244.9.1", "eth0", RTPROT_BOOT, False),  # via the overlay
        ("10.244.5.0/24", None, "eth0", RTPROT_BOOT, False),  # no gateway: a connected one
    ],
)
def test_only_routes_of_flannels_shape_are_adoptable(
    dst: str, gateway: str | None, dev: str, protocol: int, adoptable: bool
) -> None:
    via = IPv4Address(gateway) if gateway else None
    assert SHAPE.adoptable(IPv4Network(dst), via, dev, protocol) is adoptable


def _route(dst: str, gateway: str, dev: str, protocol: int) -> ForeignRoute:
    net = IPv4Network(dst)
    return ForeignRoute(
        net, f"route {net} via {gateway} dev {dev}", protocol, IPv4Address(gateway), dev
    )


def test_the_overlap_check_skips_what_flanneld_left_and_still_refuses_the_rest() -> None:
    network = IPv4Network("10.244.0.0/16")
    left = [
        _route("10.244.5.0/24", "100.64.0.5", "eth0", RTPROT_BOOT),
        _route("10.244.6.0/24", "100.64.0.6", "eth0", RTPROT_BOOT),
    ]
    # As flanneld leaves a host-gw node, the check refused to start (the old behaviour).
    with pytest.raises(ConfigError, match=r"overlaps route 10\.244\.5\.0/24"):
        check_no_overlap(network, left, allow_overlap=False)
    check_no_overlap(network, [r for r in left if not _left_by_flannel(r, SHAPE)], False)
    static = _route("10.244.7.0/24", "100.64.0.7", "eth0", STATIC)
    address = ForeignRoute(
        IPv4Network("10.244.8.0/24"),
        "address 10.244.8.1/24 on eth0",
        device="eth0",
        is_address=True,
    )
    kept = [r for r in [*left, static, address] if not _left_by_flannel(r, SHAPE)]
    assert kept == [static, address]
    with pytest.raises(ConfigError, match=r"10\.244\.7\.0/24"):
        check_no_overlap(network, kept, allow_overlap=False)


def test_a_taken_over_route_is_replaced_when_wanted_and_deleted_when_not() -> None:
    live = Route(IPv4Network("10.244.5.0/24"), IPv4Address("10.244.5.0"), "flannel.1", True)
    departed = Route(IPv4Network("10.244.6.0/24"), IPv4Address("10.244.6.0"), "flannel.1", True)
    left = [Route(r.dst, r.gateway, r.ifname, True, RTPROT_BOOT) for r in (live, departed)]
    observed = ObservedState(routes=frozenset(left))
    changes = diff(DesiredState(routes=frozenset({live})), observed)
    assert changes.routes_to_set == (live,)  # one replace re-tags it: no gap
    assert [r.dst for r in changes.routes_to_delete] == [departed.dst]
    assert changes.routes_to_delete[0].protocol == RTPROT_BOOT  # deleted with its own
    # Once ours, nothing to do.
    assert diff(
        DesiredState(routes=frozenset({live})), ObservedState(routes=frozenset({live}))
    ).empty
