"""bench.dual_stack's pure parts: the two network configs and the ratio table."""

from __future__ import annotations

from bench.dual_stack import Sample, net_conf, report
from flannelpy.store.etcd.config import parse_network_config


def test_the_dual_config_is_the_ipv4_one_with_ipv6_enabled() -> None:
    v4, dual = parse_network_config(net_conf("ipv4")), parse_network_config(net_conf("dual"))
    assert not v4.enable_ipv6 and dual.enable_ipv6
    assert v4.network == dual.network
    assert str(dual.ipv6_network) == "fd10:244::/56"


def test_the_table_gives_each_ratio_from_the_medians() -> None:
    def sample(impl: str, family: str, start: float, add: float) -> Sample:
        return Sample(impl, family, start, [add, add * 3, add], [0.02, 0.02, 0.02])

    samples = [
        sample("ours", "ipv4", 0.6, 0.010),
        sample("ours", "dual", 0.6, 0.012),
        sample("flanneld", "ipv4", 0.3, 0.015),
        sample("flanneld", "dual", 0.4, 0.024),
    ]
    text = report(samples, 1, 3, "load")
    start = next(line for line in text.splitlines() if line.startswith("start-to-ready"))
    add = next(line for line in text.splitlines() if "CNI ADD" in line)
    # ours dual/IPv4, flanneld dual/IPv4, ours/flanneld IPv4, ours/flanneld dual
    assert start.split()[-4:] == ["1.000", "1.333", "2.000", "1.500"]
    assert add.split()[-8:] == [
        "10.000",
        "12.000",
        "15.000",
        "24.000",
        "1.200",
        "1.600",
        "0.667",
        "0.500",
    ]
