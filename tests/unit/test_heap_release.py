"""After bulk work the agent keeps the plan, not the garbage: the allocator's free pages
go back to the kernel, and a netlink dump is dropped once diffed."""

from __future__ import annotations

import gc
import weakref
from ipaddress import IPv4Address

import pytest

from flannelpy import heap
from flannelpy.backend.registry import get_backend
from flannelpy.dataplane.reconciler import PLAN_CHANGED, Reconciler
from flannelpy.dataplane.state import ObservedState
from tests.support.fakes import FakeKernel, context, lease

MAC = "02:00:00:00:00:01"
OWN = lease("10.244.1.0/24", "192.168.1.10", mac=MAC)


def peers(n: int) -> list:  # type: ignore[type-arg]
    return [
        lease(
            f"10.{100 + i // 250}.{i % 250}.0/24",
            str(IPv4Address("172.16.0.1") + i),
            mac=f"02:fb:00:00:{i // 256:02x}:{i % 256:02x}",
        )
        for i in range(n)
    ]


def plan(n: int):  # type: ignore[no-untyped-def]
    return get_backend("vxlan").plan(context("vxlan"), [OWN], peers(n), MAC)


def vm_rss_kib() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


# --- the allocator's free pages ----------------------------------------------------------


def test_freed_memory_goes_back_to_the_kernel() -> None:
    blocks = [bytes(1000) for _ in range(30_000)]  # about 30 MiB, each block from malloc
    pin = bytes(1000)  # allocated last: the heap's top stays in use, so glibc keeps the rest
    before = vm_rss_kib()
    del blocks
    assert heap.release_free_memory()
    assert vm_rss_kib() < before - 20_000
    del pin


def test_only_bulk_work_trims(monkeypatch: pytest.MonkeyPatch) -> None:
    trims: list[int] = []
    monkeypatch.setattr(heap, "_malloc_trim", lambda: trims.append)
    assert not heap.after_bulk(heap.BULK_ENTRIES - 1)
    assert heap.after_bulk(heap.BULK_ENTRIES)
    assert trims == [0]


def test_without_malloc_trim_nothing_happens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_malloc_trim", lambda: None)
    assert not heap.release_free_memory()
    assert not heap.after_bulk(10 * heap.BULK_ENTRIES)


# --- the reconciler keeps the plan's entries, not a dump's ---------------------------------


class RecordingKernel(FakeKernel):
    """FakeKernel whose dumps can be watched: are they still alive?"""

    def __init__(self) -> None:
        super().__init__()
        self.dumps: list[weakref.ref[ObservedState]] = []

    def observe(self, link_names, owned_devices, expected=None):  # type: ignore[no-untyped-def]
        # Entries of its own (equal to the plan's, other objects), as a netlink dump has.
        found = super().observe(link_names, owned_devices)
        copied = ObservedState(
            links=found.links,
            addresses=found.addresses,
            routes=frozenset(_copy(r) for r in found.routes),
            neighbours=frozenset(_copy(n) for n in found.neighbours),
            fdb=frozenset(_copy(f) for f in found.fdb),
        )
        self.dumps.append(weakref.ref(copied))
        return copied


def _copy(entry):  # type: ignore[no-untyped-def]
    return type(entry)(*(getattr(entry, f) for f in entry.__dataclass_fields__))


def test_a_dump_is_dropped_once_diffed_and_the_plan_serves_as_the_view() -> None:
    kernel = RecordingKernel()
    reconciler = Reconciler(kernel, 10)
    reconciler.set_desired(plan(4))
    assert reconciler.reconcile_once("start").converged  # type: ignore[union-attr]
    result = reconciler.reconcile_once("kernel event")  # a dump that finds it all in place
    assert result is not None and result.changes.empty
    gc.collect()
    assert kernel.dumps and all(ref() is None for ref in kernel.dumps)
    calls = kernel.observe_calls
    # The next pass for a new plan still knows the kernel without a dump.
    reconciler.set_desired(plan(5))
    result = reconciler.reconcile_once(PLAN_CHANGED)
    assert kernel.observe_calls == calls
    assert result is not None and result.changes.counts["route"] == 1


def test_a_large_dump_hands_its_pages_back(monkeypatch: pytest.MonkeyPatch) -> None:
    trims: list[int] = []

    def release() -> bool:
        trims.append(1)
        return True

    monkeypatch.setattr(heap, "release_free_memory", release)
    kernel = FakeKernel()
    reconciler = Reconciler(kernel, 10)
    reconciler.set_desired(plan(3))
    reconciler.reconcile_once("start")
    reconciler.reconcile_once("kernel event")
    assert trims == []  # 9 entries: not worth a trim
    reconciler.set_desired(plan(400))
    reconciler.reconcile_once("kernel event")  # the dump finds 12 entries, adds 1,191
    assert trims == []
    reconciler.reconcile_once("kernel event")  # a dump of 1,200 entries
    assert trims == [1]
