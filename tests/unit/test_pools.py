"""Every row of field-notes §3, table-driven: tags → what may be created and allocated."""

from ipaddress import IPv4Network

import pytest

from flannelpy.subnet.pools import Pool, eligibility, may_release_lease

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
