"""The NetworkPolicy table in the kernel: the reconciler's thin adapter over ``nft``.

The planner hands a whole table as a value (:class:`~flannelpy.dataplane.state.NftTableSpec`,
NetworkPolicy's ``Ruleset``). Each pass reads the table back (``nft -s list table``)
and compares it with the listing taken right after our last write, counters aside:

* unchanged since our last write: the one transaction from what we last applied to
  the new value, which touches only the elements, sets and chains that differ
  (nothing at all when the value is the same). When the namespace's nftables
  generation (:mod:`.nfgen`) still reads what it read right after that write, no one
  has written any nftables since and the read-back is skipped: a change then costs one
  ``nft -f`` on its way to the kernel. The listing taken after it (the reference for
  the next comparison) runs once the change is in force, or later, off the change's
  way (:meth:`PolicyTable.remember`, the reconciler's next pass);
* missing, or changed by someone else, or not written by this process yet (a
  restart): the whole table is replaced by one transaction that deletes and re-creates
  it, so no packet ever sees it half-built or absent.

Until the agent has a table to enforce (policy synced after a start) it hands None
and the reconciler does not call this at all: the kernel keeps what it holds.
"""

from __future__ import annotations

import json
import logging
import subprocess
from collections.abc import Callable, Sequence

from flannelpy.dataplane.nftables import Runner, first_line, run_nft
from flannelpy.dataplane.state import NftTableSpec
from flannelpy.errors import DataplaneError

log = logging.getLogger(__name__)

MISSING = "missing"  # the table is not in the kernel
CHANGED = "changed"  # someone else changed it since our last write
AT_START = "start"  # this process has not written it yet
UNVERIFIED = "unverified"  # someone else wrote before our last write was read back


class PolicyTable:
    """Keeps one nftables table exactly as the last desired value, in one transaction per
    change. ``command_prefix`` (``ip netns exec NS``) runs ``nft`` in a namespace."""

    def __init__(
        self,
        run: Runner = subprocess.run,
        command_prefix: Sequence[str] = (),
        timeout: float = 30.0,
        generation: Callable[[], int | None] = lambda: None,
    ) -> None:
        self._run = run
        self._prefix = tuple(command_prefix)
        self._timeout = timeout
        self._generation = generation  # the namespace's nftables generation; None: unknown
        self._applied: NftTableSpec | None = None  # what our last write made the table
        self._listing: str | None = None  # its listing right after that write, stateless
        self._known_gen: int | None = None  # a generation at which it read as _listing
        # (or, while a read-back is owed, the one right after our write)
        self._owed: str | None = None  # the table whose read-back remember() owes
        self.transactions = 0  # nft -f runs that changed the table (tests read it)
        self.listings = 0  # whole-table read-backs (tests read it)

    def apply(self, desired: NftTableSpec, read_back: bool = True) -> str | None:
        """Make the table ``desired``. Returns why it was rebuilt whole (MISSING, CHANGED,
        AT_START, UNVERIFIED), or None for an incremental change or none. Raises
        DataplaneError. ``read_back=False`` leaves the read-back of a write to
        :meth:`remember`, when the generation shows that write was the only one."""
        reason = self._drift(desired.table)
        if reason is None:
            assert self._applied is not None
            script = desired.script_from(self._applied)
        else:
            script = f"add table {desired.table}\ndelete table {desired.table}\n"
            script += desired.script_from(None)
        if script:
            self._applied, self._known_gen, self._listing = None, None, None  # until read
            self._owed = None
            before = self._generation()
            self._nft(["-f", "-"], script, f"write the table {desired.table}")
            self.transactions += 1
            after = self._generation()
            if not read_back and before is not None and after == before + 1:
                self._known_gen = after  # our transaction and no other: the table is ours
                self._owed = desired.table
            else:
                self._remember(desired.table)
        self._applied = desired
        if reason is not None:
            log.info("policy table rebuilt table=%r reason=%s", desired.table, reason)
        return reason

    def remember(self) -> None:
        """Take the read-back a write left owed: while the generation is still the one our
        write left, the listing is exactly what that write made; once someone else has
        written, it would not be, so none is taken and the next change that finds the
        generation moved replaces the table whole (UNVERIFIED)."""
        table, self._owed = self._owed, None
        if table is None:
            return
        if self._generation() != self._known_gen:
            self._known_gen = None
            return
        self._remember(table)

    def _drift(self, table: str) -> str | None:
        """None when the table is as our last write left it, else why it must be rebuilt."""
        before = self._generation()
        if self._applied is not None and before is not None and before == self._known_gen:
            return None  # no nftables write at all in this namespace since
        listing = self.listing(table)
        if listing is None:
            return MISSING
        if self._applied is None:
            return AT_START
        if self._listing is None:
            return UNVERIFIED
        if listing != self._listing:
            return CHANGED
        if before is not None and self._generation() == before:
            self._known_gen = before  # someone else's write, elsewhere: verified at this one
        return None

    def _remember(self, table: str) -> None:
        """Read the table back after our write: the reference for the next comparison,
        tied to the generation only when nothing else was written while it was read."""
        self._owed = None
        before = self._generation()
        self._listing = self.listing(table)
        after = self._generation()
        self._known_gen = before if before is not None and before == after else None

    def listing(self, table: str) -> str | None:
        """``nft -s list table``: the table as text without counter values (stateless);
        None when it is absent. Text, not JSON: half the library's time for a large
        table, and compared as one string."""
        argv = [*self._prefix, "nft", "-s", "list", "table", *table.split()]
        self.listings += 1
        proc = run_nft(self._run, argv, None, self._timeout)
        if proc.returncode != 0:
            if "No such file or directory" in proc.stderr:
                return None
            raise DataplaneError(
                f"nft cannot list table {table}: {first_line(proc.stderr)}; "
                "check that nftables works on this host"
            )
        return proc.stdout

    def counters(self, table: str) -> dict[str, int]:
        """The packets each named counter of ``table`` counted (``nft -j list counters``:
        the counters alone, whatever the size of the table); empty when it is absent."""
        argv = [*self._prefix, "nft", "-j", "list", "counters", "table", *table.split()]
        proc = run_nft(self._run, argv, None, self._timeout)
        if proc.returncode != 0:
            if "No such file or directory" in proc.stderr:
                return {}
            raise DataplaneError(
                f"nft cannot list the counters of {table}: {first_line(proc.stderr)}"
            )
        try:
            doc = json.loads(proc.stdout)
        except ValueError as e:
            raise DataplaneError(
                f"nft listed the counters of {table} as something not JSON ({e})"
            ) from e
        found = {}
        for item in doc.get("nftables", []):
            counter = item.get("counter") if isinstance(item, dict) else None
            if isinstance(counter, dict) and isinstance(counter.get("name"), str):
                found[counter["name"]] = int(counter.get("packets", 0))
        return found

    def _nft(self, args: Sequence[str], script: str, what: str) -> None:
        proc = run_nft(self._run, [*self._prefix, "nft", *args], script, self._timeout)
        if proc.returncode != 0:
            raise DataplaneError(
                f"nft could not {what}: {first_line(proc.stderr)}; check that the kernel "
                "has nftables with the inet family (nf_tables, nft_ct)"
            )
