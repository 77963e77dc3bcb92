"""The status record's probe summary, kept entry by entry: the same as summarising every
peer again, recomputed exactly when an entry changed; the status reporter feeds it only
the peers with a new round unless the prober's peer set changed; the prober's results
keep their identity until one changes."""

from __future__ import annotations

from dataclasses import replace
from ipaddress import IPv4Address

from hypothesis import given, settings
from hypothesis import strategies as st

from flannelpy.agent.probe_tally import ProbeTally
from flannelpy.control.records import PeerProbe, ProbeSummary
from tests.unit.test_prober import make, rounds

KEYS = [f"10.0.{i}.0/24" for i in range(12)]

peer_probes = st.builds(
    PeerProbe,
    reachable=st.booleans(),
    mtu_ok=st.sampled_from([True, False, None]),
    ok=st.booleans(),
    probes=st.integers(0, 5),
    at=st.sampled_from([0.0, 10.0, 12.5, 20.0]),
    passed_at=st.sampled_from([None, 5.0, 11.1234, 19.0]),
)
# Each step sets a peer's latest round or drops the peer.
steps = st.lists(st.tuples(st.sampled_from(KEYS), st.one_of(st.none(), peer_probes)), max_size=60)


@settings(max_examples=300, deadline=None)
@given(steps)
def test_the_tally_summarises_as_summarising_every_peer_again(
    changes: list[tuple[str, PeerProbe | None]],
) -> None:
    tally, probes = ProbeTally(), {}
    for key, probe in changes:
        if probe is None:
            tally.drop(key)
            probes.pop(key, None)
        else:
            tally.set(key, probe)
            probes[key] = probe
        assert tally.summary() == ProbeSummary.of(probes)
        assert tally.failing == {k: p.problem() for k, p in probes.items() if p.problem()}


def test_the_summary_is_recomputed_exactly_when_an_entry_changes() -> None:
    tally = ProbeTally()
    up = PeerProbe(reachable=True, mtu_ok=True, ok=True, probes=1, at=10.0)
    tally.set(KEYS[0], up)
    tally.set(KEYS[1], up)
    first = tally.summary()
    assert tally.summary() is first  # nothing changed: the same summary, not a new one
    tally.set(KEYS[0], up)  # the same round again
    assert tally.summary() is first
    tally.set(KEYS[0], replace(up, probes=2, at=12.0))
    second = tally.summary()
    assert second is not first and second == ProbeSummary(peers=2, ok=2, passed_at=10.0)
    tally.drop(KEYS[1])
    assert tally.summary() == ProbeSummary(peers=1, ok=1, passed_at=12.0)
    tally.drop(KEYS[1])  # gone already
    assert tally.summary() is tally.summary()


def test_the_failing_version_moves_with_the_failing_set_only() -> None:
    tally = ProbeTally()
    up = PeerProbe(reachable=True, mtu_ok=True, ok=True, probes=1, at=10.0)
    down = replace(up, reachable=False, ok=False)
    tally.set(KEYS[0], up)
    v0 = tally.failing_version
    tally.set(KEYS[0], replace(up, probes=2))  # a new round, still passing
    assert tally.failing_version == v0
    tally.set(KEYS[0], down)
    v1 = tally.failing_version
    assert v1 != v0 and tally.failing == {KEYS[0]: "unreachable"}
    tally.set(KEYS[0], replace(down, probes=3))  # still unreachable
    assert tally.failing_version == v1
    tally.set(KEYS[0], replace(down, reachable=True, mtu_ok=False))
    v2 = tally.failing_version
    assert v2 != v1 and tally.failing == {KEYS[0]: "mtu"}
    tally.drop(KEYS[0])
    assert tally.failing_version != v2 and tally.failing == {}


def test_the_probers_results_keep_their_identity_until_one_changes() -> None:
    prober, _, clock, _ = make(n_peers=2)
    rounds(prober, clock, 1, key="p0")
    rounds(prober, clock, 1, key="p1")
    seen = prober.results()
    assert prober.results() is seen  # no round finished since
    before = seen["p0"].probes
    rounds(prober, clock, 1, key="p0")
    now = prober.results()
    assert now is not seen and now["p0"].probes == before + 1
    assert seen["p0"].probes == before  # what a caller holds does not change under it
    prober.set_peers({"p0": (IPv4Address("10.244.2.0"), "node0")})  # p1 left
    assert set(prober.results()) == {"p0"} and set(now) == {"p0", "p1"}
