"""All-pairs prober: is every peer reachable over the overlay, and does the path
carry full-size packets?

Each round sends a peer two ICMP echoes from our overlay address to its overlay
address, at once (ICMPv6 to the IPv6 side of a dual-stack peer, a peer of its own
here, so the budget below counts both families): a small one (ping's default
size) and one of exactly the overlay MTU with DF set (IPV6_DONTFRAG over IPv6).
A path that answers the small echo but not the big one is the silent-drop case
of field notes §1: connections hang, nothing logs an error. A local EMSGSIZE for
the big echo means our own route's MTU is below the overlay MTU, which is just as
conclusive.

Scheduling: at most ``peers_per_interval`` peers are probed per interval, so the
cost does not grow with the cluster. With N peers the *cycle* is ``interval *
ceil(N / peers_per_interval)`` (just ``interval`` while N is within the budget),
and peer P is probed at times ``phase(own, P) + k * cycle`` on the injected clock,
the phase being a hash of the pair over the cycle: a rotating sample of the peers
per interval, every pair covered once per cycle. Every node spreads its own probes
over the cycle, and since the hash covers both ends, N nodes do not send N² probes
at the same instant. Two kinds of peer are probed every ``interval`` instead, to
settle quickly what one round cannot: a peer whose latest round failed while its
verdict still says fine (one lost echo is loss; ``down_after`` or ``mtu_strikes``
rounds make an outage, and waiting a cycle for each would delay that verdict by
minutes in a large cluster), and a peer that joined after the first peer set (its
first result within an interval); at most a quarter of ``peers_per_interval`` peers
at a time, so a mass outage adds a bounded number of rounds. A peer settled as
failing goes back to the cycle. Rounds of one peer never overlap (the echo timeout
is below the interval) and at most ``max_in_flight`` echoes are outstanding; a peer
due while that many are out waits for capacity, and a missed slot is skipped rather
than caught up in a burst. Each tick costs O(log N) per round started plus the rounds in flight:
the due peers wait in a heap, not in a list sorted every tick.

Statistics over the last ``window`` rounds of a peer (``window`` cycles once the
cluster outgrows the budget):
- loss: small echoes not answered / small echoes sent;
- reachable: some echo answered in the last ``down_after`` rounds (one lost
  packet is loss, not an outage);
- mtu_ok: True as soon as a full-size DF echo is answered; False on a local
  refusal, a "fragmentation needed" answer, or ``mtu_strikes`` rounds in a row
  (skipping rounds where the small echo was lost too) where the small echo was
  answered and the big one was not. Requiring several strikes keeps random loss
  from passing for an MTU problem; None until either is seen.

The pure part (Prober with a fake clock and transport, summarize, phases) runs
in unit tests; :class:`flannelpy.dataplane.icmp.IcmpTransport` is the raw-socket
I/O and needs root.
"""

from __future__ import annotations

import errno
import hashlib
import heapq
import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv6Address, ip_address
from typing import Any, Literal, Protocol

from flannelpy.dataplane.icmp import Reply
from flannelpy.errors import ConfigError

log = logging.getLogger("flannelpy.prober")

SMALL_PROBE_BYTES = 84  # total IP packet of ping's default 56-byte payload
SMALL_PROBE_BYTES6 = 104  # the same over IPv6 (40-byte header)
BLOCKED_POLL_SECONDS = 0.02  # how soon to look again when max_in_flight holds a peer back
# Rounds per interval (20 rounds/s at the 5 s default): a 100-node cluster is probed in
# full every interval, a 1,000-node one every 50 s.
DEFAULT_PEERS_PER_INTERVAL = 100


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
    target: IPv4Address | IPv6Address | None = None
    label: str = ""

    @property
    def family(self) -> str:
        """ "ipv6" for the IPv6 side of a dual-stack peer, else "ipv4"."""
        return "ipv6" if self.target is not None and self.target.version == 6 else "ipv4"

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
    target: IPv4Address | IPv6Address | None = None,
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


def cycle_seconds(n_peers: int, interval: float, peers_per_interval: int) -> float:
    """How long one pass over every peer takes: whole intervals, each probing at most
    ``peers_per_interval`` of them."""
    return interval * max(1, math.ceil(n_peers / peers_per_interval))


def next_slot(due: float, now: float, phase: float, period: float) -> float:
    """The first slot later than ``now`` of the schedule ``phase + k * period``."""
    slot = first_slot(now, phase, period)
    while slot <= now or slot <= due:
        slot += period
    return slot


def needs_confirmation(latest: RoundOutcome, result: ProbeResult) -> bool:
    """True when the latest round failed but the verdict has not followed yet: the
    peer is probed again after an interval, not a cycle, until it does either way."""
    if not latest.small_ok:
        return result.reachable
    return latest.big == "lost" and result.mtu_ok is not False


# ---------------------------------------------------------------------------
# Transport boundary
# ---------------------------------------------------------------------------


class Transport(Protocol):
    """Sends ICMP echoes with DF set and hands back what answered them."""

    def send(
        self, source: IPv4Address | IPv6Address, target: IPv4Address | IPv6Address, size: int
    ) -> int:
        """Send one echo request of ``size`` bytes (whole IP packet), never fragmented,
        over the target's family (``source`` is of the same); return its ticket.

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
    target: IPv4Address | IPv6Address
    label: str
    window: int
    phase: float = 0.0
    next_due: float = 0.0
    history: deque[RoundOutcome] = field(default_factory=deque)
    probes: int = 0
    current: _Round | None = None
    hurry: bool = False  # probed every interval, not every cycle (module docstring)

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
        own_address6_provider: Callable[[], IPv6Address | None] = lambda: None,
        interval_seconds: float = 5.0,
        window: int = 20,
        timeout_seconds: float = 1.0,
        max_in_flight: int = 64,
        down_after: int = 3,
        mtu_strikes: int = 3,
        on_result: Callable[[str, ProbeResult], None] | None = None,
        max_sleep_seconds: float = 0.5,
        peers_per_interval: int = DEFAULT_PEERS_PER_INTERVAL,
    ) -> None:
        if interval_seconds <= 0 or not 0 < timeout_seconds < interval_seconds:
            raise ConfigError(
                f"probe interval {interval_seconds} s and timeout {timeout_seconds} s do not "
                "fit; use a positive interval and a timeout shorter than it"
            )
        if min(window, down_after, mtu_strikes, peers_per_interval) < 1 or max_in_flight < 2:
            raise ConfigError(
                "probe window, down_after, mtu_strikes and peers per interval must be at "
                "least 1 and max_in_flight at least 2 (one round is two echoes); raise them"
            )
        self._transport = transport
        self._clock = clock
        self._mtu = mtu_provider
        self._own = own_address_provider
        self._own6 = own_address6_provider
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
        self.peers_per_interval = peers_per_interval
        self.cycle = interval_seconds  # recomputed as the peer set grows or shrinks
        self._due: list[tuple[float, int, str]] = []  # heap of (next_due, seq, key); stale ok
        self._seq = itertools.count()
        self._in_flight: dict[str, _Peer] = {}  # peers with a round out, oldest first
        self._last_now: float | None = None
        self._hurried: set[str] = set()  # peers probed every interval (hurry)
        self._max_hurried = max(1, peers_per_interval // 4)

    # --- API -----------------------------------------------------------------

    def set_peers(self, peers: Mapping[str, tuple[IPv4Address | IPv6Address, str]]) -> None:
        """Replace the peer set: ``{key: (overlay address to probe, label)}``.

        ``key`` identifies the peer (its lease subnet, say) in results and phases; a
        peer whose address changes starts a fresh history. An IPv6 address is probed
        from ``own_address6_provider``'s address, and waits while that is None.
        """
        now = self._clock()
        with self._lock:
            for key in list(self._peers):
                if key not in peers or self._peers[key].target != peers[key][0]:
                    self._drop(key)
            owner = self._phase_owner or ""
            joining = bool(self._peers)  # the first set is spread over the cycle
            added = []
            for key, (target, label) in peers.items():
                peer = self._peers.get(key)
                if peer is not None:
                    peer.label = label
                    continue
                peer = _Peer(key, ip_address(target), label, self.window)
                self._peers[key] = peer
                added.append(peer)
            cycle = cycle_seconds(len(self._peers), self.interval, self.peers_per_interval)
            if cycle != self.cycle:
                self.cycle = cycle
                self._reschedule_all(owner, now)
            else:
                for peer in added:
                    self._set_hurry(peer, joining)
                    self._schedule(peer, owner, now)

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
        peer.phase = phase_seconds(owner, peer.key, self.cycle)
        period = self.interval if peer.hurry else self.cycle
        peer.next_due = first_slot(now, peer.phase % period, period)
        self._push(peer)

    def _reschedule_all(self, owner: str, now: float) -> None:
        self._due = []
        for peer in self._peers.values():
            self._schedule(peer, owner, now)

    def _push(self, peer: _Peer) -> None:
        heapq.heappush(self._due, (peer.next_due, next(self._seq), peer.key))

    def _set_hurry(self, peer: _Peer, hurry: bool) -> bool:
        """Probe the peer every interval (or every cycle again); True if that changed. At
        most a quarter of the budget is hurried at once, so a mass outage (or a mass of
        leases of nodes that are gone) costs no more than a few extra rounds per interval:
        the rest wait for their slot in the cycle."""
        if hurry and peer.key not in self._hurried and len(self._hurried) >= self._max_hurried:
            hurry = False
        if hurry == peer.hurry:
            return False
        peer.hurry = hurry
        if hurry:
            self._hurried.add(peer.key)
        else:
            self._hurried.discard(peer.key)
        return True

    def _current_entry(self, entry: tuple[float, int, str]) -> bool:
        """Is this heap entry the peer's current slot (not a dropped or moved one)?"""
        peer = self._peers.get(entry[2])
        return peer is not None and peer.next_due == entry[0]

    def _advance(self, peer: _Peer, now: float) -> None:
        """Its next slot after ``now``: an interval on (hurry) or a cycle on, at its phase."""
        period = self.interval if peer.hurry else self.cycle
        peer.next_due = next_slot(peer.next_due, now, peer.phase % period, period)
        self._push(peer)

    def _drop(self, key: str) -> None:
        peer = self._peers.pop(key)  # its heap entries go stale: skipped when popped
        self._results.pop(key, None)
        self._in_flight.pop(key, None)
        self._hurried.discard(key)
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
        for peer in list(self._in_flight.values()):
            rnd = peer.current
            assert rnd is not None
            echoes = rnd.echoes()
            if not all(e.done for e in echoes) and now < rnd.deadline:
                continue
            for echo in echoes:
                if not echo.done:
                    self._forget(echo)
                    echo.done = True
            peer.current = None
            del self._in_flight[peer.key]
            outcome = self._outcome(rnd, peer.target)
            peer.history.append(outcome)
            peer.probes += 1
            result = summarize(
                list(peer.history),
                peer.probes,
                down_after=self.down_after,
                mtu_strikes=self.mtu_strikes,
                target=peer.target,
                label=peer.label,
            )
            if self._set_hurry(peer, needs_confirmation(outcome, result)):
                # its next slot after now, at the other period
                period = self.interval if peer.hurry else self.cycle
                peer.next_due = next_slot(now, now, peer.phase % period, period)
                self._push(peer)
            self._log_change(peer, self._results.get(peer.key), result)
            self._results[peer.key] = result
            finished.append((peer.key, result))
        return finished

    def _outcome(self, rnd: _Round, target: IPv4Address | IPv6Address) -> RoundOutcome:
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

    def _timeout_text(self, size: int, target: IPv4Address | IPv6Address, df: bool) -> str:
        kind = f"{size}-byte DF echo (the overlay MTU)" if df else f"{size}-byte echo"
        return f"no reply from {target} to a {kind} within {self.timeout:g} s"

    def _dispatch(self, now: float) -> bool:
        """Start due rounds; True if a due peer had to wait for in-flight capacity."""
        source = self._own()
        owner = str(source) if source is not None else ""
        jumped_back = self._last_now is not None and now < self._last_now - self.interval
        self._last_now = now
        if owner != (self._phase_owner or "") or jumped_back:
            self._phase_owner = owner
            self._reschedule_all(owner, now)
        sources: dict[int, IPv4Address | IPv6Address | None] = {4: source, 6: self._own6()}
        mtu = self._mtu()
        due = self._due
        while due and due[0][0] <= now:
            key = due[0][2]
            peer = self._peers.get(key)
            if peer is None or not self._current_entry(due[0]):
                heapq.heappop(due)  # dropped, or rescheduled since
                continue
            src = sources[peer.target.version]
            if src is not None and peer.current is None:
                small = SMALL_PROBE_BYTES if peer.target.version == 4 else SMALL_PROBE_BYTES6
                big_size = mtu if mtu is not None and mtu > small else None
                if len(self._tickets) + (1 if big_size is None else 2) > self.max_in_flight:
                    return True
                peer.current = self._start_round(src, peer.target, small, big_size, now)
                self._in_flight[key] = peer
            heapq.heappop(due)
            self._advance(peer, now)
        return False

    def _start_round(
        self,
        source: IPv4Address | IPv6Address,
        target: IPv4Address | IPv6Address,
        small_size: int,
        big_size: int | None,
        now: float,
    ) -> _Round:
        rnd = _Round(now + self.timeout, _Echo(small_size), None)
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
        due = self._due
        while due and not self._current_entry(due[0]):
            heapq.heappop(due)
        # A due peer still in the heap waits for capacity: the blocked poll wakes for it.
        times = [due[0][0]] if due and due[0][0] > now else []
        if self._in_flight:  # the oldest round has the earliest deadline (one timeout)
            oldest = next(iter(self._in_flight.values())).current
            assert oldest is not None
            times.append(oldest.deadline)
        if blocked:
            times.append(now + BLOCKED_POLL_SECONDS)
        return min(times, default=now + self.interval)

    def _log_change(self, peer: _Peer, old: ProbeResult | None, new: ProbeResult) -> None:
        was_reachable = old.reachable if old is not None else True
        if new.reachable != was_reachable:
            log.log(
                logging.INFO if new.reachable else logging.WARNING,
                "peer reachability changed peer=%s target=%s reachable=%s error=%r",
                peer.label or peer.key,
                peer.target,
                new.reachable,
                new.last_error,
            )
        old_mtu = old.mtu_ok if old is not None else None
        if new.mtu_ok is not None and new.mtu_ok != old_mtu:
            log.log(
                logging.INFO if new.mtu_ok else logging.WARNING,
                "peer path MTU check changed peer=%s target=%s mtu_ok=%s error=%r",
                peer.label or peer.key,
                peer.target,
                new.mtu_ok,
                new.last_error,
            )


def _send_error_text(
    e: OSError, source: IPv4Address | IPv6Address, target: IPv4Address | IPv6Address, size: int
) -> str:
    if e.errno == errno.EMSGSIZE:
        kind = "DF" if target.version == 4 else "unfragmentable"
        return (
            f"message too long: this node refuses to send a {size}-byte {kind} packet to "
            f"{target}, so its route MTU is below the overlay MTU"
        )
    return f"cannot send an echo from {source} to {target}: {e.strerror or e}"
