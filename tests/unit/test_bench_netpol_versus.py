"""bench.netpol_versus's pure parts: every change of its cycle flips whether the client may
connect (else a change could be "reflected" by connections that never changed), and its
policies select the four pods and allow the ports the bench uses."""

from __future__ import annotations

from bench import netpol_versus as nv
from bench import throughput
from bench.netpol_latency import PORT


def test_every_change_of_the_cycle_flips_the_outcome_and_the_cycle_closes() -> None:
    state = nv.START
    assert nv.may_connect(state)
    seen = []
    for i in range(2 * len(nv.CYCLE)):
        kind, arg = nv.CYCLE[i % len(nv.CYCLE)]
        before = nv.may_connect(state)
        state = nv.after(state, kind, arg)
        assert nv.may_connect(state) is not before, (i, kind, arg)
        seen.append(kind)
    assert state == nv.START
    assert set(seen) == set(nv.KINDS)


def test_perf_policies_select_the_perf_pods_both_ways_on_the_bench_ports() -> None:
    docs = [nv.perf_policy(i) for i in range(3)]
    assert len({d["metadata"]["name"] for d in docs}) == 3
    for doc in docs:
        spec = doc["spec"]
        assert spec["podSelector"] == {"matchLabels": {"app": "perf"}}
        assert spec["policyTypes"] == ["Ingress", "Egress"]
        for rule in (spec["ingress"][0], spec["egress"][0]):
            ports = {p["port"] for p in rule["ports"]}
            assert {PORT, throughput.PORT} <= ports
            assert nv.CLOSED_PORT not in ports
