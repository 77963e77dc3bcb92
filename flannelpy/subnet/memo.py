"""A memo of per-lease results, so that a plan costs what changed, not the cluster's size.

Planning is pure: the same leases in the same context give the same answer. Most
events change one lease of thousands, so the answers for the others are kept, each
with the lease it was computed for, and reused while the same lease object comes
again (the lease watches keep the objects of unchanged leases, and a lease is
immutable) and the context it was computed in is equal. The memo never changes an
answer: with it or without it, the caller gets exactly what a fresh computation gives
(the unit tests compare both over random sequences of lease changes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from itertools import compress, repeat
from operator import is_
from typing import Generic, NamedTuple, TypeVar, cast

from flannelpy.subnet.lease import Lease

T = TypeVar("T")


class LeaseMemo(Generic[T]):
    """``compute(lease)`` per lease object, remembered while the context holds.

    Only the leases of the latest call are kept, so the memo never outgrows the
    cluster. Not thread-safe: one owner (the writer) calls it. A call over thousands of
    unchanged leases stays in C (map, compress and set over their ids); Python runs only
    for the leases that are new."""

    def __init__(self) -> None:
        self._context: object = _UNSET
        # The leases of the last call (holding them keeps their ids from being reused),
        # and id(lease) -> result.
        self._leases: list[Lease] = []
        self._results: dict[int, T] = {}

    def results(
        self, context: object, leases: Iterable[Lease], compute: Callable[[Lease], T]
    ) -> list[T]:
        """``compute(lease)`` for each of ``leases``, in order. ``context`` is everything
        else ``compute`` depends on; an unequal one forgets every result."""
        return self.update(context, leases, compute).results

    def update(
        self, context: object, leases: Iterable[Lease], compute: Callable[[Lease], T]
    ) -> Delta[T]:
        """:meth:`results`, and which results are new and which were dropped since the
        last call (a changed lease's old result is dropped, its new one is new)."""
        if context != self._context:
            dropped = list(self._results.values())
            self.clear()
            self._context = context
        else:
            dropped = []
        kept = self._results
        leases = list(leases)
        ids = list(map(id, leases))
        found: list[object] = list(map(kept.get, ids, repeat(_MISSING)))
        missing = list(compress(range(len(ids)), map(is_, found, repeat(_MISSING))))
        added: list[T] = []
        for index in missing:
            key = ids[index]
            if key in kept:  # the same lease twice in one call: computed once
                found[index] = kept[key]
                continue
            result = compute(leases[index])
            found[index] = kept[key] = result
            added.append(result)
        # Only the leases of this call are kept. The usual event adds or drops a lease or
        # two of thousands: the results change in place by those, not rebuilt.
        distinct = set(ids)
        if len(kept) != len(distinct):
            gone = kept.keys() - distinct
            dropped += map(kept.pop, gone)
        self._leases = leases
        return Delta(cast("list[T]", found), added, dropped)

    def clear(self) -> None:
        self._context = _UNSET
        self._leases, self._results = [], {}


class Delta(NamedTuple, Generic[T]):
    """What :meth:`LeaseMemo.update` found."""

    results: list[T]
    added: list[T]  # computed in this call (in no particular order)
    dropped: list[T]  # kept before, of leases no longer passed (in no particular order)


class _Unset:
    def __eq__(self, other: object) -> bool:
        return other is self

    def __hash__(self) -> int:
        return 0


_UNSET = _Unset()
_MISSING = _Unset()  # no result kept
