"""All-pairs prober: is every peer reachable over the overlay, and does the path
carry full-size packets?

Each round sends a peer two ICMP echoes from our overlay address to its overlay
address, at once: a small one (ping's default size) and one of exactly the
overlay MTU with DF set. A path that answers the small echo but not the big one
is the silent-drop case of field notes §1: connections hang, nothing logs an
error. A local EMSGSIZE for the big echo means our own route's MTU is below the
overlay MTU, which is just as conclusive.

Scheduling: peer P is probed at times ``phase(own, P) + k * interval`` on the
injected clock, the phase being a hash of the pair. Every node spreads its own
probes over the interval, and since the hash covers both ends, N nodes do not
send N² probes at the same instant. Rounds of one peer never overlap (the echo
timeout is below the interval) and at most ``max_in_flight`` echoes are
outstanding; a peer due while that many are out waits for capacity, and a
missed slot is skipped rather than caught up in a burst.

Statistics over the last ``window`` rounds of a peer:
- loss: small echoes not answered / small echoes sent;
- reachable: some echo answered in the last ``down_after`` rounds (one lost
  packet is loss, not an outage);
- mtu_ok: True as soon as a full-size DF echo is answered; False on a local
  refusal, a "fragmentation needed" answer, or ``mtu_strikes`` rounds in a row
  (skipping rounds where the small echo was lost too) where the small echo was
  answered and the big one was not. Requiring several strikes keeps random loss
  from passing for an MTU problem; None until either is seen.

The pure part (Prober with a fake clock and transport, summarize, phases) runs
in unit tests; IcmpTransport is the raw-socket I/O and needs root.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import math
import secrets
import select
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from ipaddress import IPv4Address
from typing import Any, Literal, NamedTuple, Protocol

from flannelpy.errors import ConfigError, DataplaneError

log = logging.getLogger("flannelpy.prober")

IP_ICMP_HEADERS = 28  # IPv4 header (no options) + ICMP echo header
SMALL_PROBE_BYTES = 84  # total IP packet of ping's default 56-byte payload
BLOCKED_POLL_SECONDS = 0.02  # how soon to look again when max_in_flight holds a peer back


# ---------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ProbeResult:
    """What the prober knows about one peer, after its latest completed round."""

    reachable: bool
    rtt_seconds: float | None  # latest answered small echo; None when unreachable
    loss_ratio: float  # 0.0 .. 1.0 over the window
    mtu_ok: bool | None  # None: not verified either way yet
    last_error: str | None  # the latest round's problem; None when it went fine
    probes: int  # rounds completed since the peer was added
    target: IPv4Address | None = None
    label: str = ""

    def as_status(self) -> dict[str, Any]:
        """The ``status.json`` form: {reachable, rtt_ms, loss, mtu_ok, error, probes}."""
        rtt_ms = None if self.rtt_seconds is None else round(self.rtt_seconds * 1000, 3)
        return {
            "reachable": self.reachable,
            "rtt_ms": rtt_ms,
            "loss": round(self.loss_ratio, 4),
            "mtu_ok": self.mtu_ok,
            "error": self.last_error,
            "probes": self.probes,
        }


BigOutcome = Literal["not-sent", "answered", "lost", "refused"]


@dataclass(frozen=True)
class RoundOutcome:
    """One completed round to one peer."""

    small_ok: bool
    rtt_seconds: float | None
    big: BigOutcome
    error: str | None = None


def summarize(
    history: Sequence[RoundOutcome],
    probes: int,
    *,
    down_after: int = 3,
    mtu_strikes: int = 3,
    target: IPv4Address | None = None,
    label: str = "",
) -> ProbeResult:
    """Turn a peer's window of rounds (oldest first) into a ProbeResult."""
    sent = len(history)
    loss = sum(not r.small_ok for r in history) / sent if sent else 0.0
    recent = history[-down_after:] if down_after > 0 else history
    reachable = any(r.small_ok or r.big == "answered" for r in recent)
    rtt = next((r.rtt_seconds for r in reversed(history) if r.small_ok), None)
    return ProbeResult(
        reachable=reachable,
        rtt_seconds=rtt if reachable else None,
        loss_ratio=loss,
        mtu_ok=mtu_verdict(history, mtu_strikes),
        last_error=history[-1].error if history else None,
        probes=probes,
        target=target,
        label=label,
    )


def mtu_verdict(history: Sequence[RoundOutcome], strikes: int = 3) -> bool | None:
    """Newest evidence first: see the module docstring."""
    seen = 0
    for r in reversed(history):
        if r.big == "answered":
            return True
        if r.big == "refused":
            return False
        if r.big == "lost" and r.small_ok:
            seen += 1
            if seen >= strikes:
                return False
    return None


# ---------------------------------------------------------------------------
# Scheduling (pure)
# ---------------------------------------------------------------------------


def phase_seconds(own: str, peer: str, interval: float) -> float:
    """Where in the interval ``own`` probes ``peer``: a stable hash of the ordered pair.

    Not Python's hash(): that one is salted per process, and the spread must be the
    same on every node and across restarts.
    """
    digest = hashlib.blake2b(f"{own}\0{peer}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 * interval


def first_slot(now: float, phase: float, interval: float) -> float:
    """The earliest time >= now that is ``phase`` modulo ``interval``."""
    slot = phase + math.ceil((now - phase) / interval) * interval
    while slot < now:  # float rounding
        slot += interval
    return slot


def slot_after(slot: float, now: float, interval: float) -> float:
    """The first slot after ``slot`` that is later than ``now`` (missed slots are skipped)."""
    nxt = slot + interval
    if nxt <= now:
        nxt += math.floor((now - nxt) / interval + 1) * interval
    while nxt <= now:  # float rounding
        nxt += interval
    return nxt


# ---------------------------------------------------------------------------
# Transport boundary
# ---------------------------------------------------------------------------


class Reply(NamedTuple):
    """What came back for one ticket: an echo reply (rtt) or an ICMP error."""

    ticket: int
    rtt_seconds: float | None
    error: str | None = None
    too_big: bool = False  # ICMP "fragmentation needed": the path MTU is lower


class Transport(Protocol):
    """Sends ICMP echoes with DF set and hands back what answered them."""

    def send(self, source: IPv4Address, target: IPv4Address, size: int) -> int:
        """Send one echo request of ``size`` bytes (whole IP packet); return its ticket.

        Raises OSError when the kernel refuses it (EMSGSIZE: larger than the route MTU).
        """
        ...

    def take_replies(self) -> list[Reply]:
        """Replies that arrived since the last call."""
        ...

    def cancel(self, ticket: int) -> None:
        """Forget a ticket (timed out), so a late reply is ignored."""
        ...


# ---------------------------------------------------------------------------
# The prober
# ---------------------------------------------------------------------------


@dataclass
class _Echo:
    size: int
    ticket: int | None = None  # outstanding while set
    done: bool = False
    rtt: float | None = None
    error: str | None = None
    refused: bool = False  # locally (EMSGSIZE) or by an ICMP "fragmentation needed"


@dataclass
class _Round:
    deadline: float
    small: _Echo
    big: _Echo | None

    def echoes(self) -> list[_Echo]:
        return [self.small] if self.big is None else [self.small, self.big]


@dataclass
class _Peer:
    key: str
    target: IPv4Address
    label: str
    window: int
    phase: float = 0.0
    next_due: float = 0.0
    history: deque[RoundOutcome] = field(default_factory=deque)
    probes: int = 0
    current: _Round | None = None

    def __post_init__(self) -> None:
        self.history = deque(maxlen=self.window)


class Prober:
    """Probes every peer once per interval; see the module docstring.

    ``set_peers`` may be called from any thread while ``run`` loops in another.
    """

    def __init__(
        self,
        transport: Transport,
        clock: Callable[[], float] = time.time,
        *,
        mtu_provider: Callable[[], int | None],
        own_address_provider: Callable[[], IPv4Address | None],
        interval_seconds: float = 5.0,
        window: int = 20,
        timeout_seconds: float = 1.0,
        max_in_flight: int = 64,
        down_after: int = 3,
        mtu_strikes: int = 3,
        on_result: Callable[[str, ProbeResult], None] | None = None,
        max_sleep_seconds: float = 0.5,
    ) -> None:
        if interval_seconds <= 0 or not 0 < timeout_seconds < interval_seconds:
            raise ConfigError(
                f"probe interval {interval_seconds} s and timeout {timeout_seconds} s do not "
                "fit; use a positive interval and a timeout shorter than it"
            )
        if window < 1 or max_in_flight < 2 or down_after < 1 or mtu_strikes < 1:
            raise ConfigError(
                "probe window, down_after and mtu_strikes must be at least 1 and "
                "max_in_flight at least 2 (one round is two echoes); raise them"
            )
        self._transport = transport
        self._clock = clock
        self._mtu = mtu_provider
        self._own = own_address_provider
        self.interval = interval_seconds
        self.window = window
        self.timeout = timeout_seconds
        self.max_in_flight = max_in_flight
        self.down_after = down_after
        self.mtu_strikes = mtu_strikes
        self._on_result = on_result
        self._max_sleep = max_sleep_seconds
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._results: dict[str, ProbeResult] = {}
        self._tickets: dict[int, _Echo] = {}  # outstanding echoes by transport ticket
        self._phase_owner: str | None = None  # the own address phases were computed for

    # --- API -----------------------------------------------------------------

    def set_peers(self, peers: Mapping[str, tuple[IPv4Address, str]]) -> None:
        """Replace the peer set: ``{key: (overlay address to probe, label)}``.

        ``key`` identifies the peer (its lease subnet, say) in results and phases; a
        peer whose address changes starts a fresh history.
        """
        now = self._clock()
        with self._lock:
            for key in list(self._peers):
                if key not in peers or self._peers[key].target != peers[key][0]:
                    self._drop(key)
            owner = self._phase_owner or ""
            for key, (target, label) in peers.items():
                peer = self._peers.get(key)
                if peer is not None:
                    peer.label = label
                    continue
                peer = _Peer(key, IPv4Address(target), label, self.window)
                self._schedule(peer, owner, now)
                self._peers[key] = peer

    def results(self) -> dict[str, ProbeResult]:
        """Latest result per peer key; a peer appears after its first completed round."""
        with self._lock:
            return dict(self._results)

    def run(self, stop: threading.Event) -> None:
        """Probe until ``stop`` is set. Never raises: a failing tick is logged and retried."""
        while not stop.is_set():
            try:
                wake = self.tick()
            except Exception:
                log.exception("probe tick failed")
                wake = self._clock() + 1.0
            stop.wait(min(max(0.0, wake - self._clock()), self._max_sleep))

    def tick(self) -> float:
        """Settle answered or timed-out rounds, start due ones; return when to tick next."""
        now = self._clock()
        with self._lock:
            self._collect()
            finished = self._settle(now)
            blocked = self._dispatch(now)
            wake = self._next_wake(now, blocked)
        for key, result in finished:
            if self._on_result is not None:
                self._on_result(key, result)
        return wake

    # --- internals (called with the lock held) ---------------------------------

    def _schedule(self, peer: _Peer, owner: str, now: float) -> None:
        peer.phase = phase_seconds(owner, peer.key, self.interval)
        peer.next_due = first_slot(now, peer.phase, self.interval)

    def _drop(self, key: str) -> None:
        peer = self._peers.pop(key)
        self._results.pop(key, None)
        if peer.current is not None:
            for echo in peer.current.echoes():
                self._forget(echo)

    def _forget(self, echo: _Echo) -> None:
        if echo.ticket is not None:
            self._tickets.pop(echo.ticket, None)
            self._transport.cancel(echo.ticket)
            echo.ticket = None

    def _collect(self) -> None:
        for reply in self._transport.take_replies():
            echo = self._tickets.pop(reply.ticket, None)
            if echo is None:
                continue  # cancelled: it timed out or its peer went away
            echo.ticket = None
            echo.done = True
            echo.rtt = reply.rtt_seconds
            echo.error = reply.error
            echo.refused = reply.too_big

    def _settle(self, now: float) -> list[tuple[str, ProbeResult]]:
        finished = []
        for peer in self._peers.values():
            rnd = peer.current
            if rnd is None:
                continue
            echoes = rnd.echoes()
            if not all(e.done for e in echoes) and now < rnd.deadline:
                continue
            for echo in echoes:
                if not echo.done:
                    self._forget(echo)
                    echo.done = True
            peer.current = None
            peer.history.append(self._outcome(rnd, peer.target))
            peer.probes += 1
            result = summarize(
                list(peer.history),
                peer.probes,
                down_after=self.down_after,
                mtu_strikes=self.mtu_strikes,
                target=peer.target,
                label=peer.label,
            )
            self._log_change(peer, self._results.get(peer.key), result)
            self._results[peer.key] = result
            finished.append((peer.key, result))
        return finished

    def _outcome(self, rnd: _Round, target: IPv4Address) -> RoundOutcome:
        small_ok = rnd.small.rtt is not None
        errors = []
        if not small_ok:
            errors.append(rnd.small.error or self._timeout_text(rnd.small.size, target, False))
        big: BigOutcome = "not-sent"
        if rnd.big is not None:
            if rnd.big.rtt is not None:
                big = "answered"
            else:
                big = "refused" if rnd.big.refused else "lost"
                errors.append(rnd.big.error or self._timeout_text(rnd.big.size, target, True))
        return RoundOutcome(small_ok, rnd.small.rtt, big, "; ".join(errors) or None)

    def _timeout_text(self, size: int, target: IPv4Address, df: bool) -> str:
        kind = f"{size}-byte DF echo (the overlay MTU)" if df else f"{size}-byte echo"
        return f"no reply from {target} to a {kind} within {self.timeout:g} s"

    def _dispatch(self, now: float) -> bool:
        """Start due rounds; True if a due peer had to wait for in-flight capacity."""
        source = self._own()
        owner = str(source) if source is not None else ""
        if owner != (self._phase_owner or ""):
            self._phase_owner = owner
            for peer in self._peers.values():
                self._schedule(peer, owner, now)
        mtu = self._mtu()
        big_size = mtu if mtu is not None and mtu > SMALL_PROBE_BYTES else None
        needed = 1 if big_size is None else 2
        for peer in self._peers.values():
            if peer.next_due - now > 2 * self.interval:  # the clock went back
                peer.next_due = first_slot(now, peer.phase, self.interval)
        for peer in sorted(self._peers.values(), key=lambda p: p.next_due):
            if peer.next_due > now:
                break
            if source is None or peer.current is not None:
                peer.next_due = slot_after(peer.next_due, now, self.interval)
                continue
            if len(self._tickets) + needed > self.max_in_flight:
                return True
            peer.current = self._start_round(source, peer.target, big_size, now)
            peer.next_due = slot_after(peer.next_due, now, self.interval)
        return False

    def _start_round(
        self, source: IPv4Address, target: IPv4Address, big_size: int | None, now: float
    ) -> _Round:
        rnd = _Round(now + self.timeout, _Echo(SMALL_PROBE_BYTES), None)
        if big_size is not None:
            rnd.big = _Echo(big_size)
        for echo in rnd.echoes():
            try:
                echo.ticket = self._transport.send(source, target, echo.size)
            except OSError as e:
                echo.done = True
                echo.refused = e.errno == errno.EMSGSIZE
                echo.error = _send_error_text(e, source, target, echo.size)
                continue
            self._tickets[echo.ticket] = echo
        return rnd

    def _next_wake(self, now: float, blocked: bool) -> float:
        times = [p.next_due for p in self._peers.values() if p.next_due > now]
        times += [p.current.deadline for p in self._peers.values() if p.current is not None]
        if blocked:
            times.append(now + BLOCKED_POLL_SECONDS)
        return min(times, default=now + self.interval)

    def _log_change(self, peer: _Peer, old: ProbeResult | None, new: ProbeResult) -> None:
        was_reachable = old.reachable if old is not None else True
        if new.reachable != was_reachable:
            log.log(
                logging.INFO if new.reachable else logging.WARNING,
                "peer reachability changed peer=%s target=%s reachable=%s error=%r",
                peer.label or peer.key, peer.target, new.reachable, new.last_error,
            )
        old_mtu = old.mtu_ok if old is not None else None
        if new.mtu_ok is not None and new.mtu_ok != old_mtu:
            log.log(
                logging.INFO if new.mtu_ok else logging.WARNING,
                "peer path MTU check changed peer=%s target=%s mtu_ok=%s error=%r",
                peer.label or peer.key, peer.target, new.mtu_ok, new.last_error,
            )


def _send_error_text(e: OSError, source: IPv4Address, target: IPv4Address, size: int) -> str:
    if e.errno == errno.EMSGSIZE:
        return (
            f"message too long: this node refuses to send a {size}-byte DF packet to "
            f"{target}, so its route MTU is below the overlay MTU"
        )
    return f"cannot send an echo from {source} to {target}: {e.strerror or e}"


# ---------------------------------------------------------------------------
# Raw ICMP transport (root)
# ---------------------------------------------------------------------------

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

_UNREACH = {
    0: "network unreachable",
    1: "host unreachable",
    2: "protocol unreachable",
    3: "port unreachable",
    9: "network administratively prohibited",
    10: "host administratively prohibited",
    13: "communication administratively prohibited",
}


def icmp_checksum(data: bytes) -> int:
    """The Internet checksum (RFC 1071) of ``data``."""
    if len(data) % 2:
        data += b"\0"
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    while total >> 16:
        total = (total & 0xFFFF) + (total >> 16)
    return ~total & 0xFFFF


def echo_request(ident: int, seq: int, payload_len: int) -> bytes:
    """An ICMP echo request (header + payload), checksum filled in."""
    payload = bytes(i & 0xFF for i in range(payload_len))
    header = struct.pack("!BBHHH", ICMP_ECHO, 0, 0, ident, seq)
    csum = icmp_checksum(header + payload)
    return struct.pack("!BBHHH", ICMP_ECHO, 0, csum, ident, seq) + payload


class IcmpTransport:
    """Echoes over one raw ICMP socket with DF on every packet (IP_PMTUDISC_DO).

    The source address is chosen per packet with IP_PKTINFO, so a new own lease
    needs no new socket. One receive thread matches replies by (id, seq) and by
    the replying address. The socket lives in the network namespace of the thread
    that constructs the transport. Close it (or use ``with``) to stop the thread.
    """

    def __init__(self) -> None:
        try:
            sock = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
        except PermissionError as e:
            raise DataplaneError(
                "cannot open a raw ICMP socket for the prober (needs root or CAP_NET_RAW); "
                "run the agent with that capability"
            ) from e
        sock.setsockopt(socket.IPPROTO_IP, IP_MTU_DISCOVER, IP_PMTUDISC_DO)
        # Pass only what can answer an echo: replies, unreachables, time exceeded.
        wanted = (1 << ICMP_ECHO_REPLY) | (1 << ICMP_DEST_UNREACH) | (1 << ICMP_TIME_EXCEEDED)
        sock.setsockopt(SOL_RAW, ICMP_FILTER, struct.pack("I", ~wanted & 0xFFFFFFFF))
        self._sock = sock
        self._ident = secrets.randbits(16)
        self._seq = secrets.randbits(16)
        self._lock = threading.Lock()
        self._pending: dict[int, tuple[IPv4Address, float]] = {}  # seq -> (target, sent at)
        self._replies: list[Reply] = []
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._receive, name="prober-icmp-rx", daemon=True)
        self._thread.start()

    def __enter__(self) -> IcmpTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(timeout=2.0)
        self._sock.close()

    def send(self, source: IPv4Address, target: IPv4Address, size: int) -> int:
        if size < IP_ICMP_HEADERS:
            raise ValueError(f"an echo needs at least {IP_ICMP_HEADERS} bytes, not {size}")
        with self._lock:
            seq = self._next_seq()
            self._pending[seq] = (target, time.perf_counter())  # before send: replies are fast
        packet = echo_request(self._ident, seq, size - IP_ICMP_HEADERS)
        pktinfo = struct.pack("=i4s4s", 0, source.packed, bytes(4))
        try:
            self._sock.sendmsg(
                [packet], [(socket.IPPROTO_IP, IP_PKTINFO, pktinfo)], 0, (str(target), 0)
            )
        except OSError:
            self.cancel(seq)
            raise
        return seq

    def take_replies(self) -> list[Reply]:
        with self._lock:
            replies, self._replies = self._replies, []
        return replies

    def cancel(self, ticket: int) -> None:
        with self._lock:
            self._pending.pop(ticket, None)

    def _next_seq(self) -> int:
        for _ in range(0x10000):
            self._seq = (self._seq + 1) & 0xFFFF
            if self._seq not in self._pending:
                return self._seq
        raise DataplaneError("65536 echoes are outstanding; lower the prober's max_in_flight")

    def _receive(self) -> None:
        while not self._closed.is_set():
            try:
                ready, _, _ = select.select([self._sock], [], [], 0.2)
                if not ready:
                    continue
                data, addr = self._sock.recvfrom(65535)
            except (OSError, ValueError):
                if self._closed.is_set():
                    return
                log.exception("prober receive failed")
                self._closed.wait(0.2)
                continue
            reply = self._match(data, IPv4Address(addr[0]), time.perf_counter())
            if reply is not None:
                with self._lock:
                    self._replies.append(reply)

    def _match(self, packet: bytes, sender: IPv4Address, now: float) -> Reply | None:
        icmp = packet[(packet[0] & 0x0F) * 4 :] if packet else b""
        if len(icmp) < 8:
            return None
        kind, code, _, ident, seq = struct.unpack("!BBHHH", icmp[:8])
        if kind == ICMP_ECHO_REPLY:
            if ident != self._ident or icmp_checksum(icmp) != 0:
                return None
            with self._lock:
                sent = self._pending.get(seq)
                if sent is None or sent[0] != sender:
                    return None
                del self._pending[seq]
            return Reply(seq, now - sent[1])
        if kind in (ICMP_DEST_UNREACH, ICMP_TIME_EXCEEDED):
            return self._match_error(icmp, kind, code, sender)
        return None

    def _match_error(self, icmp: bytes, kind: int, code: int, sender: IPv4Address) -> Reply | None:
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
        with self._lock:
            sent = self._pending.get(seq)
            if sent is None or sent[0] != target:
                return None
            del self._pending[seq]
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
