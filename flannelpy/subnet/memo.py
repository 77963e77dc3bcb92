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
from typing import Generic, NamedTuple, TypeVar, cast

from flannelpy.subnet.lease import Lease

T = TypeVar("T")


class LeaseMemo(Generic[T]):
    """``compute(lease)`` per lease object, remembered while the context holds.

    Only the leases of the latest call are kept, so the memo never outgrows the
    cluster. Not thread-safe: one owner (the writer) calls it. A call over thousands of
    unchanged leases stays in C (dict and map over their ids); Python runs only for the
    leases that are new."""

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
        previous = self._results
        same = context == self._context
        self._context = context
        kept: dict[int, T] = previous if same else {}
        leases = list(leases)
        ids = list(map(id, leases))
        found: dict[int, object] = dict(zip(ids, map(kept.get, ids, repeat(_MISSING)), strict=True))
        added: list[T] = []
        fresh = found.keys() - kept.keys()
        if fresh:  # the new leases picked out in C (compress), computed once each
            for lease in compress(leases, map(fresh.__contains__, ids)):
                key = id(lease)
                if found[key] is _MISSING:
                    result = compute(lease)
                    found[key] = result
                    added.append(result)
        new = cast("dict[int, T]", found)
        if same:
            dropped = list(map(previous.__getitem__, previous.keys() - new.keys()))
        else:
            dropped = list(previous.values())
        self._leases, self._results = leases, new
        return Delta(list(map(new.__getitem__, ids)), added, dropped)

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
