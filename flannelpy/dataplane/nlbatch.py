"""Batched rtnetlink over one raw socket: bulk writes and lean dumps.

Why this exists: one pyroute2 call per neighbour/FDB/route costs ~27x what
``ip -batch`` does, and pyroute2's generic dump decoder is slow for thousands
of entries. Here messages are packed with :mod:`struct`, many go out in one
``send`` (the kernel processes every message of a datagram in order, in the
sender's context, before ``send`` returns), and dumps are decoded only as far
as the adapter needs.

Acknowledgements: a write without ``NLM_F_ACK`` is still answered with an
``NLMSG_ERROR`` when it fails, so each chunk asks for an ACK only on its last
message; its arrival proves every earlier message of the chunk was processed and
any failure of theirs has already been queued to us (a socket's replies keep
their order). That keeps the receive queue small (no overrun, no lost replies)
and saves one ``recv`` per successful entry.

The messages themselves are :mod:`.rtnl`'s; this module is the socket and the
dumps. It knows nothing of our state types, and it opens sockets in the
namespace of the calling thread.
"""

from __future__ import annotations

import errno
import os
import socket
from collections.abc import Callable, Iterator, Sequence
from ipaddress import IPv4Address
from typing import TypeVar

from flannelpy.dataplane.rtnl import (
    AF_INET,
    AF_INET6,
    HDR,
    I32,
    IFADDR,
    IFINFO,
    IFLA_EXT_MASK,
    IFLA_IFNAME,
    NDA_IFINDEX,
    NDMSG,
    NLM_F_ACK,
    NLM_F_ACK_TLVS,
    NLM_F_DUMP,
    NLM_F_DUMP_INTR,
    NLM_F_REQUEST,
    NLMSG_DONE,
    NLMSG_ERROR,
    NLMSGERR_ATTR_MSG,
    RT_TABLE_MAIN,
    RTA_DST,
    RTA_TABLE,
    RTEXT_FILTER_SKIP_STATS,
    RTM_GETADDR,
    RTM_GETLINK,
    RTM_GETNEIGH,
    RTM_GETROUTE,
    RTM_NEWADDR,
    RTM_NEWLINK,
    RTM_NEWNEIGH,
    RTM_NEWROUTE,
    RTMSG,
    U32,
    AddrRow,
    AddrRow6,
    LinkRow,
    LinkStatsRow,
    NeighRow,
    Reply,
    Request,
    RouteRow,
    attr,
    decode_addr,
    decode_addr6,
    decode_link,
    decode_link_stats,
    decode_neigh,
    decode_route,
    parse_attrs,
)

NETLINK_ROUTE = 0
SOL_NETLINK = 270
NETLINK_CAP_ACK = 10  # errors do not echo our request back
NETLINK_EXT_ACK = 11  # errors carry the kernel's explanation
NETLINK_GET_STRICT_CHK = 12  # dumps honour the filters in the request header
SO_RCVBUFFORCE = 33

# Sizes of one send: the kernel copies a whole datagram before parsing it, so a
# few tens of KiB per send amortise the syscall without big allocations.
MAX_BATCH_BYTES = 64 * 1024
RECV_BYTES = 256 * 1024  # a dump reply is at most 32 KiB; room to spare
SOCKET_BUFFER = 4 * 1024 * 1024
IO_TIMEOUT = 10.0  # seconds; a healthy kernel answers in microseconds

T = TypeVar("T")


def _error_text(buf: bytes, offset: int, length: int, flags: int) -> str:
    """The kernel's extended-ack message, if the error carries one."""
    if not flags & NLM_F_ACK_TLVS:
        return ""
    # NLMSG_ERROR payload: int error, then the request's header (payload elided
    # thanks to NETLINK_CAP_ACK), then TLVs.
    start = offset + HDR.size + 4 + HDR.size
    raw = parse_attrs(buf, start, offset + length).get(NLMSGERR_ATTR_MSG, b"")
    return raw.rstrip(b"\0").decode(errors="replace")


# --- the socket ---------------------------------------------------------------


class DumpInterrupted(Exception):
    """The table changed while the kernel was dumping it; the caller retries."""


class KernelRefused(OSError):
    """The kernel answered a request or a dump with an error (the socket itself is fine)."""

    def __init__(self, reply: Reply) -> None:
        super().__init__(reply.error, reply.message or os.strerror(reply.error))
        self.reply = reply


class NetlinkSocket:
    """A raw NETLINK_ROUTE socket in the calling thread's network namespace."""

    def __init__(self, groups: int = 0, strict: bool = False, rcvbuf: int = SOCKET_BUFFER) -> None:
        self.sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_ROUTE)
        try:
            self._configure(groups, strict, rcvbuf)
        except BaseException:
            self.sock.close()
            raise
        self.seq = 0
        self.buf = bytearray(RECV_BYTES)

    def _configure(self, groups: int, strict: bool, rcvbuf: int) -> None:
        sock = self.sock
        try:  # needs CAP_NET_ADMIN, which the agent has anyway
            sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, rcvbuf)
        except PermissionError:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        sock.setsockopt(SOL_NETLINK, NETLINK_CAP_ACK, 1)
        sock.setsockopt(SOL_NETLINK, NETLINK_EXT_ACK, 1)
        if strict:
            sock.setsockopt(SOL_NETLINK, NETLINK_GET_STRICT_CHK, 1)
        sock.bind((0, groups))
        sock.settimeout(IO_TIMEOUT)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> NetlinkSocket:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def fileno(self) -> int:
        return self.sock.fileno()

    def _next_seq(self) -> int:
        self.seq = (self.seq + 1) & 0xFFFFFFFF or 1
        return self.seq

    def recv(self) -> bytes:
        n = self.sock.recv_into(self.buf)
        return bytes(self.buf[:n])

    # -- writes

    def batch(self, requests: Sequence[Request]) -> list[Reply]:
        """Send every request, in order; return one Reply per request. Never raises on
        a per-request failure; raises OSError only when the socket itself fails."""
        replies = [Reply()] * len(requests)
        start = 0
        while start < len(requests):
            end = self._chunk_end(requests, start)
            self._send_chunk(requests, start, end, replies)
            start = end
        return replies

    @staticmethod
    def _chunk_end(requests: Sequence[Request], start: int) -> int:
        size = 0
        end = start
        while end < len(requests):
            size += HDR.size + len(requests[end].body)
            if size > MAX_BATCH_BYTES and end > start:
                break
            end += 1
        return end

    def _send_chunk(
        self, requests: Sequence[Request], start: int, end: int, replies: list[Reply]
    ) -> None:
        parts = []
        first_seq = self.seq + 1
        pack = HDR.pack
        for i in range(start, end):
            req = requests[i]
            flags = NLM_F_REQUEST | req.flags | (NLM_F_ACK if i == end - 1 else 0)
            parts.append(pack(HDR.size + len(req.body), req.msg_type, flags, self._next_seq(), 0))
            parts.append(req.body)
        last_seq = self.seq
        self.sock.send(b"".join(parts))
        self._collect(first_seq, last_seq, start, replies)

    def _collect(self, first_seq: int, last_seq: int, start: int, replies: list[Reply]) -> None:
        """Read error/ack messages until the chunk's final ACK has arrived."""
        while True:
            try:
                n = self.sock.recv_into(self.buf)
            except TimeoutError:
                for seq in range(first_seq, last_seq + 1):
                    if replies[start + seq - first_seq].error == 0:
                        replies[start + seq - first_seq] = Reply(errno.ETIMEDOUT, "no reply")
                return
            buf = bytes(self.buf[:n])
            offset = 0
            done = False
            while offset + HDR.size <= n:
                length, msg_type, flags, seq, _pid = HDR.unpack_from(buf, offset)
                if length < HDR.size:
                    break
                if msg_type == NLMSG_ERROR and first_seq <= seq <= last_seq:
                    err = -I32.unpack_from(buf, offset + HDR.size)[0]
                    if err:
                        text = _error_text(buf, offset, length, flags)
                        replies[start + seq - first_seq] = Reply(err, text)
                    done = done or seq == last_seq
                offset += (length + 3) & ~3
            if done:
                return

    def request(self, req: Request) -> tuple[Reply, list[tuple[bytes, int, int, int]]]:
        """One non-dump request that may be answered with messages (e.g. a GET)."""
        seq = self._next_seq()
        flags = NLM_F_REQUEST | NLM_F_ACK | req.flags
        self.sock.send(HDR.pack(HDR.size + len(req.body), req.msg_type, flags, seq, 0) + req.body)
        answers: list[tuple[bytes, int, int, int]] = []
        while True:
            buf = self.recv()
            for offset, length, msg_type, flags_in, seq_in in messages(buf):
                if seq_in != seq:
                    continue
                if msg_type == NLMSG_ERROR:
                    err = -I32.unpack_from(buf, offset + HDR.size)[0]
                    text = _error_text(buf, offset, length, flags_in) if err else ""
                    return Reply(err, text), answers
                answers.append((buf, offset, length, msg_type))

    # -- dumps

    def dump(self, msg_type: int, body: bytes) -> Iterator[tuple[bytes, int, int, int]]:
        """Yield (buffer, offset, length, type) for every message of a dump.

        Raises DumpInterrupted when the kernel flags the dump as inconsistent,
        KernelRefused (an OSError) when the kernel refuses the request.
        """
        seq = self._next_seq()
        flags = NLM_F_REQUEST | NLM_F_DUMP
        self.sock.send(HDR.pack(HDR.size + len(body), msg_type, flags, seq, 0) + body)
        interrupted = False
        while True:
            buf = self.recv()
            for offset, length, mtype, mflags, mseq in messages(buf):
                if mseq != seq:
                    continue
                interrupted = interrupted or bool(mflags & NLM_F_DUMP_INTR)
                if mtype == NLMSG_DONE:
                    # A dump that fails part-way reports its errno here.
                    err = -I32.unpack_from(buf, offset + HDR.size)[0] if length >= 20 else 0
                    if err:
                        raise KernelRefused(Reply(err))
                    if interrupted:
                        raise DumpInterrupted()
                    return
                if mtype == NLMSG_ERROR:
                    err = -I32.unpack_from(buf, offset + HDR.size)[0]
                    if err:
                        raise KernelRefused(Reply(err))
                    return
                yield buf, offset, length, mtype


def messages(buf: bytes) -> Iterator[tuple[int, int, int, int, int]]:
    """(offset, length, type, flags, seq) of each netlink message in one datagram."""
    offset = 0
    end = len(buf)
    unpack = HDR.unpack_from
    while offset + HDR.size <= end:
        length, msg_type, flags, seq, _pid = unpack(buf, offset)
        if length < HDR.size:
            return
        yield offset, length, msg_type, flags, seq
        offset += (length + 3) & ~3


# --- dump helpers -------------------------------------------------------------

DUMP_RETRIES = 5


def retrying(fn: Callable[[], T]) -> T:
    """Run a dump again when the kernel says the table changed under it."""
    for _ in range(DUMP_RETRIES - 1):
        try:
            return fn()
        except DumpInterrupted:
            continue
    return fn()


def dump_links(sock: NetlinkSocket) -> list[LinkRow]:
    body = IFINFO.pack(socket.AF_UNSPEC, 0, 0, 0, 0) + attr(
        IFLA_EXT_MASK, U32.pack(RTEXT_FILTER_SKIP_STATS)
    )

    def once() -> list[LinkRow]:
        return [
            decode_link(b, o, n) for b, o, n, t in sock.dump(RTM_GETLINK, body) if t == RTM_NEWLINK
        ]

    return retrying(once)


def dump_link_stats(sock: NetlinkSocket) -> list[LinkStatsRow]:
    """Every link with its counters (``ip -s link``): name, kind, master and IFLA_STATS64."""
    body = IFINFO.pack(socket.AF_UNSPEC, 0, 0, 0, 0)

    def once() -> list[LinkStatsRow]:
        return [
            decode_link_stats(b, o, n)
            for b, o, n, t in sock.dump(RTM_GETLINK, body)
            if t == RTM_NEWLINK
        ]

    return retrying(once)


def get_link(sock: NetlinkSocket, name: str) -> LinkRow | None:
    """One link by name, or None when there is none."""
    body = (
        IFINFO.pack(socket.AF_UNSPEC, 0, 0, 0, 0)
        + attr(IFLA_EXT_MASK, U32.pack(RTEXT_FILTER_SKIP_STATS))
        + attr(IFLA_IFNAME, name.encode() + b"\0")
    )
    reply, messages = sock.request(Request(RTM_GETLINK, 0, body))
    for buf, offset, length, msg_type in messages:
        if msg_type == RTM_NEWLINK:
            return decode_link(buf, offset, length)
    if reply.error in (0, errno.ENODEV):
        return None
    raise KernelRefused(reply)


RTM_F_FIB_MATCH = 0x2000  # a route lookup answers with the entry it found, not a result


def fib_match(sock: NetlinkSocket, address: IPv4Address) -> RouteRow | int:
    """The route a lookup of ``address`` finds (``ip route get fibmatch``), as the table
    holds it; else the lookup's error: ENETUNREACH when no route matches at all, another
    when it ends in an error route (unreachable, prohibit, blackhole)."""
    body = RTMSG.pack(AF_INET, 32, 0, 0, 0, 0, 0, 0, RTM_F_FIB_MATCH) + attr(
        RTA_DST, address.packed
    )
    reply, messages = sock.request(Request(RTM_GETROUTE, 0, body))
    for buf, offset, length, msg_type in messages:
        if msg_type == RTM_NEWROUTE:
            row = decode_route(buf, offset, length)
            if row is not None:
                return row
    return reply.error or errno.ENOENT


def dump_routes(
    sock: NetlinkSocket, table: int = RT_TABLE_MAIN, protocol: int = 0, family: int = AF_INET
) -> list[RouteRow]:
    """Routes of ``family`` (IPv4 by default) in ``table`` (and ``protocol`` if non-zero),
    filtered by the kernel when the socket is strict, and again here for kernels that
    ignore the filter."""
    return retrying(lambda: list(route_rows(sock, table, protocol, family)))


def route_rows(
    sock: NetlinkSocket, table: int = RT_TABLE_MAIN, protocol: int = 0, family: int = AF_INET
) -> Iterator[RouteRow]:
    """:func:`dump_routes`' rows one at a time, as the dump reads them (a reader that keeps
    few of them keeps no list of thousands); once, raising DumpInterrupted at its end when
    the kernel says the table changed under it (the caller reads again: :func:`retrying`)."""
    body = RTMSG.pack(family, 0, 0, 0, table & 0xFF, protocol, 0, 0, 0)
    if table > 0xFF:
        body += attr(RTA_TABLE, U32.pack(table))
    for buf, offset, length, msg_type in sock.dump(RTM_GETROUTE, body):
        if msg_type != RTM_NEWROUTE:
            continue
        row = decode_route(buf, offset, length)
        if row is None or row.table != table or (protocol and row.protocol != protocol):
            continue
        if (row.dst.version == 6) != (family == AF_INET6):
            continue
        yield row


def dump_neighbours(sock: NetlinkSocket, family: int, ifindex: int = 0) -> list[NeighRow]:
    """Neighbours (AF_INET) or FDB entries (AF_BRIDGE), of one device when ``ifindex``."""
    return retrying(lambda: list(neighbour_rows(sock, family, ifindex)))


def neighbour_rows(sock: NetlinkSocket, family: int, ifindex: int = 0) -> Iterator[NeighRow]:
    """:func:`dump_neighbours`' rows one at a time, once (as :func:`route_rows`)."""
    # Strict dumps take the device as an attribute (the header's ifindex must be 0).
    body = NDMSG.pack(family, 0, 0, 0, 0, 0, 0)
    if ifindex:
        body += attr(NDA_IFINDEX, U32.pack(ifindex))
    for buf, offset, length, msg_type in sock.dump(RTM_GETNEIGH, body):
        if msg_type != RTM_NEWNEIGH:
            continue
        row = decode_neigh(buf, offset, length)
        if row.family == family and (not ifindex or row.ifindex == ifindex):
            yield row


def dump_addresses(sock: NetlinkSocket) -> list[AddrRow]:
    return _dump_addresses(sock, AF_INET, decode_addr)


def dump_addresses6(sock: NetlinkSocket) -> list[AddrRow6]:
    return _dump_addresses(sock, AF_INET6, decode_addr6)


def dump_link_addresses(sock: NetlinkSocket, ifindex: int = 0) -> list[AddrRow | AddrRow6]:
    """Addresses of both families in one dump (of one link when ``ifindex``), with their
    flags: what pod plumbing needs to see an IPv6 address still tentative."""

    def decode(buf: bytes, offset: int, length: int) -> AddrRow | AddrRow6 | None:
        row = decode_addr(buf, offset, length) or decode_addr6(buf, offset, length)
        return row if row is not None and (not ifindex or row.ifindex == ifindex) else None

    return _dump_addresses(sock, socket.AF_UNSPEC, decode)


def _dump_addresses(
    sock: NetlinkSocket, family: int, decode: Callable[[bytes, int, int], T | None]
) -> list[T]:
    """One family's addresses (AF_UNSPEC: both); ``decode`` drops what it cannot read (or
    another family)."""
    body = IFADDR.pack(family, 0, 0, 0, 0)

    def once() -> list[T]:
        rows = []
        for buf, offset, length, msg_type in sock.dump(RTM_GETADDR, body):
            if msg_type == RTM_NEWADDR:
                row = decode(buf, offset, length)
                if row is not None:
                    rows.append(row)
        return rows

    return retrying(once)


def route_get(sock: NetlinkSocket, dst: IPv4Address) -> RouteRow | None:
    """The kernel's route lookup for ``dst`` (``ip route get``), or None when unreachable."""
    body = RTMSG.pack(AF_INET, 32, 0, 0, 0, 0, 0, 0, 0) + attr(RTA_DST, dst.packed)
    reply, messages = sock.request(Request(RTM_GETROUTE, 0, body))
    for buf, offset, length, msg_type in messages:
        if msg_type == RTM_NEWROUTE:
            return decode_route(buf, offset, length)
    if reply.error in (0, errno.ENETUNREACH, errno.EHOSTUNREACH):
        return None
    raise KernelRefused(reply)
