"""The rtnetlink watch's socket filter, run by a classic BPF interpreter of the few
instructions it uses, over notifications built as the kernel lays them out."""

from __future__ import annotations

import struct

import pytest

from flannelpy.dataplane import nlfilter, rtnl
from flannelpy.dataplane.netlink_events import event_kinds
from flannelpy.dataplane.state import ROUTE_PROTOCOL


def run(program: list[nlfilter.Insn], packet: bytes) -> int:
    """Classic BPF semantics for the instructions the filter uses; a load past the end
    ends the program with 0, as the kernel's does."""
    a, pc = 0, 0
    while True:
        code, jt, jf, k = program[pc]
        pc += 1
        if code in (nlfilter.LD_W_ABS, nlfilter.LD_H_ABS, nlfilter.LD_B_ABS):
            size = {nlfilter.LD_W_ABS: 4, nlfilter.LD_H_ABS: 2, nlfilter.LD_B_ABS: 1}[code]
            if k + size > len(packet):
                return 0
            a = int.from_bytes(packet[k : k + size], "big")
        elif code == nlfilter.LD_W_LEN:
            a = len(packet)
        elif code == nlfilter.JEQ_K:
            pc += jt if a == k else jf
        elif code == nlfilter.JGE_K:
            pc += jt if a >= k else jf
        elif code == nlfilter.RET_K:
            return k
        else:
            raise AssertionError(f"unexpected opcode {code:#x}")


def message(msg_type: int, body: bytes) -> bytes:
    return struct.pack("=IHHII", 16 + len(body), msg_type, 0, 0, 0) + body


def attr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


def link(msg_type: int, name: str, first: int = rtnl.IFLA_IFNAME) -> bytes:
    header = struct.pack("=BxHiII", 0, 1, 7, 0, 0)
    attrs = attr(first, name.encode() + b"\0")
    if first != rtnl.IFLA_IFNAME:
        attrs += attr(rtnl.IFLA_IFNAME, name.encode() + b"\0")
    return message(msg_type, header + attrs)


def address(msg_type: int, scope: int) -> bytes:
    return message(msg_type, struct.pack("=BBBBi", rtnl.AF_INET6, 64, 0, scope, 7))


def route(msg_type: int, table: int, protocol: int) -> bytes:
    return message(
        msg_type, struct.pack("=BBBBBBBBI", rtnl.AF_INET, 24, 0, 0, table, protocol, 0, 1, 0)
    )


PROGRAM = nlfilter.watch_program()


@pytest.mark.parametrize(
    ("packet", "passes"),
    [
        (link(rtnl.RTM_NEWLINK, "flannel.1"), True),
        (link(rtnl.RTM_DELLINK, "flannel-v6.1"), True),
        (link(rtnl.RTM_NEWLINK, "veth1a2b3c4d"), False),
        (link(rtnl.RTM_DELLINK, "cni0"), False),
        (link(rtnl.RTM_NEWLINK, "lo"), False),
        (link(rtnl.RTM_NEWLINK, "veth0", first=rtnl.IFLA_MTU), True),  # name not first
        (address(rtnl.RTM_NEWADDR, rtnl.RT_SCOPE_UNIVERSE), False),
        (address(rtnl.RTM_DELADDR, rtnl.RT_SCOPE_LINK), False),
        (address(rtnl.RTM_DELADDR, rtnl.RT_SCOPE_UNIVERSE), True),
        (route(rtnl.RTM_NEWROUTE, rtnl.RT_TABLE_MAIN, nlfilter.RTPROT_KERNEL), False),
        (route(rtnl.RTM_DELROUTE, rtnl.RT_TABLE_MAIN, nlfilter.RTPROT_KERNEL), False),
        (route(rtnl.RTM_NEWROUTE, nlfilter.RT_TABLE_LOCAL, rtnl.RTPROT_BOOT), False),
        (route(rtnl.RTM_DELROUTE, rtnl.RT_TABLE_MAIN, ROUTE_PROTOCOL), True),
        (route(rtnl.RTM_NEWROUTE, rtnl.RT_TABLE_MAIN, rtnl.RTPROT_BOOT), True),
        (route(rtnl.RTM_NEWROUTE, rtnl.RT_TABLE_MAIN, ROUTE_PROTOCOL), False),  # our own
        (route(rtnl.RTM_NEWROUTE, nlfilter.RT_TABLE_LOCAL, ROUTE_PROTOCOL), False),
        (message(rtnl.RTM_NEWNEIGH, b"\0" * 12), False),
        (message(rtnl.RTM_DELNEIGH, b"\0" * 12), True),
        (message(rtnl.RTM_NEWLINK, b""), True),  # too short to read: passes
        (message(rtnl.RTM_DELADDR, b""), True),
        (message(rtnl.RTM_DELROUTE, b""), True),
    ],
)
def test_the_filter_drops_what_the_reconciler_ignores(packet: bytes, passes: bool) -> None:
    assert (run(PROGRAM, packet) != 0) is passes


@pytest.mark.parametrize(
    "packet",
    [
        link(rtnl.RTM_NEWLINK, "veth1a2b3c4d"),
        link(rtnl.RTM_DELLINK, "cni0"),
        address(rtnl.RTM_DELADDR, rtnl.RT_SCOPE_LINK),
        route(rtnl.RTM_NEWROUTE, rtnl.RT_TABLE_MAIN, nlfilter.RTPROT_KERNEL),
        route(rtnl.RTM_DELROUTE, rtnl.RT_TABLE_MAIN, nlfilter.RTPROT_KERNEL),
        route(rtnl.RTM_NEWROUTE, nlfilter.RT_TABLE_LOCAL, rtnl.RTPROT_BOOT),
        route(rtnl.RTM_NEWROUTE, rtnl.RT_TABLE_MAIN, ROUTE_PROTOCOL),
    ],
)
def test_whatever_it_drops_event_kinds_would_drop_too(packet: bytes) -> None:
    """The filter only spares work: it never drops a notification the reconciler uses."""
    assert run(PROGRAM, packet) == 0
    assert event_kinds(packet) == []


def test_jumps_are_forward_and_in_reach() -> None:
    for i, (code, jt, jf, _k) in enumerate(PROGRAM):
        if code in (nlfilter.JEQ_K, nlfilter.JGE_K):
            assert i + 1 + max(jt, jf) < len(PROGRAM)
    assert PROGRAM[-1][0] == PROGRAM[-2][0] == nlfilter.RET_K  # no path falls off the end
    with pytest.raises(KeyError):
        nlfilter.assemble([(nlfilter.JEQ_K, "nowhere", None, 0)])


def test_the_route_protocol_is_the_watch_s() -> None:
    """Another protocol given (a test's kernel): its new routes are dropped, ours pass."""
    other = nlfilter.watch_program(200)
    assert run(other, route(rtnl.RTM_NEWROUTE, rtnl.RT_TABLE_MAIN, 200)) == 0
    assert run(other, route(rtnl.RTM_NEWROUTE, rtnl.RT_TABLE_MAIN, ROUTE_PROTOCOL)) != 0
