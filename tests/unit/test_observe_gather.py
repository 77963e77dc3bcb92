"""``netlink_observe.gather``: a dump's entries as a set, the expected set itself when
they are exactly it, and always the same answer as the plain set of what was read."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network

import pytest

from flannelpy.dataplane.netlink_observe import gather
from flannelpy.dataplane.nlbatch import DumpInterrupted
from flannelpy.dataplane.state import Route


def route(i: int, gateway: int = 0) -> Route:
    subnet = IPv4Network(f"10.{i // 256}.{i % 256}.0/24")
    return Route(subnet, IPv4Address(int(subnet.network_address) + gateway), "flannel.1", True)


def reader(entries: list[Route]) -> tuple[list[int], object]:
    """A read that yields fresh objects equal to ``entries`` (as a dump does), counting
    how often it ran."""
    runs = [0]

    def read() -> Iterator[Route]:
        runs[0] += 1
        for r in entries:
            yield Route(r.dst, r.gateway, r.ifname, r.onlink)

    return runs, read


def test_the_kernel_as_expected_is_the_expected_set_itself() -> None:
    expected = frozenset(route(i) for i in range(50))
    runs, read = reader(sorted(expected, key=lambda r: r.dst))
    assert gather(read, expected) is expected  # type: ignore[arg-type]
    assert runs == [1]


def test_missing_extra_and_changed_entries_are_the_dump_s_truth() -> None:
    expected = frozenset(route(i) for i in range(50))
    kernel = [route(i) for i in range(50) if i not in (3, 7)] + [route(60), route(9, gateway=1)]
    runs, read = reader(kernel)
    assert gather(read, expected) == frozenset(kernel)  # type: ignore[arg-type]
    assert runs == [1]


def test_a_duplicate_does_not_hide_a_missing_entry() -> None:
    """Two kernel entries that read as one (two metrics of one route) count once."""
    expected = frozenset(route(i) for i in range(3))
    kernel = [route(0), route(0), route(1)]  # route(2) gone, as many entries as expected
    _, read = reader(kernel)
    assert gather(read, expected) == frozenset(kernel)  # type: ignore[arg-type]


def test_without_expectations_it_is_the_set_read() -> None:
    _, read = reader([route(1), route(2)])
    assert gather(read, None) == {route(1), route(2)}  # type: ignore[arg-type]


def test_an_interrupted_dump_is_read_again_from_the_start() -> None:
    expected = frozenset(route(i) for i in range(5))
    runs = [0]

    def read() -> Iterator[Route]:
        runs[0] += 1
        yield from (route(i) for i in range(4))  # the first read: one missing
        if runs[0] == 1:
            raise DumpInterrupted()
        yield route(4)

    assert gather(read, expected) is expected
    assert runs == [2]


@dataclass(frozen=True)
class Colliding:
    """Entries whose hashes collide in pairs (as distinct entries' hashes may, rarely)."""

    n: int

    def __hash__(self) -> int:
        return self.n // 2


def test_expected_entries_sharing_a_hash_are_read_again_without_it() -> None:
    expected = frozenset(Colliding(i) for i in range(6))
    kernel = [Colliding(i) for i in (0, 2, 3, 4, 5)]  # 1 gone; its hash is 0's
    runs = [0]

    def read() -> Iterator[Colliding]:
        runs[0] += 1
        return iter(kernel)

    assert gather(read, expected) == frozenset(kernel)  # type: ignore[arg-type,type-var]
    assert runs == [2]


@pytest.mark.parametrize("seed", range(40))
def test_always_the_plain_set_of_what_was_read(seed: int) -> None:
    rng = random.Random(seed)
    universe = [route(i, gateway=g) for i in range(30) for g in (0, 1)]
    expected = frozenset(rng.sample(universe, rng.randint(0, 40)))
    kernel = rng.sample(universe, rng.randint(0, 40))
    kernel += rng.sample(kernel, min(len(kernel), rng.randint(0, 3)))  # duplicates
    rng.shuffle(kernel)
    _, read = reader(kernel)
    assert gather(read, expected) == frozenset(kernel)  # type: ignore[arg-type]
