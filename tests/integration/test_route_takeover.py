"""Taking over the routes another Flannel left, on a real kernel (NetlinkKernel.adopt).

Routes are added the way flanneld adds them (no protocol: the kernel records ``boot``).
With the shape set, observe reports them, a desired one is re-tagged by one replace,
a departed peer's is deleted, and routes of another shape are left alone.
"""

from __future__ import annotations

from collections.abc import Iterator
from ipaddress import IPv4Address, IPv4Interface, IPv4Network

import pytest

from flannelpy.dataplane.adopt import RTPROT_BOOT, FlannelRouteShape
from flannelpy.dataplane.diff import diff
from flannelpy.dataplane.netlink import NetlinkKernel
from flannelpy.dataplane.state import Address, Changes, DesiredState, Route, VxlanLink
from tests.support.netns_util import Netns, is_root, temp_netns

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(not is_root(), reason="network namespaces need root"),
]

DEV = "flannel.1"
LINK = VxlanLink(DEV, 1, IPv4Address("192.168.50.2"), "u0", 8472, 1450, None)
SHAPE = FlannelRouteShape(IPv4Network("10.100.0.0/16"), 24, DEV, "u0")


@pytest.fixture
def node() -> Iterator[Netns]:
    with temp_netns("tk") as ns:
        ns.veth("u0", "192.168.50.2/24")
        kernel = NetlinkKernel()
        vtep = Address(DEV, IPv4Interface("10.100.9.0/32"))
        result = ns.call(kernel.apply, Changes(links_to_create=(LINK,), addresses_to_add=(vtep,)))
        assert result.failures == ()
        yield ns


def test_flanneld_routes_are_taken_over_and_departed_ones_removed(node: Netns) -> None:
    node.ip(f"route add 10.100.1.0/24 via 10.100.1.0 dev {DEV} onlink")  # a live peer (vxlan)
    node.ip(f"route add 10.100.2.0/24 via 10.100.2.0 dev {DEV} onlink")  # a departed one
    node.ip("route add 10.100.3.0/24 via 192.168.50.3 dev u0")  # host-gw, departed
    node.ip("route add 10.100.4.0/25 via 192.168.50.4 dev u0")  # not a lease: foreign
    node.ip("route add 10.100.5.0/24 via 192.168.50.5 dev u0 proto static")  # foreign
    kernel = NetlinkKernel()
    # Without the shape (the old behaviour) they are invisible, and never cleaned.
    assert node.call(kernel.observe, [DEV], [DEV]).routes == frozenset()

    kernel.adopt_routes(SHAPE)
    observed = node.call(kernel.observe, [DEV], [DEV])
    assert {(str(r.dst), r.protocol) for r in observed.routes} == {
        ("10.100.1.0/24", RTPROT_BOOT),
        ("10.100.2.0/24", RTPROT_BOOT),
        ("10.100.3.0/24", RTPROT_BOOT),
    }
    live = Route(IPv4Network("10.100.1.0/24"), IPv4Address("10.100.1.0"), DEV, onlink=True)
    changes = diff(
        DesiredState(
            links=frozenset({LINK}), routes=frozenset({live}), owned_devices=frozenset({DEV})
        ),
        observed,
    )
    result = node.call(kernel.apply, changes)
    assert result.failures == ()
    assert node.ip("route show proto 75").strip() == (
        f"10.100.1.0/24 via 10.100.1.0 dev {DEV} onlink"
    )
    left = node.ip("route show")
    assert "10.100.2.0/24" not in left and "10.100.3.0/24" not in left
    assert "10.100.4.0/25 via 192.168.50.4 dev u0" in left
    assert "10.100.5.0/24 via 192.168.50.5 dev u0 proto static" in left
    assert node.call(kernel.observe, [DEV], [DEV]).routes == frozenset({live})


def test_survey_reports_what_tells_a_left_route_from_a_foreign_one(node: Netns) -> None:
    node.ip("route add 10.100.3.0/24 via 192.168.50.3 dev u0")
    node.ip("route add 10.100.5.0/24 via 192.168.50.5 dev u0 proto static")
    found = {str(r.network): r for r in node.call(NetlinkKernel().survey, [DEV])}
    left, static = found["10.100.3.0/24"], found["10.100.5.0/24"]
    assert (left.protocol, left.gateway, left.device) == (
        RTPROT_BOOT,
        IPv4Address("192.168.50.3"),
        "u0",
    )
    assert SHAPE.adoptable(left.network, left.gateway, left.device, left.protocol)
    assert not SHAPE.adoptable(static.network, static.gateway, static.device, static.protocol)
