"""NetworkPolicy's families, read when Prometheus scrapes (``--enable-network-policy``).

- ``flannelpy_policy_denied_packets_total{namespace, policy, direction}``: packets the
  node's table dropped because policies isolate a pod and none of their rules let the
  packet in (or out). The kernel counts them in named counters, one per namespace, set
  of isolating policies (``policy``: their names, comma-joined, as several policies
  that select one pod deny together) and direction; a scrape lists those counters
  alone (``nft list counters``), never the table, so its cost does not grow with the
  policies' sets. The totals are summed from deltas, so they stay monotonic when a
  counter goes with the last pod it served;
- ``flannelpy_policy_policies``, ``flannelpy_policy_selected_pods``,
  ``flannelpy_policy_set_elements``: the policies the agent holds, this node's pods they
  isolate, and the elements of the table's sets and maps (what a change touches).

The families have no samples while policy is off, and until the agent has read every
policy, pod and namespace once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

DENIED = "flannelpy_policy_denied_packets_total"
POLICIES = "flannelpy_policy_policies"
SELECTED_PODS = "flannelpy_policy_selected_pods"
SET_ELEMENTS = "flannelpy_policy_set_elements"
TYPES = {DENIED: "counter", POLICIES: "gauge", SELECTED_PODS: "gauge", SET_ELEMENTS: "gauge"}

Labels = tuple[str, str, str]  # namespace, policy, direction


@dataclass(frozen=True)
class PolicyReading:
    policies: int
    selected_pods: int
    set_elements: int
    # Per named counter in the kernel: its labels and the packets it counted.
    denied: Mapping[str, tuple[Labels, int]] = field(default_factory=dict)


class PolicyCollector(Collector):
    def __init__(self, read: Callable[[], PolicyReading | None]) -> None:
        self._read = read
        self._lock = threading.Lock()
        self._last: dict[str, int] = {}  # counter name -> packets at the last scrape
        self._totals: dict[Labels, int] = {}

    def describe(self) -> Iterator[Metric]:
        yield from _families(None, {})

    def collect(self) -> Iterator[Metric]:
        reading = self._read()
        with self._lock:
            totals = self._accumulate(reading.denied) if reading is not None else {}
        yield from _families(reading, totals)

    def _accumulate(self, denied: Mapping[str, tuple[Labels, int]]) -> dict[Labels, int]:
        for name, (labels, packets) in denied.items():
            last = self._last.get(name)
            # A counter new since the last scrape, or made anew (its count fell), adds all.
            delta = packets - last if last is not None and packets >= last else packets
            self._totals[labels] = self._totals.get(labels, 0) + delta
        self._last = {name: packets for name, (_, packets) in denied.items()}
        return dict(self._totals)


def _families(reading: PolicyReading | None, totals: Mapping[Labels, int]) -> Iterator[Metric]:
    denied = CounterMetricFamily(
        DENIED.removesuffix("_total"),
        "Packets the node's NetworkPolicy table dropped, by the namespace, the isolating "
        "policies (names, comma-joined) and the direction.",
        labels=("namespace", "policy", "direction"),
    )
    for labels, packets in sorted(totals.items()):
        denied.add_metric(labels, packets)
    gauges = [
        (POLICIES, "NetworkPolicies the agent holds (accepted, cluster-wide).", "policies"),
        (SELECTED_PODS, "Pods of this node that policies isolate.", "selected_pods"),
        (SET_ELEMENTS, "Elements of the policy table's sets and maps.", "set_elements"),
    ]
    yield denied
    for name, text, attribute in gauges:
        family = GaugeMetricFamily(name, text)
        if reading is not None:
            family.add_metric((), getattr(reading, attribute))
        yield family
