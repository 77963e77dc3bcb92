"""Subnet choice: Flannel's acquire order plus the node-name takeover."""

from __future__ import annotations

import json
import random
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flannelpy.config.netconf import NetworkConfig, parse_network_config
from flannelpy.errors import PoolExhausted
from flannelpy.subnet.choose import (
    LeaseChoice,
    PoolChoice,
    candidate_subnets,
    choose_lease,
    choose_new_subnet,
    lease_fits,
    lease_fits_pools,
)
from flannelpy.subnet.lease import Lease, LeaseAttrs
from flannelpy.subnet.pools import Pool, eligibility, leasable_range

NET16 = parse_network_config('{"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan"}}')


def net(text: str) -> IPv4Network:
    return IPv4Network(text)


def attrs(ip: str, node: str | None = None) -> LeaseAttrs:
    return LeaseAttrs(public_ip=IPv4Address(ip), backend_type="vxlan", node_name=node)


def lease(subnet: str, ip: str, node: str | None = None, v6: str | None = None) -> Lease:
    return Lease(
        subnet=net(subnet),
        attrs=attrs(ip, node),
        ipv6_subnet=IPv6Network(v6) if v6 else None,
        revision=7,
        store_lease_id=1,
    )


def config(**keys: object) -> NetworkConfig:
    return parse_network_config(json.dumps({"Backend": {"Type": "vxlan"}, **keys}))


def choose(
    cfg: NetworkConfig,
    leases: list[Lease],
    me: LeaseAttrs,
    previous: str | None = None,
    seed: int = 1,
    gone: bool = True,
) -> LeaseChoice:
    """``gone``: whether a lease's holder is proven gone (the manager asks etcd)."""
    return choose_lease(
        cfg,
        leases,
        me,
        net(previous) if previous else None,
        random.Random(seed),
        holder_gone=lambda _: gone,
    )


@pytest.mark.parametrize(
    ("subnet", "fits"),
    [
        ("10.244.1.0/24", True),
        ("10.244.255.0/24", True),
        ("10.244.0.0/24", False),  # below SubnetMin: Flannel skips the first subnet
        ("10.245.1.0/24", False),  # outside Network
        ("10.244.1.0/25", False),  # wrong SubnetLen
        ("10.244.0.0/16", False),
    ],
)
def test_lease_fits_default_range(subnet: str, fits: bool) -> None:
    assert lease_fits(NET16, net(subnet)) is fits


def test_lease_fits_respects_explicit_min_max() -> None:
    cfg = config(Network="10.244.0.0/16", SubnetMin="10.244.10.0", SubnetMax="10.244.20.0")
    assert lease_fits(cfg, net("10.244.10.0/24"))
    assert lease_fits(cfg, net("10.244.20.0/24"))
    assert not lease_fits(cfg, net("10.244.9.0/24"))
    assert not lease_fits(cfg, net("10.244.21.0/24"))


def test_lease_fits_dual_stack_needs_both_families() -> None:
    cfg = config(
        Network="10.244.0.0/16", EnableIPv6=True, IPv6Network="fd00:10:244::/56"
    )  # IPv6SubnetLen 64
    assert lease_fits(cfg, net("10.244.1.0/24"), IPv6Network("fd00:10:244:1::/64"))
    assert not lease_fits(cfg, net("10.244.1.0/24"))
    assert not lease_fits(cfg, net("10.244.1.0/24"), IPv6Network("fd00:99::/64"))
    # And a dual-stack lease no longer fits once IPv6 is switched off (as in Flannel).
    assert not lease_fits(NET16, net("10.244.1.0/24"), IPv6Network("fd00:10:244:1::/64"))


def test_reuses_the_lease_with_our_public_ip() -> None:
    mine = lease("10.244.7.0/24", "192.168.1.5")
    leases = [lease("10.244.3.0/24", "192.168.1.4"), mine]
    choice = choose(NET16, leases, attrs("192.168.1.5"), previous="10.244.9.0/24")
    assert (choice.subnet, choice.reason, choice.existing, choice.delete) == (
        net("10.244.7.0/24"),
        "public-ip",
        mine,
        (),
    )


def test_our_lease_outside_the_config_is_deleted_and_a_new_one_chosen() -> None:
    old = lease("10.5.7.0/24", "192.168.1.5")  # the Network changed since
    choice = choose(NET16, [old], attrs("192.168.1.5"))
    assert choice.delete == (old,)
    assert choice.existing is None
    assert lease_fits(NET16, choice.subnet)


def test_takes_over_the_lease_of_our_node_name_when_our_address_changed() -> None:
    old = lease("10.244.7.0/24", "192.168.1.5", node="node-a")
    other = lease("10.244.8.0/24", "192.168.1.6", node="node-b")
    choice = choose(NET16, [other, old], attrs("192.168.1.99", node="node-a"))
    assert (choice.subnet, choice.reason, choice.existing) == (
        net("10.244.7.0/24"),
        "node-name",
        old,
    )


def test_a_live_holder_of_our_node_name_keeps_its_lease_and_is_reported() -> None:
    # Two live nodes with one name (the host name by default) must not take one
    # lease from each other: the newcomer gets a free subnet and the conflict.
    old = lease("10.244.7.0/24", "192.168.1.5", node="node-a")
    choice = choose(NET16, [old], attrs("192.168.1.99", node="node-a"), gone=False)
    assert (choice.reason, choice.existing, choice.delete, choice.name_conflict) == (
        "free",
        None,
        (),
        old,
    )
    assert not choice.subnet.overlaps(old.subnet)


def test_a_live_holder_of_our_node_name_keeps_even_its_previous_subnet() -> None:
    old = lease("10.244.7.0/24", "192.168.1.5", node="node-a")
    choice = choose(
        NET16, [old], attrs("192.168.1.99", node="node-a"), previous="10.244.7.0/24", gone=False
    )
    assert choice.subnet != old.subnet and choice.name_conflict == old


def test_the_default_never_takes_over_by_name() -> None:
    old = lease("10.244.7.0/24", "192.168.1.5", node="node-a")
    choice = choose_lease(
        NET16, [old], attrs("192.168.1.99", node="node-a"), None, random.Random(1)
    )
    assert choice.existing is None and choice.name_conflict == old


def test_a_live_holder_of_our_node_name_in_a_pool_is_reported() -> None:
    old = lease("10.250.3.0/24", "192.168.1.5", node="node-a")
    choice = choose_in(TWO_POOLS, [old], attrs("192.168.1.99", node="node-a"), gone=False)
    assert (choice.existing, choice.name_conflict) == (None, old)


def test_public_ip_match_wins_over_node_name_match() -> None:
    by_ip = lease("10.244.7.0/24", "192.168.1.5")
    by_name = lease("10.244.8.0/24", "192.168.1.6", node="node-a")
    choice = choose(NET16, [by_name, by_ip], attrs("192.168.1.5", node="node-a"))
    assert choice.existing is by_ip


def test_node_name_none_never_matches_leases_without_a_name() -> None:
    anonymous = lease("10.244.7.0/24", "192.168.1.6")  # written by flanneld: no NodeName
    choice = choose(NET16, [anonymous], attrs("192.168.1.5"))
    assert choice.existing is None
    assert choice.subnet != anonymous.subnet


def test_reuses_the_previous_subnet_when_free() -> None:
    choice = choose(
        NET16,
        [lease("10.244.3.0/24", "192.168.1.4")],
        attrs("192.168.1.5"),
        previous="10.244.42.0/24",
    )
    assert (choice.subnet, choice.reason, choice.existing) == (
        net("10.244.42.0/24"),
        "previous",
        None,
    )


@pytest.mark.parametrize(
    "previous",
    [
        "10.244.3.0/24",  # taken by another node
        "10.99.3.0/24",  # outside Network
        "10.244.0.0/24",  # below SubnetMin
    ],
)
def test_previous_subnet_is_skipped_when_taken_or_out_of_range(previous: str) -> None:
    taken = lease("10.244.3.0/24", "192.168.1.4")
    choice = choose(NET16, [taken], attrs("192.168.1.5"), previous=previous)
    assert choice.reason == "free"
    assert choice.subnet != net(previous)


def test_random_pick_is_among_the_first_100_free_subnets() -> None:
    taken = [lease(f"10.244.{i}.0/24", f"192.168.2.{i}") for i in range(1, 11)]
    picks = {choose(NET16, taken, attrs("192.168.1.5"), seed=s).subnet for s in range(200)}
    first_free = [net(f"10.244.{i}.0/24") for i in range(11, 111)]
    assert picks <= set(first_free)
    assert len(picks) > 20  # random, so nodes starting together rarely collide


def test_a_lease_of_another_length_blocks_the_subnets_it_overlaps() -> None:
    cfg = config(Network="10.244.0.0/22", SubnetLen=24)  # candidates .1 .2 .3
    wide = lease("10.244.2.0/23", "192.168.2.1")  # covers .2 and .3
    narrow = lease("10.244.1.128/25", "192.168.2.2")  # inside .1
    with pytest.raises(PoolExhausted):
        choose(cfg, [wide, narrow], attrs("192.168.1.5"))
    choice = choose(cfg, [wide], attrs("192.168.1.5"))
    assert choice.subnet == net("10.244.1.0/24")


def test_full_pool_raises_pool_exhausted_with_a_clear_sentence() -> None:
    taken = [lease(f"10.244.{i}.0/24", f"192.168.{i}.1") for i in range(1, 256)]
    with pytest.raises(PoolExhausted) as err:
        choose(NET16, taken, attrs("192.168.100.100"))
    assert str(err.value) == (
        "no free subnet in 10.244.0.0/16: all 255 subnets of length /24 between 10.244.1.0 "
        "and 10.244.255.0 are leased; free some leases or enlarge Network"
    )


def test_deleted_stale_lease_frees_its_subnet_for_the_new_choice() -> None:
    # SubnetLen changed from /23 to /24: our old /23 no longer fits and is deleted, so the
    # /24s it covered are free again.
    cfg = config(Network="10.244.0.0/22", SubnetLen=24)
    old = lease("10.244.2.0/23", "192.168.1.5")
    others = [lease("10.244.1.0/24", "192.168.2.1")]
    choice = choose(cfg, [old, *others], attrs("192.168.1.5"))
    assert choice.delete == (old,)
    assert choice.subnet in {net("10.244.2.0/24"), net("10.244.3.0/24")}


DUAL = config(
    Network="10.244.0.0/16",
    EnableIPv6=True,
    IPv6Network="fd00:10:244::/56",
    IPv6SubnetMax="fd00:10:244:3::",
)


def test_dual_stack_picks_the_ipv6_subnet_on_its_own() -> None:
    # Flannel picks the IPv6 subnet independently of the IPv4 one: with the first IPv6
    # subnets held (by a flanneld node's random pick), a new lease still gets a free one.
    held = [
        lease("10.244.9.0/24", "192.168.1.9", v6="fd00:10:244:1::/64"),
        lease("10.244.8.0/24", "192.168.1.8", v6="fd00:10:244:2::/64"),
    ]
    picks = {choose(DUAL, held, attrs("192.168.1.5"), seed=s).ipv6_subnet for s in range(20)}
    assert picks == {IPv6Network("fd00:10:244:3::/64")}
    v4_picks = {choose(DUAL, held, attrs("192.168.1.5"), seed=s).subnet for s in range(20)}
    assert len(v4_picks) > 1  # the IPv4 pick stays random over its whole range


def test_dual_stack_keeps_both_previous_subnets() -> None:
    choice = choose_lease(
        DUAL,
        [],
        attrs("192.168.1.5"),
        net("10.244.5.0/24"),
        random.Random(1),
        previous_ipv6_subnet=IPv6Network("fd00:10:244:2::/64"),
    )
    assert (choice.reason, choice.subnet, choice.ipv6_subnet) == (
        "previous",
        net("10.244.5.0/24"),
        IPv6Network("fd00:10:244:2::/64"),
    )
    # A previous IPv6 subnet another node took meanwhile: a fresh one, the IPv4 kept.
    taken = [lease("10.244.9.0/24", "192.168.1.9", v6="fd00:10:244:2::/64")]
    choice = choose_lease(
        DUAL,
        taken,
        attrs("192.168.1.5"),
        net("10.244.5.0/24"),
        random.Random(1),
        previous_ipv6_subnet=IPv6Network("fd00:10:244:2::/64"),
    )
    assert choice.subnet == net("10.244.5.0/24")
    assert choice.ipv6_subnet in {
        IPv6Network("fd00:10:244:1::/64"),
        IPv6Network("fd00:10:244:3::/64"),
    }


def test_dual_stack_out_of_ipv6_subnets_is_said() -> None:
    held = [
        lease(f"10.244.{i}.0/24", f"192.168.1.{i}", v6=f"fd00:10:244:{i}::/64") for i in (1, 2, 3)
    ]
    with pytest.raises(PoolExhausted, match="no free IPv6 subnet in fd00:10:244::/56"):
        choose(DUAL, held, attrs("192.168.1.5"))


def test_reused_dual_lease_without_ipv6_is_replaced() -> None:
    # A lease of ours from an IPv4-only run does not fit a dual-stack config (Flannel).
    old = lease("10.244.7.0/24", "192.168.1.5")
    choice = choose(DUAL, [old], attrs("192.168.1.5"))
    assert choice.delete == (old,)
    assert choice.ipv6_subnet is not None


def test_ipv6_only_config_leases_an_ipv6_subnet_alone() -> None:
    cfg = config(EnableIPv4=False, EnableIPv6=True, IPv6Network="fd00:10:244::/56")
    me = LeaseAttrs(public_ip=None, backend_type="vxlan", public_ipv6=IPv6Address("fd00:64::5"))
    other = LeaseAttrs(public_ip=None, backend_type="vxlan", public_ipv6=IPv6Address("fd00:64::6"))
    held = Lease(None, other, ipv6_subnet=IPv6Network("fd00:10:244:1::/64"))
    choice = choose(cfg, [held], me)
    assert choice.subnet is None and choice.reason == "free"
    assert choice.ipv6_subnet is not None and choice.ipv6_subnet.prefixlen == 64
    assert choice.ipv6_subnet != held.ipv6_subnet
    # Another IPv6-only node's lease is not ours (no PublicIP on either side): ours is
    # recognised by PublicIPv6, and kept on restart.
    mine = Lease(None, me, ipv6_subnet=IPv6Network("fd00:10:244:7::/64"))
    again = choose(cfg, [held, mine], me)
    assert (again.reason, again.ipv6_subnet) == ("public-ip", mine.ipv6_subnet)
    # With pools: the IPv6 primary alone leases as without them.
    pooled = choose_lease(cfg, [held], me, None, random.Random(1), pools=[])
    assert pooled.subnet is None and pooled.ipv6_subnet is not None
    assert pooled.pool is not None and pooled.pool.network == cfg.ipv6_network


# --- property: whatever the store holds, the choice is valid -----------------

SMALL = config(Network="10.244.0.0/20", SubnetLen=24)  # 15 candidates: pools fill up


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[Lease], LeaseAttrs, IPv4Network | None, int]:
    third_octets = draw(st.lists(st.integers(0, 20), unique=True, max_size=16))
    leases = [
        lease(
            f"10.244.{o}.0/24",
            f"192.168.0.{draw(st.integers(1, 6))}",
            node=draw(st.sampled_from([None, "a", "b", "c"])),
        )
        for o in third_octets
    ]
    me = attrs(f"192.168.0.{draw(st.integers(1, 6))}", draw(st.sampled_from([None, "a", "z"])))
    previous = draw(st.none() | st.integers(0, 20).map(lambda o: net(f"10.244.{o}.0/24")))
    return leases, me, previous, draw(st.integers(0, 2**32))


@settings(max_examples=300, deadline=None)
@given(scenarios())
def test_choice_is_always_inside_the_range_aligned_and_not_held_by_another(
    scenario: tuple[list[Lease], LeaseAttrs, IPv4Network | None, int],
) -> None:
    leases, me, previous, seed = scenario
    try:
        choice = choose_lease(SMALL, leases, me, previous, random.Random(seed))
    except PoolExhausted:
        # Only when every candidate is held by a lease that is not ours to reuse.
        free = [
            v4
            for v4 in candidate_subnets(SMALL)
            if all(not held.subnet.overlaps(v4) for held in leases)
        ]
        assert free == []
        assert all(
            not (h.attrs.public_ip == me.public_ip and lease_fits(SMALL, h.subnet)) for h in leases
        )
        return
    subnet = choice.subnet
    assert SMALL.network is not None
    assert subnet.subnet_of(SMALL.network)
    assert subnet.prefixlen == SMALL.subnet_len
    assert int(subnet.network_address) % (1 << (32 - SMALL.subnet_len)) == 0
    assert SMALL.subnet_min <= subnet.network_address <= SMALL.subnet_max
    deleted = {id(d) for d in choice.delete}
    holders = [h for h in leases if h.subnet.overlaps(subnet) and id(h) not in deleted]
    if choice.existing is None:
        assert holders == []
    else:
        assert holders == [choice.existing]
        assert choice.existing.attrs.public_ip == me.public_ip or (
            me.node_name is not None and choice.existing.attrs.node_name == me.node_name
        )
    for stale in choice.delete:  # only ever our own leases are deleted
        assert stale.attrs.public_ip == me.public_ip or stale.attrs.node_name == me.node_name
        assert not lease_fits(SMALL, stale.subnet)


# --- several pools (field-notes §3) --------------------------------------------------------

ROLE = "flannelpy.io/role"


def pool(cidr: str, primary: bool = False, **tags: str) -> Pool:
    keyed = {
        ROLE if k == "role" else f"flannelpy.io/cluster/{k[len('cluster_') :]}": v
        for k, v in tags.items()
    }
    return Pool(net(cidr), keyed, primary, 24)


def fill(cidr: str, first: int = 1) -> list[Lease]:
    """A lease on every /24 of ``cidr`` from its ``first``-th subnet."""
    network = net(cidr)
    return [
        lease(str(s), f"192.168.{i // 250}.{i % 250 + 1}")
        for i, s in enumerate(network.subnets(new_prefix=24))
        if i >= first
    ]


SMALL_PRIMARY = config(Network="10.244.0.0/22")  # leasable: .1 .2 .3


def new_subnet(
    pools: list[Pool],
    leases: list[Lease],
    cluster: str | None = None,
    cfg: NetworkConfig = SMALL_PRIMARY,
    seed: int = 1,
) -> PoolChoice:
    return choose_new_subnet(cfg, pools, cluster, leases, random.Random(seed))


def test_new_subnet_comes_from_the_primary_pool_first() -> None:
    pools = [pool("10.250.0.0/22", role="1"), pool("10.244.0.0/22", primary=True)]
    picks = {new_subnet(pools, [], seed=s).subnet for s in range(50)}
    assert picks == {net("10.244.1.0/24"), net("10.244.2.0/24"), net("10.244.3.0/24")}
    assert new_subnet(pools, []).pool.primary


def test_without_pools_the_config_network_is_the_primary_pool() -> None:
    taken = [lease(f"10.244.{i}.0/24", f"192.168.2.{i}") for i in range(1, 11)]
    picks = {choose_new_subnet(NET16, [], None, taken, random.Random(s)).subnet for s in range(200)}
    assert picks <= {net(f"10.244.{i}.0/24") for i in range(11, 111)}  # Flannel's 100
    assert len(picks) > 20


def test_a_full_primary_overflows_into_opted_in_pools_in_cidr_order() -> None:
    pools = [
        pool("10.244.0.0/22", primary=True),
        pool("10.252.0.0/22", role="1"),
        pool("10.250.0.0/22", role="1"),
        pool("10.248.0.0/22"),  # untagged: first in CIDR order, but never used for new leases
    ]
    choice = new_subnet(pools, fill("10.244.0.0/22"))
    assert choice.pool.network == net("10.250.0.0/22")
    assert choice.subnet in {net("10.250.1.0/24"), net("10.250.2.0/24"), net("10.250.3.0/24")}
    # 10.250 full too: the next opted-in pool.
    choice = new_subnet(pools, fill("10.244.0.0/22") + fill("10.250.0.0/22"))
    assert choice.pool.network == net("10.252.0.0/22")


def test_the_random_pick_stays_within_the_first_100_free_of_the_pool() -> None:
    pools = [pool("10.244.0.0/22", primary=True), pool("10.250.0.0/16", role="1")]
    held = [*fill("10.244.0.0/22"), lease("10.250.5.0/24", "192.168.9.9")]
    picks = {new_subnet(pools, held, seed=s).subnet for s in range(300)}
    first_free = {net(f"10.250.{i}.0/24") for i in range(1, 102) if i != 5}
    assert picks <= first_free
    assert len(picks) > 30


def test_a_primary_tagged_0_takes_nothing_new() -> None:
    pools = [pool("10.244.0.0/22", primary=True, role="0"), pool("10.250.0.0/22", role="1")]
    assert new_subnet(pools, []).pool.network == net("10.250.0.0/22")


@pytest.mark.parametrize(
    ("cluster", "expected"),
    [("a", "10.250.0.0/22"), ("b", "10.252.0.0/22"), (None, "10.252.0.0/22")],
)
def test_a_cluster_scoped_pool_serves_only_its_cluster(cluster: str | None, expected: str) -> None:
    pools = [
        pool("10.244.0.0/22", primary=True),
        pool("10.250.0.0/22", role="1", cluster_a="true"),
        pool("10.252.0.0/22", role="1"),  # no scope: shared by every cluster
    ]
    assert new_subnet(pools, fill("10.244.0.0/22"), cluster).pool.network == net(expected)


def test_a_lease_anywhere_blocks_what_it_overlaps_in_every_pool() -> None:
    pools = [pool("10.244.0.0/22", primary=True), pool("10.250.0.0/22", role="1")]
    wide = lease("10.250.0.0/23", "192.168.7.7")  # covers 10.250.1.0/24
    picks = {new_subnet(pools, [*fill("10.244.0.0/22"), wide], seed=s).subnet for s in range(50)}
    assert picks == {net("10.250.2.0/24"), net("10.250.3.0/24")}


def test_exhaustion_names_every_pool_and_why() -> None:
    pools = [
        pool("10.244.0.0/22", primary=True),
        pool("10.250.0.0/22"),
        pool("10.251.0.0/22", role="0"),
        pool("10.252.0.0/22", role="1", cluster_b="true"),
        pool("10.253.0.0/22", role="yes"),
        pool("10.254.0.0/22", role="1"),
    ]
    with pytest.raises(PoolExhausted) as err:
        new_subnet(pools, fill("10.244.0.0/22") + fill("10.254.0.0/22"), cluster="a")
    assert str(err.value) == (
        "no pool can take a new lease: "
        "10.244.0.0/22 is full (all 3 /24 subnets leased); "
        "10.250.0.0/22 has no flannelpy.io/role tag (untagged pools take no new leases); "
        "10.251.0.0/22 is tagged flannelpy.io/role=0 (draining); "
        "10.252.0.0/22 belongs to cluster(s) b, not a; "
        "10.253.0.0/22 has flannelpy.io/role='yes', which is neither 1 nor 0; "
        "10.254.0.0/22 is full (all 3 /24 subnets leased); "
        "free some leases, or add a pool (flannelpy pools add CIDR) and tag it "
        "flannelpy.io/role=1"
    )


@pytest.mark.parametrize(
    ("pools", "cluster", "says", "full"),
    [
        (
            [pool("10.244.0.0/22", primary=True, role="0")],
            None,
            "the primary pool 10.244.0.0/22 is tagged flannelpy.io/role=0 (draining)",
            False,
        ),
        (
            [pool("10.244.0.0/22", primary=True, cluster_b="1")],
            None,
            "the primary pool 10.244.0.0/22 belongs to cluster(s) b, and this agent has no "
            "cluster name",
            False,
        ),
        (
            [pool("10.244.0.0/22", primary=True), Pool(net("10.250.0.0/24"), {ROLE: "1"})],
            None,
            "10.250.0.0/24 holds no /24 subnet to lease",
            True,
        ),
    ],
)
def test_exhaustion_reasons_for_the_primary_and_empty_pools(
    pools: list[Pool], cluster: str | None, says: str, full: bool
) -> None:
    with pytest.raises(PoolExhausted) as err:
        new_subnet(pools, fill("10.244.0.0/22"), cluster)
    assert says in str(err.value)
    assert "\n" not in str(err.value)
    # Freeing leases is suggested only where a usable pool is full.
    assert ("free some leases" in str(err.value)) == full
    assert str(err.value).endswith(
        "add a pool (flannelpy pools add CIDR) and tag it flannelpy.io/role=1"
    )


def test_dual_stack_takes_each_family_from_a_pool_of_that_family() -> None:
    cfg = config(Network="10.244.0.0/22", EnableIPv6=True, IPv6Network="fd00:10:244::/56")
    pools = [pool("10.244.0.0/22", primary=True), pool("10.250.0.0/22", role="1")]
    choice = new_subnet(pools, [], cfg=cfg, seed=3)
    assert choice.subnet.subnet_of(net("10.244.0.0/22"))
    assert choice.ipv6_subnet is not None and choice.ipv6_subnet.prefixlen == 64
    assert choice.ipv6_subnet.subnet_of(IPv6Network("fd00:10:244::/56"))
    assert choice.ipv6_subnet != IPv6Network("fd00:10:244::/64")  # the first one is skipped
    # The IPv4 primary is full: the IPv4 half comes from the opted-in IPv4 pool, the
    # IPv6 half still from IPv6Network (no IPv6 pool besides it).
    spill = new_subnet(pools, fill("10.244.0.0/22"), cfg=cfg)
    assert spill.subnet is not None and spill.subnet.subnet_of(net("10.250.0.0/22"))
    assert spill.pool == pools[1]
    assert spill.ipv6_subnet is not None and spill.ipv6_pool is not None
    assert spill.ipv6_pool.network == cfg.ipv6_network and spill.ipv6_pool.primary


# --- choose_lease with pools ---------------------------------------------------------------

TWO_POOLS = [pool("10.244.0.0/22", primary=True), pool("10.250.0.0/22")]


def choose_in(
    pools: list[Pool],
    leases: list[Lease],
    me: LeaseAttrs,
    previous: str | None = None,
    seed: int = 1,
    gone: bool = True,
) -> LeaseChoice:
    return choose_lease(
        SMALL_PRIMARY,
        leases,
        me,
        net(previous) if previous else None,
        random.Random(seed),
        pools=pools,
        holder_gone=lambda _: gone,
    )


def test_our_lease_in_an_untagged_pool_keeps_serving() -> None:
    mine = lease("10.250.2.0/24", "192.168.1.5")
    choice = choose_in(TWO_POOLS, [mine], attrs("192.168.1.5"))
    assert (choice.existing, choice.reason, choice.delete) == (mine, "public-ip", ())
    assert choice.pool == TWO_POOLS[1]
    # Without pools, Flannel's rule would drop it: it lies outside Network.
    assert choose(SMALL_PRIMARY, [mine], attrs("192.168.1.5")).delete == (mine,)


def test_node_name_takeover_works_in_any_pool() -> None:
    old = lease("10.250.3.0/24", "192.168.1.5", node="node-a")
    choice = choose_in(TWO_POOLS, [old], attrs("192.168.1.99", node="node-a"))
    assert (choice.existing, choice.reason) == (old, "node-name")


def test_our_lease_in_no_pool_is_deleted_and_a_new_one_chosen() -> None:
    stale = lease("10.9.1.0/24", "192.168.1.5")
    choice = choose_in(TWO_POOLS, [stale], attrs("192.168.1.5"))
    assert choice.delete == (stale,)
    assert (choice.reason, choice.existing, choice.pool) == ("free", None, TWO_POOLS[0])


@pytest.mark.parametrize(
    ("previous", "role", "taken"),
    [
        ("10.250.2.0/24", "1", True),
        ("10.250.2.0/24", None, False),
        ("10.250.2.0/24", "0", False),
        ("10.250.0.0/24", "1", False),
    ],  # the first is skipped
)
def test_the_previous_subnet_is_a_new_lease_so_its_pool_must_take_new_ones(
    previous: str, role: str | None, taken: bool
) -> None:
    tags = {"role": role} if role else {}
    pools = [pool("10.244.0.0/22", primary=True), pool("10.250.0.0/22", **tags)]
    choice = choose_in(pools, [], attrs("192.168.1.5"), previous=previous)
    assert (choice.reason == "previous") is taken
    assert (choice.subnet == net(previous)) is taken


def test_choose_lease_with_pools_raises_the_pool_sentence_when_all_are_full() -> None:
    with pytest.raises(PoolExhausted) as err:
        choose_in(TWO_POOLS, fill("10.244.0.0/22"), attrs("192.168.100.1"))
    assert str(err.value).startswith("no pool can take a new lease: 10.244.0.0/22 is full")


@pytest.mark.parametrize(
    ("subnet", "fits"),
    [
        ("10.244.1.0/24", "10.244.0.0/22"),
        ("10.244.0.0/24", None),
        ("10.250.3.0/24", "10.250.0.0/22"),
        ("10.250.0.0/24", None),
        ("10.250.1.0/25", None),
        ("10.251.0.0/24", None),
    ],
)
def test_lease_fits_pools_names_the_pool_whatever_its_tags(subnet: str, fits: str | None) -> None:
    found = lease_fits_pools(SMALL_PRIMARY, TWO_POOLS, net(subnet))
    assert (str(found.network) if found else None) == fits


@st.composite
def pool_scenarios(draw: st.DrawFn) -> tuple[list[Pool], list[Lease], str | None, int]:
    roles = st.sampled_from([None, "0", "1", "x"])
    pools = [pool("10.244.0.0/22", primary=True, **({"role": r} if (r := draw(roles)) else {}))]
    for third in draw(st.lists(st.sampled_from([248, 250, 252]), unique=True, max_size=3)):
        tags = {"role": r} if (r := draw(roles)) else {}
        if draw(st.booleans()):
            tags[f"cluster_{draw(st.sampled_from(['a', 'b']))}"] = "true"
        pools.append(pool(f"10.{third}.0.0/22", **tags))
    subnets = draw(
        st.lists(
            st.sampled_from([f"10.{t}.{i}.0/24" for t in (244, 248, 250, 252) for i in range(4)]),
            unique=True,
        )
    )
    leases = [lease(s, f"192.168.3.{i + 1}") for i, s in enumerate(subnets)]
    return pools, leases, draw(st.sampled_from([None, "a", "b"])), draw(st.integers(0, 2**32))


@settings(max_examples=300, deadline=None)
@given(pool_scenarios())
def test_a_new_subnet_is_free_aligned_and_in_the_first_eligible_pool_with_room(
    scenario: tuple[list[Pool], list[Lease], str | None, int],
) -> None:
    pools, leases, cluster, seed = scenario
    order = [p for p in pools if p.primary] + sorted(
        (p for p in pools if not p.primary), key=lambda p: int(p.network.network_address)
    )

    def room(p: Pool) -> list[IPv4Network]:
        span = leasable_range(p, SMALL_PRIMARY)
        return [
            span.subnet(i)
            for i in range(span.count)
            if not any(h.subnet.overlaps(span.subnet(i)) for h in leases)
        ]

    usable = [p for p in order if eligibility(p, cluster).create_leases and room(p)]
    try:
        choice = new_subnet(pools, leases, cluster, seed=seed)
    except PoolExhausted as e:
        assert usable == []
        for p in pools:
            assert str(p.network) in str(e)
        return
    assert choice.pool == usable[0]
    assert choice.subnet in room(choice.pool)
