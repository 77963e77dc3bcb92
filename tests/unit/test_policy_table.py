"""The reconciler's policy adapter on a stand-in ``nft``: a whole-table replace in one
transaction at start, when the table went missing or someone else changed it; otherwise
the one proportional transaction, and nothing when nothing changed."""

from __future__ import annotations

import pytest

from flannelpy.dataplane.policy_table import AT_START, CHANGED, MISSING, UNVERIFIED, PolicyTable
from flannelpy.errors import DataplaneError
from flannelpy.netpol.nft import TABLE
from tests.support.fake_nft import FakeNft
from tests.support.netpol_cases import DB_POLICY, pod, table

PODS = [pod("db", "db", "10.244.1.3"), pod("api", "api", "10.244.2.2", node="n2")]
FIRST = table([DB_POLICY], PODS)
SECOND = table([DB_POLICY], [*PODS, pod("api2", "api", "10.244.2.3", node="n2")])


def test_the_first_write_replaces_whatever_table_a_previous_run_left_in_one_script() -> None:
    nft = FakeNft()
    nft.table = ["add rule left by a previous run"]
    adapter = PolicyTable(run=nft)
    assert adapter.apply(FIRST) == AT_START
    (script,) = nft.scripts
    lines = script.splitlines()
    assert lines[:3] == [
        f"add table inet {TABLE}",
        f"delete table inet {TABLE}",
        f"add table inet {TABLE}",
    ]
    assert nft.table == lines[2:]


def test_an_unchanged_table_is_left_alone_and_a_change_is_one_proportional_transaction() -> None:
    nft = FakeNft()
    adapter = PolicyTable(run=nft)
    assert adapter.apply(FIRST) == MISSING
    assert adapter.apply(FIRST) is None
    assert len(nft.scripts) == 1  # nothing written for an unchanged table
    assert adapter.apply(SECOND) is None
    assert len(nft.scripts) == 2
    assert nft.scripts[1] == SECOND.script_from(FIRST)
    assert "table" not in nft.scripts[1] and "add element" in nft.scripts[1]


@pytest.mark.parametrize(("damage", "reason"), [("delete_table", MISSING), ("alter", CHANGED)])
def test_a_table_deleted_or_changed_by_hand_is_replaced_whole(damage: str, reason: str) -> None:
    nft = FakeNft()
    adapter = PolicyTable(run=nft)
    adapter.apply(FIRST)
    getattr(nft, damage)()
    assert adapter.apply(FIRST) == reason
    assert nft.scripts[-1].startswith(f"add table inet {TABLE}\ndelete table inet {TABLE}\n")
    assert adapter.apply(FIRST) is None  # and left alone again after the repair
    assert len(nft.scripts) == 2


def test_a_failed_write_raises_and_the_next_pass_replaces_the_table_whole() -> None:
    nft = FakeNft()
    failing = [True]

    def run(argv: list[str], **kwargs: object) -> object:
        if "-f" in argv and failing and failing.pop():
            return FakeNft._done(argv, 1, err="Error: Could not process rule")
        return nft(argv, **kwargs)

    adapter = PolicyTable(run=run)  # type: ignore[arg-type]
    nft.table = []
    with pytest.raises(DataplaneError, match="nft could not write the table"):
        adapter.apply(FIRST)
    assert adapter.apply(FIRST) == AT_START  # what the kernel holds is unknown: whole
    assert nft.table is not None and nft.table[0] == f"add table inet {TABLE}"


def test_with_the_generation_unmoved_a_change_is_written_without_reading_the_table_back() -> None:
    nft = FakeNft()
    adapter = PolicyTable(run=nft, generation=lambda: nft.generation)
    assert adapter.apply(FIRST) == MISSING
    read = adapter.listings
    assert adapter.apply(SECOND) is None
    assert nft.scripts[1] == SECOND.script_from(FIRST)
    assert adapter.listings == read + 1  # only the reference read after the write
    assert adapter.apply(SECOND) is None  # a pass with nothing to do reads nothing
    assert adapter.listings == read + 1 and len(nft.scripts) == 2


def test_someone_elses_write_elsewhere_costs_one_read_and_is_then_trusted() -> None:
    nft = FakeNft()
    adapter = PolicyTable(run=nft, generation=lambda: nft.generation)
    adapter.apply(FIRST)
    nft.elsewhere()
    read = adapter.listings
    assert adapter.apply(FIRST) is None  # read back, found as we left it
    assert adapter.apply(FIRST) is None  # and trusted at that generation
    assert adapter.listings == read + 1 and len(nft.scripts) == 1


@pytest.mark.parametrize(("damage", "reason"), [("delete_table", MISSING), ("alter", CHANGED)])
def test_a_change_by_hand_moves_the_generation_and_is_still_replaced_whole(
    damage: str, reason: str
) -> None:
    nft = FakeNft()
    adapter = PolicyTable(run=nft, generation=lambda: nft.generation)
    adapter.apply(FIRST)
    getattr(nft, damage)()
    assert adapter.apply(SECOND) == reason
    assert nft.table == SECOND.script_from(None).splitlines()


def test_an_unknown_generation_reads_the_table_back_every_time() -> None:
    nft = FakeNft()
    adapter = PolicyTable(run=nft, generation=lambda: None)
    adapter.apply(FIRST)
    read = adapter.listings
    adapter.apply(FIRST)
    adapter.apply(FIRST)
    assert adapter.listings == read + 2


THIRD = table([DB_POLICY], [*PODS, pod("api3", "api", "10.244.2.4", node="n2")])


def test_a_read_back_left_owed_is_taken_later_once_and_only_then() -> None:
    nft = FakeNft()
    adapter = PolicyTable(run=nft, generation=lambda: nft.generation)
    adapter.apply(FIRST)
    read = adapter.listings
    assert adapter.apply(SECOND, read_back=False) is None
    assert adapter.apply(THIRD, read_back=False) is None  # no reference needed yet
    assert adapter.listings == read and nft.scripts[2] == THIRD.script_from(SECOND)
    adapter.remember()
    adapter.remember()  # nothing owed any more
    assert adapter.listings == read + 1
    nft.elsewhere()
    assert adapter.apply(THIRD) is None  # compared with that reference: found intact
    assert len(nft.scripts) == 3


def test_a_write_by_someone_else_before_the_read_back_means_a_rebuild_at_the_next_change() -> None:
    nft = FakeNft()
    adapter = PolicyTable(run=nft, generation=lambda: nft.generation)
    adapter.apply(FIRST)
    adapter.apply(SECOND, read_back=False)
    nft.alter()  # a rule slipped into our table before we read it back
    read = adapter.listings
    adapter.remember()
    assert adapter.listings == read  # what it would read is not only ours: not taken
    assert adapter.apply(SECOND) == UNVERIFIED
    assert nft.table == SECOND.script_from(None).splitlines()  # the hand's rule is gone
    assert adapter.apply(SECOND) is None and len(nft.scripts) == 3


def test_without_a_generation_the_read_back_is_never_left_owed() -> None:
    nft = FakeNft()
    adapter = PolicyTable(run=nft, generation=lambda: None)
    adapter.apply(FIRST)
    read = adapter.listings
    adapter.apply(SECOND, read_back=False)
    assert adapter.listings == read + 2  # the check before the write, the reference after
