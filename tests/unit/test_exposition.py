"""TextRenderer writes what prometheus-client's generate_latest writes, byte for byte."""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from ipaddress import IPv4Address, IPv4Network

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from flannelpy.observe.exposition import TextRenderer, go_float
from flannelpy.observe.metrics import AgentMetrics
from flannelpy.subnet.lease import Lease, LeaseAttrs


class Families(Collector):
    """Families built afresh at every collect, from whatever ``self.value`` is now."""

    def __init__(self) -> None:
        self.value = 1.0
        self.peers = ["10.0.1.0/24", "10.0.2.0/24"]

    def collect(self) -> Iterator[Metric]:
        c = CounterMetricFamily("x_drops", 'Drops "quoted" \\ back\nslash.', labels=["scope"])
        c.add_metric(["node"], self.value)
        c.add_metric(['we"ird\\va\nlue'], 3)
        yield c
        g = GaugeMetricFamily("x_rtt_seconds", "RTT.", labels=["peer", "family"])
        for peer in self.peers:
            g.add_metric([peer, "ipv4"], self.value / 7)
        yield g
        # not written by the renderer itself: the library's own output is used
        info = InfoMetricFamily("x_build", "Build.")
        info.add_metric([], {"version": "1.2"})
        yield info
        s = SummaryMetricFamily("x_latency_seconds", "Latency.")
        s.add_metric([], count_value=2, sum_value=0.5)
        yield s
        t = GaugeMetricFamily("x_stamped", "With a timestamp.")
        t.add_metric([], 1, timestamp=1700000000.5)
        yield t


def registry_with_everything() -> tuple[CollectorRegistry, Families]:
    r = CollectorRegistry()
    Counter("y_requests", "Requests.", ["command", "code"], registry=r).labels("ADD", "0").inc(5)
    h = Histogram(
        "y_duration_seconds", "Duration.", ["command"], buckets=(0.001, 0.5, 1e7), registry=r
    )
    h.labels("ADD").observe(0.2)
    h.labels("DEL").observe(3e6)
    g = Gauge("y_values", "Values.", ["kind"], registry=r)
    for kind, value in (
        ("nan", math.nan),
        ("inf", math.inf),
        ("ninf", -math.inf),
        ("big", 123456789.0),
        ("small", 1e-9),
        ("neg", -5e12),
        ("int", 42),
    ):
        g.labels(kind).set(value)
    Gauge("y_plain", "No labels.", registry=r).set(0)
    families = Families()
    r.register(families)
    return r, families


def test_same_bytes_as_generate_latest_on_every_scrape() -> None:
    r, families = registry_with_everything()
    renderer = TextRenderer(r)
    for value in (1.0, 2.5, 1e300, 0.0):
        families.value = value
        assert renderer.render() == generate_latest(r)


VALUES = [
    0.0,
    -0.0,
    1.0,
    1e6,
    1234567.0,
    1e-7,
    0.1,
    2.5e22,
    -3e9,
    math.nan,
    math.inf,
    -math.inf,
    7,
    True,
]


@pytest.mark.parametrize("value", VALUES)
def test_values_written_as_the_library_writes_them(value: float) -> None:
    from prometheus_client.utils import floatToGoString

    assert go_float(value) == floatToGoString(value)


def test_values_are_fresh_and_series_that_went_are_forgotten() -> None:
    r, families = registry_with_everything()
    renderer = TextRenderer(r)
    renderer.render()
    before = renderer.cached_series
    families.value = 9.0
    families.peers = ["10.0.3.0/24"]
    body = renderer.render()
    assert body == generate_latest(r)
    assert b'x_rtt_seconds{family="ipv4",peer="10.0.3.0/24"} 1.2857142857142858' in body
    assert b"10.0.1.0/24" not in body
    assert renderer.cached_series == before - 1  # two peers gone, one new


def test_agent_metrics_render_as_the_library_does() -> None:
    m = AgentMetrics()
    assert m.exposition() == generate_latest(m.registry)
    leases = [
        Lease(
            IPv4Network(f"10.245.{i}.0/24"),
            LeaseAttrs(
                IPv4Address(f"192.168.78.{i + 10}"),
                "vxlan",
                {"VNI": 1},
                node_name=f"n{i}",
                mtu=1450,
            ),
        )
        for i in range(3)
    ]
    m.peers(leases)
    for i, lease in enumerate(leases):
        m.probe(lease.subnet, i != 1, 0.0004 * (i + 1), None, i == 0)
    m.cni_request("ADD", 0, 0.004)
    assert m.exposition() == generate_latest(m.registry)
    m.forget_probes([str(leases[0].subnet)])
    assert m.exposition() == generate_latest(m.registry)


def test_concurrent_renders_are_each_complete() -> None:
    r, _ = registry_with_everything()
    renderer = TextRenderer(r)
    expected = generate_latest(r)
    bodies: list[bytes] = []

    def scrape() -> None:
        for _ in range(20):
            bodies.append(renderer.render())

    threads = [threading.Thread(target=scrape) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(bodies) == 80 and set(bodies) == {expected}
