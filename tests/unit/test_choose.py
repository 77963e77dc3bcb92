"""Subnet choice: Flannel's acquire order plus the node-name takeover."""

from __future__ import annotations

import json
import random
from ipaddress import IPv4Address, IPv4Network, IPv6Network

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flannelpy.config import NetworkConfig, parse_network_config
from flannelpy.errors import ConfigError, PoolExhausted
from flannelpy.subnet.choose import LeaseChoice, candidate_subnets, choose_lease, lease_fits
from flannelpy.subnet.lease import Lease, LeaseAttrs

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
) -> LeaseChoice:
    return choose_lease(cfg, leases, me, net(previous) if previous else None, random.Random(seed))


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
        net("10.244.7.0/24"), "public-ip", mine, ()
    )  # fmt: skip


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
        net("10.244.7.0/24"), "node-name", old
    )  # fmt: skip


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
    choice = choose(NET16, [lease("10.244.3.0/24", "192.168.1.4")], attrs("192.168.1.5"),
                    previous="10.244.42.0/24")  # fmt: skip
    assert (choice.subnet, choice.reason, choice.existing) == (
        net("10.244.42.0/24"), "previous", None
    )  # fmt: skip


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


def test_dual_stack_walk_pairs_v4_and_v6_subnets() -> None:
    cfg = config(Network="10.244.0.0/16", EnableIPv6=True, IPv6Network="fd00:10:244::/56")
    pairs = list(candidate_subnets(cfg))[:2]
    assert pairs == [
        (net("10.244.1.0/24"), IPv6Network("fd00:10:244:1::/64")),
        (net("10.244.2.0/24"), IPv6Network("fd00:10:244:2::/64")),
    ]
    choice = choose(cfg, [], attrs("192.168.1.5"), previous="10.244.5.0/24")
    assert (choice.subnet, choice.ipv6_subnet) == (
        net("10.244.5.0/24"), IPv6Network("fd00:10:244:5::/64")
    )  # fmt: skip


def test_ipv6_only_config_is_refused() -> None:
    cfg = config(EnableIPv4=False, EnableIPv6=True, IPv6Network="fd00:10:244::/56")
    with pytest.raises(ConfigError, match="EnableIPv4"):
        choose(cfg, [], attrs("192.168.1.5"))


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
            for v4, _ in candidate_subnets(SMALL)
            if all(not held.subnet.overlaps(v4) for held in leases)
        ]
        assert free == []
        assert all(not (h.attrs.public_ip == me.public_ip and lease_fits(SMALL, h.subnet))
                   for h in leases)  # fmt: skip
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
