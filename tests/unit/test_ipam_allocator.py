"""The pure per-lease allocator: address set, order, cooldown, accounting, messages, docs."""

from __future__ import annotations

import json
from ipaddress import IPv4Address, IPv4Interface, IPv4Network
from typing import Any

import pytest

from flannelpy.ipam.allocator import Accounting, PoolAllocator, exhaustion_message
from flannelpy.ipam.errors import IpamExhausted

T0 = 1_700_000_000.0
COOL = 30.0


def ip(text: str) -> IPv4Address:
    return IPv4Address(text)


def pool(subnet: str = "10.244.1.0/29", reserved: tuple[str, ...] = ()) -> PoolAllocator:
    return PoolAllocator(IPv4Network(subnet), [ip(r) for r in reserved])


def fill(p: PoolAllocator, n: int, now: float = T0, prefix: str = "c") -> list[IPv4Address]:
    return [p.allocate(f"{prefix}{i}", "eth0", now, COOL).ip for i in range(n)]


# --- the address set -----------------------------------------------------------


@pytest.mark.parametrize(
    ("subnet", "reserved", "total", "first"),
    [
        ("10.244.1.0/24", (), 253, "10.244.1.2"),  # .0 network, .1 gateway, .255 broadcast
        ("10.244.1.0/29", (), 5, "10.244.1.2"),
        ("10.244.1.0/29", ("10.244.1.2", "10.244.1.3"), 3, "10.244.1.4"),
        ("10.244.1.0/30", (), 1, "10.244.1.2"),
        ("10.244.1.0/31", (), 0, None),
        ("10.244.1.0/32", (), 0, None),
    ],
)
def test_usable_addresses(
    subnet: str, reserved: tuple[str, ...], total: int, first: str | None
) -> None:
    p = pool(subnet, reserved)
    assert p.accounting(T0, COOL) == Accounting(IPv4Network(subnet), total, 0, 0, total, None)
    if first is None:
        with pytest.raises(IpamExhausted):
            p.allocate("c", "eth0", T0, COOL)
    else:
        assert p.allocate("c", "eth0", T0, COOL).ip == ip(first)


def test_allocation_fields() -> None:
    a = pool("10.244.1.0/24").allocate("abc", "eth0", T0, COOL)
    assert (a.container_id, a.ifname, a.assigned_at) == ("abc", "eth0", T0)
    assert a.gateway == ip("10.244.1.1")
    assert a.interface == IPv4Interface("10.244.1.2/24")


# --- order ---------------------------------------------------------------------


def test_idempotent_for_same_container_and_ifname() -> None:
    p = pool()
    first = p.allocate("c", "eth0", T0, COOL)
    assert p.allocate("c", "eth0", T0 + 5, COOL) is first
    other_if = p.allocate("c", "net1", T0, COOL)
    assert other_if.ip != first.ip
    assert p.accounting(T0, COOL).assigned == 2


def test_never_used_addresses_before_released_ones() -> None:
    p = pool()  # .2 .. .6
    fill(p, 3)  # .2 .3 .4
    p.release("c0", "eth0", T0)  # .2 released long ago
    later = T0 + 1000
    # .5 and .6 were never used: they go first although .2 has cooled down.
    assert [p.allocate(f"n{i}", "eth0", later, COOL).ip for i in range(2)] == [
        ip("10.244.1.5"),
        ip("10.244.1.6"),
    ]
    assert p.allocate("n2", "eth0", later, COOL).ip == ip("10.244.1.2")


def test_round_robin_from_last_allocated() -> None:
    p = pool("10.244.1.0/24")
    fill(p, 5)  # .2 .. .6, last = .6
    doc = p.to_doc()
    # An address below the cursor that was never used (a hand-edited or older
    # state) is taken only after the ones above the cursor: round-robin wraps.
    doc["last"] = "10.244.1.250"
    q = PoolAllocator.from_doc(doc)
    assert [q.allocate(f"n{i}", "eth0", T0, COOL).ip for i in range(6)] == [
        ip("10.244.1.251"),
        ip("10.244.1.252"),
        ip("10.244.1.253"),
        ip("10.244.1.254"),
        ip("10.244.1.7"),  # wrapped past the broadcast, skipping .2-.6 (assigned)
        ip("10.244.1.8"),
    ]


def test_released_reused_least_recently_released_first_after_cooldown() -> None:
    p = pool()
    fill(p, 5)  # .2 .. .6, pool full
    for offset, cid in [(0, "c3"), (1, "c1"), (2, "c4")]:  # .5, .3, .6
        p.release(cid, "eth0", T0 + offset)
    with pytest.raises(IpamExhausted):
        p.allocate("x", "eth0", T0 + COOL - 0.001, COOL)  # .5 still cools
    assert p.allocate("x", "eth0", T0 + COOL, COOL).ip == ip("10.244.1.5")  # boundary: free
    assert p.allocate("y", "eth0", T0 + 100, COOL).ip == ip("10.244.1.3")
    assert p.allocate("z", "eth0", T0 + 100, COOL).ip == ip("10.244.1.6")


def test_same_release_time_keeps_release_order() -> None:
    p = pool()
    fill(p, 5)
    for cid in ["c4", "c0", "c2"]:  # .6 .2 .4, all at T0
        p.release(cid, "eth0", T0)
    got = [p.allocate(f"n{i}", "eth0", T0 + COOL, COOL).ip for i in range(3)]
    assert got == [ip("10.244.1.6"), ip("10.244.1.2"), ip("10.244.1.4")]


def test_zero_cooldown_reuses_at_once_but_never_used_still_first() -> None:
    p = pool()
    fill(p, 1)
    p.release("c0", "eth0", T0)
    assert p.allocate("n", "eth0", T0, 0).ip == ip("10.244.1.3")
    fill(p, 3, prefix="m")  # .4 .5 .6
    assert p.allocate("o", "eth0", T0, 0).ip == ip("10.244.1.2")


def test_clock_stepped_back_lengthens_cooldown_never_shortens() -> None:
    p = pool("10.244.1.0/30")  # one address
    p.allocate("c", "eth0", T0, COOL)
    p.release("c", "eth0", T0)
    earlier = T0 - 3600  # the wall clock was stepped back an hour
    acc = p.accounting(earlier, COOL)
    assert (acc.cooling, acc.free, acc.next_free_in) == (1, 0, 3600 + COOL)
    with pytest.raises(IpamExhausted):
        p.allocate("d", "eth0", earlier + 3600 + COOL - 1, COOL)


def test_release_unknown_returns_none_and_changes_nothing() -> None:
    p = pool()
    fill(p, 2)
    before = p.to_doc()
    assert p.release("nope", "eth0", T0) is None
    assert p.release("c0", "net1", T0) is None
    assert p.to_doc() == before


def test_negative_cooldown_is_refused() -> None:
    with pytest.raises(ValueError, match="cooldown"):
        pool().allocate("c", "eth0", T0, -1)


# --- accounting and messages ---------------------------------------------------


@pytest.mark.parametrize(
    ("releases", "now", "expected"),
    [
        # (release offsets of c0.., now offset) -> (assigned, cooling, free, next_free_in)
        ([], 0, (5, 0, 0, None)),
        ([0.0], 0, (4, 1, 0, 30.0)),
        ([0.0], 29.5, (4, 1, 0, 0.5)),
        ([0.0], 30, (4, 0, 1, None)),  # cooldown ends exactly at 30 s
        ([0.0, 10.0], 12, (3, 2, 0, 18.0)),
        ([0.0, 10.0], 35, (3, 1, 1, 5.0)),
        ([0.0, 10.0, 20.0], 100, (2, 0, 3, None)),
    ],
)
def test_accounting_never_counts_cooling_as_free(
    releases: list[float], now: float, expected: tuple[int, int, int, float | None]
) -> None:
    p = pool()
    fill(p, 5)
    for i, offset in enumerate(releases):
        p.release(f"c{i}", "eth0", T0 + offset)
    acc = p.accounting(T0 + now, COOL)
    assert (acc.assigned, acc.cooling, acc.free, acc.next_free_in) == expected
    assert acc.total == acc.assigned + acc.cooling + acc.free == 5


@pytest.mark.parametrize(
    ("accounting", "message"),
    [
        (
            [Accounting(IPv4Network("10.244.1.0/24"), 253, 200, 53, 0, 11.4)],
            "no free address in 10.244.1.0/24: 200 assigned, 53 cooling down (next free in 12 s)",
        ),
        (
            [Accounting(IPv4Network("10.244.1.0/24"), 253, 200, 53, 0, 12.0)],
            "no free address in 10.244.1.0/24: 200 assigned, 53 cooling down (next free in 12 s)",
        ),
        (  # never promise earlier than true: 0.2 s rounds up to 1 s
            [Accounting(IPv4Network("10.244.1.0/24"), 253, 252, 1, 0, 0.2)],
            "no free address in 10.244.1.0/24: 252 assigned, 1 cooling down (next free in 1 s)",
        ),
        (  # float noise does not add a second
            [Accounting(IPv4Network("10.244.1.0/24"), 253, 252, 1, 0, 12.0000000001)],
            "no free address in 10.244.1.0/24: 252 assigned, 1 cooling down (next free in 12 s)",
        ),
        (
            [Accounting(IPv4Network("10.244.1.0/24"), 253, 253, 0, 0, None)],
            "no free address in 10.244.1.0/24: 253 assigned, 0 cooling down",
        ),
        (
            [
                Accounting(IPv4Network("10.244.1.0/24"), 253, 200, 53, 0, 12.0),
                Accounting(IPv4Network("10.244.7.0/29"), 5, 5, 0, 0, None),
            ],
            "no free address in 10.244.1.0/24: 200 assigned, 53 cooling down (next free in 12 s)"
            "; 10.244.7.0/29: 5 assigned, 0 cooling down",
        ),
        (
            [],
            "no free address: this node holds no allocatable lease yet "
            "(the agent has not acquired its subnet lease, or every lease is draining)",
        ),
    ],
)
def test_exhaustion_message(accounting: list[Accounting], message: str) -> None:
    assert exhaustion_message(accounting) == message


def test_exhausted_error_says_exactly_what_is_true() -> None:
    p = pool("10.244.1.0/24")
    fill(p, 253)
    for i in range(53):
        p.release(f"c{i}", "eth0", T0 + i * 0.1)
    now = T0 + 5.3 + 18  # the first release (at T0) frees at T0 + 30: in 6.7 s
    with pytest.raises(IpamExhausted) as caught:
        p.allocate("new", "eth0", now, COOL)
    assert str(caught.value) == (
        "no free address in 10.244.1.0/24: 200 assigned, 53 cooling down (next free in 7 s)"
    )
    assert caught.value.exit_code == 6
    [acc] = caught.value.accounting
    assert (acc.total, acc.assigned, acc.cooling, acc.free) == (253, 200, 53, 0)
    assert acc.next_free_in == pytest.approx(6.7)


# --- documents -----------------------------------------------------------------


def test_doc_round_trip_resumes_exactly() -> None:
    p = pool("10.244.1.0/24")
    fill(p, 6)
    p.release("c2", "eth0", T0 + 1)
    p.release("c0", "eth0", T0 + 2)
    doc = p.to_doc()
    assert json.loads(p.to_json()) == doc
    assert doc["released"] == [
        {"ip": "10.244.1.4", "released_at": T0 + 1},
        {"ip": "10.244.1.2", "released_at": T0 + 2},
    ]
    q = PoolAllocator.from_doc(json.loads(json.dumps(doc)))
    assert q.to_doc() == doc
    assert q.allocations() == p.allocations()
    for now in (T0 + 3, T0 + 31.5, T0 + 40):
        assert q.accounting(now, COOL) == p.accounting(now, COOL)
    # Both continue identically: fresh .8 first, then .4 then .2 once cooled.
    later = T0 + 100
    got_p = [p.allocate(f"n{i}", "eth0", later, COOL).ip for i in range(249)]
    got_q = [q.allocate(f"n{i}", "eth0", later, COOL).ip for i in range(249)]
    assert got_p == got_q
    assert got_p[-2:] == [ip("10.244.1.4"), ip("10.244.1.2")]


def base_doc() -> dict[str, Any]:
    return {
        "version": 1,
        "subnet": "10.244.1.0/29",
        "last": "10.244.1.3",
        "allocations": [
            {"ip": "10.244.1.2", "container_id": "a", "ifname": "eth0", "assigned_at": T0},
        ],
        "released": [{"ip": "10.244.1.3", "released_at": T0}],
    }


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"version": 2}, "unsupported IPAM state version 2"),
        ({"subnet": "nonsense"}, "no valid subnet"),
        ({"allocations": {}}, "'allocations' is not a list"),
        (
            {
                "allocations": [
                    {"ip": "10.244.1.1", "container_id": "a", "ifname": "eth0", "assigned_at": T0}
                ]
            },
            "10.244.1.1 that is not an allocatable address of 10.244.1.0/29",
        ),
        (
            {
                "allocations": [
                    {"ip": "10.244.2.2", "container_id": "a", "ifname": "eth0", "assigned_at": T0}
                ]
            },
            "not an allocatable address",
        ),
        (
            {
                "allocations": [
                    {"ip": "10.244.1.2", "container_id": "a", "ifname": "eth0", "assigned_at": T0},
                    {"ip": "10.244.1.2", "container_id": "b", "ifname": "eth0", "assigned_at": T0},
                ]
            },
            "assigns 10.244.1.2 or its container twice",
        ),
        (
            {
                "allocations": [
                    {"ip": "10.244.1.2", "container_id": "a", "ifname": "eth0", "assigned_at": T0},
                    {"ip": "10.244.1.4", "container_id": "a", "ifname": "eth0", "assigned_at": T0},
                ]
            },
            "twice",
        ),
        (
            {"allocations": [{"ip": "10.244.1.4", "ifname": "eth0", "assigned_at": T0}]},
            "has no container_id",
        ),
        ({"released": [{"ip": "10.244.1.2", "released_at": T0}]}, "released 10.244.1.2 twice"),
        ({"released": [{"ip": "10.244.1.4", "released_at": "soon"}]}, "no numeric released_at"),
        ({"released": [{"ip": "10.244.1.4", "released_at": float("inf")}]}, "numeric"),
        ({"released": ["10.244.1.4"]}, "not an object"),
        ({"last": "x"}, "invalid last address"),
    ],
)
def test_from_doc_rejects_inconsistent_state(change: dict[str, Any], error: str) -> None:
    PoolAllocator.from_doc(base_doc())  # the base is valid
    with pytest.raises(ValueError, match=error):
        PoolAllocator.from_doc({**base_doc(), **change})


def test_from_doc_refuses_allocation_on_a_now_reserved_address() -> None:
    with pytest.raises(ValueError, match="not an allocatable address"):
        PoolAllocator.from_doc(base_doc(), reserved=[ip("10.244.1.2")])
