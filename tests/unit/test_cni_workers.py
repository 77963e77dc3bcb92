"""Workers: every task runs at once on a thread of its own, idle threads are reused,
and none outlives a quiet spell."""

from __future__ import annotations

import threading

import pytest

from flannelpy.cni.workers import Workers
from tests.support.waiting import wait_until


def test_tasks_run_at_once_side_by_side_then_threads_are_reused() -> None:
    workers = Workers("t", idle_seconds=30)
    all_in = threading.Barrier(5 + 1)
    for _ in range(5):  # all five must run together: the barrier needs every one
        workers.submit(lambda: all_in.wait(5))
    all_in.wait(5)
    assert workers.started == 5
    wait_until(lambda: workers._idle == 5, 5, "the five threads to go idle")
    seen: list[str] = []
    done = threading.Barrier(3 + 1)

    def task() -> None:
        seen.append(threading.current_thread().name)
        done.wait(5)

    for _ in range(3):
        workers.submit(task)
    done.wait(5)
    assert workers.started == 5  # served by idle threads, none started
    assert seen == ["t"] * 3


def test_an_idle_thread_ends_after_its_quiet_spell() -> None:
    workers = Workers("quiet-spell", idle_seconds=0.05)
    ran = threading.Event()
    workers.submit(ran.set)
    assert ran.wait(5)
    wait_until(
        lambda: not [t for t in threading.enumerate() if t.name == "quiet-spell"],
        5,
        "the thread to end",
    )
    assert workers._idle == 0
    again = threading.Event()
    workers.submit(again.set)  # a new thread for the next task
    assert again.wait(5) and workers.started == 2


def test_a_failing_task_keeps_its_thread_for_the_next(caplog: pytest.LogCaptureFixture) -> None:
    workers = Workers("t", idle_seconds=30)

    def boom() -> None:
        raise ValueError("boom")

    workers.submit(boom)
    wait_until(lambda: workers._idle == 1, 5, "the thread to go idle")
    ran = threading.Event()
    workers.submit(ran.set)
    assert ran.wait(5) and workers.started == 1
    assert "a worker's task failed" in caplog.text


def test_no_thread_to_be_had_is_the_callers_to_handle(monkeypatch: pytest.MonkeyPatch) -> None:
    workers = Workers("t")

    def no_threads(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_threads)
    with pytest.raises(RuntimeError, match="can't start"):
        workers.submit(lambda: None)
    assert workers.started == 0
