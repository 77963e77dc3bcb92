"""Traffic probe run inside one pod's network namespace (standard library only).

    ip netns exec <pod netns> python3 traffic_probe.py icmp --targets A,B --rate 20
    ip netns exec <pod netns> python3 traffic_probe.py tcp-server --port 7407
    ip netns exec <pod netns> python3 traffic_probe.py tcp-client --target A --port 7407

Every mode is one select loop in one process: no subprocess per packet, so ten
pods probing nine peers each at 20/s stay cheap on a small machine.

Output, one JSON object per line on stdout:
``{"event": "first", "target": ip}`` (icmp: the first reply from that target),
``{"event": "warm"}`` (icmp: every target answered; tcp-client: first echo),
``{"event": "listening"}`` (tcp-server), ``{"event": "measuring"}`` (after SIGUSR1:
counting restarts at the next packet, so warm-up is not counted), and on
SIGTERM/SIGINT ``{"event": "report", ...}``, after which the process exits 0.

icmp counts per target from its own sequence numbers (a 64-bit one in the
payload, echoed back), not from ping's summary: after SIGTERM it stops sending
and waits ``--grace`` seconds for replies still in flight, so the last echo is
not counted lost merely because it was in the air. A failed send counts as sent
and lost (the packet did not get through).

tcp-client keeps one connection and sends sequence-numbered messages; each echo
must come back in order within ``--timeout`` seconds. Any error, reset, early
close, out-of-order or missing echo marks the stream broken (and ends it). On
SIGTERM it sends nothing more, waits for the outstanding echoes, half-closes
and waits for the server's close: only that is a clean end.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import errno
import json
import os
import select
import signal
import socket
import struct
import sys
import time
from typing import Any

ICMP_ECHO_REPLY = 0
ICMP_ECHO_REQUEST = 8
SOL_RAW = 255  # linux/socket.h
ICMP_FILTER = 1  # linux/icmp.h: a bit mask of ICMP types the raw socket does NOT receive
ICMP6_ECHO_REQUEST = 128
ICMP6_ECHO_REPLY = 129
ICMP6_FILTER = 1  # linux/icmpv6.h, at IPPROTO_ICMPV6: 256 bits, a set one is a type NOT received
ICMP_MAGIC = b"FPTI"
ICMP_PAYLOAD = struct.Struct("!4sQ")  # magic, 64-bit sequence number
ICMP_HEADER = struct.Struct("!BBHHH")  # type, code, checksum, identifier, sequence
TCP_MAGIC = b"FPTS"
TCP_FRAME = struct.Struct("!4sQ")
LOST_SEQS_CAP = 100  # lost sequence numbers listed per target (all are counted)
STARVED_S = 1.0  # a send schedule this far behind restarts from now instead of bursting
RECONNECT_S = 0.2  # between connection attempts before the first connect
TICK_S = 0.02  # the ICMP prober's wake-up period
SO_TIMESTAMPNS = 35  # asm-generic/socket.h: stamp received packets (struct timespec)
TIMESPEC = struct.Struct("@qq")
ANCILLARY_SPACE = socket.CMSG_SPACE(TIMESPEC.size)


def emit(doc: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(doc, sort_keys=True) + "\n")
    sys.stdout.flush()


class Flags:
    """What the signal handlers asked for; the loop acts on it (handlers only set flags)."""

    def __init__(self) -> None:
        self.stop = False
        self.mark = False

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._stop)
        signal.signal(signal.SIGINT, self._stop)
        signal.signal(signal.SIGUSR1, self._mark)  # default action would kill us

    def _stop(self, *_: Any) -> None:
        self.stop = True

    def _mark(self, *_: Any) -> None:
        self.mark = True


def checksum(data: bytes) -> int:
    """The Internet checksum (RFC 1071)."""
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


def echo_request(ident: int, seq: int, ipv6: bool = False) -> bytes:
    """An echo request; over IPv6 the kernel writes the checksum (it covers the addresses)."""
    kind = ICMP6_ECHO_REQUEST if ipv6 else ICMP_ECHO_REQUEST
    payload = ICMP_PAYLOAD.pack(ICMP_MAGIC, seq)
    header = ICMP_HEADER.pack(kind, 0, 0, ident, seq & 0xFFFF)
    total = 0 if ipv6 else checksum(header + payload)
    return ICMP_HEADER.pack(kind, 0, total, ident, seq & 0xFFFF) + payload


def parse_echo_reply(packet: bytes, ident: int, ipv6: bool = False) -> int | None:
    """The 64-bit sequence number of one of our echo replies, else None: over IPv4 the
    packet starts with the IP header, over IPv6 (a raw ICMPv6 socket) with the ICMP one."""
    if ipv6:
        body = packet
    elif len(packet) < 20:
        return None
    else:
        body = packet[(packet[0] & 0x0F) * 4 :]
    if len(body) < ICMP_HEADER.size + ICMP_PAYLOAD.size:
        return None
    kind, _, _, their_ident, _ = ICMP_HEADER.unpack_from(body)
    if kind != (ICMP6_ECHO_REPLY if ipv6 else ICMP_ECHO_REPLY) or their_ident != ident:
        return None
    magic, seq = ICMP_PAYLOAD.unpack_from(body, ICMP_HEADER.size)
    return seq if magic == ICMP_MAGIC else None


class PairTracker:
    """Echoes to one target: what was sent, answered, lost, duplicated (pure; times in seconds).

    Sequence numbers before ``mark_seq`` belong to the warm-up and are not counted.
    """

    def __init__(self, now: float) -> None:
        self.next_seq = 0
        self.mark_seq = 0
        self.mark_at = now
        self.outstanding: dict[int, float] = {}  # seq -> sent at
        self.first_reply_at: float | None = None
        self.sent = 0
        self.received = 0
        self.duplicates = 0
        self.send_errors = 0
        self.last_reply_at = now
        self.max_gap = 0.0
        self.max_rtt = 0.0

    def mark(self, now: float) -> None:
        """Count from the next sequence number on."""
        self.mark_seq = self.next_seq
        self.mark_at = self.last_reply_at = now
        self.sent = self.received = self.duplicates = self.send_errors = 0
        self.max_gap = self.max_rtt = 0.0

    def on_send(self, now: float, ok: bool) -> int:
        seq = self.next_seq
        self.next_seq += 1
        self.outstanding[seq] = now
        self.sent += 1
        if not ok:
            self.send_errors += 1
        return seq

    def on_reply(self, seq: int, now: float) -> bool:
        """Record a reply; True if it was the target's first one ever."""
        first = self.first_reply_at is None
        if first:
            self.first_reply_at = now
        sent_at = self.outstanding.pop(seq, None)
        if seq < self.mark_seq:
            return first
        if sent_at is None:
            if seq < self.next_seq:
                self.duplicates += 1
            return first
        self.received += 1
        self.max_rtt = max(self.max_rtt, now - sent_at)
        self.max_gap = max(self.max_gap, now - self.last_reply_at)
        self.last_reply_at = now
        return first

    def waiting(self) -> bool:
        """Measured echoes still unanswered."""
        return any(seq >= self.mark_seq for seq in self.outstanding)

    def report(self, stopped_at: float) -> dict[str, Any]:
        lost = sorted(seq for seq in self.outstanding if seq >= self.mark_seq)
        gap = max(self.max_gap, stopped_at - self.last_reply_at) if self.sent else 0.0
        return {
            "sent": self.sent,
            "received": self.received,
            "lost": len(lost),
            "lost_seqs": lost[:LOST_SEQS_CAP],
            "duplicates": self.duplicates,
            "send_errors": self.send_errors,
            "max_gap_ms": round(gap * 1000, 1),
            "max_rtt_ms": round(self.max_rtt * 1000, 1),
        }


def icmp_socket(ipv6: bool = False) -> socket.socket:
    # Only echo replies reach us: a raw socket otherwise gets a copy of every
    # incoming ICMP packet, including the peers' echo requests to this pod.
    if ipv6:
        sock = socket.socket(socket.AF_INET6, socket.SOCK_RAW, socket.IPPROTO_ICMPV6)
        blocked = [0xFFFFFFFF] * 8
        blocked[ICMP6_ECHO_REPLY >> 5] &= ~(1 << (ICMP6_ECHO_REPLY & 31))
        sock.setsockopt(socket.IPPROTO_ICMPV6, ICMP6_FILTER, struct.pack("8I", *blocked))
    else:
        sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
        mask = ~(1 << ICMP_ECHO_REPLY) & 0xFFFFFFFF
        sock.setsockopt(SOL_RAW, ICMP_FILTER, struct.pack("I", mask))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
    sock.setblocking(False)
    return sock


def _arrival(ancdata: list[tuple[int, int, bytes]]) -> float:
    """The kernel's receive time of a packet (wall clock), or now if it gave none."""
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPNS and len(data) >= TIMESPEC.size:
            sec, nsec = TIMESPEC.unpack_from(data)
            return sec + nsec / 1e9
    return time.time()


def run_icmp(targets: list[str], rate: float, grace: float, flags: Flags) -> dict[str, Any]:
    """Echo every target at ``rate``/s until stopped; counts on the wall clock, since the
    kernel stamps each reply's arrival in it (so wake-up latency does not count). IPv6
    targets are echoed over ICMPv6, on a socket of their own."""
    socks = {ipv6: icmp_socket(ipv6) for ipv6 in {":" in t for t in targets}}
    ident = os.getpid() & 0xFFFF
    trackers = {t: PairTracker(time.time()) for t in targets}
    order = list(trackers.items())
    interval = 1.0 / (rate * len(order))  # targets take turns: sends are spread evenly
    next_send = time.monotonic()
    turn = 0
    starved = 0
    waiting_first = set(targets)
    stopped_at = time.time()

    def drain(ipv6: bool, sock: socket.socket) -> None:
        while True:
            try:
                packet, ancdata, _, address = sock.recvmsg(2048, ANCILLARY_SPACE)
            except BlockingIOError:
                return
            source = address[0]
            tracker = trackers.get(source)
            seq = parse_echo_reply(packet, ident, ipv6)
            if tracker is None or seq is None:
                continue
            if tracker.on_reply(seq, _arrival(ancdata)) and source in waiting_first:
                waiting_first.discard(source)
                emit({"event": "first", "target": source})
                if not waiting_first:
                    emit({"event": "warm"})

    while not flags.stop:
        if flags.mark:
            flags.mark = False
            now = time.time()
            for tracker in trackers.values():
                tracker.mark(now)
            emit({"event": "measuring"})
        mono = time.monotonic()
        while next_send <= mono:
            target, tracker = order[turn]
            turn = (turn + 1) % len(order)
            sent_at = time.time()  # before: on loopback the reply arrives inside sendto
            try:
                ipv6 = ":" in target
                socks[ipv6].sendto(echo_request(ident, tracker.next_seq, ipv6), (target, 0))
                ok = True
            except OSError:  # no route, full buffer, filtered: the echo did not leave
                ok = False
            tracker.on_send(sent_at, ok)
            next_send += interval
            if mono - next_send > STARVED_S:
                next_send = mono
                starved += 1
        stopped_at = time.time()
        # Wake once per tick, not per packet: sends due meanwhile go out together and
        # replies wait in the socket (stamped on arrival). Halves the probe's CPU.
        time.sleep(max(0.0, max(next_send, mono + TICK_S) - time.monotonic()))
        for ipv6, sock in socks.items():
            drain(ipv6, sock)

    deadline = time.monotonic() + grace
    while any(t.waiting() for t in trackers.values()):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        ready = select.select(list(socks.values()), [], [], min(left, TICK_S))[0]
        for ipv6, sock in socks.items():
            if sock in ready:
                drain(ipv6, sock)
    for sock in socks.values():
        sock.close()
    return {
        "mode": "icmp",
        "rate": rate,
        "measured_s": round(stopped_at - min(t.mark_at for t in trackers.values()), 3),
        "starved": starved,
        "targets": {t: tr.report(stopped_at) for t, tr in trackers.items()},
    }


class EchoChecker:
    """Order and timeliness of the echoes on one stream (pure; times in seconds)."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.next_seq = 0
        self.mark_seq = 0
        self.outstanding: collections.deque[tuple[int, float]] = collections.deque()
        self.pending = bytearray()  # received bytes of a frame not complete yet
        self.sent = 0
        self.echoed = 0
        self.max_stall = 0.0
        self.error: str | None = None
        self.first_echo = False

    def mark(self) -> None:
        self.mark_seq = self.next_seq
        self.sent = self.echoed = 0
        self.max_stall = 0.0

    def next_frame(self, now: float) -> bytes:
        seq = self.next_seq
        self.next_seq += 1
        self.outstanding.append((seq, now))
        self.sent += 1
        return TCP_FRAME.pack(TCP_MAGIC, seq)

    def on_data(self, data: bytes, now: float) -> None:
        """Check every complete echo; sets ``error`` at the first wrong one."""
        self.pending += data
        while self.error is None and len(self.pending) >= TCP_FRAME.size:
            magic, seq = TCP_FRAME.unpack_from(self.pending)
            del self.pending[: TCP_FRAME.size]
            if magic != TCP_MAGIC:
                self.error = f"garbled echo {magic!r} after {self.echoed} echoes"
            elif not self.outstanding:
                self.error = f"echo of seq {seq} that was never sent"
            elif seq != self.outstanding[0][0]:
                self.error = f"echo of seq {seq} where seq {self.outstanding[0][0]} was due"
            else:
                _, sent_at = self.outstanding.popleft()
                self.first_echo = True
                if seq >= self.mark_seq:
                    self.echoed += 1
                    self.max_stall = max(self.max_stall, now - sent_at)

    def check_stall(self, now: float) -> None:
        if self.outstanding and self.error is None:
            seq, sent_at = self.outstanding[0]
            waited = now - sent_at
            if seq >= self.mark_seq:
                self.max_stall = max(self.max_stall, waited)
            if waited > self.timeout:
                self.error = f"no echo of seq {seq} within {self.timeout:g} s"

    def report(self) -> dict[str, Any]:
        return {
            "sent": self.sent,
            "echoed": self.echoed,
            "broken": self.error is not None,
            "error": self.error,
            "max_stall_ms": round(self.max_stall * 1000, 1),
        }


def _connect(target: str, port: int, flags: Flags, timeout: float) -> socket.socket | None:
    """Connect, retrying refused attempts (the server may not listen yet) until stopped."""
    while not flags.stop:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        code = sock.connect_ex((target, port))
        if code == errno.EINPROGRESS:
            if select.select([], [sock], [], timeout)[1]:
                code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
            else:
                code = errno.ETIMEDOUT
        if code == 0:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            return sock
        sock.close()
        time.sleep(RECONNECT_S)
    return None


def run_tcp_client(
    target: str, port: int, rate: float, timeout: float, flags: Flags
) -> dict[str, Any]:
    checker = EchoChecker(timeout)
    sock = _connect(target, port, flags, min(timeout, 1.0))
    if sock is None:
        report = checker.report()
        report.update(broken=True, error=f"never connected to {target}:{port}")
        return {"mode": "tcp-client", **report}
    emit({"event": "connected"})
    out = bytearray()
    interval = 1.0 / rate
    next_send = time.monotonic()
    announced = False
    closing_at: float | None = None  # when the half-close was sent

    def fail(message: str) -> None:
        if checker.error is None:
            checker.error = message

    try:
        while checker.error is None:
            now = time.monotonic()
            if flags.mark:
                flags.mark = False
                checker.mark()
                emit({"event": "measuring"})
            if not flags.stop:
                while next_send <= now:
                    out += checker.next_frame(now)
                    next_send += interval
                    if now - next_send > STARVED_S:
                        next_send = now
            elif closing_at is None and not out and not checker.outstanding:
                sock.shutdown(socket.SHUT_WR)
                closing_at = now
            if out:
                with contextlib.suppress(BlockingIOError):  # full: the next round sends it
                    del out[: sock.send(out)]
            checker.check_stall(now)
            if closing_at is not None and now - closing_at > timeout:
                fail(f"the server did not close within {timeout:g} s of our half-close")
            if checker.error is not None:
                break
            wait = 0.05 if flags.stop else max(0.0, min(next_send - now, 0.05))
            readable, _, _ = select.select([sock], [sock] if out else [], [], wait)
            if readable:
                data = sock.recv(65536)
                if not data:
                    if closing_at is None or checker.outstanding:
                        fail("the server closed the connection")
                    break  # clean end: our half-close answered by the server's
                if closing_at is not None:
                    fail(f"{len(data)} unexpected bytes after the half-close")
                checker.on_data(data, time.monotonic())
                if checker.first_echo and not announced:
                    announced = True
                    emit({"event": "warm"})
    except OSError as e:  # reset, unreachable, timed out: the stream is broken
        fail(f"{type(e).__name__}: {e}")
    finally:
        sock.close()
    if checker.error is not None and not flags.stop:
        while not flags.stop:  # report at SIGTERM like every probe
            time.sleep(0.05)
    return {"mode": "tcp-client", **checker.report()}


def run_tcp_server(port: int, flags: Flags) -> dict[str, Any]:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("0.0.0.0", port))
    listener.listen(64)
    listener.setblocking(False)
    conns: dict[socket.socket, bytearray] = {}
    eof: set[socket.socket] = set()
    accepted = 0
    echoed = 0
    errors: list[str] = []
    emit({"event": "listening"})

    def drop(conn: socket.socket) -> None:
        conns.pop(conn, None)
        eof.discard(conn)
        conn.close()

    while not flags.stop:
        writers = [c for c, buf in conns.items() if buf]
        readable, writable, _ = select.select([listener, *conns], writers, [], 0.1)
        for conn in writable:
            try:
                del conns[conn][: conn.send(conns[conn])]
            except OSError as e:
                errors.append(f"send: {e}")
                drop(conn)
        for conn in readable:
            if conn is listener:
                try:
                    new, _ = listener.accept()
                except BlockingIOError:
                    continue
                new.setblocking(False)
                new.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                conns[new] = bytearray()
                accepted += 1
                continue
            if conn not in conns:
                continue
            try:
                data = conn.recv(65536)
            except OSError as e:
                errors.append(f"recv: {e}")
                drop(conn)
                continue
            if data:
                conns[conn] += data
                echoed += len(data)
            else:
                eof.add(conn)
        for conn in [c for c in eof if not conns.get(c)]:
            drop(conn)  # the client half-closed and got every echo: close our side
    for conn in list(conns):
        drop(conn)
    listener.close()
    return {"mode": "tcp-server", "accepted": accepted, "echoed_bytes": echoed, "errors": errors}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    modes = parser.add_subparsers(dest="mode", required=True)
    icmp = modes.add_parser("icmp")
    icmp.add_argument("--targets", required=True, help="comma-separated IPv4 or IPv6 addresses")
    icmp.add_argument("--rate", type=float, default=20.0, help="echoes per second per target")
    icmp.add_argument("--grace", type=float, default=2.0, help="seconds to wait for late replies")
    server = modes.add_parser("tcp-server")
    server.add_argument("--port", type=int, required=True)
    client = modes.add_parser("tcp-client")
    client.add_argument("--target", required=True)
    client.add_argument("--port", type=int, required=True)
    client.add_argument("--rate", type=float, default=50.0, help="messages per second")
    client.add_argument("--timeout", type=float, default=5.0, help="seconds an echo may take")
    args = parser.parse_args(argv)

    flags = Flags()
    flags.install()
    started = time.monotonic()
    if args.mode == "icmp":
        targets = [t for t in args.targets.split(",") if t]
        doc = run_icmp(targets, args.rate, args.grace, flags)
    elif args.mode == "tcp-server":
        doc = run_tcp_server(args.port, flags)
    else:
        doc = run_tcp_client(args.target, args.port, args.rate, args.timeout, flags)
    cpu = os.times()
    doc.update(
        cpu_s=round(cpu.user + cpu.system, 3),
        cpu_user_s=round(cpu.user, 3),
        wall_s=round(time.monotonic() - started, 3),
    )
    emit({"event": "report", **doc})
    return 0


if __name__ == "__main__":
    sys.exit(main())
