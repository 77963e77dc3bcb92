"""When the prober probes a peer: slots of the schedule ``phase + k * period``.

The phase is a stable hash of the (own address, peer) pair, so every node spreads
its probes over the cycle the same way on every run, and the cycle is as many
intervals as the per-interval budget needs to cover every peer once. Pure
arithmetic on the injected clock's seconds; :class:`flannelpy.observe.prober.Prober`
keeps the peers' slots in a heap.
"""

from __future__ import annotations

import hashlib
import math


def phase_seconds(own: str, peer: str, interval: float) -> float:
    """Where in the interval ``own`` probes ``peer``: a stable hash of the ordered pair.

    Not Python's hash(): that one is salted per process, and the spread must be the
    same on every node and across restarts.
    """
    return phase_unit(own, peer) * interval


def phase_unit(own: str, peer: str) -> float:
    """:func:`phase_seconds` of an interval of one second: kept per peer, a phase over a
    new cycle is a multiplication, not a hash (the same float as hashing again)."""
    digest = hashlib.blake2b(f"{own}\0{peer}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def cycle_after(cycle: float, n_peers: int, interval: float, peers_per_interval: int) -> float:
    """The cycle for ``n_peers``, from ``cycle``: longer as soon as the peers outgrow its
    budget, shorter only once a tenth of an interval's budget is free below the shorter
    one, so that a peer coming and going at the edge does not re-plan every peer's slot
    each time (at most a tenth fewer probes per interval than the budget, meanwhile)."""
    needed = cycle_seconds(n_peers, interval, peers_per_interval)
    if needed >= cycle:
        return needed
    margin = max(1, peers_per_interval // 10)
    return min(cycle, cycle_seconds(n_peers + margin, interval, peers_per_interval))


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
