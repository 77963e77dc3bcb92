"""Address pools and warm capacity in both families (issue 31): IPv6 pools beside IPv4
ones, a dual-stack lease cut from one pool of each family, tags per family, and the
warm-capacity plan judged per family."""

from __future__ import annotations

import json
import random
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_network

import pytest

from flannelpy.config.netconf import NetworkConfig, parse_network_config
from flannelpy.errors import ConfigError, PoolExhausted
from flannelpy.ipam.capacity import CapacitySettings, LeaseUsage, plan_capacity
from flannelpy.subnet.choose import choose_lease, choose_new_subnet, lease_pools
from flannelpy.subnet.keys import KeyValue, pool_key, pools_prefix
from flannelpy.subnet.lease import Lease, LeaseAttrs
from flannelpy.subnet.pools import (
    Pool,
    PoolNetwork,
    assemble_pools,
    capacity,
    check_new_pool,
    eligibility,
    leasable_range,
    pool_record,
    records_to_pools,
)

ROLE = "flannelpy.io/role"
PREFIX = "/coreos.com/network"
V4_NET = IPv4Network("10.244.0.0/22")  # leasable: .1 .2 .3
V6_NET = IPv6Network("fd00:10::/62")  # leasable /64s: :1 :2 :3
V6_NEW = IPv6Network("fd00:20::/62")
V4_NEW = IPv4Network("10.250.0.0/22")


def config(**keys: object) -> NetworkConfig:
    return parse_network_config(json.dumps({"Backend": {"Type": "vxlan"}, **keys}))


DUAL = config(Network=str(V4_NET), EnableIPv6=True, IPv6Network=str(V6_NET))
V6_ONLY = config(EnableIPv4=False, EnableIPv6=True, IPv6Network=str(V6_NET))
V4_ONLY = config(Network=str(V4_NET))


def dual_pools(v6_primary_role: str | None = None, v6_new_role: str | None = "1") -> list[Pool]:
    return assemble_pools(
        DUAL,
        [
            Pool(V6_NET, {ROLE: v6_primary_role} if v6_primary_role else {}),
            Pool(V6_NEW, {ROLE: v6_new_role} if v6_new_role else {}, subnet_len=64),
        ],
    )


def v6_lease(v4: str | None, v6: str, ip: int = 9) -> Lease:
    who = LeaseAttrs(
        public_ip=IPv4Address(f"192.168.0.{ip}") if v4 else None,
        backend_type="vxlan",
        public_ipv6=IPv6Address(f"fd64::{ip}"),
    )
    return Lease(IPv4Network(v4) if v4 else None, who, ipv6_subnet=IPv6Network(v6))


def fill6(network: IPv6Network, first: int = 1) -> list[Lease]:
    """A lease on every /64 of ``network`` from its ``first``-th, IPv6 part only held."""
    return [
        v6_lease(None, str(s), 100 + i)
        for i, s in enumerate(network.subnets(new_prefix=64))
        if i >= first
    ]


# --- pools of both families ---------------------------------------------------------------


def test_the_config_gives_one_primary_pool_per_family_and_records_follow_by_family() -> None:
    v4_extra = Pool(V4_NEW, {ROLE: "1"}, subnet_len=24)
    records = [Pool(V6_NEW, {}, subnet_len=64), v4_extra, Pool(V6_NET, {ROLE: "0"})]
    pools = assemble_pools(DUAL, records)
    assert [(p.network, p.primary) for p in pools] == [
        (V4_NET, True),
        (V6_NET, True),
        (V4_NEW, False),
        (V6_NEW, False),
    ]
    assert pools[1].tags == {ROLE: "0"} and pools[1].subnet_len == 64  # the config's length
    only6 = assemble_pools(V6_ONLY, [])
    assert [(p.network, p.primary) for p in only6] == [(V6_NET, True)]


def test_an_ipv6_pool_record_round_trips_under_its_own_key() -> None:
    record = Pool(V6_NEW, {ROLE: "1"}, subnet_len=64)
    key = pool_key(PREFIX, V6_NEW)
    assert key == f"{PREFIX}/flannelpy/pools/fd00:20::-62"
    kv = KeyValue(key, pool_record(record, 64), 1)
    pools, ignored = records_to_pools(DUAL, [kv], PREFIX)
    assert ignored == [] and pools[-1] == record
    # A key that is not the record's canonical form is ignored with a reason.
    odd = KeyValue(pools_prefix(PREFIX) + "fd00:0020::-62", pool_record(record, 64), 1)
    _, ignored = records_to_pools(DUAL, [odd], PREFIX)
    assert len(ignored) == 1 and "canonical" in ignored[0]


@pytest.mark.parametrize(
    ("cfg", "cidr", "says"),
    [
        (V4_ONLY, "fd00:20::/48", "net-conf.json runs no IPv6; set EnableIPv6 and IPv6Network"),
        (V6_ONLY, "10.250.0.0/16", "net-conf.json runs no IPv4; set EnableIPv4 and Network"),
        (DUAL, "fd00:10::/48", "overlaps the primary pool (the config's IPv6Network) fd00:10::/62"),
        (DUAL, "fd00:10::/62", "is the primary pool (the config's IPv6Network)"),
        (DUAL, "fd00:20::/64", "too small for IPv6SubnetLen 64"),
    ],
)
def test_a_new_pool_is_checked_against_its_own_family(
    cfg: NetworkConfig, cidr: str, says: str
) -> None:
    with pytest.raises(ConfigError, match=says.replace("(", r"\(").replace(")", r"\)")):
        check_new_pool(ip_network(cidr), cfg, assemble_pools(cfg, []))


def test_an_ipv6_pool_beside_ipv4_ranges_is_accepted_and_leases_its_subnets() -> None:
    check_new_pool(V6_NEW, DUAL, assemble_pools(DUAL, []))
    check_new_pool(IPv6Network("fd00:30::/48"), V6_ONLY, assemble_pools(V6_ONLY, []))
    primary, extra = dual_pools()[1], dual_pools()[2]
    span = leasable_range(primary, DUAL)
    assert (span.first, span.length, span.count) == (IPv6Address("fd00:10:0:1::"), 64, 3)
    span = leasable_range(extra, DUAL)
    assert [span.subnet(i) for i in range(span.count)] == list(V6_NEW.subnets(new_prefix=64))[1:]


def test_capacity_counts_each_pool_in_its_own_family() -> None:
    leases = [
        v6_lease("10.244.1.0/24", "fd00:20:0:1::/64"),
        v6_lease("10.244.2.0/24", "fd00:10:0:2::/64", 8),
    ]
    caps = {c.pool.network: c for c in capacity(DUAL, dual_pools(), leases)}
    assert (caps[V4_NET].taken, caps[V4_NET].size) == (2, 3)
    assert (caps[V6_NET].taken, caps[V6_NET].leases) == (1, 1)
    assert (caps[V6_NEW].taken, caps[V6_NEW].leases) == (1, 1)


# --- choosing: one pool per family --------------------------------------------------------


def test_a_drained_ipv6_primary_sends_the_ipv6_half_to_the_opted_in_ipv6_pool() -> None:
    choice = choose_new_subnet(DUAL, dual_pools("0"), None, [], random.Random(1))
    assert choice.subnet is not None and choice.subnet.subnet_of(V4_NET)
    assert choice.pool.network == V4_NET
    assert choice.ipv6_subnet is not None and choice.ipv6_subnet.subnet_of(V6_NEW)
    assert choice.ipv6_pool is not None and choice.ipv6_pool.network == V6_NEW


def test_no_eligible_ipv6_pool_refuses_the_lease_naming_the_ipv6_pools() -> None:
    with pytest.raises(PoolExhausted) as err:
        choose_new_subnet(DUAL, dual_pools("0", None), None, [], random.Random(1))
    text = str(err.value)
    assert text.startswith("no IPv6 pool can take a new lease: ")
    assert "the primary pool fd00:10::/62 is tagged flannelpy.io/role=0 (draining)" in text
    assert "fd00:20::/62 has no flannelpy.io/role tag" in text
    assert text.endswith(
        "add a IPv6 pool (flannelpy pools add CIDR) and tag it flannelpy.io/role=1"
    )
    # A full IPv6 primary spills into the IPv6 pool, the IPv4 half stays in Network.
    spill = choose_new_subnet(DUAL, dual_pools(), None, fill6(V6_NET), random.Random(1))
    assert spill.ipv6_subnet is not None and spill.ipv6_subnet.subnet_of(V6_NEW)
    assert spill.subnet is not None and spill.subnet.subnet_of(V4_NET)


def test_the_previous_ipv6_subnet_is_kept_only_if_its_pool_takes_new_leases() -> None:
    me = LeaseAttrs(
        public_ip=IPv4Address("192.168.0.1"),
        backend_type="vxlan",
        public_ipv6=IPv6Address("fd64::1"),
    )
    prev4, prev6 = IPv4Network("10.244.2.0/24"), IPv6Network("fd00:10:0:2::/64")
    kept = choose_lease(
        DUAL, [], me, prev4, random.Random(1), pools=dual_pools(), previous_ipv6_subnet=prev6
    )
    assert (kept.subnet, kept.ipv6_subnet, kept.reason) == (prev4, prev6, "previous")
    moved = choose_lease(
        DUAL, [], me, prev4, random.Random(1), pools=dual_pools("0"), previous_ipv6_subnet=prev6
    )
    assert moved.subnet == prev4 and moved.reason == "previous"
    assert moved.ipv6_subnet is not None and moved.ipv6_subnet.subnet_of(V6_NEW)


def test_ipv6_only_leases_from_ipv6_pools() -> None:
    pools = assemble_pools(
        V6_ONLY, [Pool(V6_NET, {ROLE: "0"}), Pool(V6_NEW, {ROLE: "1"}, subnet_len=64)]
    )
    me = LeaseAttrs(public_ip=None, backend_type="vxlan", public_ipv6=IPv6Address("fd64::1"))
    choice = choose_lease(V6_ONLY, [], me, None, random.Random(1), pools=pools)
    assert choice.subnet is None and choice.ipv6_subnet is not None
    assert choice.ipv6_subnet.subnet_of(V6_NEW) and choice.pool == pools[1]
    # Our lease in the drained pool is still ours (fail open), kept on restart.
    mine = Lease(None, me, ipv6_subnet=IPv6Network("fd00:10:0:3::/64"))
    again = choose_lease(V6_ONLY, [mine], me, None, random.Random(1), pools=pools)
    assert (again.reason, again.ipv6_subnet, again.pool) == (
        "public-ip",
        mine.ipv6_subnet,
        pools[0],
    )


@pytest.mark.parametrize(
    ("v4", "v6", "expected"),
    [
        ("10.244.1.0/24", "fd00:10:0:1::/64", (V4_NET, V6_NET)),
        ("10.244.1.0/24", "fd00:20:0:3::/64", (V4_NET, V6_NEW)),
        ("10.244.1.0/24", "fd00:30:0:1::/64", None),  # its IPv6 half is in no pool
        ("10.244.1.0/24", None, None),  # dual stack needs both halves
        ("10.244.1.0/24", "fd00:20::/64", None),  # a pool's first subnet is not leasable
    ],
)
def test_a_dual_stack_lease_belongs_to_one_pool_per_family(
    v4: str, v6: str | None, expected: tuple[PoolNetwork, ...] | None
) -> None:
    found = lease_pools(DUAL, dual_pools(), IPv4Network(v4), IPv6Network(v6) if v6 else None)
    assert (tuple(p.network for p in found) if found else None) == expected


def test_a_drain_of_either_familys_pool_stops_the_lease_serving() -> None:
    pools = dual_pools("0")
    found = lease_pools(DUAL, pools, IPv4Network("10.244.1.0/24"), IPv6Network("fd00:10:0:1::/64"))
    assert found is not None
    assert [eligibility(p, None).allocate_addresses for p in found] == [True, False]


# --- warm capacity per family -------------------------------------------------------------

T0 = 1_700_000_000.0
A4, A6 = IPv4Network("10.244.1.0/24"), IPv6Network("fd00:10:0:1::/122")
B4, B6 = IPv4Network("10.244.2.0/24"), IPv6Network("fd00:10:0:2::/122")
WARM = CapacitySettings(min_free_addresses=16, max_leases_per_node=3, hold_down_seconds=60)


def part(
    subnet: PoolNetwork,
    lease: PoolNetwork,
    assigned: int = 0,
    cooling: int = 0,
    serving: bool = True,
) -> LeaseUsage:
    total = 253 if subnet.version == 4 else 61
    return LeaseUsage(subnet, total, assigned, cooling, total - assigned - cooling, serving, lease)


@pytest.mark.parametrize(
    ("usage", "acquire", "says"),
    [
        # IPv6 short, IPv4 roomy: another lease, for IPv6's sake
        (
            [part(A4, A4, 50), part(A6, A4, 50)],
            True,
            "11 free IPv6 addresses < MinFreeAddresses 16: acquire lease 2 of at most 3",
        ),
        # and the other way round
        (
            [part(A4, A4, 240), part(A6, A4, 10)],
            True,
            "13 free IPv4 addresses < MinFreeAddresses 16: acquire lease 2",
        ),
        # both have room
        ([part(A4, A4, 50), part(A6, A4, 40)], False, "203 free IPv4 and 21 free IPv6 addresses"),
        # the second lease's IPv6 room counts for IPv6
        (
            [part(A4, A4, 50), part(A6, A4, 61), part(B4, B4), part(B6, B4)],
            False,
            "nothing to do",
        ),
    ],
)
def test_the_plan_judges_each_family_on_its_own(
    usage: list[LeaseUsage], acquire: bool, says: str
) -> None:
    plan = plan_capacity(usage, WARM, T0, {})
    assert plan.acquire == acquire and plan.release == ()
    assert says in plan.reason


def test_a_dual_stack_lease_is_released_only_when_both_halves_are_empty() -> None:
    drained = [part(A4, A4, serving=False), part(A6, A4, 0, 1, serving=False)]
    serving = [part(B4, B4, 5), part(B6, B4, 5)]
    assert plan_capacity(drained + serving, WARM, T0, {}).release == ()
    cooled = [part(A4, A4, serving=False), part(A6, A4, serving=False)]
    plan = plan_capacity(cooled + serving, WARM, T0, {})
    assert plan.release == (A4,) and f"{A4} is draining and empty" in plan.reason


def test_a_surplus_lease_goes_only_if_every_family_keeps_the_minimum_without_it() -> None:
    long_ago: dict[PoolNetwork, float] = {B4: T0 - 100, B6: T0 - 100}
    # Without B, IPv6 would keep 11 free (< 16): B stays, though IPv4 has plenty.
    usage = [part(A4, A4, 5), part(A6, A4, 50), part(B4, B4), part(B6, B4)]
    assert plan_capacity(usage, WARM, T0, long_ago).release == ()
    roomy = [part(A4, A4, 5), part(A6, A4, 5), part(B4, B4), part(B6, B4)]
    plan = plan_capacity(roomy, WARM, T0, long_ago)
    assert plan.release == (B4,)
    assert "keeps 248 free IPv4 and 56 free IPv6 addresses without it" in plan.reason
    # One half empty only recently: the lease is empty as a whole since the later time.
    recent: dict[PoolNetwork, float] = {B4: T0 - 100, B6: T0 - 10}
    assert plan_capacity(roomy, WARM, T0, recent).release == ()
