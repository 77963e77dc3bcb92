"""The lab runtime hands a cached result to DEL in the conflist's version, as libcni does: a
migrated node's conflist changes between 1.0.0 (ours) and 0.3.1 (Flannel's), and plugins
refuse a prevResult of another version than their config's."""

from __future__ import annotations

from flannelpy_lab.runtime import convert_result

OURS = {
    "cniVersion": "1.0.0",
    "interfaces": [{"name": "eth0", "sandbox": "/run/netns/p1"}],
    "ips": [
        {"address": "10.244.3.5/24", "gateway": "10.244.3.1", "interface": 0},
        {"address": "fd10:244:0:3::5/64", "gateway": "fd10:244:0:3::1", "interface": 0},
    ],
}


def test_a_1_0_0_result_gains_each_ips_family_for_0_3_1() -> None:
    converted = convert_result(OURS, "0.3.1")
    assert converted["cniVersion"] == "0.3.1"
    assert [ip["version"] for ip in converted["ips"]] == ["4", "6"]
    assert converted["interfaces"] == OURS["interfaces"]
    assert "version" not in OURS["ips"][0]  # the cached result is left as it was


def test_a_0_3_1_result_loses_the_families_for_1_0_0() -> None:
    back = convert_result(convert_result(OURS, "0.3.1"), "1.0.0")
    assert back == OURS
