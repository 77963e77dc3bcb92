"""A socket filter (classic BPF) for the reconciler's rtnetlink watch: the kernel drops
the notifications the reconciler never acts on before they are queued, so the watching
thread does not wake for them.

Every pod's ADD and DEL bring about 27 notifications (its veth's links coming, going
up, joining the bridge; the link-local address, the kernel's routes of it, the
neighbours); :func:`flannelpy.dataplane.netlink_events.event_kinds` drops them all, but
only after the watch thread woke, read and decoded each one (0.3-0.6 ms of CPU per
pod in a 100-pod burst, one core being what a burst is bounded by). The filter drops,
by fixed offsets only:

- ``RTM_NEWADDR`` and ``RTM_NEWNEIGH`` (the reconciler watches deletions of those);
- ``RTM_NEWLINK``/``RTM_DELLINK`` whose first attribute is ``IFLA_IFNAME`` (the
  kernel puts it first) with a name not starting with ``flan`` (our devices are
  ``flannel.<VNI>`` and ``flannel-v6.<VNI>``);
- ``RTM_DELADDR`` of link scope (a veth's IPv6 link-local address);
- routes of the kernel's own protocol or of the local table;
- ``RTM_NEWROUTE`` of our protocol (each route we add would wake the thread once).

Anything else, and any message it cannot read at those offsets, passes: the filter
only spares work, ``event_kinds`` still decides. A message shorter than an offset read
passes too (classic BPF would drop it when the load runs past the end).
"""

from __future__ import annotations

import ctypes
import socket
import struct
from collections.abc import Sequence

from flannelpy.dataplane import rtnl
from flannelpy.dataplane.state import ROUTE_PROTOCOL

SO_ATTACH_FILTER = 26  # asm-generic/socket.h

# Classic BPF opcodes (linux/filter.h, linux/bpf_common.h).
LD_W_ABS, LD_H_ABS, LD_B_ABS, LD_W_LEN = 0x20, 0x28, 0x30, 0x80
JEQ_K, JGE_K = 0x15, 0x35
RET_K = 0x06
ACCEPT, DROP = 0xFFFFFFFF, 0

RTPROT_KERNEL = 2
RT_TABLE_LOCAL = 255
OWN_NAME_PREFIX = b"flan"  # the first four bytes of flannel.<VNI> and flannel-v6.<VNI>

# Offsets in a notification: the 16-byte nlmsghdr, then the family header.
_TYPE = 4  # nlmsghdr.nlmsg_type
_IFA_SCOPE = 16 + 3  # ifaddrmsg.ifa_scope
_RTM_TABLE, _RTM_PROTOCOL = 16 + 4, 16 + 5  # rtmsg.rtm_table, rtmsg.rtm_protocol
_FIRST_ATTR_TYPE = 16 + 16 + 2  # after ifinfomsg: the first attribute's nla_type
_FIRST_ATTR_DATA = 16 + 16 + 4

Insn = tuple[int, int, int, int]  # (code, jt, jf, k)
# An instruction with its jump targets named (None: the next one), or a label.
_Step = tuple[int, "str | None", "str | None", int] | str


def _host(value: int, size: int) -> int:
    """A host-order field as classic BPF's big-endian load reads it."""
    fmt = {1: "=B", 2: "=H", 4: "=I"}[size]
    return int.from_bytes(struct.pack(fmt, value), "big")


def _if(value: int, size: int, then: str, otherwise: str | None = None) -> _Step:
    return (JEQ_K, then, otherwise, _host(value, size))


def watch_program(protocol: int = ROUTE_PROTOCOL) -> list[Insn]:
    """The filter, as (code, jt, jf, k) instructions; ``protocol``: our routes'."""
    steps: list[_Step] = [
        (LD_H_ABS, None, None, _TYPE),
        _if(rtnl.RTM_NEWLINK, 2, "link"),
        _if(rtnl.RTM_DELLINK, 2, "link"),
        _if(rtnl.RTM_DELADDR, 2, "addr"),
        _if(rtnl.RTM_NEWROUTE, 2, "newroute"),
        _if(rtnl.RTM_DELROUTE, 2, "route"),
        _if(rtnl.RTM_NEWADDR, 2, "drop"),
        _if(rtnl.RTM_NEWNEIGH, 2, "drop", "accept"),
        "link",
        (LD_W_LEN, None, None, 0),
        (JGE_K, None, "accept", _FIRST_ATTR_DATA + len(OWN_NAME_PREFIX)),
        (LD_H_ABS, None, None, _FIRST_ATTR_TYPE),
        _if(rtnl.IFLA_IFNAME, 2, "name", "accept"),  # not the name first: let it through
        "name",
        (LD_W_ABS, None, None, _FIRST_ATTR_DATA),
        (JEQ_K, "accept", "drop", int.from_bytes(OWN_NAME_PREFIX, "big")),
        "addr",
        (LD_W_LEN, None, None, 0),
        (JGE_K, None, "accept", _IFA_SCOPE + 1),
        (LD_B_ABS, None, None, _IFA_SCOPE),
        _if(rtnl.RT_SCOPE_LINK, 1, "drop", "accept"),
        "newroute",  # a new route of ours: our own write (event_kinds drops it too)
        (LD_W_LEN, None, None, 0),
        (JGE_K, None, "accept", _RTM_PROTOCOL + 1),
        (LD_B_ABS, None, None, _RTM_PROTOCOL),
        _if(protocol, 1, "drop", "route"),
        "route",
        (LD_W_LEN, None, None, 0),
        (JGE_K, None, "accept", _RTM_PROTOCOL + 1),
        (LD_B_ABS, None, None, _RTM_PROTOCOL),
        _if(RTPROT_KERNEL, 1, "drop"),
        (LD_B_ABS, None, None, _RTM_TABLE),
        _if(RT_TABLE_LOCAL, 1, "drop", "accept"),
        "accept",
        (RET_K, None, None, ACCEPT),
        "drop",
        (RET_K, None, None, DROP),
    ]
    return assemble(steps)


def assemble(steps: Sequence[_Step]) -> list[Insn]:
    """Instructions with named forward jumps -> classic BPF's relative offsets."""
    labels: dict[str, int] = {}
    insns: list[tuple[int, str | None, str | None, int]] = []
    for step in steps:
        if isinstance(step, str):
            labels[step] = len(insns)
        else:
            insns.append(step)

    def offset(at: int, target: str | None) -> int:
        if target is None:
            return 0
        jump = labels[target] - at - 1
        if not 0 <= jump <= 255:
            raise ValueError(f"jump to {target} out of reach from {at}")
        return jump

    return [(code, offset(i, jt), offset(i, jf), k) for i, (code, jt, jf, k) in enumerate(insns)]


def attach(sock: socket.socket, program: Sequence[Insn]) -> None:
    """Attach ``program`` to ``sock`` (SO_ATTACH_FILTER); OSError if the kernel refuses."""
    raw = b"".join(struct.pack("=HBBI", *insn) for insn in program)
    buf = ctypes.create_string_buffer(raw, len(raw))
    fprog = struct.pack("=HxxxxxxQ", len(program), ctypes.addressof(buf))
    sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, fprog)
