"""``Reconciler.set_desired_policy``: a new policy table alone is written at once on the
caller's thread while no pass runs and a table is in place; otherwise (the first table,
a pass running, a failed write) it is left to the next pass, as any new plan is."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from flannelpy.dataplane.reconciler import PLAN_CHANGED, READ_BACK, Reconciler
from flannelpy.dataplane.state import DesiredState
from flannelpy.errors import DataplaneError
from tests.support.fakes import FakeKernel
from tests.support.waiting import wait_until


@dataclass(frozen=True)
class Table:
    name: str

    @property
    def table(self) -> str:
        return "inet test"

    def script_from(self, old: Any) -> str:
        return "" if old == self else f"to {self.name}\n"


class RecordingTable:
    """A policy adapter that records what it applied and on which thread."""

    def __init__(self) -> None:
        self.applied: list[tuple[str, str]] = []
        self.read_back: list[bool] = []
        self.fail = False
        self.remembered = 0

    def apply(self, desired: Any, read_back: bool = True) -> str | None:
        if self.fail:
            raise DataplaneError("injected")
        self.applied.append((desired.name, threading.current_thread().name))
        self.read_back.append(read_back)
        return None

    def remember(self) -> None:
        self.remembered += 1

    def counters(self, table: str) -> dict[str, int]:
        return {}


def make() -> tuple[Reconciler, RecordingTable, FakeKernel, DesiredState]:
    kernel, table = FakeKernel(), RecordingTable()
    reconciler = Reconciler(kernel, 10.0, policy=table)
    desired = DesiredState(policy=Table("a"))
    reconciler.set_desired(desired)
    return reconciler, table, kernel, desired


def in_place() -> tuple[Reconciler, RecordingTable, FakeKernel, DesiredState]:
    """:func:`make`, with the first table written by a pass and the wake-up and reasons
    that asked for it taken, as the loop takes them before its pass."""
    reconciler, table, kernel, desired = make()
    reconciler.reconcile_once("loop")
    reconciler._wake.clear()
    reconciler._reasons.clear()
    return reconciler, table, kernel, desired


def run_loop_until(reconciler: Reconciler, done: Callable[[], bool], what: str) -> None:
    """Run the reconciler's loop on a thread of its own until ``done``, then stop it."""
    stop = threading.Event()
    loop = threading.Thread(target=reconciler.run, args=(stop,))
    loop.start()
    try:
        wait_until(done, 5.0, what)
    finally:
        stop.set()
        reconciler.trigger("stop")
        loop.join(5.0)


def test_the_first_table_waits_for_a_pass() -> None:
    reconciler, table, _, desired = make()
    reconciler.set_desired_policy(replace(desired, policy=Table("b")))
    assert table.applied == []
    reconciler.reconcile_once("loop")
    assert [name for name, _ in table.applied] == ["b"]


def test_with_a_table_in_place_a_new_one_is_written_at_once_without_a_pass() -> None:
    reconciler, table, kernel, desired = in_place()
    passes, observed = reconciler.last_result, kernel.observe_calls
    reconciler.set_desired_policy(replace(desired, policy=Table("b")))
    assert table.applied[-1] == ("b", threading.current_thread().name)
    assert table.read_back == [True, False]  # the read-back is the loop's, later
    assert reconciler._reasons == {READ_BACK}
    assert reconciler.last_result is passes and kernel.observe_calls == observed
    assert reconciler.desired is not None and reconciler.desired.policy == Table("b")
    reconciler.reconcile_once("desired state changed")  # a later pass finds it in place
    assert len(table.applied) == 2


def test_while_a_pass_runs_the_table_is_left_to_the_next_pass() -> None:
    reconciler, table, _, desired = in_place()
    with reconciler._pass_lock:  # a pass of the loop's, running
        reconciler.set_desired_policy(replace(desired, policy=Table("b")))
        assert [name for name, _ in table.applied] == ["a"]
    assert reconciler._wake.is_set()  # the loop's next pass is asked for
    reconciler.reconcile_once("loop")
    assert [name for name, _ in table.applied] == ["a", "b"]


def test_a_failed_write_is_retried_and_reported_by_the_next_pass() -> None:
    reconciler, table, _, desired = in_place()
    table.fail = True
    reconciler.set_desired_policy(replace(desired, policy=Table("b")))
    assert reconciler._wake.is_set()
    result = reconciler.reconcile_once("loop")
    assert result is not None and any("injected" in f for f in result.failures)
    table.fail = False
    result = reconciler.reconcile_once("loop")
    assert result is not None and result.converged
    assert [name for name, _ in table.applied] == ["a", "b"]


def test_the_loop_takes_the_owed_read_back_without_a_pass() -> None:
    reconciler, table, _, desired = in_place()
    reconciler.set_desired_policy(replace(desired, policy=Table("b")))
    remembered, passes = table.remembered, reconciler.last_result
    run_loop_until(reconciler, lambda: table.remembered > remembered, "the read-back")
    assert table.remembered == remembered + 1
    assert reconciler.last_result is passes  # no pass ran for it


def test_a_pass_that_also_owes_a_read_back_is_a_pass_for_the_plan() -> None:
    """With a new plan waiting too, the pass takes the read-back; it reads no route back."""
    reconciler, table, kernel, desired = in_place()
    reconciler.set_desired_policy(replace(desired, policy=Table("b")))
    reconciler.set_desired(replace(desired, policy=Table("c")))
    observed, remembered = kernel.observe_calls, table.remembered
    run_loop_until(reconciler, lambda: table.remembered > remembered, "the pass")
    result = reconciler.last_result
    assert result is not None and result.reason == PLAN_CHANGED
    assert kernel.observe_calls == observed  # the kernel known from the last pass
    assert [name for name, _ in table.applied] == ["a", "b", "c"]
