"""Over gRPC (a node with a client certificate), an idle etcd watch's thread wakes once a
second, not ten times, and still sees a response at once: gRPC's blocking iterators wait
on a condition that a response notifies, in slices that only bound how often an idle
thread wakes."""

from __future__ import annotations

import threading
import time

from grpc import _common

from flannelpy.store.etcd import grpc_member


def test_grpc_waits_in_one_second_slices_once_the_grpc_member_module_loads() -> None:
    assert _common.MAXIMUM_WAIT_TIMEOUT == grpc_member.GRPC_WAIT_SLICE == 1.0


def test_a_notified_wait_returns_at_once_and_an_idle_one_wakes_per_slice() -> None:
    condition = threading.Condition()
    ready = threading.Event()
    wakeups = 0

    def wait_fn(timeout: float) -> None:
        nonlocal wakeups
        wakeups += 1
        condition.wait(timeout)

    def answer() -> None:
        time.sleep(2.2)  # two idle slices and a bit
        with condition:
            ready.set()
            condition.notify_all()

    start = time.monotonic()  # before the answer's clock starts, so waited >= 2.2
    threading.Thread(target=answer).start()
    with condition:
        _common.wait(wait_fn, ready.is_set)
    waited = time.monotonic() - start
    assert ready.is_set()
    assert 2.15 <= waited < 2.9  # woken by the notify, not by the end of a slice
    assert wakeups <= 4  # 3 slices; at 0.1 s it would be 23
