"""Golden bytes of every netlink message we pack by hand (rtnl, nlbatch).

Each request is compared with pyroute2's own encoding of the same message
(pyroute2 is the reference: it is what the kernel-facing tests were first
written against). Where our encoding deliberately differs from pyroute2's (a
link kind sent without its NUL, as iproute2 sends it), the expected bytes are
fixed hex, and pyroute2 decodes them back to the fields we meant.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator
from ipaddress import IPv4Address, IPv4Interface, IPv6Address, IPv6Interface
from typing import Any

import pytest
from pyroute2.netlink.rtnl.ifaddrmsg import ifaddrmsg
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg
from pyroute2.netlink.rtnl.ndmsg import ndmsg
from pyroute2.netlink.rtnl.rtmsg import rtmsg

from flannelpy.dataplane import nlbatch, podnames, rtnl
from flannelpy.dataplane.netlink_events import (
    ECHO_SECONDS,
    OwnDeletions,
    event_kinds,
    fdb_key,
    neighbour_key,
    route_key,
)
from flannelpy.dataplane.rtnl import Request

MAC = "aa:bb:cc:dd:ee:01"
PEER_MAC = "0a:58:0a:f4:01:05"
OUR_PROTOCOL = 75  # the reconciler's route protocol


def encoded(msg: Any, fields: dict[str, Any], attrs: list[Any], req: Request) -> bytes:
    """pyroute2's bytes for ``msg`` with ``fields`` and ``attrs``, without the header."""
    for name, value in fields.items():
        msg[name] = value
    msg["attrs"] = attrs
    msg["header"]["type"] = req.msg_type
    msg["header"]["flags"] = req.flags
    msg.encode()
    data = bytes(msg.data)
    (length,) = struct.unpack_from("=I", data)
    assert length == len(data)
    return data[nlbatch.HDR.size :]


def decoded(msg_class: Any, req: Request) -> Any:
    """pyroute2's reading of ``req`` (header added), for the fixed-hex cases."""
    header = nlbatch.HDR.pack(nlbatch.HDR.size + len(req.body), req.msg_type, req.flags, 1, 0)
    msg = msg_class(header + req.body)
    msg.decode()
    return msg


# --- neighbours and FDB entries (rtnl) ------------------------------------------------


def test_neighbour_set_is_a_permanent_replace() -> None:
    req = rtnl.neigh_request(False, 3, IPv4Address("10.244.2.0"), MAC)
    assert (req.msg_type, req.flags) == (rtnl.RTM_NEWNEIGH, 0x400 | 0x100)
    assert req.body == encoded(
        ndmsg(),
        {"family": socket.AF_INET, "ifindex": 3, "state": 0x80, "flags": 0, "ndm_type": 0},
        [("NDA_DST", "10.244.2.0"), ("NDA_LLADDR", MAC)],
        req,
    )


def test_neighbour_delete_names_only_the_address() -> None:
    req = rtnl.neigh_request(True, 3, IPv4Address("10.244.2.0"))
    assert (req.msg_type, req.flags) == (rtnl.RTM_DELNEIGH, 0)
    assert req.body == encoded(
        ndmsg(),
        {"family": socket.AF_INET, "ifindex": 3, "state": 0x80},
        [("NDA_DST", "10.244.2.0")],
        req,
    )


@pytest.mark.parametrize(
    ("delete", "msg_type", "flags"),
    [(False, rtnl.RTM_NEWNEIGH, 0x400 | 0x100), (True, rtnl.RTM_DELNEIGH, 0)],
)
def test_fdb_entry_is_replaced_or_deleted_on_the_device_itself(
    delete: bool, msg_type: int, flags: int
) -> None:
    req = rtnl.fdb_request(delete, 7, MAC, IPv4Address("192.168.1.12"))
    assert (req.msg_type, req.flags) == (msg_type, flags)
    assert req.body == encoded(
        ndmsg(),
        {"family": rtnl.AF_BRIDGE, "ifindex": 7, "state": 0x80, "flags": 0x02},
        [("NDA_LLADDR", MAC), ("NDA_DST", "192.168.1.12")],
        req,
    )


# --- routes (rtnl) --------------------------------------------------------------------

DST = IPv4Interface("10.244.3.0/24").network


def test_route_via_a_gateway_is_a_universe_replace() -> None:
    req = rtnl.route_request(
        False, OUR_PROTOCOL, DST.network_address.packed, 24, IPv4Address("192.168.1.13"), oif=2
    )
    assert (req.msg_type, req.flags) == (rtnl.RTM_NEWROUTE, 0x400 | 0x100)
    assert req.body == encoded(
        rtmsg(),
        {
            "family": socket.AF_INET,
            "dst_len": 24,
            "table": 254,
            "proto": OUR_PROTOCOL,
            "scope": 0,
            "type": 1,
            "flags": 0,
        },
        [("RTA_DST", "10.244.3.0"), ("RTA_OIF", 2), ("RTA_GATEWAY", "192.168.1.13")],
        req,
    )


def test_onlink_route_sets_the_next_hop_flag() -> None:
    req = rtnl.route_request(
        False, OUR_PROTOCOL, DST.network_address.packed, 24, IPv4Address("10.244.3.0"), 9, True
    )
    assert req.body == encoded(
        rtmsg(),
        {
            "family": socket.AF_INET,
            "dst_len": 24,
            "table": 254,
            "proto": OUR_PROTOCOL,
            "scope": 0,
            "type": 1,
            "flags": 0x4,
        },
        [("RTA_DST", "10.244.3.0"), ("RTA_OIF", 9), ("RTA_GATEWAY", "10.244.3.0")],
        req,
    )


def test_route_without_a_gateway_has_link_scope() -> None:
    req = rtnl.route_request(False, OUR_PROTOCOL, DST.network_address.packed, 24, oif=4)
    assert req.body == encoded(
        rtmsg(),
        {
            "family": socket.AF_INET,
            "dst_len": 24,
            "table": 254,
            "proto": OUR_PROTOCOL,
            "scope": 253,
            "type": 1,
        },
        [("RTA_DST", "10.244.3.0"), ("RTA_OIF", 4)],
        req,
    )


def test_route_delete_names_only_destination_and_protocol() -> None:
    req = rtnl.route_request(True, OUR_PROTOCOL, DST.network_address.packed, 24)
    assert (req.msg_type, req.flags) == (rtnl.RTM_DELROUTE, 0)
    assert req.body == encoded(
        rtmsg(),
        {
            "family": socket.AF_INET,
            "dst_len": 24,
            "table": 254,
            "proto": OUR_PROTOCOL,
            "scope": 255,
            "type": 0,
        },
        [("RTA_DST", "10.244.3.0")],
        req,
    )


# --- dump and get requests (nlbatch) --------------------------------------------------


class RecordingSocket:
    """Stands in for NetlinkSocket: records what a dump helper asks, answers nothing."""

    def __init__(self) -> None:
        self.sent: list[Request] = []

    def dump(self, msg_type: int, body: bytes) -> Iterator[tuple[bytes, int, int, int]]:
        self.sent.append(Request(msg_type, 0, body))
        return iter(())

    def request(self, req: Request) -> tuple[rtnl.Reply, list[tuple[bytes, int, int, int]]]:
        self.sent.append(req)
        return rtnl.Reply(), []  # no answer: "none" to get_link and route_get


def sent_by(fn: Any, *args: Any) -> Request:
    sock = RecordingSocket()
    fn(sock, *args)
    [req] = sock.sent
    return req


def test_link_dump_skips_statistics() -> None:
    req = sent_by(nlbatch.dump_links)
    assert req.msg_type == rtnl.RTM_GETLINK
    assert req.body == encoded(ifinfmsg(), {"family": 0}, [("IFLA_EXT_MASK", 1 << 3)], req)


def test_link_stats_dump_asks_for_everything() -> None:
    req = sent_by(nlbatch.dump_link_stats)
    assert req.msg_type == rtnl.RTM_GETLINK
    assert req.body == encoded(ifinfmsg(), {"family": 0}, [], req)


def test_get_link_by_name() -> None:
    req = sent_by(nlbatch.get_link, "flannel.1")
    assert (req.msg_type, req.flags) == (rtnl.RTM_GETLINK, 0)
    assert req.body == encoded(
        ifinfmsg(), {"family": 0}, [("IFLA_EXT_MASK", 1 << 3), ("IFLA_IFNAME", "flannel.1")], req
    )


def test_route_dump_filters_on_table_and_protocol() -> None:
    req = sent_by(nlbatch.dump_routes, 254, OUR_PROTOCOL)
    assert req.msg_type == rtnl.RTM_GETROUTE
    assert req.body == encoded(
        rtmsg(), {"family": socket.AF_INET, "table": 254, "proto": OUR_PROTOCOL}, [], req
    )


def test_route_dump_of_a_table_above_255_names_it_in_an_attribute() -> None:
    req = sent_by(nlbatch.dump_routes, 1000)
    assert req.body == encoded(
        rtmsg(), {"family": socket.AF_INET, "table": 1000 & 0xFF}, [("RTA_TABLE", 1000)], req
    )


@pytest.mark.parametrize(("family", "ifindex"), [(socket.AF_INET, 0), (rtnl.AF_BRIDGE, 7)])
def test_neighbour_dump_names_the_device_in_an_attribute(family: int, ifindex: int) -> None:
    req = sent_by(nlbatch.dump_neighbours, family, ifindex)
    assert req.msg_type == rtnl.RTM_GETNEIGH
    attrs = [("NDA_IFINDEX", ifindex)] if ifindex else []
    assert req.body == encoded(ndmsg(), {"family": family, "ifindex": 0}, attrs, req)


def test_address_dump() -> None:
    req = sent_by(nlbatch.dump_addresses)
    assert req.msg_type == rtnl.RTM_GETADDR
    assert req.body == encoded(ifaddrmsg(), {"family": socket.AF_INET}, [], req)


def test_address_dump_of_both_families_is_one_request() -> None:
    req = sent_by(nlbatch.dump_link_addresses, 4)
    assert req.msg_type == rtnl.RTM_GETADDR
    assert req.body == encoded(ifaddrmsg(), {"family": socket.AF_UNSPEC}, [], req)


def test_route_get_asks_for_one_host() -> None:
    req = sent_by(nlbatch.route_get, IPv4Address("10.244.9.1"))
    assert (req.msg_type, req.flags) == (rtnl.RTM_GETROUTE, 0)
    assert req.body == encoded(
        rtmsg(), {"family": socket.AF_INET, "dst_len": 32}, [("RTA_DST", "10.244.9.1")], req
    )


# --- headers: what NetlinkSocket adds to each request ---------------------------------


class FakeKernel:
    """The raw socket under NetlinkSocket: records each send, answers it like the kernel."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self._queue: list[bytes] = []

    def send(self, data: bytes) -> int:
        self.sent.append(data)
        offset = 0
        last = None
        while offset < len(data):
            length, msg_type, flags, seq, _ = nlbatch.HDR.unpack_from(data, offset)
            last = (msg_type, flags, seq)
            offset += length
        assert last is not None
        _, flags, seq = last
        if flags & rtnl.NLM_F_DUMP == rtnl.NLM_F_DUMP:  # no request of ours sets both bits
            done = struct.pack("=i", 0)
            self._queue.append(
                nlbatch.HDR.pack(nlbatch.HDR.size + 4, rtnl.NLMSG_DONE, 2, seq, 0) + done
            )
        else:  # an ACK: error 0 and the request's header (NETLINK_CAP_ACK)
            ack = struct.pack("=i", 0) + data[offset - length : offset - length + 16]
            self._queue.append(
                nlbatch.HDR.pack(nlbatch.HDR.size + len(ack), rtnl.NLMSG_ERROR, 0x100, seq, 0) + ack
            )
        return len(data)

    def recv_into(self, buf: bytearray) -> int:
        data = self._queue.pop(0)
        buf[: len(data)] = data
        return len(data)


def fake_socket() -> tuple[nlbatch.NetlinkSocket, FakeKernel]:
    kernel = FakeKernel()
    sock = object.__new__(nlbatch.NetlinkSocket)
    sock.sock = kernel  # type: ignore[assignment]
    sock.seq = 0
    sock.buf = bytearray(nlbatch.RECV_BYTES)
    return sock, kernel


def whole(
    msg: Any, fields: dict[str, Any], attrs: list[Any], msg_type: int, flags: int, seq: int
) -> bytes:
    for name, value in fields.items():
        msg[name] = value
    msg["attrs"] = attrs
    msg["header"].update({"type": msg_type, "flags": flags, "sequence_number": seq, "pid": 0})
    msg.encode()
    return bytes(msg.data)


def test_a_batch_is_one_datagram_and_only_its_last_message_asks_for_an_ack() -> None:
    sock, kernel = fake_socket()
    first = rtnl.neigh_request(False, 3, IPv4Address("10.244.2.0"), MAC)
    second = rtnl.fdb_request(False, 3, MAC, IPv4Address("192.168.1.12"))
    assert sock.batch([first, second]) == [rtnl.Reply(), rtnl.Reply()]
    [datagram] = kernel.sent
    assert datagram == whole(
        ndmsg(),
        {"family": socket.AF_INET, "ifindex": 3, "state": 0x80},
        [("NDA_DST", "10.244.2.0"), ("NDA_LLADDR", MAC)],
        rtnl.RTM_NEWNEIGH,
        0x1 | 0x400 | 0x100,
        1,
    ) + whole(
        ndmsg(),
        {"family": rtnl.AF_BRIDGE, "ifindex": 3, "state": 0x80, "flags": 0x02},
        [("NDA_LLADDR", MAC), ("NDA_DST", "192.168.1.12")],
        rtnl.RTM_NEWNEIGH,
        0x1 | 0x4 | 0x400 | 0x100,
        2,
    )


def test_a_single_request_asks_for_an_ack() -> None:
    sock, kernel = fake_socket()
    req = rtnl.link_delete_request("veth1234abcd")
    reply, answers = sock.request(req)
    assert (reply, answers) == (rtnl.Reply(), [])
    assert kernel.sent == [
        whole(
            ifinfmsg(),
            {"family": 0},
            [("IFLA_IFNAME", "veth1234abcd")],
            rtnl.RTM_DELLINK,
            0x1 | 0x4,
            1,
        )
    ]


def test_a_dump_request_has_the_dump_flags() -> None:
    sock, kernel = fake_socket()
    assert nlbatch.dump_addresses(sock) == []
    assert kernel.sent == [
        whole(ifaddrmsg(), {"family": socket.AF_INET}, [], rtnl.RTM_GETADDR, 0x1 | 0x300, 1)
    ]


# --- rows decoded from what the kernel sends (rtnl) -----------------------------------


def test_a_link_row_names_its_bridge_and_its_alias() -> None:
    attrs = [
        ("IFLA_IFNAME", "veth0a1b2c3d"),
        ("IFLA_MTU", 1450),
        ("IFLA_MASTER", 5),
        ("IFLA_IFALIAS", "flannelpy 0a1b"),
    ]
    msg = whole(ifinfmsg(), {"family": 0, "index": 12}, attrs, rtnl.RTM_NEWLINK, 0, 1)
    row = rtnl.decode_link(msg, 0, len(msg))
    assert (row.index, row.name, row.mtu) == (12, "veth0a1b2c3d", 1450)
    assert (row.master, row.alias) == (5, "flannelpy 0a1b")
    lo = whole(
        ifinfmsg(), {"family": 0, "index": 1}, [("IFLA_IFNAME", "lo")], rtnl.RTM_NEWLINK, 0, 1
    )
    row = rtnl.decode_link(lo, 0, len(lo))
    assert (row.master, row.alias) == (0, None)


@pytest.mark.parametrize("name", ["veth0a1b2c3d", "flannel.1", "cni0"])
def test_the_event_filter_reads_a_links_name_as_decode_link_does(name: str) -> None:
    """The event filter reads a link's name with the scrape's in-place scan (about 20 link
    notifications per pod): wherever the name sits, it reads what decode_link reads."""
    attrs = [("IFLA_MTU", 1450), ("IFLA_MASTER", 5), ("IFLA_IFNAME", name), ("IFLA_TXQLEN", 0)]
    for msg_type in (rtnl.RTM_NEWLINK, rtnl.RTM_DELLINK):
        msg = whole(ifinfmsg(), {"family": 0, "index": 12}, attrs, msg_type, 0, 0)
        assert rtnl.decode_link_stats(msg, 0, len(msg)).name == name
        assert rtnl.decode_link(msg, 0, len(msg)).name == name
        assert event_kinds(msg) == (["link"] if name.startswith("flannel") else [])


@pytest.mark.parametrize(
    ("scope", "address", "kinds"),
    [(253, "fe80::1", []), (0, "fd00:10:244:1::", ["address"]), (0, "10.244.1.0", ["address"])],
)
def test_only_deleted_addresses_of_global_scope_wake_the_reconciler(
    scope: int, address: str, kinds: list[str]
) -> None:
    """A pod veth's link-local address goes with the veth at every DEL; the reconciler's
    own addresses (a VTEP's) are of global scope."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    fields = {"family": family, "prefixlen": 64, "scope": scope, "index": 4}
    msg = whole(ifaddrmsg(), fields, [("IFA_ADDRESS", address)], rtnl.RTM_DELADDR, 0, 0)
    assert event_kinds(msg) == kinds


@pytest.mark.parametrize(
    ("family", "state", "dst", "kinds"),
    [
        (socket.AF_INET6, 0x40, "ff02::16", []),  # a veth's multicast neighbour (NOARP)
        (socket.AF_INET, 0x20, "224.0.0.251", []),
        (socket.AF_INET, 0x20, "10.244.2.0", ["neighbour"]),  # a VTEP's, deleted by hand
        (socket.AF_INET, 0x02, "10.244.1.7", []),  # the ARP cache's own churn
    ],
)
def test_deleted_neighbours_that_are_never_the_reconcilers_are_dropped(
    family: int, state: int, dst: str, kinds: list[str]
) -> None:
    fields = {"family": family, "ifindex": 4, "state": state}
    msg = whole(ndmsg(), fields, [("NDA_DST", dst)], rtnl.RTM_DELNEIGH, 0, 0)
    assert event_kinds(msg) == kinds


@pytest.mark.parametrize(
    ("header_flags", "attrs", "flags"),
    [(0x40, [], 0x40), (0x80, [("IFA_FLAGS", 0x40 | 0x200)], 0x40 | 0x200)],
)
def test_an_address_row_carries_its_flags(header_flags: int, attrs: list[Any], flags: int) -> None:
    """IFA_FLAGS, when present, holds all of them; the header's byte only the low 8."""
    fields = {"family": socket.AF_INET6, "prefixlen": 64, "flags": header_flags, "index": 4}
    attrs = [("IFA_ADDRESS", "fd00:10:244:1::5"), *attrs]
    msg = whole(ifaddrmsg(), fields, attrs, rtnl.RTM_NEWADDR, 0, 1)
    row = rtnl.decode_addr6(msg, 0, len(msg))
    assert row == rtnl.AddrRow6(4, IPv6Address("fd00:10:244:1::5"), 64, flags)
    assert rtnl.decode_addr(msg, 0, len(msg)) is None


# --- links and addresses: pod plumbing (rtnl) -----------------------------------------


def test_bridge_create() -> None:
    req = rtnl.bridge_request("cni0", 1450, "0a:58:0a:f4:01:01")
    assert (req.msg_type, req.flags) == (rtnl.RTM_NEWLINK, 0x400 | 0x200)
    # iproute2's encoding: the kind without its NUL (pyroute2 adds one).
    assert req.body.hex() == (
        "00000000"
        "00000000"
        "01000000"
        "01000000"  # ifinfomsg: AF_UNSPEC, up/up
        "09000300"
        "636e693000000000"  # IFLA_IFNAME "cni0\0"
        "08000400"
        "aa050000"  # IFLA_MTU 1450
        "0a000100"
        "0a580af401010000"  # IFLA_ADDRESS
        "10001200"
        "0a000100"
        "6272696467650000"  # IFLA_LINKINFO { IFLA_INFO_KIND "bridge" }
    )
    msg = decoded(ifinfmsg, req)
    assert (msg.get_attr("IFLA_IFNAME"), msg.get_attr("IFLA_MTU")) == ("cni0", 1450)
    assert msg.get_attr("IFLA_ADDRESS") == "0a:58:0a:f4:01:01"
    assert msg.get_attr("IFLA_LINKINFO").get_attr("IFLA_INFO_KIND") == "bridge"
    assert (msg["flags"], msg["change"]) == (1, 1)


def test_veth_create_puts_the_peer_in_the_pod_namespace() -> None:
    req = rtnl.veth_request("veth0a1b2c3d", MAC, "eth0", PEER_MAC, 42, 1450, 5)
    assert (req.msg_type, req.flags) == (rtnl.RTM_NEWLINK, 0x400 | 0x200)
    assert req.body.hex() == (
        "00000000"
        "00000000"
        "01000000"
        "01000000"
        "11000300"
        "76657468306131623263336400000000"  # IFLA_IFNAME "veth0a1b2c3d\0"
        "08000400"
        "aa050000"  # IFLA_MTU
        "0a000100"
        "aabbccddee010000"  # IFLA_ADDRESS
        "08000a00"
        "05000000"  # IFLA_MASTER 5
        "4c001200"  # IFLA_LINKINFO
        "08000100"
        "76657468"  # IFLA_INFO_KIND "veth"
        "40000200"  # IFLA_INFO_DATA
        "3c000100"  # VETH_INFO_PEER: an ifinfomsg and its attributes
        "00000000"
        "00000000"
        "00000000"
        "00000000"
        "09000300"
        "6574683000000000"  # IFLA_IFNAME "eth0\0"
        "08001c00"
        "2a000000"  # IFLA_NET_NS_FD 42
        "08000400"
        "aa050000"  # IFLA_MTU
        "0a000100"
        "0a580af401050000"  # IFLA_ADDRESS
    )
    msg = decoded(ifinfmsg, req)
    assert msg.get_attr("IFLA_IFNAME") == "veth0a1b2c3d"
    assert (msg.get_attr("IFLA_MASTER"), msg.get_attr("IFLA_MTU")) == (5, 1450)
    assert msg.get_attr("IFLA_LINKINFO").get_attr("IFLA_INFO_KIND") == "veth"


def test_hairpin_on_a_bridge_port() -> None:
    req = rtnl.hairpin_request("veth0a1b2c3d", True)
    assert (req.msg_type, req.flags) == (rtnl.RTM_NEWLINK, 0)
    assert req.body.hex() == (
        "00000000"
        "00000000"
        "00000000"
        "00000000"
        "11000300"
        "76657468306131623263336400000000"  # "veth0a1b2c3d\0"
        "1c001200"  # IFLA_LINKINFO
        "0a000400"
        "6272696467650000"  # IFLA_INFO_SLAVE_KIND "bridge"
        "0c000500"
        "05000400"
        "01000000"  # IFLA_INFO_SLAVE_DATA { IFLA_BRPORT_MODE 1 }
    )
    msg = decoded(ifinfmsg, req)
    assert msg.get_attr("IFLA_IFNAME") == "veth0a1b2c3d"


@pytest.mark.parametrize(
    ("address", "broadcast"), [("10.244.1.1/24", "10.244.1.255"), ("10.244.1.1/31", None)]
)
@pytest.mark.parametrize("delete", [False, True])
def test_address_add_or_delete(address: str, broadcast: str | None, delete: bool) -> None:
    iface = IPv4Interface(address)
    req = rtnl.address_request(4, iface, delete)
    expected_type = rtnl.RTM_DELADDR if delete else rtnl.RTM_NEWADDR
    expected_flags = 0 if delete else 0x400 | 0x100
    assert (req.msg_type, req.flags) == (expected_type, expected_flags)
    attrs = [("IFA_LOCAL", str(iface.ip)), ("IFA_ADDRESS", str(iface.ip))]
    attrs += [("IFA_BROADCAST", broadcast)] if broadcast else []
    assert req.body == encoded(
        ifaddrmsg(),
        {"family": socket.AF_INET, "prefixlen": iface.network.prefixlen, "scope": 0, "index": 4},
        attrs,
        req,
    )


@pytest.mark.parametrize(
    ("up", "mtu", "flags", "change", "attrs"),
    [
        (True, None, 1, 1, []),
        (False, None, 0, 1, []),
        (None, 1400, 0, 0, [("IFLA_MTU", 1400)]),
        (True, 1400, 1, 1, [("IFLA_MTU", 1400)]),
    ],
)
def test_link_set(
    up: bool | None, mtu: int | None, flags: int, change: int, attrs: list[Any]
) -> None:
    req = rtnl.link_set_request(6, up, mtu)
    assert (req.msg_type, req.flags) == (rtnl.RTM_NEWLINK, 0)
    assert req.body == encoded(
        ifinfmsg(), {"family": 0, "index": 6, "flags": flags, "change": change}, attrs, req
    )


def test_link_delete_by_name() -> None:
    req = rtnl.link_delete_request("veth0a1b2c3d")
    assert (req.msg_type, req.flags) == (rtnl.RTM_DELLINK, 0)
    assert req.body == encoded(ifinfmsg(), {"family": 0}, [("IFLA_IFNAME", "veth0a1b2c3d")], req)


def test_link_delete_by_index() -> None:
    req = rtnl.link_delete_index_request(9)
    assert (req.msg_type, req.flags) == (rtnl.RTM_DELLINK, 0)
    assert req.body == encoded(ifinfmsg(), {"family": 0, "index": 9}, [], req)


def test_link_alias_names_the_owner() -> None:
    req = rtnl.link_alias_request("veth0a1b2c3d", "flannelpy 0a1b")
    assert (req.msg_type, req.flags) == (rtnl.RTM_NEWLINK, 0)
    # iproute2's encoding: the alias without its NUL (pyroute2 adds one).
    named = encoded(ifinfmsg(), {"family": 0}, [("IFLA_IFNAME", "veth0a1b2c3d")], req)
    assert req.body == named + bytes.fromhex("12001400") + b"flannelpy 0a1b\0\0"
    assert decoded(ifinfmsg, req).get_attr("IFLA_IFALIAS") == "flannelpy 0a1b"


@pytest.mark.parametrize(("delete", "flags"), [(False, [("IFA_FLAGS", 0x02)]), (True, [])])
def test_ipv6_address_is_added_without_duplicate_address_detection(
    delete: bool, flags: list[Any]
) -> None:
    req = rtnl.address_request(4, IPv6Interface("fd00:10:244:1::1/64"), delete)
    assert req.msg_type == (rtnl.RTM_DELADDR if delete else rtnl.RTM_NEWADDR)
    ip = "fd00:10:244:1::1"
    fields = {"family": socket.AF_INET6, "prefixlen": 64, "scope": 0, "index": 4}
    attrs = [("IFA_LOCAL", ip), ("IFA_ADDRESS", ip), *flags]  # IFA_F_NODAD unless deleting
    assert req.body == encoded(ifaddrmsg(), fields, attrs, req)


def test_pod_default_route_is_tagged_like_ip_route_add() -> None:
    req = rtnl.route_add_request(2, IPv4Address("10.244.1.1"), podnames.DEFAULT_ROUTE)
    # CREATE|EXCL, never REPLACE: a route in the pod we did not add is left alone.
    assert (req.msg_type, req.flags) == (rtnl.RTM_NEWROUTE, 0x400 | 0x200)
    assert req.body == encoded(
        rtmsg(),
        {"family": socket.AF_INET, "dst_len": 0, "table": 254, "proto": 3, "scope": 0, "type": 1},
        [("RTA_DST", "0.0.0.0"), ("RTA_OIF", 2), ("RTA_GATEWAY", "10.244.1.1")],
        req,
    )


def test_pod_ipv6_default_route_is_tagged_like_ip_route_add() -> None:
    gateway = IPv6Address("fd00:10:244:1::1")
    req = rtnl.route_add_request(2, gateway, podnames.DEFAULT_ROUTE6)
    assert (req.msg_type, req.flags) == (rtnl.RTM_NEWROUTE, 0x400 | 0x200)
    fields = {"family": socket.AF_INET6, "dst_len": 0, "table": 254, "proto": 3, "type": 1}
    attrs = [("RTA_DST", "::"), ("RTA_OIF", 2), ("RTA_GATEWAY", str(gateway))]
    assert req.body == encoded(rtmsg(), fields, attrs, req)


def test_pod_route_via_a_gateway_of_another_family_is_refused() -> None:
    with pytest.raises(ValueError, match="the families differ"):
        rtnl.route_add_request(2, IPv6Address("fd00:10:244:1::1"), podnames.DEFAULT_ROUTE)


def test_blackhole_route_has_no_device_and_a_metric_below_the_connected_route() -> None:
    req = rtnl.route_request(
        False, OUR_PROTOCOL, DST.network_address.packed, 24, blackhole_metric=1024
    )
    assert (req.msg_type, req.flags) == (rtnl.RTM_NEWROUTE, 0x400 | 0x100)
    assert req.body == encoded(
        rtmsg(),
        {
            "family": socket.AF_INET,
            "dst_len": 24,
            "table": 254,
            "proto": OUR_PROTOCOL,
            "scope": 0,
            "type": 6,
            "flags": 0,
        },
        [("RTA_DST", "10.244.3.0"), ("RTA_PRIORITY", 1024)],
        req,
    )


def test_deletions_of_ours_are_dropped_and_the_same_of_anyone_else_are_not() -> None:
    """The watch drops the notification of a deletion the adapter itself asked for
    (OwnDeletions), once; an expected key is consumed by its first notification, so the
    same entry deleted again later (by another tool) wakes the reconciler."""
    route = whole(
        rtmsg(),
        {"family": socket.AF_INET, "dst_len": 24, "table": 254, "proto": OUR_PROTOCOL, "type": 1},
        [("RTA_DST", "10.244.3.0"), ("RTA_OIF", 4)],
        rtnl.RTM_DELROUTE,
        0,
        0,
    )
    neighbour = whole(
        ndmsg(),
        {"family": socket.AF_INET, "ifindex": 4, "state": 0x80},
        [("NDA_DST", "10.244.3.0"), ("NDA_LLADDR", "02:aa:00:00:00:03")],
        rtnl.RTM_DELNEIGH,
        0,
        0,
    )
    fdb = whole(
        ndmsg(),
        {"family": socket.AF_BRIDGE, "ifindex": 4, "state": 0x80},
        [("NDA_LLADDR", "02:aa:00:00:00:03"), ("NDA_DST", "192.168.1.13")],
        rtnl.RTM_DELNEIGH,
        0,
        0,
    )
    own = OwnDeletions()
    own.expect(
        [
            route_key(4, int(IPv4Address("10.244.3.0")), 24),
            neighbour_key(4, IPv4Address("10.244.3.0")),
            fdb_key(4, "02:AA:00:00:00:03", IPv4Address("192.168.1.13")),  # any case
        ]
    )
    assert len(own) == 3
    for msg in (route, neighbour, fdb):
        assert event_kinds(msg, OUR_PROTOCOL, own.consume) == []
    assert len(own) == 0
    kinds = event_kinds(route + neighbour + fdb, OUR_PROTOCOL, own.consume)
    assert sorted(kinds) == ["fdb", "neighbour", "route"]
    # Another device's entry, another prefix length: not the deletion that was expected.
    own.expect([neighbour_key(5, IPv4Address("10.244.3.0")), route_key(4, 0x0AF40300, 23)])
    assert sorted(event_kinds(route + neighbour, OUR_PROTOCOL, own.consume)) == [
        "neighbour",
        "route",
    ]


def test_an_expected_deletion_is_expected_for_a_while_and_can_be_withdrawn() -> None:
    now = [100.0]
    own = OwnDeletions(clock=lambda: now[0])
    late, withdrawn, never = route_key(4, 1, 24), route_key(4, 2, 24), route_key(4, 4, 24)
    own.expect([late, withdrawn, never])
    own.forget([withdrawn])
    assert not own.consume(withdrawn)
    now[0] += ECHO_SECONDS + 0.1
    assert not own.consume(late), "a notification that never came is not waited for forever"
    own.expect([route_key(4, 3, 24)])
    assert len(own) == 1, "expired expectations are dropped (never's notification never came)"
