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

from collections.abc import Callable, Collection, Iterable, Mapping
from itertools import compress, repeat
from operator import is_, is_not
from typing import Any, Generic, TypeVar, cast

from flannelpy.subnet.lease import Lease

T = TypeVar("T")


class LeaseSnapshot(dict[str, Lease]):
    """Every lease of one moment, keyed by store key, as a lease watch delivers it, and the
    keys that changed since the snapshot it delivered before (``changed``; None: unknown,
    as after a list). ``follows`` is that snapshot's ``token``. The watch never changes a
    snapshot it delivered; the writer, skipping some, widens the next one's ``changed``
    over them (:meth:`absorb`)."""

    __slots__ = ("changed", "follows", "token")
    changed: frozenset[str] | None
    follows: object
    token: object

    def __init__(
        self,
        leases: Mapping[str, Lease],
        changed: frozenset[str] | None = None,
        previous: LeaseSnapshot | None = None,
    ) -> None:
        super().__init__(leases)
        self.changed = changed if previous is not None else None
        self.follows = previous.token if previous is not None else None
        self.token = object()

    def absorb(self, earlier: Mapping[str, Lease]) -> None:
        """Follow what ``earlier`` followed: ``earlier`` was delivered just before this one
        and is skipped, so the keys it changed count as changed here too (a map that is
        no snapshot: what changed is unknown)."""
        if (
            self.changed is None
            or not isinstance(earlier, LeaseSnapshot)
            or earlier.changed is None
            or self.follows is not earlier.token
        ):
            self.changed = None
            return
        self.changed = self.changed | earlier.changed
        self.follows = earlier.follows


class LeaseList(list[Lease]):
    """Leases in order, and which of them came (``added``) and went (``dropped``) since
    the list this one was made after: a memo whose last call had that list applies only
    those, whatever the cluster's size. The planner makes one per plan, so the memos of a
    plan share one walk of the leases (two passes in C) instead of each walking them.

    Made of a map of store keys to leases (the list is its values; of other leases, each
    is its own key), a lease is new when its key is or holds another object: a lease
    object is immutable and the lease watches keep the objects of unchanged leases. The
    dropped leases are held with the list, so their ids are not reused while a memo may
    still look them up."""

    __slots__ = ("added", "by_key", "dropped", "follows", "token")

    def __init__(
        self,
        leases: Mapping[str, Lease] | Iterable[Lease],
        previous: LeaseList | None = None,
        changed: Collection[str] | None = None,
    ) -> None:
        """``changed``: the only keys of ``leases`` (a map) whose lease may differ from
        ``previous``'s, when known: then only those are looked at."""
        if isinstance(leases, Mapping):
            super().__init__(leases.values())
            by_key: Mapping[Any, Lease] = leases  # store keys, or ids below
        else:  # keyed by object: a list made of a map follows this one as if all were new
            super().__init__(leases)
            by_key = dict(zip(map(id, self), self, strict=True))
        self.by_key = by_key
        self.token = object()  # what the next list follows; a list's own id may be reused
        self.follows: object = None
        self.added: list[Lease] = list(self)
        self.dropped: list[Lease] = []
        if previous is None:
            return
        now, before = by_key, previous.by_key
        if changed is not None:
            keys = sorted(changed)  # one order, whatever the set's
            added = [now[k] for k in keys if k in now and before.get(k) is not now[k]]
            dropped = [before[k] for k in keys if k in before and now.get(k) is not before[k]]
        else:  # in C: each key looked up in the other map, its lease compared by identity
            added = list(compress(now.values(), map(is_not, now.values(), map(before.get, now))))
            dropped = list(
                compress(before.values(), map(is_not, before.values(), map(now.get, before)))
            )
        if len(set(map(id, added + dropped))) == len(added) + len(dropped):
            self.follows, self.added, self.dropped = previous.token, added, dropped
        # else one lease object under two keys moved: no memo follows this list.

    def after(self, leases: Mapping[str, Lease] | Iterable[Lease]) -> LeaseList:
        """The list of ``leases``, made after this one."""
        return LeaseList(leases, self)


class LeaseMemo(Generic[T]):
    """``compute(lease)`` per lease object, remembered while the context holds.

    Only the leases of the latest call are kept, so the memo never outgrows the
    cluster. Not thread-safe: one owner (the writer) calls it. Given a
    :class:`LeaseList` made after the one of its last call, a call costs the leases that
    came and went; given anything else, it walks the leases in C (map, compress and set
    over their ids), and Python runs only for the leases that are new."""

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
        try:
            return self._update(context, leases, compute)
        except BaseException:
            self.clear()  # a compute that raised: no half-updated memo meets the next call
            raise

    def _update(
        self, context: object, leases: Iterable[Lease], compute: Callable[[Lease], T]
    ) -> Delta[T]:
        last = self._leases
        if (
            isinstance(leases, LeaseList)
            and isinstance(last, LeaseList)
            and leases.follows is last.token
            and context == self._context
        ):
            return self._follow(leases, compute)
        if context != self._context:
            dropped = list(self._results.values())
            self.clear()
            self._context = context
        else:
            dropped = []
        kept = self._results
        leases = leases if isinstance(leases, list) else list(leases)
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

    def _follow(self, leases: LeaseList, compute: Callable[[Lease], T]) -> Delta[T]:
        """:meth:`update` by the leases that came and went since the last call's list:
        the results then line up with ``leases.added`` and ``leases.dropped``."""
        kept = self._results
        dropped = [kept.pop(id(lease)) for lease in leases.dropped]
        added = [compute(lease) for lease in leases.added]
        kept.update(zip(map(id, leases.added), added, strict=True))
        self._leases = leases
        return Delta(None, added, dropped, leases, kept)

    def clear(self) -> None:
        self._context = _UNSET
        self._leases, self._results = [], {}


class Delta(Generic[T]):
    """What :meth:`LeaseMemo.update` found: the results computed in this call (``added``)
    and those of leases no longer passed (``dropped``), in no particular order, unless
    ``follows``: then in the order of the list's own ``added`` and ``dropped``. A changed
    lease's old result is dropped and its new one added."""

    __slots__ = ("_kept", "_leases", "_results", "added", "dropped")

    def __init__(
        self,
        results: list[T] | None,
        added: list[T],
        dropped: list[T],
        leases: LeaseList | None = None,
        kept: dict[int, T] | None = None,
    ) -> None:
        self.added, self.dropped = added, dropped
        self._results, self._leases, self._kept = results, leases, kept

    @property
    def follows(self) -> bool:
        """The call applied a :class:`LeaseList`'s changes alone."""
        return self._results is None

    @property
    def results(self) -> list[T]:
        """Every lease's result, in the call's order; read before the memo's next call
        (a call that followed a list gathers them only when asked)."""
        if self._results is None:
            assert self._leases is not None and self._kept is not None
            self._results = list(map(self._kept.__getitem__, map(id, self._leases)))
        return self._results


class _Unset:
    def __eq__(self, other: object) -> bool:
        return other is self

    def __hash__(self) -> int:
        return 0


_UNSET = _Unset()
_MISSING = _Unset()  # no result kept
