"""Golden bytes of the VTEP's link requests (:mod:`flannelpy.dataplane.rtnl_vxlan`), read
back by pyroute2 (the encoder the agent used for them before) and by our own decoder."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address
from typing import Any

import pytest
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg

from flannelpy.dataplane import nlbatch, rtnl
from flannelpy.dataplane.netlink_observe import vxlan_link
from flannelpy.dataplane.rtnl_vxlan import link_mac_request, vxlan_request
from flannelpy.dataplane.state import VxlanLink

V4 = VxlanLink("flannel.1", 1, IPv4Address("198.18.0.1"), "ul0", 8472, 1450, "aa:bb:cc:dd:ee:01")


def decoded(req: rtnl.Request) -> Any:
    header = nlbatch.HDR.pack(nlbatch.HDR.size + len(req.body), req.msg_type, req.flags, 1, 0)
    msg = ifinfmsg(header + req.body)
    msg.decode()
    return msg


def test_vxlan_create_bytes() -> None:
    req = vxlan_request(V4, 7)
    assert (req.msg_type, req.flags) == (rtnl.RTM_NEWLINK, 0x400 | 0x200)  # CREATE | EXCL
    assert req.body.hex() == (
        "00000000" "00000000" "00000000" "00000000"  # ifinfomsg: AF_UNSPEC, down
        "0e000300" "666c616e6e656c2e31000000"  # IFLA_IFNAME "flannel.1\0"
        "08000400" "aa050000"  # IFLA_MTU 1450
        "0a000100" "aabbccddee010000"  # IFLA_ADDRESS
        "3c001200"  # IFLA_LINKINFO {
        "09000100" "76786c616e000000"  # IFLA_INFO_KIND "vxlan" (iproute2's: no NUL)
        "2c000200"  # IFLA_INFO_DATA {
        "08000100" "01000000"  # IFLA_VXLAN_ID 1
        "08000400" "c6120001"  # IFLA_VXLAN_LOCAL 198.18.0.1
        "08000300" "07000000"  # IFLA_VXLAN_LINK 7
        "06000f00" "21180000"  # IFLA_VXLAN_PORT 8472, big-endian
        "05000700" "00000000"  # IFLA_VXLAN_LEARNING 0 }}
    )  # fmt: skip


@pytest.mark.parametrize(
    ("link", "local"),
    [
        (V4, ("IFLA_VXLAN_LOCAL", "198.18.0.1")),
        (
            VxlanLink("flannel-v6.1", 1, IPv6Address("2001:2::1"), "ul0", 8472, 1430, None),
            ("IFLA_VXLAN_LOCAL6", "2001:2::1"),
        ),
        (
            VxlanLink(
                "flannel.9", 9, IPv4Address("10.0.0.5"), "ul0", 4789, 1400, None, gbp=True,
                learning=True,
            ),
            ("IFLA_VXLAN_LOCAL", "10.0.0.5"),
        ),
    ],
)  # fmt: skip
def test_vxlan_create_as_pyroute2_reads_it(link: VxlanLink, local: tuple[str, str]) -> None:
    msg = decoded(vxlan_request(link, 3))
    assert msg.get_attr("IFLA_IFNAME") == link.name
    assert msg.get_attr("IFLA_MTU") == link.mtu
    assert msg.get_attr("IFLA_ADDRESS") == link.mac  # None: the kernel chooses
    info = msg.get_attr("IFLA_LINKINFO")
    assert info.get_attr("IFLA_INFO_KIND") == "vxlan"
    data = dict(info.get_attr("IFLA_INFO_DATA")["attrs"])
    assert data.pop("IFLA_VXLAN_GBP", None) == (True if link.gbp else None)
    assert data == {
        "IFLA_VXLAN_ID": link.vni,
        local[0]: local[1],
        "IFLA_VXLAN_LINK": 3,
        "IFLA_VXLAN_PORT": link.port,
        "IFLA_VXLAN_LEARNING": int(link.learning),
    }


def test_vxlan_create_as_the_observer_reads_it() -> None:
    """What the reconciler compares a device with (``_vxlan_matches``) round-trips."""
    req = vxlan_request(V4, 7)
    header = nlbatch.HDR.pack(nlbatch.HDR.size + len(req.body), req.msg_type, req.flags, 1, 0)
    row = rtnl.decode_link(header + req.body, 0, nlbatch.HDR.size + len(req.body))
    assert (row.name, row.kind, row.mtu, row.mac) == ("flannel.1", "vxlan", 1450, V4.mac)
    have = vxlan_link(row, {7: "ul0"})
    assert (have.vni, have.local_ip, have.underlay, have.port, have.gbp, have.learning) == (
        1,
        IPv4Address("198.18.0.1"),
        "ul0",
        8472,
        False,
        False,
    )


def test_link_mac() -> None:
    req = link_mac_request(6, "0a:58:0a:f4:01:01")
    assert (req.msg_type, req.flags) == (rtnl.RTM_NEWLINK, 0)
    msg = decoded(req)
    assert (msg["index"], msg["flags"], msg["change"]) == (6, 0, 0)
    assert msg.get_attr("IFLA_ADDRESS") == "0a:58:0a:f4:01:01"
