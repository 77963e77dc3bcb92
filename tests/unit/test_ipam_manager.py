"""NodeIpam: leases, persistence, bounded wait, GC, threads, and field-notes §2 replayed.

Every NodeIpam here writes real files in a temporary state directory; the
clock and sleep are fakes so cooldowns take no real time.
"""

from __future__ import annotations

import fcntl
import itertools
import json
import math
import os
import re
import shutil
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterator
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from flannelpy.errors import ConfigError, StoreError
from flannelpy.ipam import Accounting, Allocation, IpamStore, LeaseUsage, NodeIpam
from flannelpy.ipam.errors import IpamExhausted
from flannelpy.ipam.store import pool_file_name
from tests.support.waiting import wait_until

T0 = 1_700_000_000.0
A = IPv4Network("10.244.1.0/24")
B = IPv4Network("10.244.2.0/24")
TINY = IPv4Network("10.244.9.0/29")  # 5 allocatable addresses
ONE = IPv4Network("10.244.8.0/30")  # 1 allocatable address


class FakeClock:
    """Wall clock and sleep in one; sleeping advances the clock."""

    def __init__(self, now: float = T0) -> None:
        self.now = now
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def open_ipam(path: Path, clock: FakeClock, **kwargs: float) -> NodeIpam:
    return NodeIpam(str(path), clock=clock, sleep=clock.sleep, fsync=False, **kwargs)


@pytest.fixture
def ipam(tmp_path: Path, clock: FakeClock) -> Iterator[NodeIpam]:
    with open_ipam(tmp_path, clock) as node:
        node.set_leases([A])
        yield node


def addr(text: str) -> IPv4Address:
    return IPv4Address(text)


# --- basics and persistence ----------------------------------------------------


def test_allocate_is_idempotent_and_on_disk_before_returning(
    ipam: NodeIpam, tmp_path: Path
) -> None:
    a = ipam.allocate("c1", "eth0")
    assert (a.ip, a.subnet, a.assigned_at) == (addr("10.244.1.2"), A, T0)
    assert ipam.allocate("c1", "eth0") == a
    doc = json.loads((tmp_path / pool_file_name(A)).read_text())
    assert doc["allocations"] == [
        {"ip": "10.244.1.2", "container_id": "c1", "ifname": "eth0", "assigned_at": T0}
    ]
    assert oct((tmp_path).stat().st_mode & 0o777) == oct(0o700)
    assert oct((tmp_path / pool_file_name(A)).stat().st_mode & 0o777) == oct(0o600)


def test_restart_keeps_allocations_and_cooldowns(tmp_path: Path, clock: FakeClock) -> None:
    with open_ipam(tmp_path, clock) as first:
        first.set_leases([TINY])
        ips = [first.allocate(f"c{i}", "eth0").ip for i in range(5)]
        first.release("c0", "eth0")
    clock.now += 10
    with open_ipam(tmp_path, clock) as second:
        # Found before the lease is even known again (DEL right after a restart).
        assert second.find("c1", "eth0") is not None
        second.set_leases([TINY])
        assert [a.ip for a in second.allocations()] == ips[1:]
        with pytest.raises(
            IpamExhausted, match=r"4 assigned, 1 cooling down \(next free in 20 s\)"
        ):
            second.allocate("new", "eth0")
        clock.now += 20
        assert second.allocate("new", "eth0").ip == ips[0]


def test_release_find_and_unknown(ipam: NodeIpam, clock: FakeClock) -> None:
    a = ipam.allocate("c1", "eth0")
    clock.now += 3
    assert ipam.find("c1", "eth0") == a
    assert ipam.release("c1", "eth0") == a
    assert ipam.find("c1", "eth0") is None
    assert ipam.release("c1", "eth0") is None
    [acc] = ipam.accounting()
    assert acc == Accounting(A, 253, 0, 1, 252, 30.0)


def test_bad_seconds_are_config_errors(tmp_path: Path, clock: FakeClock) -> None:
    with pytest.raises(ConfigError, match="ipCooldownSeconds must be"):
        open_ipam(tmp_path, clock, cooldown_seconds=-1)
    with pytest.raises(ConfigError, match="ipWaitSeconds must be"):
        open_ipam(tmp_path, clock, wait_seconds=float("nan"))


# --- several leases --------------------------------------------------------------


def test_first_allocatable_lease_with_a_free_address(tmp_path: Path, clock: FakeClock) -> None:
    with open_ipam(tmp_path, clock) as node:
        node.set_leases([ONE, TINY])
        got = [node.allocate(f"c{i}", "eth0") for i in range(6)]
        assert [a.subnet for a in got] == [ONE] + [TINY] * 5
        node.release("c0", "eth0")  # ONE's address cools: the next goes nowhere
        with pytest.raises(IpamExhausted) as caught:
            node.allocate("x", "eth0")
        assert str(caught.value) == (
            "no free address in 10.244.8.0/30: 0 assigned, 1 cooling down (next free in 30 s)"
            "; 10.244.9.0/29: 5 assigned, 0 cooling down"
        )
        assert [a.subnet for a in caught.value.accounting] == [ONE, TINY]


def test_draining_lease_gets_nothing_new_but_keeps_its_pods(
    tmp_path: Path, clock: FakeClock
) -> None:
    with open_ipam(tmp_path, clock) as node:
        node.set_leases([A, B])
        old = node.allocate("old", "eth0")
        node.set_leases([A, B], allocatable=[B])
        assert node.allocate("new", "eth0").subnet == B
        assert node.allocate("old", "eth0") == old  # idempotent across drain
        with pytest.raises(ValueError, match="not among the leases"):
            node.set_leases([A], allocatable=[B])


def test_lease_that_went_away_keeps_allocations(tmp_path: Path, clock: FakeClock) -> None:
    with open_ipam(tmp_path, clock) as node:
        node.set_leases([A])
        kept = node.allocate("kept", "eth0")
        gone = node.allocate("gone", "eth0")
        node.set_leases([B])
        assert node.allocate("new", "eth0").subnet == B
        assert node.find("kept", "eth0") == kept
        assert [a.subnet for a in node.accounting()] == [B, A]  # former lease: pods remain
        assert node.release("gone", "eth0") == gone
    with open_ipam(tmp_path, clock) as again:
        again.set_leases([B])
        assert again.find("kept", "eth0") == kept
        again.release("kept", "eth0")
        assert [a.subnet for a in again.accounting()] == [B]  # no pods left on A
        assert (tmp_path / pool_file_name(A)).exists()  # its cooldowns stay on disk


def test_allocation_walks_serving_leases_in_the_leases_order(
    tmp_path: Path, clock: FakeClock
) -> None:
    with open_ipam(tmp_path, clock) as node:
        # The allocatable set says which leases serve; the leases' order (oldest
        # first) says in which order, whatever order the set came in.
        node.set_leases([ONE, TINY, A], allocatable=[A, ONE])
        got = [node.allocate(f"c{i}", "eth0").subnet for i in range(3)]
        assert got == [ONE, A, A]  # TINY drains: skipped although it has room
        assert [(u.subnet, u.allocatable) for u in node.usage()] == [
            (ONE, True),
            (TINY, False),
            (A, True),
        ]


def test_usage_per_lease_never_counts_cooling_as_free(tmp_path: Path, clock: FakeClock) -> None:
    with open_ipam(tmp_path, clock) as node:
        node.set_leases([TINY, A])
        for i in range(5):
            node.allocate(f"t{i}", "eth0")
        node.allocate("a0", "eth0")
        node.release("t0", "eth0")
        node.release("t1", "eth0")
        node.set_leases([TINY, A], allocatable=[A])  # TINY's pool is excluded now
        assert node.usage() == [
            LeaseUsage(TINY, total=5, assigned=3, cooling=2, free=0, allocatable=False),
            LeaseUsage(A, total=253, assigned=1, cooling=0, free=252, allocatable=True),
        ]
        clock.now += 30
        [tiny, _] = node.usage()
        assert (tiny.cooling, tiny.free, tiny.state) == (0, 2, "draining")


def test_is_empty_only_without_assigned_and_cooling(tmp_path: Path, clock: FakeClock) -> None:
    with open_ipam(tmp_path, clock) as node:
        node.set_leases([TINY])
        assert node.is_empty(TINY)
        node.allocate("c", "eth0")
        assert not node.is_empty(TINY)
        node.release("c", "eth0")
        assert not node.is_empty(TINY)  # cooling: another node must not get it yet
        clock.now += 29.9
        assert not node.is_empty(TINY)
        clock.now += 0.1
        assert node.is_empty(TINY)
        assert node.is_empty(B)  # never known: nothing on it


def test_emptiness_honours_the_longest_cooldown_requested(tmp_path: Path, clock: FakeClock) -> None:
    with open_ipam(tmp_path, clock) as node:
        node.set_leases([TINY])
        node.allocate("c", "eth0", cooldown=90)  # a CNI config's own ipCooldownSeconds
        node.release("c", "eth0")
        clock.now += 60
        assert not node.is_empty(TINY)
        assert not node.remove_lease_if_empty(TINY)
        clock.now += 30
        assert node.remove_lease_if_empty(TINY)


def test_a_restart_keeps_the_longest_cooldown_requested(tmp_path: Path, clock: FakeClock) -> None:
    with open_ipam(tmp_path, clock) as node:
        node.set_leases([TINY])
        node.allocate("c", "eth0", cooldown=90)
        node.release("c", "eth0")
    clock.now += 60
    with open_ipam(tmp_path, clock) as restarted:  # default cooldown 30 s again
        restarted.set_leases([TINY])
        assert not restarted.is_empty(TINY)
        assert not restarted.remove_lease_if_empty(TINY)
        clock.now += 30
        assert restarted.remove_lease_if_empty(TINY)


@pytest.mark.parametrize("content", [b"{not json", b'{"longest_cooldown_seconds": -1}', b"[]"])
def test_an_unusable_cooldown_file_falls_back_to_the_default(
    tmp_path: Path, clock: FakeClock, content: bytes
) -> None:
    (tmp_path / "cooldown.json").write_bytes(content)
    with open_ipam(tmp_path, clock) as node:
        node.set_leases([TINY])
        node.allocate("c", "eth0")
        node.release("c", "eth0")
        clock.now += 30.1
        assert node.is_empty(TINY)


def test_remove_lease_only_when_empty(tmp_path: Path, clock: FakeClock) -> None:
    with open_ipam(tmp_path, clock) as node, open_ipam(tmp_path, clock) as other:
        node.set_leases([A, TINY])
        node.allocate("a", "eth0")
        node.set_leases([A, TINY], allocatable=[TINY])
        t = node.allocate("t", "eth0")
        assert t.subnet == TINY
        assert not node.remove_lease_if_empty(A)  # an assigned address: refused
        node.release("a", "eth0")
        assert not node.remove_lease_if_empty(A)  # a cooling address: refused
        assert [u.subnet for u in node.usage()] == [A, TINY]
        clock.now += 30
        assert node.remove_lease_if_empty(A)
        assert not (tmp_path / pool_file_name(A)).exists()
        assert [u.subnet for u in node.usage()] == [TINY]
        assert [a.subnet for a in node.accounting()] == [TINY]
        assert node.remove_lease_if_empty(A)  # already gone: idempotent
        # Another process on the directory sees the removal too.
        other.set_leases([TINY])
        assert other.find("t", "eth0") == t
        assert other.is_empty(A)
        # The subnet acquired again later starts afresh.
        node.set_leases([TINY, A])
        assert node.usage()[1] == LeaseUsage(A, 253, 0, 0, 253, True)


def test_remove_lease_checks_the_file_of_a_pool_it_never_loaded(
    tmp_path: Path, clock: FakeClock
) -> None:
    with open_ipam(tmp_path, clock) as early:  # opened before TINY's file exists
        with open_ipam(tmp_path, clock) as writer:
            writer.set_leases([TINY])
            writer.allocate("c", "eth0")
        assert not early.is_empty(TINY)
        assert not early.remove_lease_if_empty(TINY)
        assert (tmp_path / pool_file_name(TINY)).exists()


# --- low free-address watch (warm capacity) ---------------------------------------


def test_low_free_watch_fires_on_the_allocation_that_crosses(
    tmp_path: Path, clock: FakeClock
) -> None:
    seen: list[tuple[int, bool, list[LeaseUsage]]] = []
    with open_ipam(tmp_path, clock) as node:

        def on_low(free: int) -> None:
            # Runs without IPAM's locks, after the allocation reached the disk.
            on_disk = json.loads((tmp_path / pool_file_name(TINY)).read_text())
            seen.append((free, len(on_disk["allocations"]) == 5 - free, node.usage()))

        node.set_leases([A, TINY], allocatable=[TINY])  # A drains: its room never counts
        node.set_low_free_watch(3, on_low)
        node.allocate("c0", "eth0")
        node.allocate("c1", "eth0")
        assert seen == []  # 4, then 3 free: not below 3
        node.allocate("c2", "eth0")
        assert [(free, on_disk) for free, on_disk, _ in seen] == [(2, True)]
        assert seen[0][2][1].free == 2
        node.allocate("c2", "eth0")  # the existing allocation: nothing new, no call
        assert len(seen) == 1
        node.allocate("c3", "eth0")
        node.allocate("c4", "eth0")
        with pytest.raises(IpamExhausted):
            node.allocate("c5", "eth0")
        assert [free for free, _, _ in seen] == [2, 1, 0, 0]


def test_low_free_watch_off_and_failing_callbacks(tmp_path: Path, clock: FakeClock) -> None:
    calls: list[int] = []

    def broken(free: int) -> None:
        calls.append(free)
        raise RuntimeError("agent bug")

    with open_ipam(tmp_path, clock) as node:
        node.set_leases([TINY])
        node.set_low_free_watch(0, calls.append)  # threshold 0: off
        node.allocate("c0", "eth0")
        assert calls == []
        node.set_low_free_watch(10, broken)
        a = node.allocate("c1", "eth0")  # the ADD succeeds whatever the callback does
        assert calls == [3]
        assert node.find("c1", "eth0") == a
        node.set_low_free_watch(10, None)
        node.allocate("c2", "eth0")
        assert calls == [3]
        for bad in (-1, 1.5, True):
            with pytest.raises(ValueError, match="threshold"):
                node.set_low_free_watch(bad, calls.append)  # type: ignore[arg-type]


def test_no_lease_yet(tmp_path: Path, clock: FakeClock) -> None:
    with open_ipam(tmp_path, clock, wait_seconds=60) as node:
        with pytest.raises(IpamExhausted, match="holds no allocatable lease yet"):
            node.allocate("c", "eth0")
        assert clock.sleeps == []


# --- bounded wait ----------------------------------------------------------------


def test_wait_for_next_cooling_address_within_bound(tmp_path: Path, clock: FakeClock) -> None:
    with open_ipam(tmp_path, clock, wait_seconds=10) as node:
        node.set_leases([ONE])
        node.allocate("c0", "eth0")
        node.release("c0", "eth0")
        clock.now += 25  # frees in 5 s: within the 10 s wait
        a = node.allocate("c1", "eth0")
        assert a.ip == addr("10.244.8.2")
        assert clock.sleeps == [pytest.approx(5.0)]
        assert a.assigned_at == pytest.approx(T0 + 30)


def test_wait_that_cannot_succeed_fails_at_once(tmp_path: Path, clock: FakeClock) -> None:
    with open_ipam(tmp_path, clock, wait_seconds=10) as node:
        node.set_leases([ONE])
        node.allocate("c0", "eth0")
        node.release("c0", "eth0")
        clock.now += 15  # frees in 15 s: beyond the 10 s wait
        with pytest.raises(IpamExhausted, match=r"next free in 15 s"):
            node.allocate("c1", "eth0")
        assert clock.sleeps == []
        node.allocate("c2", "eth0", wait=15)  # a per-request wait overrides
        assert clock.sleeps == [pytest.approx(15.0)]


def test_wait_zero_and_nothing_cooling_never_sleep(tmp_path: Path, clock: FakeClock) -> None:
    with open_ipam(tmp_path, clock, wait_seconds=100) as node:
        node.set_leases([ONE])
        node.allocate("c0", "eth0")
        with pytest.raises(IpamExhausted, match=r"1 assigned, 0 cooling down$"):
            node.allocate("c1", "eth0")  # nothing cools: waiting cannot help
        node.release("c0", "eth0")
        with pytest.raises(IpamExhausted):
            node.allocate("c1", "eth0", wait=0)
        assert clock.sleeps == []


class HeldSleep(FakeClock):
    """A sleep that lasts until the test opens ``gate``; ``asleep`` is set meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.asleep = threading.Event()
        self.gate = threading.Event()

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        start = self.now
        self.asleep.set()
        self.gate.wait(5)
        self.asleep.clear()
        self.now = max(self.now, start + seconds)


def test_wait_releases_the_lock_so_others_proceed(tmp_path: Path) -> None:
    # One thread waits for a cooling address while another thread releases and
    # allocates; the waiter must not block them.
    clock = HeldSleep()
    with open_ipam(tmp_path, clock, cooldown_seconds=0.3, wait_seconds=2) as node:
        node.set_leases([TINY])
        for i in range(5):
            node.allocate(f"c{i}", "eth0")
        node.release("c0", "eth0")
        result: list[Allocation] = []
        waiter = threading.Thread(target=lambda: result.append(node.allocate("w", "eth0")))
        waiter.start()
        assert clock.asleep.wait(5), "the allocate did not wait for the cooling address"
        clock.now += 0.05
        assert node.find("c1", "eth0") is not None
        node.release("c1", "eth0")
        # Had the sleeping allocate kept the lock, these calls would have waited it out.
        assert clock.asleep.is_set(), "find and release waited for the sleeping allocate"
        clock.gate.set()
        waiter.join(5)
        assert [a.ip for a in result] == [addr("10.244.9.2")]


# --- gc ------------------------------------------------------------------------


def test_gc_releases_rejected_into_cooldown(ipam: NodeIpam, clock: FakeClock) -> None:
    for i in range(4):
        ipam.allocate(f"c{i}", "eth0")
    # keep() may call back into the IPAM: it runs without the locks.
    released = ipam.gc(
        lambda a: a.container_id in {"c1", "c3"} or ipam.find("x", "eth0") is not None
    )
    assert sorted(a.container_id for a in released) == ["c0", "c2"]
    assert sorted(a.container_id for a in ipam.allocations()) == ["c1", "c3"]
    [acc] = ipam.accounting()
    assert (acc.assigned, acc.cooling) == (2, 2)
    assert ipam.gc(lambda a: True) == []


def test_gc_leaves_an_allocation_remade_while_keep_ran(ipam: NodeIpam) -> None:
    ipam.allocate("c0", "eth0")

    def keep(a: Allocation) -> bool:
        # The runtime deletes and re-adds the container meanwhile.
        ipam.release("c0", "eth0")
        ipam.allocate("c0", "eth0")
        return False

    assert ipam.gc(keep) == []
    assert ipam.find("c0", "eth0") is not None


# --- concurrency ---------------------------------------------------------------


def test_threads_get_distinct_addresses(ipam: NodeIpam) -> None:
    results: list[Allocation] = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        for i in range(25):
            a = ipam.allocate(f"t{n}-{i}", "eth0")
            with lock:
                results.append(a)

    side_by_side(worker, 8)
    assert len({a.ip for a in results}) == 200
    assert len(ipam.allocations()) == 200


def test_concurrent_allocations_share_directory_fsyncs_and_each_waits_for_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group commit: 30 ADDs at once each return only after a directory fsync that began
    once their allocation was in the pool file, and those fsyncs run outside IPAM's
    locks, shared, instead of 30 in a row under them."""
    from flannelpy import fsutil

    durable: list[str] = []  # the pool file's content as each finished fsync covered it
    lock = threading.Lock()

    def slow_fsync_dir(directory: str | os.PathLike[str]) -> None:
        seen = (tmp_path / pool_file_name(A)).read_text()
        threading.Event().wait(0.01)
        with lock:
            durable.append(seen)

    with NodeIpam(str(tmp_path)) as node:
        node.set_leases([A])
        monkeypatch.setattr(fsutil, "fsync_dir", slow_fsync_dir)
        assert thirty_at_once(node, durable, lock) == []
        assert 1 <= len(durable) < 30


def thirty_at_once(node: NodeIpam, durable: list[str], lock: threading.Lock) -> list[str]:
    """30 allocations at once; the addresses not in any of ``durable`` (the pool file's
    versions made durable so far) when their allocation returned."""
    start = threading.Barrier(30)
    late: list[str] = []

    def add(n: int) -> None:
        start.wait()
        ip = f'"{node.allocate(f"c{n}", "eth0").ip}"'
        with lock:
            if not any(ip in seen for seen in durable):
                late.append(ip)

    side_by_side(add, 30)
    assert len(node.allocations()) == 30
    return late


def side_by_side(target: Callable[[int], None], count: int) -> None:
    """``target(0)`` .. ``target(count - 1)``, each on a thread of its own; returns when all end."""
    threads = [threading.Thread(target=target, args=(n,)) for n in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def test_a_deferred_allocation_is_on_disk_and_durable_once_its_commit_returns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ADD's form: allocate_all_deferred hands the address out in memory, holding the file
    lock; the caller's commit writes the pool file and fsyncs the directory (beside its
    other work) and releases the lock. A release is durable when it returns."""
    from flannelpy import fsutil

    fsyncs: list[str] = []
    with NodeIpam(str(tmp_path)) as node:
        node.set_leases([A])
        monkeypatch.setattr(fsutil, "fsync_dir", lambda d: fsyncs.append(str(d)))
        allocations, commit = node.allocate_all_deferred("c1", "eth0")
        pool = tmp_path / pool_file_name(A)
        assert not pool.exists()  # written by the commit
        assert fsyncs == []
        assert flock_held_elsewhere(tmp_path)  # no other process reads the older pool
        commit()
        assert '"c1"' in (tmp_path / pool_file_name(A)).read_text()
        assert fsyncs == [str(tmp_path)]
        assert not flock_held_elsewhere(tmp_path)
        assert [a.container_id for a in allocations] == ["c1"]
        assert node.allocate_all_deferred("c1", "eth0")[0] == allocations  # nothing new
        assert node.release("c1", "eth0") == allocations[0]
        assert '"c1"' not in (tmp_path / pool_file_name(A)).read_text().split('"released"')[0]
        assert fsyncs == [str(tmp_path)] * 2


def flock_held_elsewhere(directory: Path) -> bool:
    """Whether another open of the IPAM directory's lock would block."""
    fd = os.open(directory / "lock", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_a_burst_shares_pool_writes_and_each_answer_waits_for_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Group commit of the pool file: 30 allocations at once write it a few times, not 30,
    and each returns only once a written and fsync'd version holds its address."""
    from flannelpy.ipam import store as ipam_store

    durable: list[str] = []  # each write's content, once its fsync'd rename is done
    lock = threading.Lock()
    real_write = ipam_store.atomic_write

    def slow_write(path: str, data: bytes, *args: Any, **kwargs: Any) -> None:
        threading.Event().wait(0.01)
        real_write(path, data, *args, **kwargs)
        with lock:
            durable.append(data.decode())

    monkeypatch.setattr(ipam_store, "atomic_write", slow_write)
    with NodeIpam(str(tmp_path)) as node:
        node.set_leases([A])
        durable.clear()
        assert thirty_at_once(node, durable, lock) == []
        assert 1 <= len(durable) < 30


def test_a_failed_batch_fails_every_request_in_it_and_memory_is_disk_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No request whose change a failed batch dropped is told it succeeded, and what
    follows the failure is served from what the disk holds."""
    from flannelpy.ipam import store as ipam_store

    real_write = ipam_store.atomic_write
    entered, go = threading.Event(), threading.Event()
    fail = True

    def gated_write(path: str, data: bytes, *args: Any, **kwargs: Any) -> None:
        entered.set()
        assert go.wait(5)
        if fail:
            raise OSError(28, "No space left on device")
        real_write(path, data, *args, **kwargs)

    with NodeIpam(str(tmp_path)) as node:
        node.set_leases([A])
        node.allocate("c0", "eth0")
        monkeypatch.setattr(ipam_store, "atomic_write", gated_write)
        outcomes: dict[str, str] = {}

        def add(name: str) -> None:
            try:
                outcomes[name] = str(node.allocate(name, "eth0").ip)
            except StoreError as e:
                outcomes[name] = str(e)

        first = threading.Thread(target=add, args=("c1",))
        first.start()
        assert entered.wait(5)  # c1's batch is being written, IPAM's lock held
        later = [threading.Thread(target=add, args=(f"c{n}",)) for n in (2, 3)]
        for t in later:
            t.start()
        go.set()
        for t in [first, *later]:
            t.join()
        assert "No space left" in outcomes["c1"]
        assert node.find("c1", "eth0") is None
        fail = False
        for name in ("c2", "c3"):  # either in c1's batch (failed) or a later one (written)
            if "No space left" in outcomes[name]:
                assert node.find(name, "eth0") is None
            else:
                assert node.find(name, "eth0") is not None
        monkeypatch.undo()
    with NodeIpam(str(tmp_path)) as again:  # what the disk holds is what was answered
        on_disk = {a.container_id for a in again.allocations()}
        answered = {n for n, out in outcomes.items() if "No space" not in out}
        assert on_disk == {"c0"} | answered


def test_killed_between_the_batch_write_and_the_reply(tmp_path: Path, clock: FakeClock) -> None:
    """An agent killed once the batch is on disk but before its ADDs answered: the
    restart finds the addresses assigned (never handed out twice), and the start-up GC,
    which finds no record for them, frees them."""
    node = open_ipam(tmp_path, clock)
    node.set_leases([A])
    allocations, commit = node.allocate_all_deferred("c1", "eth0")
    commit()  # the batch is written; the "reply" never happens
    node.close()  # the kill: memory gone, the file lock released with the process
    with open_ipam(tmp_path, clock) as restarted:
        restarted.set_leases([A])
        assert restarted.find("c1", "eth0") == allocations[0]
        assert restarted.allocate("c2", "eth0").ip != allocations[0].ip
        assert restarted.gc(lambda a: a.container_id != "c1") == allocations
        assert restarted.find("c1", "eth0") is None


def test_killed_before_the_batch_write_hands_out_nothing(tmp_path: Path, clock: FakeClock) -> None:
    """Killed after allocating in memory, before the batch: nothing was answered and
    nothing is on disk, so the restart has the address free and nothing to collect."""
    node = open_ipam(tmp_path, clock)
    node.set_leases([A])
    node.allocate_all_deferred("c1", "eth0")  # never committed
    node.close()
    with open_ipam(tmp_path, clock) as restarted:
        restarted.set_leases([A])
        assert restarted.allocations() == []


def test_two_instances_on_one_directory_never_interleave(tmp_path: Path, clock: FakeClock) -> None:
    # Two agents sharing a state directory (as during an overlapping restart):
    # each operation re-reads what the other wrote under the file lock.
    with open_ipam(tmp_path, clock) as one, open_ipam(tmp_path, clock) as two:
        one.set_leases([TINY])
        two.set_leases([TINY])
        got = []
        for i in range(5):
            got.append((one if i % 2 else two).allocate(f"c{i}", "eth0").ip)
        assert len(set(got)) == 5
        one.release("c0", "eth0")
        with pytest.raises(IpamExhausted, match="4 assigned, 1 cooling down"):
            two.allocate("x", "eth0")
        assert two.find("c0", "eth0") is None


def test_failed_write_leaves_memory_as_disk(
    ipam: NodeIpam, monkeypatch: pytest.MonkeyPatch
) -> None:
    ipam.allocate("c0", "eth0")

    def broken(src: str, dst: str) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken)
    with pytest.raises(StoreError, match=r"cannot write IPAM state file .*No space left"):
        ipam.allocate("c1", "eth0")
    monkeypatch.undo()
    assert ipam.find("c1", "eth0") is None  # not handed out, since not on disk
    assert [a.container_id for a in ipam.allocations()] == ["c0"]


# --- the store -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "error"),
    [
        (b"{not json", "is invalid: not JSON"),
        (b"[]", "is invalid: not a JSON object"),
        (b'{"version": 9}', "is invalid: unsupported IPAM state version 9"),
        (
            json.dumps(
                {"version": 1, "subnet": "10.244.2.0/24", "allocations": [], "released": []}
            ).encode(),
            "it holds the state of 10.244.2.0/24",
        ),
    ],
)
def test_corrupt_state_is_refused_loudly(
    tmp_path: Path, clock: FakeClock, content: bytes, error: str
) -> None:
    (tmp_path / pool_file_name(A)).write_bytes(content)
    with pytest.raises(
        StoreError, match=re.escape(str(tmp_path / pool_file_name(A))) + ".*" + error
    ):
        open_ipam(tmp_path, clock)


def test_store_requires_the_lock(tmp_path: Path) -> None:
    store = IpamStore(tmp_path)
    try:
        with pytest.raises(RuntimeError, match="outside"):
            store.subnets()
        with store.locked():
            (tmp_path / "10.244.3.0_24.json").write_text("{}")
            (tmp_path / "999.1.1.1_24.json").write_text("{}")
            (tmp_path / "notes.txt").write_text("")
            assert store.subnets() == [IPv4Network("10.244.3.0/24")]
    finally:
        store.close()


def test_file_lock_excludes_another_open_of_the_directory(tmp_path: Path) -> None:
    first, second = IpamStore(tmp_path), IpamStore(tmp_path)
    entered = threading.Event()

    def contend() -> None:
        with second.locked():
            entered.set()

    try:
        with first.locked():
            t = threading.Thread(target=contend)
            t.start()
            wait_until(lambda: flock_waiters(tmp_path / "lock"), 5.0, "the second open to block")
            assert not entered.is_set()
        assert entered.wait(5)
        t.join()
    finally:
        first.close()
        second.close()


def flock_waiters(path: Path) -> int:
    """How many flock requests on ``path`` are blocked (``->`` rows of /proc/locks)."""
    inode = f":{path.stat().st_ino} "
    with open("/proc/locks") as f:
        return sum("-> FLOCK" in row and inode in row for row in f)


# --- speed -----------------------------------------------------------------------


@pytest.mark.parametrize("fsync", [True, False])
def test_an_allocation_writes_its_subnet_file_once(
    tmp_path: Path, fsync: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # An ADD's cost is the kernel's file create and rename (bench/ times it beside the
    # reference host-local plugin): a slip such as one write per held address, or a
    # re-read of every file per allocation, shows here as a count, not as a time.
    from flannelpy.ipam import store as ipam_store

    writes: list[str] = []
    real_write = ipam_store.atomic_write

    def counting_write(path: str, *args: Any, **kwargs: Any) -> None:
        writes.append(os.path.basename(path))
        real_write(path, *args, **kwargs)

    monkeypatch.setattr(ipam_store, "atomic_write", counting_write)
    with NodeIpam(str(tmp_path), fsync=fsync) as node:
        node.set_leases([A])
        writes.clear()
        for i in range(100):
            node.allocate(f"c{i}", "eth0")
    assert len(writes) == 100, writes[:10]
    assert len(set(writes)) == 1  # the one subnet's file, replaced whole each time


# --- field-notes §2: churn on a /24 with a 30 s cooldown -------------------------


def churn(
    tmp_path: Path, period: float, seconds: float, wait: float = 0
) -> tuple[list[tuple[float, Accounting, str]], list[float]]:
    """110 pods on a /24; every ``period`` s one pod ends and one is added, for
    ``seconds`` of simulated time. Returns the failed ADDs (time, accounting at
    failure, message) and how long each successful ADD waited. Asserts on every
    ADD that no address is reused within the cooldown."""
    clock = FakeClock()
    released_at: dict[IPv4Address, float] = {}
    failures: list[tuple[float, Accounting, str]] = []
    waits: list[float] = []
    with open_ipam(tmp_path, clock, cooldown_seconds=30, wait_seconds=wait) as node:
        node.set_leases([A])
        pods: deque[str] = deque()
        pending: deque[str] = deque(f"p{i}" for i in range(110))
        serial = 110
        end = T0 + seconds
        while clock.now < end:
            while pending:
                pod = pending[0]
                before = clock.now
                try:
                    a = node.allocate(pod, "eth0")
                except IpamExhausted as e:
                    [acc] = node.accounting()
                    failures.append((clock.now, acc, str(e)))
                    break  # the kubelet retries this pod on the next tick
                waits.append(clock.now - before)
                last = released_at.get(a.ip)
                assert last is None or a.assigned_at - last >= 30, f"{a.ip} reused in cooldown"
                pods.append(pending.popleft())
            clock.now += period
            gone = pods.popleft()
            released = node.release(gone, "eth0")
            assert released is not None
            released_at[released.ip] = clock.now
            pending.append(f"p{serial}")
            serial += 1
        [acc] = node.accounting()
        assert acc.assigned + acc.cooling + acc.free == 253
    return failures, waits


def test_churn_200_pod_events_per_30s_never_fails(tmp_path: Path) -> None:
    # 100 DEL + 100 ADD per 30 s: at most 100 addresses cool at any time, so
    # 110 + 100 < 253 and no ADD may fail (the incident failed exactly here,
    # because cooling addresses were counted as available).
    failures, waits = churn(tmp_path, period=0.3, seconds=300)
    assert failures == []
    assert len(waits) > 110 + 990


def test_churn_beyond_capacity_fails_only_when_no_address_is_free(tmp_path: Path) -> None:
    # 200 DEL + 200 ADD per 30 s needs 110 + 200 = 310 addresses outside of
    # "free" while a /24 has 253: no allocator that honours a 30 s cooldown
    # can serve it. What must hold: an ADD fails only when every address is
    # assigned or cooling, and the message says so with the true numbers.
    failures, _ = churn(tmp_path, period=0.15, seconds=120)
    assert failures
    first = failures[0][0] - T0
    assert first >= (253 - 110) * 0.15 - 1e-6  # not before the free addresses ran out
    for _, acc, message in failures:
        assert acc.free == 0
        assert acc.assigned + acc.cooling == 253
        assert acc.next_free_in is not None and 0 < acc.next_free_in <= 30
        assert message == (
            f"no free address in 10.244.1.0/24: {acc.assigned} assigned, "
            f"{acc.cooling} cooling down (next free in {math.ceil(round(acc.next_free_in, 3))} s)"
        )


def test_churn_beyond_capacity_with_bounded_wait_never_fails(tmp_path: Path) -> None:
    # With ipWaitSeconds an ADD waits for the next cooling address instead of
    # failing. The free addresses run out at the 144th release (21.6 s); the
    # oldest cooling address, released at 0.15 s, frees at 30.15 s, so that
    # ADD waits 8.55 s (and, in this sequential replay, the churn with it).
    # The churn then runs at exactly what the pool sustains: 144 ADDs per
    # 30.15 s cycle (21.6 s of churn, one 8.55 s wait), and no ADD fails.
    failures, waits = churn(tmp_path, period=0.15, seconds=120, wait=10)
    assert failures == []
    waited = [i for i, w in enumerate(waits) if w > 0]
    assert [waits[i] for i in waited] == [pytest.approx(30.15 - 144 * 0.15, abs=1e-3)] * 4
    assert [b - a for a, b in itertools.pairwise(waited)] == [144] * 3


def test_tiny_pool_message_is_exact(tmp_path: Path, clock: FakeClock) -> None:
    with open_ipam(tmp_path, clock) as node:
        node.set_leases([TINY])
        for i in range(5):
            node.allocate(f"c{i}", "eth0")
        node.release("c3", "eth0")
        clock.now += 4
        node.release("c1", "eth0")
        clock.now += 7.5
        with pytest.raises(IpamExhausted) as caught:
            node.allocate("x", "eth0")
        assert str(caught.value) == (
            "no free address in 10.244.9.0/29: 3 assigned, 2 cooling down (next free in 19 s)"
        )


# --- a state machine against a simple model --------------------------------------

POOL_A = IPv4Network("10.0.0.0/29")  # .2-.6
POOL_B = IPv4Network("10.0.1.0/30")  # .2
COOLDOWN = 30.0
CIDS = st.sampled_from([f"c{i}" for i in range(8)])
IFNAMES = st.sampled_from(["eth0", "net1"])


class ModelPool:
    def __init__(self, subnet: IPv4Network) -> None:
        self.subnet = subnet
        self.usable = [subnet.network_address + i for i in range(2, subnet.num_addresses - 1)]
        self.ever: set[IPv4Address] = set()
        self.released: dict[IPv4Address, tuple[float, int]] = {}  # ip -> (at, seq)
        self.last: IPv4Address | None = None

    def choose(self, now: float) -> IPv4Address | None:
        fresh = [ip for ip in self.usable if ip not in self.ever]
        if fresh:
            after = [ip for ip in fresh if self.last is None or ip > self.last]
            return (after or fresh)[0]
        ready = [ip for ip, (at, _) in self.released.items() if at + COOLDOWN <= now]
        return min(ready, key=lambda ip: self.released[ip]) if ready else None


class IpamMachine(RuleBasedStateMachine):
    """allocate / release / advance clock / drain / restart, checked against a model
    that predicts the exact address each allocation returns."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="ipam-sm-")
        self.clock = FakeClock()
        self.ipam = self._open()
        self.pools = {s: ModelPool(s) for s in (POOL_A, POOL_B)}
        self.allocatable = [POOL_A, POOL_B]
        self.ipam.set_leases([POOL_A, POOL_B])
        self.assigned: dict[tuple[str, str], tuple[IPv4Network, IPv4Address]] = {}
        self.seq = 0

    def _open(self) -> NodeIpam:
        return NodeIpam(
            self.dir,
            cooldown_seconds=COOLDOWN,
            clock=self.clock,
            sleep=self.clock.sleep,
            fsync=False,
        )

    def teardown(self) -> None:
        self.ipam.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _cooling(self, pool: ModelPool) -> int:
        return sum(1 for at, _ in pool.released.values() if at + COOLDOWN > self.clock.now)

    @rule(cid=CIDS, ifname=IFNAMES)
    def allocate(self, cid: str, ifname: str) -> None:
        key = (cid, ifname)
        expected: tuple[IPv4Network, IPv4Address] | None = self.assigned.get(key)
        if expected is None:
            for subnet in self.allocatable:
                ip = self.pools[subnet].choose(self.clock.now)
                if ip is not None:
                    expected = (subnet, ip)
                    break
        if expected is None:
            with pytest.raises(IpamExhausted):
                self.ipam.allocate(cid, ifname)
            return
        a = self.ipam.allocate(cid, ifname)
        assert (a.subnet, a.ip) == expected
        pool = self.pools[a.subnet]
        if key not in self.assigned:
            assert a.ip not in {ip for _, ip in self.assigned.values()}, "assigned twice"
            released = pool.released.pop(a.ip, None)
            assert released is None or released[0] + COOLDOWN <= self.clock.now, (
                "reused in cooldown"
            )
            pool.ever.add(a.ip)
            pool.last = a.ip
            self.assigned[key] = expected

    @rule(keys=st.lists(st.tuples(CIDS, IFNAMES), min_size=1, max_size=7))
    def burst(self, keys: list[tuple[str, str]]) -> None:
        # Many ADDs in a row reach exhaustion and reuse far more often.
        for cid, ifname in keys:
            self.allocate(cid, ifname)

    @rule(cid=CIDS, ifname=IFNAMES)
    def release(self, cid: str, ifname: str) -> None:
        held = self.assigned.pop((cid, ifname), None)
        got = self.ipam.release(cid, ifname)
        if held is None:
            assert got is None
            return
        assert got is not None and (got.subnet, got.ip) == held
        self.seq += 1
        self.pools[held[0]].released[held[1]] = (self.clock.now, self.seq)

    @rule(seconds=st.sampled_from([0.0, 0.5, 1.0, 10.0, 29.5, 30.0, 31.0, 90.0]))
    def advance(self, seconds: float) -> None:
        self.clock.now += seconds

    @rule(allocatable=st.sampled_from([[POOL_A, POOL_B], [POOL_B], [POOL_A], []]))
    def drain(self, allocatable: list[IPv4Network]) -> None:
        self.allocatable = allocatable
        self.ipam.set_leases([POOL_A, POOL_B], allocatable=allocatable)

    @rule(subnet=st.sampled_from([POOL_A, POOL_B]))
    def remove_and_reacquire(self, subnet: IPv4Network) -> None:
        # The lease is released when empty and, later, the same subnet leased again.
        pool = self.pools[subnet]
        empty = self._cooling(pool) == 0 and all(s != subnet for s, _ in self.assigned.values())
        assert self.ipam.is_empty(subnet) == empty
        assert self.ipam.remove_lease_if_empty(subnet) == empty
        if empty:
            self.pools[subnet] = ModelPool(subnet)
        self.ipam.set_leases([POOL_A, POOL_B], allocatable=self.allocatable)

    @rule()
    def restart(self) -> None:
        self.ipam.close()
        self.ipam = self._open()
        self.ipam.set_leases([POOL_A, POOL_B], allocatable=self.allocatable)

    @precondition(lambda self: bool(self.assigned))
    @rule(data=st.data())
    def gc(self, data: st.DataObject) -> None:
        doomed = data.draw(st.sets(st.sampled_from(sorted(self.assigned))))
        released = self.ipam.gc(lambda a: (a.container_id, a.ifname) not in doomed)
        assert {(a.container_id, a.ifname) for a in released} == doomed
        # gc releases in address order, all at one instant.
        for key in sorted(doomed, key=lambda k: self.assigned[k][1]):
            subnet, ip = self.assigned.pop(key)
            self.seq += 1
            self.pools[subnet].released[ip] = (self.clock.now, self.seq)

    @invariant()
    def accounting_matches_model(self) -> None:
        got = {a.subnet: a for a in self.ipam.accounting()}
        for subnet, pool in self.pools.items():
            acc = got[subnet]
            assigned = sum(1 for s, _ in self.assigned.values() if s == subnet)
            cooling = self._cooling(pool)
            assert (acc.total, acc.assigned, acc.cooling) == (len(pool.usable), assigned, cooling)
            assert acc.free == acc.total - assigned - cooling
            assert (acc.next_free_in is None) == (cooling == 0)

    @invariant()
    def usage_matches_accounting(self) -> None:
        usage = self.ipam.usage()
        assert [u.subnet for u in usage] == [POOL_A, POOL_B]
        for u, acc in zip(usage, self.ipam.accounting(), strict=False):
            assert u == LeaseUsage.of(acc, u.subnet in self.allocatable)

    @invariant()
    def allocations_match_model(self) -> None:
        got = {(a.container_id, a.ifname): (a.subnet, a.ip) for a in self.ipam.allocations()}
        assert got == self.assigned
        assert len({ip for _, ip in got.values()}) == len(got)


TestIpamMachine = IpamMachine.TestCase
TestIpamMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None)


def test_an_operation_that_changed_nothing_waits_for_the_pending_changes_it_saw(
    tmp_path: Path,
) -> None:
    """An exhaustion or a found allocation rests on what memory shows; it is answered
    only once the changes of others it saw are on disk, never before."""
    store = IpamStore(tmp_path)
    subnet = IPv4Network("10.244.3.0/24")
    try:
        with store.locked():
            store.save(subnet, b"{}")  # another request's allocation, its batch not written
            theirs = store.take_ticket()
        with store.locked():  # ours: it reads the pool and changes nothing
            ours = store.take_ticket()
        assert theirs is not None and ours == theirs
        assert not (tmp_path / "10.244.3.0_24.json").exists()
        store.commit(ours)  # what our answer waits for: their write
        assert (tmp_path / "10.244.3.0_24.json").read_bytes() == b"{}"
        with store.locked():  # nothing pending any more: nothing to wait for
            assert store.take_ticket() is None
    finally:
        store.close()
