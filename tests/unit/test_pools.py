"""Every row of field-notes §3, table-driven: tags → what may be created and allocated."""

import json
import re
from ipaddress import IPv4Address, IPv4Network, IPv6Network

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flannelpy.config.netconf import NetworkConfig, parse_network_config
from flannelpy.errors import ConfigError
from flannelpy.subnet.lease import Lease, LeaseAttrs
from flannelpy.subnet.pools import (
    WARN_UTILISATION,
    Pool,
    assemble_pools,
    capacity,
    check_new_pool,
    check_tag,
    eligibility,
    leasable_range,
    may_release_lease,
    parse_pool_cidr,
    parse_pool_record,
    parse_tag,
    pool_record,
)

NET = IPv4Network("10.250.0.0/16")
ROLE = "flannelpy.io/role"
SCOPE_A = "flannelpy.io/cluster/a"


@pytest.mark.parametrize(
    ("tags", "primary", "cluster", "create", "allocate"),
    [
        # role 1: opt-in; new leases may be created, existing ones stay usable
        ({ROLE: "1"}, False, None, True, True),
        # role 0: excluded; nothing new, and existing leases get no new pod addresses
        ({ROLE: "0"}, False, None, False, False),
        # no tag: creation fails closed, reconciliation fails open
        ({}, False, None, False, True),
        # the primary pool is eligible without a tag ...
        ({}, True, None, True, True),
        # ... unless tagged 0
        ({ROLE: "0"}, True, None, False, False),
        ({ROLE: "1"}, True, None, True, True),
        # cluster scope: only the named cluster uses the pool
        ({ROLE: "1", SCOPE_A: "1"}, False, "a", True, True),
        ({ROLE: "1", SCOPE_A: "1"}, False, "b", False, True),
        ({ROLE: "1", SCOPE_A: "1"}, False, None, False, True),
        # pools without a cluster tag are shared by every cluster using the store
        ({ROLE: "1"}, False, "b", True, True),
        # an unknown role value never opens creation
        ({ROLE: "yes"}, False, None, False, True),
    ],
)
def test_tag_semantics(
    tags: dict[str, str], primary: bool, cluster: str | None, create: bool, allocate: bool
) -> None:
    verdict = eligibility(Pool(NET, tags, primary), cluster)
    assert (verdict.create_leases, verdict.allocate_addresses) == (create, allocate)
    assert str(NET) in verdict.reason


def test_removing_the_opt_in_tag_leaves_live_leases_serving() -> None:
    before = eligibility(Pool(NET, {ROLE: "1"}), None)
    after = eligibility(Pool(NET, {}), None)
    assert before.allocate_addresses and after.allocate_addresses
    assert not after.create_leases


@pytest.mark.parametrize(
    ("tags", "assigned", "cooling", "released"),
    [
        ({ROLE: "0"}, 0, 0, True),  # drained and empty: release
        ({ROLE: "0"}, 3, 0, False),  # pods still there: never, whatever the tags
        ({ROLE: "0"}, 0, 2, False),  # addresses still cooling down: not yet
        ({}, 0, 0, False),  # untagged: fail open, keep
        ({ROLE: "1"}, 0, 0, False),  # in service
    ],
)
def test_a_lease_is_released_only_when_drained_and_empty(
    tags: dict[str, str], assigned: int, cooling: int, released: bool
) -> None:
    assert may_release_lease(Pool(NET, tags), None, assigned, cooling) is released


# --- tags, CIDRs and records ---------------------------------------------------------------

CONFIG = parse_network_config('{"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan"}}')


def cfg(**keys: object) -> NetworkConfig:
    return parse_network_config(json.dumps({"Backend": {"Type": "vxlan"}, **keys}))


def lease(subnet: str, n: int = 1) -> Lease:
    attrs = LeaseAttrs(public_ip=IPv4Address(f"192.168.0.{n}"), backend_type="vxlan")
    return Lease(subnet=IPv4Network(subnet), attrs=attrs)


@pytest.mark.parametrize(
    ("text", "parsed"),
    [
        ("flannelpy.io/role=1", (ROLE, "1")),
        ("flannelpy.io/role=0", (ROLE, "0")),
        ("flannelpy.io/cluster/prod-eu=true", ("flannelpy.io/cluster/prod-eu", "true")),
        ("flannelpy.io/cluster/a=", ("flannelpy.io/cluster/a", "")),  # value is free-form
    ],
)
def test_parse_tag_accepts_the_section_3_keys(text: str, parsed: tuple[str, str]) -> None:
    assert parse_tag(text) == parsed


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("flannelpy.io/role=yes", "is not a role"),
        ("flannelpy.io/role=", "is not a role"),
        ("flannelpy.io/role", "is not KEY=VALUE"),
        ("=1", "is not KEY=VALUE"),
        ("role=1", "is not a pool tag"),
        ("flannelpy.io/zone=a", "is not a pool tag"),
        ("flannelpy.io/cluster/=1", "is not a cluster name"),
        ("flannelpy.io/cluster/-a=1", "is not a cluster name"),
        ("flannelpy.io/cluster/a/b=1", "is not a cluster name"),
    ],
)
def test_parse_tag_refuses_anything_else_with_one_sentence(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as err:
        parse_tag(text)
    assert "\n" not in str(err.value)


def test_check_tag_without_a_value_checks_the_key_only() -> None:
    check_tag(ROLE, None)
    check_tag(SCOPE_A, None)
    with pytest.raises(ConfigError):
        check_tag("other", None)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("10.250.0.1/16", "has host bits set; write the network address, 10.250.0.0/16"),
        ("10.250.0.0", "is not a CIDR"),
        ("fd00::1/48", "has host bits set; write the network address, fd00::/48"),
        ("banana/8", "pools are ranges like 10.250.0.0/16 or fd00:250::/48"),
    ],
)
def test_parse_pool_cidr_names_the_fix(text: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        parse_pool_cidr(text)
    assert parse_pool_cidr(" 10.250.0.0/16 ") == IPv4Network("10.250.0.0/16")
    assert parse_pool_cidr("fd00:250::/48") == IPv6Network("fd00:250::/48")


def test_pool_record_round_trips_and_has_the_documented_shape() -> None:
    pool = Pool(IPv4Network("10.250.0.0/16"), {ROLE: "1", SCOPE_A: "true"}, subnet_len=25)
    raw = pool_record(pool, 24)
    assert json.loads(raw) == {
        "Network": "10.250.0.0/16",
        "SubnetLen": 25,
        "Tags": {SCOPE_A: "true", ROLE: "1"},
    }
    assert parse_pool_record(raw) == pool
    # No SubnetLen of its own: the config's is written.
    assert json.loads(pool_record(Pool(pool.network), 24))["SubnetLen"] == 24


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"{", "not JSON"),
        (b"[]", "not a JSON object"),
        (b'{"Network": "10.250.0.1/16"}', "no valid Network"),
        (b'{"Network": "10.250.0.0/16", "SubnetLen": "24"}', "invalid SubnetLen"),
        (b'{"Network": "10.250.0.0/16", "SubnetLen": 33}', "invalid SubnetLen"),
        (b'{"Network": "10.250.0.0/16", "Tags": {"a": 1}}', "Tags"),
    ],
)
def test_parse_pool_record_refuses_broken_records(raw: bytes, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_pool_record(raw)


def test_assemble_pools_puts_the_primary_first_then_cidr_order() -> None:
    records = [
        Pool(IPv4Network("10.252.0.0/16"), {ROLE: "1"}),
        Pool(IPv4Network("10.9.0.0/16")),
        Pool(IPv4Network("10.244.0.0/16"), {ROLE: "0"}, subnet_len=28),  # primary's record
        Pool(IPv4Network("10.250.0.0/16")),
    ]
    pools = assemble_pools(CONFIG, records)
    assert [(str(p.network), p.primary) for p in pools] == [
        ("10.244.0.0/16", True),
        ("10.9.0.0/16", False),
        ("10.250.0.0/16", False),
        ("10.252.0.0/16", False),
    ]
    # The primary keeps its record's tags, but its SubnetLen follows the config.
    assert (dict(pools[0].tags), pools[0].subnet_len) == ({ROLE: "0"}, 24)
    assert assemble_pools(CONFIG, []) == [Pool(CONFIG.network, {}, True, 24)]  # type: ignore[arg-type]


def test_leasable_range_primary_follows_subnet_min_max_others_skip_the_first() -> None:
    narrowed = cfg(Network="10.244.0.0/16", SubnetMin="10.244.10.0", SubnetMax="10.244.19.0")
    primary = assemble_pools(narrowed, [])[0]
    span = leasable_range(primary, narrowed)
    assert (str(span.first), span.length, span.count) == ("10.244.10.0", 24, 10)
    other = Pool(IPv4Network("10.250.0.0/22"), subnet_len=24)
    span = leasable_range(other, narrowed)
    assert (str(span.first), span.count) == ("10.250.1.0", 3)
    assert [str(span.subnet(i)) for i in range(3)] == [
        "10.250.1.0/24",
        "10.250.2.0/24",
        "10.250.3.0/24",
    ]
    # A pool without its own SubnetLen takes the config's.
    assert leasable_range(Pool(IPv4Network("10.250.0.0/20")), narrowed).count == 15


@pytest.mark.parametrize(
    ("cidr", "says"),
    [
        ("10.244.128.0/17", "overlaps the primary pool (the config's Network) 10.244.0.0/16"),
        ("10.0.0.0/8", "overlaps the primary pool"),
        ("10.244.0.0/16", "is the primary pool"),
        ("10.250.0.0/16", "is a pool already"),
        ("10.250.0.0/15", "overlaps pool 10.250.0.0/16"),
        ("10.251.0.0/24", "too small for SubnetLen 24"),
        ("10.251.0.0/25", "too small for SubnetLen 24"),
    ],
)
def test_check_new_pool_refuses_overlaps_and_too_small(cidr: str, says: str) -> None:
    pools = assemble_pools(CONFIG, [Pool(IPv4Network("10.250.0.0/16"))])
    with pytest.raises(ConfigError, match=re.escape(says)) as err:
        check_new_pool(IPv4Network(cidr), CONFIG, pools)
    assert "\n" not in str(err.value)


def test_check_new_pool_accepts_two_subnets_and_more() -> None:
    pools = assemble_pools(CONFIG, [Pool(IPv4Network("10.250.0.0/16"))])
    check_new_pool(IPv4Network("10.251.0.0/23"), CONFIG, pools)
    check_new_pool(IPv4Network("172.16.0.0/12"), CONFIG, pools)


# --- capacity ------------------------------------------------------------------------------


def test_capacity_counts_size_taken_free_and_leases_per_pool() -> None:
    pools = assemble_pools(CONFIG, [Pool(IPv4Network("10.250.0.0/22"), {ROLE: "1"})])
    leases = [
        lease("10.244.1.0/24"),
        lease("10.244.2.0/24"),
        lease("10.250.2.0/24"),
        lease("10.250.0.0/24"),  # the skipped first subnet: a lease, but no leasable one
        lease("10.9.0.0/24"),  # in no pool
    ]
    primary, extra = capacity(CONFIG, pools, leases)
    assert (primary.size, primary.taken, primary.free, primary.leases) == (255, 2, 253, 2)
    assert (extra.size, extra.taken, extra.free, extra.leases) == (3, 1, 2, 2)
    assert primary.utilisation == pytest.approx(2 / 255)
    assert extra.utilisation == pytest.approx(1 / 3)
    assert primary.warning is None and extra.warning is None


def test_a_wide_lease_counts_every_subnet_it_blocks_and_overlaps_count_once() -> None:
    pools = assemble_pools(CONFIG, [])
    leases = [lease("10.244.0.0/22"), lease("10.244.2.0/24"), lease("10.244.3.128/25")]
    (cap,) = capacity(CONFIG, pools, leases)
    assert cap.taken == 3  # .1 .2 .3 (.0 is not leasable)
    assert cap.leases == 3


@pytest.mark.parametrize(("taken", "warned"), [(1, False), (2, False), (3, True), (4, True)])
def test_warning_when_more_than_half_used(taken: int, warned: bool) -> None:
    small = cfg(Network="10.244.0.0/16", SubnetMin="10.244.1.0", SubnetMax="10.244.4.0")
    (cap,) = capacity(
        small,
        assemble_pools(small, []),
        [lease(f"10.244.{i}.0/24", i) for i in range(1, taken + 1)],
    )
    assert (cap.utilisation > WARN_UTILISATION) is warned
    if warned:
        assert cap.warning == (
            f"10.244.0.0/16 is {taken / 4:.0%} used ({taken} of 4 /24 subnets): plan for "
            "twice the expected need, so add a pool (flannelpy pools add CIDR) and tag it "
            "flannelpy.io/role=1"
        )
    else:
        assert cap.warning is None


def test_an_empty_range_counts_as_full() -> None:
    tiny = Pool(IPv4Network("10.250.0.0/24"), subnet_len=24)  # hand-written: no leasable subnet
    (_, cap) = capacity(CONFIG, assemble_pools(CONFIG, [tiny]), [])
    assert (cap.size, cap.free, cap.utilisation) == (0, 0, 1.0)
    assert cap.warning is not None


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["10.244.0.0", "10.250.0.0"]),
            st.integers(0, 8191),  # offset inside the /19
            st.integers(20, 27),  # prefix length: wider and narrower than SubnetLen
        ),
        max_size=12,
    )
)
def test_capacity_agrees_with_a_subnet_by_subnet_count(held: list[tuple[str, int, int]]) -> None:
    config = cfg(Network="10.244.0.0/19", SubnetLen=24)  # 31 leasable subnets
    extra = Pool(IPv4Network("10.250.0.0/21"), {ROLE: "1"}, subnet_len=24)  # 7 leasable
    pools = assemble_pools(config, [extra])
    leases = [
        lease(str(IPv4Network((int(IPv4Address(base)) + offset, length), strict=False)))
        for base, offset, length in held
    ]
    for cap in capacity(config, pools, leases):
        span = leasable_range(cap.pool, config)
        subnets = [span.subnet(i) for i in range(span.count)]
        blocked = [s for s in subnets if any(h.subnet.overlaps(s) for h in leases)]
        assert (cap.size, cap.taken, cap.free) == (
            len(subnets),
            len(blocked),
            len(subnets) - len(blocked),
        )
        assert cap.leases == sum(h.subnet.overlaps(cap.pool.network) for h in leases)
