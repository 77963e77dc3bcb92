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

This module is that budget and the loop; the pieces it composes are modules of
their own: :mod:`~flannelpy.observe.probe_schedule` (the slot arithmetic),
:mod:`~flannelpy.observe.probe_rounds` (a round's echoes through a Transport) and
:mod:`~flannelpy.observe.probe_verdict` (loss, reachability and the MTU verdict over
a peer's window of rounds). All but the raw-socket transport
(:class:`flannelpy.dataplane.icmp.IcmpTransport`, which needs root) run in unit
tests with a fake clock and transport.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address, ip_address

from flannelpy.errors import ConfigError
from flannelpy.observe.probe_rounds import (
    SMALL_PROBE_BYTES,
    SMALL_PROBE_BYTES6,
    Echo,
    Round,
    Transport,
    round_outcome,
    start_round,
)
from flannelpy.observe.probe_schedule import cycle_after, first_slot, next_slot, phase_unit
from flannelpy.observe.probe_verdict import (
    ProbeResult,
    RoundOutcome,
    needs_confirmation,
    summarize,
)

log = logging.getLogger("flannelpy.prober")

BLOCKED_POLL_SECONDS = 0.02  # how soon to look again when max_in_flight holds a peer back
# The loop's shortest sleep: the rounds due within it start together and the rounds
# finished within it are reported together (one writer event), so an idle prober wakes
# twice a second rather than at every round's slot and deadline (about 40 at the
# default budget). A wake-up of the prober and one of the writer cost far more than the
# rounds they carry (the interpreter starts cold each time), so the tick is what the
# idle CPU follows; a round starts and is settled up to a tick late, which moves no
# verdict (rounds are seconds apart). RTTs are stamped by the transport as replies
# arrive, not here.
TICK_SECONDS = 0.5
# Echoes outstanding at most. At the default budget with every peer silent, rounds of
# up to 25 a second each hold two echoes for a timeout plus up to a tick: about 75.
MAX_IN_FLIGHT = 128
# Rounds per interval (20 rounds/s at the 5 s default): a 100-node cluster is probed in
# full every interval, a 1,000-node one every 50 s.
DEFAULT_PEERS_PER_INTERVAL = 100


@dataclass(slots=True)
class _Peer:
    key: str
    target: IPv4Address | IPv6Address
    label: str
    # Where in the cycle it is probed, over a cycle of one second (probe_schedule's
    # phase_unit, hashed once for the own address of the prober's phases).
    phase_unit: float = 0.0
    next_due: float = 0.0
    # The last ``window`` outcomes, oldest first: a tuple (one pointer per round; a
    # peer's empty deque alone took 600 bytes, a fifth of what a peer cost at ready).
    history: tuple[RoundOutcome, ...] = ()
    probes: int = 0
    current: Round | None = None
    hurry: bool = False  # probed every interval, not every cycle (module docstring)


def _address(target: IPv4Address | IPv6Address | str) -> IPv4Address | IPv6Address:
    """The target as an address object: the caller's own when it is one (the plan's,
    shared, not a copy per peer)."""
    return target if isinstance(target, IPv4Address | IPv6Address) else ip_address(target)


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
        max_in_flight: int = MAX_IN_FLIGHT,
        down_after: int = 3,
        mtu_strikes: int = 3,
        on_results: Callable[[list[tuple[str, ProbeResult]]], None] | None = None,
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
        self._on_results = on_results
        self._max_sleep = max_sleep_seconds
        self._lock = threading.Lock()
        self._peers: dict[str, _Peer] = {}
        self._results: dict[str, ProbeResult] = {}
        self._snapshot: Mapping[str, ProbeResult] | None = None  # results(); None: changed
        self._tickets: dict[int, Echo] = {}  # outstanding echoes by transport ticket
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
        with self._lock:
            gone = [key for key in self._peers if key not in peers]
            self._change(peers, gone)

    def follows(self, key: str) -> bool:
        """Whether ``key`` is one of the peers probed now."""
        with self._lock:
            return key in self._peers

    def change_peers(
        self,
        added: Mapping[str, tuple[IPv4Address | IPv6Address, str]],
        removed: Iterable[str],
    ) -> None:
        """:meth:`set_peers` by difference: ``added`` are new or changed peers (a new
        address or label), ``removed`` the keys of peers that left (a key also in
        ``added`` stays). A peer set of thousands changed by one lease costs that lease."""
        with self._lock:
            self._change(added, [key for key in removed if key not in added])

    def _change(
        self, changed: Mapping[str, tuple[IPv4Address | IPv6Address, str]], gone: Iterable[str]
    ) -> None:
        now = self._clock()
        for key in gone:
            if key in self._peers:
                self._drop(key)
        for key, (target, _) in changed.items():
            peer = self._peers.get(key)
            if peer is not None and peer.target != target:
                self._drop(key)  # a new address: a fresh history
        owner = self._phase_owner or ""
        joining = bool(self._peers)  # the first set is spread over the cycle
        added = []
        for key, (target, label) in changed.items():
            peer = self._peers.get(key)
            if peer is not None:
                peer.label = label
                continue
            peer = _Peer(key, _address(target), label, phase_unit(owner, key))
            self._peers[key] = peer
            added.append(peer)
        cycle = cycle_after(self.cycle, len(self._peers), self.interval, self.peers_per_interval)
        if cycle != self.cycle:
            self.cycle = cycle
            self._reschedule_all(None, now)
        else:
            for peer in added:
                self._set_hurry(peer, joining)
                self._schedule(peer, None, now)

    def results(self) -> Mapping[str, ProbeResult]:
        """Latest result per peer key; a peer appears after its first completed round.
        The same (read-only) mapping until a result changes, so a caller can tell that
        nothing changed since its last look by its identity."""
        with self._lock:
            if self._snapshot is None:
                self._snapshot = dict(self._results)
            return self._snapshot

    def run(self, stop: threading.Event, quantum: float | None = None) -> None:
        """Probe until ``stop`` is set, sleeping at least ``quantum`` between ticks
        (default: ``TICK_SECONDS``, or a quarter of a shorter probe interval, so that a
        short interval still gets its rounds). Never raises: a failing tick is logged and
        retried."""
        if quantum is None:
            quantum = min(TICK_SECONDS, self.interval / 4)
        while not stop.is_set():
            try:
                wake = self.tick()
            except Exception:
                log.exception("probe tick failed")
                wake = self._clock() + 1.0
            stop.wait(min(max(quantum, wake - self._clock()), max(quantum, self._max_sleep)))

    def tick(self) -> float:
        """Settle answered or timed-out rounds, start due ones, report the finished ones in
        one call; return when to tick next."""
        now = self._clock()
        with self._lock:
            self._collect()
            finished = self._settle(now)
            blocked = self._dispatch(now)
            wake = self._next_wake(now, blocked)
        if finished and self._on_results is not None:
            self._on_results(finished)
        return wake

    # --- internals (called with the lock held) ---------------------------------

    def _phase(self, peer: _Peer) -> float:
        """The peer's phase over the current cycle."""
        return peer.phase_unit * self.cycle

    def _schedule(self, peer: _Peer, owner: str | None, now: float, push: bool = True) -> None:
        """Put the peer at its first slot from ``now``; ``owner``: the own address to hash
        its phase for (None: the one it has)."""
        if owner is not None:
            peer.phase_unit = phase_unit(owner, peer.key)
        period = self.interval if peer.hurry else self.cycle
        peer.next_due = first_slot(now, self._phase(peer) % period, period)
        if push:
            self._push(peer)

    def _reschedule_all(self, owner: str | None, now: float) -> None:
        """Every peer at its first slot from ``now`` (a new cycle, a clock that jumped
        back), hashed again for ``owner`` (a new own address) unless None."""
        for peer in self._peers.values():
            self._schedule(peer, owner, now, push=False)
        self._due = [(peer.next_due, next(self._seq), peer.key) for peer in self._peers.values()]
        heapq.heapify(self._due)  # one heap of all, not a push per peer

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
        peer.next_due = next_slot(peer.next_due, now, self._phase(peer) % period, period)
        self._push(peer)

    def _drop(self, key: str) -> None:
        peer = self._peers.pop(key)  # its heap entries go stale: skipped when popped
        if self._results.pop(key, None) is not None:
            self._snapshot = None
        self._in_flight.pop(key, None)
        self._hurried.discard(key)
        if peer.current is not None:
            for echo in peer.current.echoes():
                self._forget(echo)

    def _forget(self, echo: Echo) -> None:
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
            # Every round in flight is looked at every tick, most of them unanswered
            # yet: this test is the cheapest first (no list, no generator).
            if now < rnd.deadline and not (rnd.small.done and (rnd.big is None or rnd.big.done)):
                continue
            for echo in rnd.echoes():
                if not echo.done:
                    self._forget(echo)
                    echo.done = True
            peer.current = None
            del self._in_flight[peer.key]
            outcome = round_outcome(rnd, peer.target, self.timeout)
            peer.history = (*peer.history, outcome)[-self.window :]
            peer.probes += 1
            result = summarize(
                peer.history,
                peer.probes,
                down_after=self.down_after,
                mtu_strikes=self.mtu_strikes,
                target=peer.target,
                label=peer.label,
            )
            if self._set_hurry(peer, needs_confirmation(outcome, result)):
                # its next slot after now, at the other period
                period = self.interval if peer.hurry else self.cycle
                peer.next_due = next_slot(now, now, self._phase(peer) % period, period)
                self._push(peer)
            self._log_change(peer, self._results.get(peer.key), result)
            self._results[peer.key] = result
            self._snapshot = None
            finished.append((peer.key, result))
        return finished

    def _dispatch(self, now: float) -> bool:
        """Start due rounds; True if a due peer had to wait for in-flight capacity."""
        source = self._own()
        owner = str(source) if source is not None else ""
        jumped_back = self._last_now is not None and now < self._last_now - self.interval
        self._last_now = now
        if owner != (self._phase_owner or ""):
            self._phase_owner = owner
            self._reschedule_all(owner, now)  # every phase hashed for the new address
        elif jumped_back:
            self._reschedule_all(None, now)
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
                peer.current = start_round(
                    self._transport,
                    self._tickets,
                    src,
                    peer.target,
                    small,
                    big_size,
                    now + self.timeout,
                )
                self._in_flight[key] = peer
            heapq.heappop(due)
            self._advance(peer, now)
        return False

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
