"""NetworkPolicy's families in /metrics: denials by namespace, policies and direction,
summed from the kernel's named counters so that they never fall, and the table's size."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from flannelpy.observe.policy_metrics import PolicyCollector, PolicyReading

SHOP_IN = ("shop", "db", "ingress")
SHOP_OUT = ("shop", "db,web", "egress")


def scrape(collector: PolicyCollector) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    registry = CollectorRegistry()
    registry.register(collector)
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in registry.collect()
        for s in family.samples
    }


def denied(samples: dict, labels: tuple[str, str, str]) -> float:
    key = tuple(sorted(zip(("namespace", "policy", "direction"), labels, strict=True)))
    return samples[("flannelpy_policy_denied_packets_total", key)]


class Readings:
    def __init__(self, *readings: PolicyReading | None) -> None:
        self.left = list(readings)

    def __call__(self) -> PolicyReading | None:
        return self.left.pop(0)


def test_denials_and_the_tables_size_are_shown_by_their_labels() -> None:
    reading = PolicyReading(4, 2, 31, {"deny_a_in": (SHOP_IN, 5), "deny_b_out": (SHOP_OUT, 2)})
    samples = scrape(PolicyCollector(lambda: reading))
    assert denied(samples, SHOP_IN) == 5
    assert denied(samples, SHOP_OUT) == 2
    assert samples[("flannelpy_policy_policies", ())] == 4
    assert samples[("flannelpy_policy_selected_pods", ())] == 2
    assert samples[("flannelpy_policy_set_elements", ())] == 31


def test_a_counter_that_goes_or_starts_over_never_makes_the_total_fall() -> None:
    readings = Readings(
        PolicyReading(1, 1, 1, {"deny_a_in": (SHOP_IN, 5)}),
        PolicyReading(1, 1, 1, {"deny_a_in": (SHOP_IN, 9)}),  # +4
        PolicyReading(1, 0, 1, {}),  # its last pod went, and with it the counter
        PolicyReading(1, 1, 1, {"deny_a_in": (SHOP_IN, 3)}),  # made anew: +3
        PolicyReading(1, 1, 1, {"deny_c_in": (SHOP_IN, 1)}),  # another with the same labels
    )
    collector = PolicyCollector(readings)
    seen = [denied(scrape(collector), SHOP_IN) for _ in range(2)]
    samples = scrape(collector)
    assert ("flannelpy_policy_denied_packets_total", ()) not in samples
    seen += [denied(scrape(collector), SHOP_IN) for _ in range(2)]
    assert seen == [5, 9, 12, 13]


def test_nothing_is_shown_before_the_first_sync_or_with_policy_off() -> None:
    samples = scrape(PolicyCollector(lambda: None))
    assert samples == {}
