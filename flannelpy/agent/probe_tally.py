"""Every peer's latest probe as the status record sees it, and the record's summary of
them, kept up to date entry by entry.

The status record's :class:`~flannelpy.control.records.ProbeSummary` is a function of
every peer's :class:`~flannelpy.control.records.PeerProbe`; recomputing it walks every
peer (a thousand of them at each 2 s status tick). The tally keeps what the summary is
made of (the failing set, the count of passing peers, each passing peer's last pass)
and changes it by the entries that changed, so a tick with a few new rounds costs those
rounds; a tally with no change since the last summary returns that summary. The result
is the same as ``ProbeSummary.of`` over the same entries (a unit test compares them).
"""

from __future__ import annotations

import heapq

from flannelpy.control.records import MAX_FAILING_SHOWN, FailingPeer, PeerProbe, ProbeSummary


class ProbeTally:
    def __init__(self) -> None:
        self.probes: dict[str, PeerProbe] = {}  # peer key -> its latest round
        self.failing: dict[str, str] = {}  # peer key -> problem: every failing peer
        # Bumped whenever the failing set changes; callers keep their own copy per version.
        self.failing_version = 0
        self._ok = 0  # peers whose latest round passed
        self._passes: dict[str, float] = {}  # peers not failing, with a last pass: when
        self._unpassed: set[str] = set()  # peers not failing without one yet
        self._summary: ProbeSummary | None = None  # None: an entry changed since

    def set(self, key: str, probe: PeerProbe) -> None:
        """``key``'s latest round (a new peer, or a newer round of a known one)."""
        old = self.probes.get(key)
        if old is not None:
            if old == probe:
                return
            self._forget(key, old)
        self.probes[key] = probe
        self._ok += probe.ok
        problem = probe.problem()
        if problem is not None:
            if self.failing.get(key) != problem:
                self.failing[key] = problem
                self.failing_version += 1
        else:
            if self.failing.pop(key, None) is not None:
                self.failing_version += 1
            last = probe.last_pass()
            if last is None:
                self._unpassed.add(key)
            else:
                self._passes[key] = last
        self._summary = None

    def drop(self, key: str) -> None:
        """A peer that left (the prober no longer has a result for it)."""
        old = self.probes.pop(key, None)
        if old is None:
            return
        self._forget(key, old)
        if self.failing.pop(key, None) is not None:
            self.failing_version += 1
        self._summary = None

    def _forget(self, key: str, old: PeerProbe) -> None:
        """Take ``old``'s share out of the counts (the failing set is the caller's)."""
        self._ok -= old.ok
        self._passes.pop(key, None)
        self._unpassed.discard(key)

    def summary(self) -> ProbeSummary:
        """``ProbeSummary.of(self.probes)``, computed again only after a change."""
        if self._summary is None:
            passed = min(self._passes.values()) if self._passes and not self._unpassed else None
            self._summary = ProbeSummary(
                peers=len(self.probes),
                ok=self._ok,
                failing=len(self.failing),
                failing_peers=tuple(
                    FailingPeer(k, self.failing[k])
                    for k in heapq.nsmallest(MAX_FAILING_SHOWN, self.failing)
                ),
                passed_at=None if passed is None else round(passed, 3),
            )
        return self._summary
