"""MTU consistency between our overlay MTU and what peer leases advertise."""

from __future__ import annotations

import random
from ipaddress import IPv4Address, IPv4Network

import pytest

from flannelpy.observe.mtu import (
    MtuReport,
    MtuTally,
    PeerMtu,
    describe_unknown,
    follow_mtu,
    mtu_mismatches,
)
from flannelpy.subnet.lease import Lease, LeaseAttrs
from flannelpy.subnet.memo import Delta, LeaseMemo


def lease(third_octet: int, mtu: int | None) -> Lease:
    return Lease(
        IPv4Network(f"10.244.{third_octet}.0/24"),
        LeaseAttrs(IPv4Address(f"192.168.50.{third_octet}"), "vxlan", mtu=mtu),
    )


def peer(third_octet: int, mtu: int | None) -> PeerMtu:
    return PeerMtu(
        IPv4Network(f"10.244.{third_octet}.0/24"), IPv4Address(f"192.168.50.{third_octet}"), mtu
    )


@pytest.mark.parametrize(
    ("own", "peers", "mismatched", "unknown"),
    [
        (1450, [], [], []),
        (1450, [(2, 1450), (3, 1450)], [], []),
        (1450, [(2, 1400)], [(2, 1400)], []),
        (1450, [(2, 9000), (3, 1450)], [(2, 9000)], []),
        (1450, [(2, None)], [], [(2, None)]),  # flanneld: unknown, never a mismatch
        (1450, [(4, None), (3, 1400), (2, 1450)], [(3, 1400)], [(4, None)]),
        (1500, [(5, 1450), (2, 1400)], [(2, 1400), (5, 1450)], []),  # sorted by subnet
    ],
)
def test_mtu_mismatches(
    own: int,
    peers: list[tuple[int, int | None]],
    mismatched: list[tuple[int, int | None]],
    unknown: list[tuple[int, int | None]],
) -> None:
    report = mtu_mismatches(own, [lease(o, m) for o, m in peers])
    assert report.own_mtu == own
    assert report.mismatched == [peer(o, m) for o, m in mismatched]
    assert report.unknown == len(unknown)
    assert report.consistent is (not mismatched)
    assert len(report.sentences()) == len(mismatched)


def test_peer_mtu_unpacks_as_a_triple() -> None:
    subnet, public_ip, advertised = mtu_mismatches(1450, [lease(2, 1400)]).mismatched[0]
    assert (str(subnet), str(public_ip), advertised) == ("10.244.2.0/24", "192.168.50.2", 1400)


def test_sentences_say_what_is_wrong_and_what_to_do() -> None:
    report = mtu_mismatches(1450, [lease(2, 1400), lease(3, None)])
    (mismatch,) = report.sentences()
    assert mismatch.startswith("peer 10.244.2.0/24 (192.168.50.2) advertises overlay MTU 1400")
    assert "this node uses 1450" in mismatch and "over 1400 bytes" in mismatch
    assert "same underlay MTU" in mismatch
    unknown = describe_unknown(peer(3, None))
    assert unknown.startswith("peer 10.244.3.0/24 (192.168.50.3) advertises no overlay MTU")
    assert "\n" not in mismatch + unknown


def test_advertised_mtu_round_trips_through_the_lease_json() -> None:
    # what a flannelpy peer writes is what mtu_mismatches reads; flanneld's JSON has none
    ours = LeaseAttrs.from_json(
        LeaseAttrs(IPv4Address("192.168.50.2"), "vxlan", mtu=1400).to_json()
    )
    flanneld = LeaseAttrs.from_json('{"PublicIP":"192.168.50.3","BackendType":"vxlan"}')
    report = mtu_mismatches(
        1450,
        [
            Lease(IPv4Network("10.244.2.0/24"), ours),
            Lease(IPv4Network("10.244.3.0/24"), flanneld),
        ],
    )
    assert [p.advertised for p in report.mismatched] == [1400]
    assert report.unknown == 1


def test_followed_the_last_report_stands_while_no_lease_and_not_our_mtu_changed() -> None:
    memo: LeaseMemo[PeerMtu | None] = LeaseMemo()
    leases = [lease(2, 1450), lease(3, None), lease(4, 1400), lease(5, None)]
    first, arrived, left = follow_mtu(1450, leases, memo, None)
    assert first == mtu_mismatches(1450, leases)
    assert [p.subnet for p in arrived] == [
        IPv4Network("10.244.3.0/24"),
        IPv4Network("10.244.5.0/24"),
    ]
    assert left == []
    assert follow_mtu(1450, list(leases), memo, first) == (first, [], [])  # the same leases
    assert follow_mtu(1450, list(leases), memo, first).report is first
    # A new lease object for the third peer (now 1450), the fifth gone, a sixth without MTU.
    changed = [*leases[:2], lease(4, 1450), lease(6, None)]
    second, arrived, left = follow_mtu(1450, changed, memo, first)
    assert second == mtu_mismatches(1450, changed) and second.mismatched == []
    assert [p.subnet for p in arrived] == [IPv4Network("10.244.6.0/24")]
    assert [p.subnet for p in left] == [IPv4Network("10.244.5.0/24")]
    third = follow_mtu(1400, changed, memo, second).report  # our MTU changed
    assert third == mtu_mismatches(1400, changed)
    assert [p.subnet for p in third.mismatched] == [
        IPv4Network("10.244.2.0/24"),
        IPv4Network("10.244.4.0/24"),
    ]


@pytest.mark.parametrize("seed", range(20))
def test_the_tally_gives_the_report_of_every_peer_over_random_changes(seed: int) -> None:
    """Leases come, go and change their MTU, and our own MTU changes now and then: the
    report kept by difference is the one computed from every peer, every step."""
    rnd = random.Random(seed)
    memo: LeaseMemo[PeerMtu | None] = LeaseMemo()
    tally = MtuTally()
    current: dict[int, Lease] = {}
    report = None
    own = 1450
    for step in range(60):
        for _ in range(rnd.randint(0, 4)):
            octet = rnd.randint(2, 30)
            if octet in current and rnd.random() < 0.4:
                del current[octet]
            else:
                current[octet] = lease(octet, rnd.choice([None, 1450, 1400, 9000]))
        if step % 17 == 16:
            own = rnd.choice([1450, 1400])
        peers = list(current.values())
        rnd.shuffle(peers)
        report = follow_mtu(own, peers, memo, report, tally).report
        assert report == mtu_mismatches(own, peers), f"step {step}"


def test_a_tally_out_of_step_with_its_memo_judges_every_peer_again() -> None:
    tally = MtuTally()
    known = peer(2, 1400)
    tally.follow(1450, Delta([known], [known], []))
    stray = peer(3, 9000)  # dropped, never counted
    report = tally.follow(1450, Delta([known], [], [stray]))
    assert report == MtuReport(1450, [known], 0)
    unknown = peer(4, None)
    tally.follow(1450, Delta([known, unknown], [unknown], []))
    report = tally.follow(1450, Delta([known], [], [unknown, peer(5, None)]))  # one too many
    assert report == MtuReport(1450, [known], 0)
