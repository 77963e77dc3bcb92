"""The node watch's ``LeaseMap``: its health rule (``take_watch_health``: what makes a
broken watch start a fresh backoff) and the lease map it keeps event by event."""

from __future__ import annotations

import random
from ipaddress import IPv4Address, IPv4Network

from flannelpy.store.kube import node as kn
from flannelpy.store.kube.watch import HEALTHY_WATCH, LeaseMap
from flannelpy.subnet.lease import Lease, LeaseAttrs


def test_no_watch_opened_is_not_healthy() -> None:
    assert not LeaseMap("a").take_watch_health(100.0)


def test_a_watch_that_ends_at_once_without_events_is_not_healthy() -> None:
    state = LeaseMap("a")
    state.watch_opened(100.0)
    assert not state.take_watch_health(100.0 + HEALTHY_WATCH / 2)


def test_a_watch_open_long_enough_is_healthy_even_without_events() -> None:
    state = LeaseMap("a")
    state.watch_opened(100.0)
    assert state.take_watch_health(100.0 + HEALTHY_WATCH)


def test_a_watch_that_brought_an_event_is_healthy_however_short() -> None:
    state = LeaseMap("a")
    state.watch_opened(100.0)
    state.watch_event()
    assert state.take_watch_health(100.01)


def test_health_is_taken_once_and_each_watch_counts_its_own_events() -> None:
    state = LeaseMap("a")
    state.watch_opened(100.0)
    state.watch_event()
    assert state.take_watch_health(100.1)
    assert not state.take_watch_health(200.0)  # a failed list after it: no watch opened
    state.watch_opened(300.0)  # a new watch starts with no events
    assert not state.take_watch_health(300.1)


def test_the_map_kept_event_by_event_is_the_map_built_from_every_node() -> None:
    """Random puts and deletes, podCIDR collisions included: what is delivered after each
    is what ``leases_by_key`` and ``duplicate_claims`` give for the whole node map."""
    rnd = random.Random(3)
    state = LeaseMap("n3")
    state.replace_all({f"n{i}": node_lease(i % 7) for i in range(5)}, "1")
    got: list[dict[str, Lease]] = []
    for step in range(300):
        name = f"n{rnd.randrange(12)}"
        state.put(name, None if rnd.random() < 0.3 else node_lease(rnd.randrange(9)))
        state.deliver(lambda leases, _rv: got.append(dict(leases)), always=True)
        want = kn.leases_by_key(state.by_node, "n3")
        assert got[-1] == want, f"step {step}"
        assert all(got[-1][k] is want[k] for k in want), f"step {step}"
        assert state.duplicates() == kn.duplicate_claims(state.by_node, want), f"step {step}"


def node_lease(n: int) -> Lease:
    return Lease(
        IPv4Network(f"10.244.{n}.0/24"),
        LeaseAttrs(IPv4Address(f"192.168.1.{random.randrange(2, 250)}"), "vxlan"),
    )
