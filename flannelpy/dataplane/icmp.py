"""The prober's transport: ICMP echoes over raw sockets, never fragmented (root).

Implements :class:`flannelpy.observe.probe_rounds.Transport`: ``send`` returns a
ticket, ``take_replies`` hands back a :class:`Reply` per echo answered (an echo
reply with its round-trip time, or the ICMP error that quoted it).
:class:`IcmpTransport` is IPv4 (DF set), :class:`Icmp6Transport` ICMPv6 (with
IPV6_DONTFRAG the sender never fragments: a packet over the route's MTU is refused
with EMSGSIZE), :class:`DualTransport` both behind one ticket space.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import secrets
import select
import socket
import struct
import threading
import time
from ipaddress import IPv4Address, IPv6Address, ip_address
from typing import NamedTuple

from flannelpy.errors import DataplaneError

log = logging.getLogger("flannelpy.prober")  # the prober's, as before the transport moved here

MAX_KEPT_ADDRESSES = 16384  # sockaddrs kept per transport (two per peer and family at most)
IP_ICMP_HEADERS = 28  # IPv4 header (no options) + ICMP echo header

# Linux values; Python's socket module does not export them.
IP_PKTINFO = 8
IP_MTU_DISCOVER = 10
IP_PMTUDISC_DO = 2
SOL_RAW = 255
ICMP_FILTER = 1
ICMP_ECHO_REPLY = 0
ICMP_DEST_UNREACH = 3
ICMP_ECHO = 8
ICMP_TIME_EXCEEDED = 11
ICMP_FRAG_NEEDED = 4  # code of ICMP_DEST_UNREACH

IP6_ICMP_HEADERS = 48  # IPv6 header + ICMPv6 echo header
IPV6_PKTINFO = 50
IPV6_DONTFRAG = 62
ICMP6_FILTER = 1
ICMP6_DEST_UNREACH = 1
ICMP6_PACKET_TOO_BIG = 2
ICMP6_TIME_EXCEEDED = 3
ICMP6_ECHO_REQUEST = 128
ICMP6_ECHO_REPLY = 129

_UNREACH6 = {
    0: "no route to destination",
    1: "communication administratively prohibited",
    3: "address unreachable",
    4: "port unreachable",
}

_UNREACH = {
    0: "network unreachable",
    1: "host unreachable",
    2: "protocol unreachable",
    3: "port unreachable",
    9: "network administratively prohibited",
    10: "host administratively prohibited",
    13: "communication administratively prohibited",
}


def _ones_sum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    return sum(struct.unpack(f"!{len(data) // 2}H", data))


def _fold(total: int) -> int:
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def icmp_checksum(data: bytes) -> int:
    """The Internet checksum (RFC 1071) of ``data``."""
    return _fold(_ones_sum(data))


@functools.lru_cache(maxsize=8)
def _payload(payload_len: int) -> tuple[bytes, int]:
    """The echo payload of that length and its ones' complement sum: the prober sends
    two sizes, over and over, so neither is rebuilt or summed per echo."""
    payload = bytes(i & 0xFF for i in range(payload_len))
    return payload, _ones_sum(payload)


def echo_request(ident: int, seq: int, payload_len: int) -> bytes:
    """An ICMP echo request (header + payload), checksum filled in."""
    header, payload = echo_parts(ident, seq, payload_len)
    return header + payload


def echo_parts(ident: int, seq: int, payload_len: int) -> tuple[bytes, bytes]:
    """An echo request's header (checksum filled in) and payload, sent as two buffers of
    one packet: the payload, the same for every echo of that size, is not copied."""
    payload, payload_sum = _payload(payload_len)
    # The header is 8 bytes (even), so the payload's words keep their alignment.
    csum = _fold((ICMP_ECHO << 8) + ident + seq + payload_sum)
    return struct.pack("!BBHHH", ICMP_ECHO, 0, csum, ident, seq), payload


class Reply(NamedTuple):
    """What came back for one ticket: an echo reply (rtt) or an ICMP error."""

    ticket: int
    rtt_seconds: float | None
    error: str | None = None
    too_big: bool = False  # ICMP "fragmentation needed": the path MTU is lower


class IcmpTransport:
    """Echoes over one raw ICMP socket with DF on every packet (IP_PMTUDISC_DO).

    The source address is chosen per packet with IP_PKTINFO, so a new own lease
    needs no new socket. One receive thread matches replies by (id, seq) and by
    the replying address. The socket lives in the network namespace of the thread
    that constructs the transport. Close it (or use ``with``) to stop the thread.
    """

    headers = IP_ICMP_HEADERS

    def __init__(self) -> None:
        self._sock = self._open()
        self._ident = secrets.randbits(16)
        self._seq = secrets.randbits(16)
        self._lock = threading.Lock()
        # seq -> (target, sent at)
        self._pending: dict[int, tuple[IPv4Address | IPv6Address, float]] = {}
        self._replies: list[Reply] = []
        self._sockaddrs: dict[int, tuple[str, int]] = {}
        self._source: tuple[IPv4Address | IPv6Address, bytes] | None = None
        self._closed = threading.Event()
        # close() writes here: the receive thread sleeps in select() until a packet or
        # this arrives, instead of waking every 0.2 s to look at ``_closed``.
        self._wake_r, self._wake_w = os.pipe()
        self._thread = threading.Thread(target=self._receive, name="prober-icmp-rx", daemon=True)
        self._thread.start()

    def _open(self) -> socket.socket:
        sock = _raw_socket(socket.AF_INET, socket.IPPROTO_ICMP)
        sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        # Pass only what can answer an echo: replies, unreachables, time exceeded.
        wanted = (1 << ICMP_ECHO_REPLY) | (1 << ICMP_DEST_UNREACH) | (1 << ICMP_TIME_EXCEEDED)
        sock.setsockopt(SOL_RAW, ICMP_FILTER, struct.pack("I", ~wanted & 0xFFFFFFFF))
        return sock

    def __enter__(self) -> IcmpTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        os.write(self._wake_w, b"x")
        self._thread.join(timeout=2.0)
        self._sock.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def send(
        self, source: IPv4Address | IPv6Address, target: IPv4Address | IPv6Address, size: int
    ) -> int:
        if size < self.headers:
            raise ValueError(f"an echo needs at least {self.headers} bytes, not {size}")
        with self._lock:
            seq = self._next_seq()
            self._pending[seq] = (target, time.perf_counter())  # before send: replies are fast
        try:
            self._sendmsg(source, target, seq, size - self.headers)
        except OSError:
            self.cancel(seq)
            raise
        return seq

    def _sendmsg(
        self,
        source: IPv4Address | IPv6Address,
        target: IPv4Address | IPv6Address,
        seq: int,
        payload_len: int,
    ) -> None:
        header, payload = echo_parts(self._ident, seq, payload_len)
        self._sock.sendmsg(
            [header, payload],
            [(socket.IPPROTO_IP, IP_PKTINFO, self._pktinfo(source))],
            0,
            self._sockaddr(target),
        )

    def _sockaddr(self, target: IPv4Address | IPv6Address) -> tuple[str, int]:
        """``(str(target), 0)``, kept per address: the prober sends two echoes to every
        peer, over and over. Keyed by the address's integer (one family per transport):
        an address object's own hash formats it in hex."""
        key = int(target)
        to = self._sockaddrs.get(key)
        if to is None:
            if len(self._sockaddrs) >= MAX_KEPT_ADDRESSES:
                self._sockaddrs.clear()
            to = self._sockaddrs[key] = (str(target), 0)
        return to

    def _pktinfo(self, source: IPv4Address | IPv6Address) -> bytes:
        """The IP_PKTINFO that sends from ``source``, kept for the last source."""
        kept = self._source
        if kept is None or kept[0] != source:
            kept = self._source = (source, self._pack_pktinfo(source))
        return kept[1]

    def _pack_pktinfo(self, source: IPv4Address | IPv6Address) -> bytes:
        return struct.pack("=i4s4s", 0, source.packed, bytes(4))

    def take_replies(self) -> list[Reply]:
        with self._lock:
            replies, self._replies = self._replies, []
        return replies

    def cancel(self, ticket: int) -> None:
        with self._lock:
            self._pending.pop(ticket, None)

    def _claim(self, seq: int, peer: IPv4Address | IPv6Address) -> float | None:
        """Take the outstanding echo ``seq`` if it went to ``peer``: its send time, or
        None when it is not ours (another prober, a late or spoofed answer)."""
        with self._lock:
            sent = self._pending.get(seq)
            if sent is None or sent[0] != peer:
                return None
            del self._pending[seq]
        return sent[1]

    def _next_seq(self) -> int:
        for _ in range(0x10000):
            self._seq = (self._seq + 1) & 0xFFFF
            if self._seq not in self._pending:
                return self._seq
        raise DataplaneError("65536 echoes are outstanding; lower the prober's max_in_flight")

    def _receive(self) -> None:
        while not self._closed.is_set():
            try:
                ready, _, _ = select.select([self._sock.fileno(), self._wake_r], [], [])
                if self._wake_r in ready:
                    continue  # close() woke us: the loop ends
                data, addr = self._sock.recvfrom(65535)
            except (OSError, ValueError):
                if self._closed.is_set():
                    return
                log.exception("prober receive failed")
                self._closed.wait(0.2)
                continue
            reply = self._match(data, ip_address(addr[0].split("%")[0]), time.perf_counter())
            if reply is not None:
                with self._lock:
                    self._replies.append(reply)

    def _match(self, packet: bytes, sender: IPv4Address | IPv6Address, now: float) -> Reply | None:
        icmp = packet[(packet[0] & 0x0F) * 4 :] if packet else b""
        if len(icmp) < 8:
            return None
        kind, code, _, ident, seq = struct.unpack("!BBHHH", icmp[:8])
        if kind == ICMP_ECHO_REPLY:
            if ident != self._ident or icmp_checksum(icmp) != 0:
                return None
            sent_at = self._claim(seq, sender)
            return None if sent_at is None else Reply(seq, now - sent_at)
        if kind in (ICMP_DEST_UNREACH, ICMP_TIME_EXCEEDED):
            return self._match_error(icmp, kind, code, sender)
        return None

    def _match_error(
        self, icmp: bytes, kind: int, code: int, sender: IPv4Address | IPv6Address
    ) -> Reply | None:
        """An ICMP error quoting one of our echoes: the quoted IP header plus 8 bytes."""
        inner = icmp[8:]
        if len(inner) < 20:
            return None
        ihl = (inner[0] & 0x0F) * 4
        quoted = inner[ihl : ihl + 8]
        if len(quoted) < 8:
            return None
        qkind, _, _, ident, seq = struct.unpack("!BBHHH", quoted)
        if qkind != ICMP_ECHO or ident != self._ident:
            return None
        target = IPv4Address(inner[16:20])
        if self._claim(seq, target) is None:
            return None
        if kind == ICMP_TIME_EXCEEDED:
            return Reply(seq, None, f"time exceeded at {sender} on the way to {target}")
        if code == ICMP_FRAG_NEEDED:
            (next_mtu,) = struct.unpack("!H", icmp[6:8])
            return Reply(
                seq,
                None,
                f"fragmentation needed: {sender} forwards at most {next_mtu} bytes "
                f"towards {target}",
                too_big=True,
            )
        reason = _UNREACH.get(code, f"destination unreachable (code {code})")
        return Reply(seq, None, f"{reason}: reported by {sender} for {target}")


def echo6_request(ident: int, seq: int, payload_len: int) -> bytes:
    """An ICMPv6 echo request, checksum zero: the kernel fills it in on raw ICMPv6
    sockets (it covers the pseudo-header, which needs the source it picks)."""
    payload, _ = _payload(payload_len)
    return struct.pack("!BBHHH", ICMP6_ECHO_REQUEST, 0, 0, ident, seq) + payload


def _raw_socket(family: socket.AddressFamily, proto: int) -> socket.socket:
    try:
        return socket.socket(family, socket.SOCK_RAW, proto)
    except PermissionError as e:
        raise DataplaneError(
            "cannot open a raw ICMP socket for the prober (needs root or CAP_NET_RAW); "
            "run the agent with that capability"
        ) from e
    except OSError as e:
        raise DataplaneError(
            f"cannot open a raw {'ICMPv6' if family == socket.AF_INET6 else 'ICMP'} socket "
            f"for the prober ({e.strerror or e}); enable that family in the kernel"
        ) from e


class Icmp6Transport(IcmpTransport):
    """ICMPv6 echoes with IPV6_DONTFRAG: never fragmented by the sender, so a full-size
    echo over a path that cannot carry it is refused here (EMSGSIZE, once the kernel
    knows the path MTU) or lost, or answered by a Packet Too Big."""

    headers = IP6_ICMP_HEADERS

    def _open(self) -> socket.socket:
        sock = _raw_socket(socket.AF_INET6, socket.IPPROTO_ICMPV6)
        sock.setsockopt(socket.IPPROTO_IPV6, IPV6_DONTFRAG, 1)
        wanted = (ICMP6_ECHO_REPLY, ICMP6_DEST_UNREACH, ICMP6_PACKET_TOO_BIG, ICMP6_TIME_EXCEEDED)
        blocked = [0xFFFFFFFF] * 8  # a set bit blocks that type
        for kind in wanted:
            blocked[kind >> 5] &= ~(1 << (kind & 31)) & 0xFFFFFFFF
        sock.setsockopt(socket.IPPROTO_ICMPV6, ICMP6_FILTER, struct.pack("8I", *blocked))
        return sock

    def _sendmsg(
        self,
        source: IPv4Address | IPv6Address,
        target: IPv4Address | IPv6Address,
        seq: int,
        payload_len: int,
    ) -> None:
        packet = echo6_request(self._ident, seq, payload_len)
        self._sock.sendmsg(
            [packet],
            [(socket.IPPROTO_IPV6, IPV6_PKTINFO, self._pktinfo(source))],
            0,
            self._sockaddr(target),
        )

    def _pack_pktinfo(self, source: IPv4Address | IPv6Address) -> bytes:
        return struct.pack("=16si", source.packed, 0)

    def _match(self, packet: bytes, sender: IPv4Address | IPv6Address, now: float) -> Reply | None:
        """Raw ICMPv6 sockets deliver the ICMPv6 message without the IPv6 header; the
        kernel has verified its checksum."""
        if len(packet) < 8:
            return None
        kind, code, _, ident, seq = struct.unpack("!BBHHH", packet[:8])
        if kind == ICMP6_ECHO_REPLY:
            if ident != self._ident:
                return None
            sent_at = self._claim(seq, sender)
            return None if sent_at is None else Reply(seq, now - sent_at)
        if kind in (ICMP6_DEST_UNREACH, ICMP6_PACKET_TOO_BIG, ICMP6_TIME_EXCEEDED):
            return self._match_error(packet, kind, code, sender)
        return None

    def _match_error(
        self, icmp: bytes, kind: int, code: int, sender: IPv4Address | IPv6Address
    ) -> Reply | None:
        """An ICMPv6 error quoting one of our echoes: the quoted IPv6 header, then ours."""
        inner = icmp[8:]
        quoted = inner[40:48]
        if len(quoted) < 8 or inner[6] != socket.IPPROTO_ICMPV6:
            return None
        qkind, _, _, ident, seq = struct.unpack("!BBHHH", quoted)
        if qkind != ICMP6_ECHO_REQUEST or ident != self._ident:
            return None
        target = IPv6Address(inner[24:40])
        if self._claim(seq, target) is None:
            return None
        if kind == ICMP6_TIME_EXCEEDED:
            return Reply(seq, None, f"time exceeded at {sender} on the way to {target}")
        if kind == ICMP6_PACKET_TOO_BIG:
            (next_mtu,) = struct.unpack("!I", icmp[4:8])
            return Reply(
                seq,
                None,
                f"packet too big: {sender} forwards at most {next_mtu} bytes towards {target}",
                too_big=True,
            )
        reason = _UNREACH6.get(code, f"destination unreachable (code {code})")
        return Reply(seq, None, f"{reason}: reported by {sender} for {target}")


class DualTransport:
    """An IPv4 and an IPv6 transport behind one ticket space (even: IPv4, odd: IPv6);
    each echo goes out on the one of its target's family."""

    def __init__(self, v4: IcmpTransport, v6: IcmpTransport | None) -> None:
        self._v4 = v4
        self._v6 = v6

    def send(
        self, source: IPv4Address | IPv6Address, target: IPv4Address | IPv6Address, size: int
    ) -> int:
        if target.version == 4:
            return self._v4.send(source, target, size) << 1
        if self._v6 is None:
            raise OSError(errno.EAFNOSUPPORT, "no ICMPv6 socket (IPv6 is disabled in this kernel)")
        return self._v6.send(source, target, size) << 1 | 1

    def take_replies(self) -> list[Reply]:
        replies = [r._replace(ticket=r.ticket << 1) for r in self._v4.take_replies()]
        if self._v6 is not None:
            replies += [r._replace(ticket=r.ticket << 1 | 1) for r in self._v6.take_replies()]
        return replies

    def cancel(self, ticket: int) -> None:
        if ticket & 1:
            if self._v6 is not None:
                self._v6.cancel(ticket >> 1)
        else:
            self._v4.cancel(ticket >> 1)

    def close(self) -> None:
        self._v4.close()
        if self._v6 is not None:
            self._v6.close()
