"""IPv6 pod addresses and dual-stack CNI results: pure allocation, the node's IPAM on
disk, and the result the handler builds (with a fake pod network)."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flannelpy.cni.add import build_result, pod_routes
from flannelpy.cni.spec import render_result
from flannelpy.ipam import NodeIpam, PoolAllocator
from flannelpy.ipam.allocator import Allocation
from flannelpy.ipam.errors import IpamExhausted
from flannelpy.ipam.store import pool_file_name
from tests.unit.test_cni_handler import POD_NS, Env, make_env

V4 = IPv4Network("10.244.1.0/24")
V6 = IPv6Network("fc00:0:0:1::/64")
TINY6 = IPv6Network("fc00:0:0:9::/125")  # 8 addresses: ::2 .. ::6 are allocatable


class Clock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


# --- the pure pool ---------------------------------------------------------------------


def test_a_slash_64_allocates_sequentially_and_counts_without_listing() -> None:
    pool = PoolAllocator(V6)
    got = [pool.allocate(f"c{i}", "eth0", 0.0, 30).ip for i in range(3)]
    assert got == [
        IPv6Address("fc00:0:0:1::2"),
        IPv6Address("fc00:0:0:1::3"),
        IPv6Address("fc00:0:0:1::4"),
    ]
    acc = pool.accounting(0.0, 30)
    assert acc.total == 2**64 - 3  # minus the network address, the gateway and the last one
    assert (acc.assigned, acc.cooling, acc.free) == (3, 0, 2**64 - 6)
    assert acc.describe() == "fc00:0:0:1::/64: 3 assigned, 0 cooling down"
    assert pool.allocate("c0", "eth0", 0.0, 30).ip == got[0]  # idempotent per key


def test_an_ipv6_pool_never_reuses_a_cooling_address_and_its_state_stays_bounded() -> None:
    pool = PoolAllocator(V6)
    seen: set[IPv6Address] = set()
    for i in range(2000):
        now = float(i)
        alloc = pool.allocate(f"c{i}", "eth0", now, cooldown=30)
        assert alloc.ip not in seen  # a /64 hands out fresh addresses long before reuse
        seen.add(alloc.ip)  # type: ignore[arg-type]
        pool.release(f"c{i}", "eth0", now)
        pool.forget_cooled(now, 30)
    # Only the addresses released in the last 30 s are remembered (as cooling).
    doc = pool.to_doc()
    assert len(doc["released"]) <= 31 and doc["allocations"] == []
    assert len(pool.to_json()) < 4000
    assert doc["last"] == str(V6.network_address + 2001)


def test_a_small_ipv6_pool_exhausts_with_its_cooldown_honestly() -> None:
    pool = PoolAllocator(TINY6)
    for i in range(5):
        pool.allocate(f"c{i}", "eth0", 0.0, 30)
    pool.release("c0", "eth0", 10.0)
    with pytest.raises(IpamExhausted, match=r"4 assigned, 1 cooling down \(next free in 30 s\)"):
        pool.allocate("new", "eth0", 10.0, 30)
    assert pool.allocate("new", "eth0", 40.0, 30).ip == IPv6Address("fc00:0:0:9::2")


def test_an_ipv6_pool_resumes_its_cursor_and_holds_from_its_document() -> None:
    pool = PoolAllocator(V6)
    for i in range(3):
        pool.allocate(f"c{i}", "eth0", 0.0, 30)
    pool.release("c1", "eth0", 5.0)
    again = PoolAllocator.from_doc(json.loads(pool.to_json()))
    assert again.allocations() == pool.allocations()
    assert again.allocate("next", "eth0", 6.0, 30).ip == IPv6Address("fc00:0:0:1::5")
    assert again.accounting(6.0, 30).cooling == 1
    with pytest.raises(ValueError, match="not an allocatable address"):
        PoolAllocator.from_doc(
            {
                **pool.to_doc(),
                "allocations": [
                    {"ip": "10.244.1.2", "container_id": "x", "ifname": "eth0", "assigned_at": 0}
                ],
            }
        )


_OPS = st.tuples(st.sampled_from(["alloc", "release", "hold"]), st.integers(0, 40))


@settings(max_examples=60, deadline=None)
@given(st.lists(_OPS, max_size=80))
def test_the_cursor_finds_what_a_scan_of_the_range_would(ops: list[tuple[str, int]]) -> None:
    """Bisection over the taken addresses agrees with walking a small range."""
    subnet = IPv6Network("fc00::/122")  # 64 addresses, allocatable ::2 .. ::3e
    pool = PoolAllocator(subnet, reserved=[IPv6Address("fc00::7")])
    taken = {7}
    last: int | None = None
    for op, n in ops:
        if op == "alloc":
            lo, hi = 2, 62
            start = lo if last is None or last >= hi else last + 1
            order = list(range(start, hi + 1)) + list(range(lo, start))
            expected = next((a for a in order if a not in taken), None)
            try:
                got = int(pool.allocate(f"c{n}", "eth0", 0.0, 1e9).ip) - int(subnet.network_address)
            except IpamExhausted:
                assert expected is None
                continue
            if got in taken:  # the key already had this address
                continue
            assert got == expected
            taken.add(got)
            last = got
        elif op == "release":
            pool.release(f"c{n}", "eth0", 0.0)  # stays taken: cooling for 1e9 s
        elif pool.hold(subnet.network_address + 2 + n, f"h{n}", "eth0"):
            taken.add(2 + n)


# --- the node's IPAM, both families ----------------------------------------------------


@pytest.fixture
def ipam(tmp_path: Path) -> Iterator[tuple[NodeIpam, Clock]]:
    clock = Clock()
    node = NodeIpam(str(tmp_path), fsync=False, clock=clock)
    node.set_leases([V4, V6])
    try:
        yield node, clock
    finally:
        node.close()


def test_one_address_per_family_on_disk_and_found_after_a_restart(
    ipam: tuple[NodeIpam, Clock], tmp_path: Path
) -> None:
    node, _ = ipam
    made = node.allocate_all("c1", "eth0")
    assert [str(a.interface) for a in made] == ["10.244.1.2/24", "fc00:0:0:1::2/64"]
    assert node.allocate_all("c1", "eth0") == made  # idempotent
    assert node.families() == [4, 6]
    assert sorted(os.listdir(tmp_path)) == sorted(["lock", pool_file_name(V4), pool_file_name(V6)])
    assert ":" not in pool_file_name(V6)
    with NodeIpam(str(tmp_path), fsync=False) as again:  # a SIGKILLed agent restarts
        assert again.find_all("c1", "eth0") == made
        again.set_leases([V4, V6])
        assert [str(a.ip) for a in again.allocate_all("c2", "eth0")] == [
            "10.244.1.3",
            "fc00:0:0:1::3",
        ]


def test_release_cools_both_families_and_the_ipv6_state_forgets_only_after_cooldown(
    ipam: tuple[NodeIpam, Clock], tmp_path: Path
) -> None:
    node, clock = ipam
    node.allocate_all("c1", "eth0")
    released = node.release("c1", "eth0")  # every family's; the IPv4 one is returned
    assert released is not None and released.ip == IPv4Address("10.244.1.2")
    assert node.find_all("c1", "eth0") == []
    cooling = {a.subnet: a.cooling for a in node.accounting()}
    assert cooling == {V4: 1, V6: 1}
    clock.now += 31
    node.allocate_all("c2", "eth0")  # writes the IPv6 pool again, past the cooldown
    doc = json.loads((tmp_path / pool_file_name(V6)).read_text())
    assert doc["released"] == []  # forgotten: its cooldown has passed
    doc4 = json.loads((tmp_path / pool_file_name(V4)).read_text())
    assert [r["ip"] for r in doc4["released"]] == ["10.244.1.2"]  # IPv4 keeps its history


def test_a_family_without_a_free_address_undoes_the_other(tmp_path: Path) -> None:
    with NodeIpam(str(tmp_path), fsync=False) as node:
        node.set_leases([V4, TINY6])
        for i in range(5):
            node.allocate_all(f"c{i}", "eth0")
        with pytest.raises(IpamExhausted, match="fc00:0:0:9::/125: 5 assigned"):
            node.allocate_all("late", "eth0")
        assert node.find_all("late", "eth0") == []  # its IPv4 address went back
        acc = {a.subnet: (a.assigned, a.cooling) for a in node.accounting()}
        assert acc[V4] == (5, 1)  # into cooldown, as any release


def test_warm_capacity_sees_each_family_and_the_low_free_watch_follows_the_family(
    tmp_path: Path,
) -> None:
    small6 = IPv6Network("fc00:0:0:9::/124")  # ::2 .. ::e: 13 addresses
    with NodeIpam(str(tmp_path), fsync=False) as node:
        node.set_leases([V6])
        assert node.families() == [6]
        (only,) = node.allocate_all("c1", "eth0")
        assert only.ip == IPv6Address("fc00:0:0:1::2")
        assert [(u.subnet, u.assigned) for u in node.usage()] == [(V6, 1)]
        node.set_leases([V4, small6])
        calls: list[int] = []
        node.set_low_free_watch(10, calls.append)
        for i in range(3):
            node.allocate_all(f"p{i}", "eth0")
        # IPv4 keeps 250 free; IPv6 falls to 12, 11, 10: not below 10 yet
        assert calls == []
        node.allocate_all("p3", "eth0")
        assert calls == [9]  # the IPv6 count, though IPv4 has room
        assert [(u.subnet, u.free) for u in node.usage()] == [(V4, 249), (small6, 9)]


TINY4 = IPv4Network("10.244.9.0/29")  # .2 .. .6 are allocatable (.1 is the gateway)


@pytest.mark.parametrize(
    ("leases", "full", "spare"),
    [((TINY4, V6), TINY4, V6), ((V4, TINY6), TINY6, V4)],
    ids=["ipv4-full", "ipv6-full"],
)
def test_each_familys_cooldown_holds_on_its_own_across_a_restart(
    tmp_path: Path,
    leases: tuple[IPv4Network | IPv6Network, ...],
    full: IPv4Network | IPv6Network,
    spare: IPv4Network | IPv6Network,
) -> None:
    clock = Clock()
    with NodeIpam(str(tmp_path), fsync=False, clock=clock) as node:
        node.set_leases(list(leases))
        made = {f"c{i}": node.allocate_all(f"c{i}", "eth0") for i in range(5)}
        node.release("c0", "eth0")
    gone = {a.subnet: a.ip for a in made["c0"]}
    clock.now += 29
    # A restarted agent: the cooldown of both of c0's addresses comes from disk.
    with NodeIpam(str(tmp_path), fsync=False, clock=clock) as node:
        node.set_leases(list(leases))
        # The full family's only candidate is c0's address, still cooling: no ADD, and
        # the spare family's new address goes back rather than leaking.
        with pytest.raises(IpamExhausted, match=rf"{full}: 4 assigned, 1 cooling down"):
            node.allocate_all("late", "eth0")
        assert node.find_all("late", "eth0") == []
        # One family alone: the spare one has fresh addresses and never re-uses c0's.
        (alone,) = [node.allocate("solo", "eth0", family=spare.version)]
        assert alone.ip != gone[spare]
        clock.now += 2  # c0 was released 31 s ago: past the 30 s cooldown
        late = {a.subnet: a.ip for a in node.allocate_all("late", "eth0")}
        assert late[full] == gone[full]  # the only address, cooled
        assert late[spare] != gone[spare]  # fresh ones come before any released one


# --- results -------------------------------------------------------------------------


def _allocs() -> list[Allocation]:
    return [
        Allocation(IPv4Address("10.244.1.5"), V4, "c1", "eth0", 0.0),
        Allocation(IPv6Address("fc00:0:0:1::5"), V6, "c1", "eth0", 0.0),
    ]


def test_pod_routes_go_via_their_familys_gateway() -> None:
    dsts = [IPv4Network("0.0.0.0/0"), IPv6Network("::/0"), IPv6Network("fc00::/48")]
    assert [(str(d), str(g)) for d, g in pod_routes(_allocs(), dsts)] == [
        ("0.0.0.0/0", "10.244.1.1"),
        ("::/0", "fc00:0:0:1::1"),
        ("fc00::/48", "fc00:0:0:1::1"),
    ]
    assert pod_routes(_allocs()[1:], dsts[:1]) == []  # IPv6-only: no IPv4 route


@pytest.mark.parametrize(
    ("version", "family_key"), [("1.1.0", None), ("1.0.0", None), ("0.4.0", ["4", "6"])]
)
def test_the_result_carries_both_families_in_every_version(
    version: str, family_key: list[str] | None
) -> None:
    allocs = _allocs()
    routes = pod_routes(allocs, [IPv4Network("0.0.0.0/0"), IPv6Network("::/0")])
    result = build_result(
        version,
        "veth1",
        "02:00:00:00:00:01",
        "eth0",
        "0a:58:0a:f4:01:05",
        POD_NS,
        allocs,
        routes,
        {},
    )
    doc = json.loads(render_result(result, version))
    assert [i.get("version") for i in doc["ips"]] == (family_key or [None, None])
    assert [(i["interface"], i["address"], i["gateway"]) for i in doc["ips"]] == [
        (1, "10.244.1.5/24", "10.244.1.1"),
        (1, "fc00:0:0:1::5/64", "fc00:0:0:1::1"),
    ]
    assert doc["routes"] == [
        {"dst": "0.0.0.0/0", "gw": "10.244.1.1"},
        {"dst": "::/0", "gw": "fc00:0:0:1::1"},
    ]
    assert doc["interfaces"][1] == {"name": "eth0", "mac": "0a:58:0a:f4:01:05", "sandbox": POD_NS}


@pytest.fixture
def env6(tmp_path: Any) -> Iterator[Env]:
    e = make_env(str(tmp_path))
    e.ipam.set_leases([V4, V6])
    e.handler.settings = dataclasses.replace(
        e.handler.settings, cluster_networks=lambda: (IPv4Network("10.244.0.0/16"),)
    )
    try:
        yield e
    finally:
        e.ipam.close()


def test_the_handler_plumbs_and_records_both_families(env6: Env) -> None:
    code, result = env6.call("ADD")
    assert code == 0
    assert [i["address"] for i in result["ips"]] == ["10.244.1.2/24", "fc00:0:0:1::2/64"]
    (call,) = [c for c in env6.pods.calls if c[0] == "add_pod"]
    assert call[4:6] == ("10.244.1.2/24,fc00:0:0:1::2/64", "10.244.1.1,fc00:0:0:1::1")
    assert {str(g) for g in env6.pods.bridges["cni0"]} == {"10.244.1.1/24", "fc00:0:0:1::1/64"}
    (record,) = env6.records.list()
    assert [str(a) for a in record.addresses] == ["10.244.1.2/24", "fc00:0:0:1::2/64"]
    assert env6.call("ADD") == (0, result)  # the record still describes it
    assert env6.call("DEL") == (0, None)
    assert env6.ipam.find_all("c1", "eth0") == []


def test_without_a_default_gateway_each_family_needs_its_cluster_network(env6: Env) -> None:
    code, err = env6.call("ADD", isDefaultGateway=False)
    assert (code, err["code"]) == (1, 11)
    assert err["msg"] == (
        "the flannelpy agent does not know the IPv6 cluster network yet; try again later"
    )
    env6.handler.settings = dataclasses.replace(
        env6.handler.settings,
        cluster_networks=lambda: (IPv4Network("10.244.0.0/16"), IPv6Network("fc00::/48")),
    )
    code, result = env6.call("ADD", isDefaultGateway=False)
    assert code == 0 and result["routes"] == [
        {"dst": "10.244.0.0/16", "gw": "10.244.1.1"},
        {"dst": "fc00::/48", "gw": "fc00:0:0:1::1"},
    ]


def test_the_lab_reads_both_families_from_an_add_result() -> None:
    from flannelpy_lab.pods import result_addresses
    from flannelpy_lab.state import PodInfo

    dual = {"ips": [{"address": "10.244.1.5/24"}, {"address": "fc00:0:0:1::5/64"}]}
    assert result_addresses(dual) == ("10.244.1.5/24", "fc00:0:0:1::5/64")
    assert result_addresses({"ips": [{"address": "fc00:0:0:1::5/64"}]}) == (
        None,
        "fc00:0:0:1::5/64",
    )
    assert result_addresses({"ips": [{"address": "bogus"}, 7]}) == (None, None)
    pod = PodInfo("n1-p1", "n1", "ns", "cid", address6="fc00:0:0:1::5/64")
    assert (pod.ip, pod.ip6) == (None, IPv6Address("fc00:0:0:1::5"))


def test_a_cursor_outside_the_range_restarts_at_its_first_address() -> None:
    doc = {**PoolAllocator(V6).to_doc(), "last": "fc00:0:0:2::9"}  # another subnet's
    pool = PoolAllocator.from_doc(doc)
    assert pool.allocate("c1", "eth0", 0.0, 30).ip == IPv6Address("fc00:0:0:1::2")
    with pytest.raises(ValueError, match="invalid last address"):
        PoolAllocator.from_doc({**doc, "last": "10.244.1.9"})


# --- a dual-stack Flannel node taken over: host-local's entries of both families -------


def test_host_locals_ipv6_entries_are_held_and_never_handed_out(tmp_path: Path) -> None:
    from flannelpy.ipam import hostlocal

    directory = tmp_path / "cbr0"
    directory.mkdir()
    (directory / "10.244.1.2").write_text("old\r\neth0")
    (directory / "fc00:0:0:1::2").write_text("old\r\neth0")
    (directory / "last_reserved_ip.1").write_text("fc00:0:0:1::2")
    found = hostlocal.within(hostlocal.read_dir(str(directory)), [V4, V6])
    assert [str(e.ip) for e in found] == ["10.244.1.2", "fc00:0:0:1::2"]
    with NodeIpam(str(tmp_path / "ipam"), fsync=False, host_local_dir=str(directory)) as node:
        node.set_leases([V4, V6])
        assert node.hold_foreign(found) == found
        assert [str(a.ip) for a in node.allocate_all("new", "eth0")] == [
            "10.244.1.3",
            "fc00:0:0:1::3",
        ]
        # The old pod's DEL frees both (into cooldown) and forgets them in host-local's dir.
        released = node.release("old", "eth0")
        assert released is not None and released.ip == IPv4Address("10.244.1.2")
        assert node.host_local_entries() == [
            hostlocal.HostLocalEntry(a.ip, "new", "eth0") for a in node.find_all("new", "eth0")
        ]
        assert sorted(os.listdir(directory)) == ["last_reserved_ip.1"]
        cooling = {a.subnet: a.cooling for a in node.accounting()}
        assert cooling == {V4: 1, V6: 1}


def test_check_of_a_dual_stack_pod_attached_before_the_take_over(env6: Env) -> None:
    from flannelpy.ipam.hostlocal import HostLocalEntry

    held = [
        HostLocalEntry(IPv4Address("10.244.1.7"), "old", "eth0"),
        HostLocalEntry(IPv6Address("fc00:0:0:1::7"), "old", "eth0"),
    ]
    env6.ipam.hold_foreign(held)
    sandbox = {"name": "eth0", "sandbox": POD_NS}
    prev: dict[str, Any] = {
        "cniVersion": "1.0.0",
        "interfaces": [{"name": "cni0"}, {"name": "veth1a2b3c4d"}, sandbox],
        "ips": [
            {"interface": 2, "address": "10.244.1.7/24", "gateway": "10.244.1.1"},
            {"interface": 2, "address": "fc00:0:0:1::7/64", "gateway": "fc00:0:0:1::1"},
        ],
    }
    assert env6.call("CHECK", cid="old", prevResult=prev) == (0, None)
    (call,) = [c for c in env6.pods.calls if c[0] == "check_pod"]
    assert [str(a) for a in call[5]] == ["10.244.1.7/24", "fc00:0:0:1::7/64"]
    assert [(str(d), str(g)) for d, g in call[6]] == [
        ("0.0.0.0/0", "10.244.1.1"),
        ("::/0", "fc00:0:0:1::1"),
    ]
    prev["ips"] = prev["ips"][:1]
    code, err = env6.call("CHECK", cid="old", prevResult=prev)
    assert (code, err["msg"]) == (
        1,
        "prevResult names 10.244.1.7/24, but IPAM holds fc00:0:0:1::7/64 for it",
    )
