"""The metrics read at scrape time: link counters by role and IPAM accounting per lease.

Read from providers the agent registers with :class:`~flannelpy.observe.metrics.AgentMetrics`
when Prometheus asks: that costs nothing between scrapes and is never stale.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from flannelpy.dataplane.linkstats import RoleStats
from flannelpy.ipam.allocator import Accounting

LinkProvider = Callable[[], Sequence[RoleStats]]
IpamProvider = Callable[[], Sequence[Accounting]]


class ScrapeCollector(Collector):
    """Families whose values are read from the providers when Prometheus scrapes.

    ``read_links`` and ``read_ipam`` return None when there is no provider or it
    failed (the owner counts the failure): the family is then left out, not zeroed.
    """

    def __init__(
        self,
        read_links: Callable[[], Sequence[RoleStats] | None],
        read_ipam: Callable[[], Sequence[Accounting] | None],
    ) -> None:
        self._read_links = read_links
        self._read_ipam = read_ipam

    def describe(self) -> Iterator[Metric]:
        # Names only, so registering never calls the providers.
        yield from link_families()
        yield from ipam_families()

    def collect(self) -> Iterator[Metric]:
        links = self._read_links()
        if links is not None:
            yield from link_families(links)
        pools = self._read_ipam()
        if pools is not None:
            yield from ipam_families(pools)


def link_families(stats: Sequence[RoleStats] = ()) -> list[Metric]:
    labels = ["role", "direction"]
    dropped = CounterMetricFamily(
        "flannelpy_interface_dropped_packets",
        "Packets dropped by managed interfaces (kernel link statistics), by role; "
        "role=pods sums every pod veth.",
        labels=labels,
    )
    errors = CounterMetricFamily(
        "flannelpy_interface_errors",
        "Receive/transmit errors of managed interfaces, by role.",
        labels=labels,
    )
    packets = CounterMetricFamily(
        "flannelpy_interface_packets",
        "Packets through managed interfaces, by role.",
        labels=labels,
    )
    octets = CounterMetricFamily(
        "flannelpy_interface_bytes", "Bytes through managed interfaces, by role.", labels=labels
    )
    count = GaugeMetricFamily(
        "flannelpy_interfaces",
        "Links in each role (role=pods: pod veths on the bridge).",
        labels=["role"],
    )
    up = GaugeMetricFamily(
        "flannelpy_interfaces_up",
        "Links in each role that are up with carrier.",
        labels=["role"],
    )
    for s in stats:
        c = s.counters
        for direction, drop, err, pkt, byt in (
            ("rx", c.rx_dropped, c.rx_errors, c.rx_packets, c.rx_bytes),
            ("tx", c.tx_dropped, c.tx_errors, c.tx_packets, c.tx_bytes),
        ):
            dropped.add_metric([s.role, direction], drop)
            errors.add_metric([s.role, direction], err)
            packets.add_metric([s.role, direction], pkt)
            octets.add_metric([s.role, direction], byt)
        count.add_metric([s.role], s.interfaces)
        up.add_metric([s.role], s.up)
    return [dropped, errors, packets, octets, count, up]


def ipam_families(pools: Sequence[Accounting] = ()) -> list[Metric]:
    assigned = GaugeMetricFamily(
        "flannelpy_ipam_assigned_addresses",
        "Pod addresses assigned, per lease.",
        labels=["subnet"],
    )
    cooling = GaugeMetricFamily(
        "flannelpy_ipam_cooling_addresses",
        "Released addresses in cooldown, per lease: not usable yet, never counted as free.",
        labels=["subnet"],
    )
    free = GaugeMetricFamily(
        "flannelpy_ipam_free_addresses",
        "Addresses a new pod can get now (capacity - assigned - cooling), per lease.",
        labels=["subnet"],
    )
    capacity = GaugeMetricFamily(
        "flannelpy_ipam_capacity_addresses",
        "Allocatable addresses of the lease (without network, gateway, broadcast).",
        labels=["subnet"],
    )
    for a in pools:
        subnet = [str(a.subnet)]
        assigned.add_metric(subnet, a.assigned)
        cooling.add_metric(subnet, a.cooling)
        free.add_metric(subnet, a.free)
        capacity.add_metric(subnet, a.total)
    return [assigned, cooling, free, capacity]
