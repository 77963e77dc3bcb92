"""net-conf.json parsing and agent flags (flannelpy.config)."""

from __future__ import annotations

import argparse
import json
import socket
from dataclasses import fields
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flannelpy.config.netconf import (
    FLANNEL_ONLY_BACKENDS,
    BackendConfig,
    NetworkConfig,
    parse_network_config,
)
from flannelpy.config.settings import AgentSettings, add_agent_arguments, settings_from_args
from flannelpy.errors import ConfigError


def parse(doc: dict[str, Any]) -> NetworkConfig:
    return parse_network_config(json.dumps(doc))


def assert_one_sentence(message: str) -> None:
    assert "\n" not in message
    assert ". " not in message, message
    assert not message.endswith(".")


# --------------------------------------------------------------------------- defaults


def test_minimal_config_gets_flannels_defaults() -> None:
    cfg = parse({"Network": "10.244.0.0/16"})
    assert cfg.network == IPv4Network("10.244.0.0/16")
    assert cfg.subnet_len == 24
    assert cfg.subnet_min == IPv4Address("10.244.1.0")
    assert cfg.subnet_max == IPv4Address("10.244.255.0")
    assert cfg.enable_ipv4 is True
    assert cfg.enable_ipv6 is False
    assert cfg.ipv6_network is None
    assert cfg.ipv6_subnet_len is None
    assert cfg.ipv6_subnet_min is None
    assert cfg.ipv6_subnet_max is None
    assert cfg.enable_nftables is False
    assert cfg.backend == BackendConfig()
    assert cfg.backend.type == "vxlan"
    assert cfg.backend.vni == 1
    assert cfg.backend.port == 0
    assert cfg.backend.effective_port == 8472
    assert (cfg.backend.gbp, cfg.backend.learning, cfg.backend.direct_routing) == (
        False,
        False,
        False,
    )
    assert cfg.backend.mtu is None
    assert cfg.backend_defaulted is True


@pytest.mark.parametrize(
    ("network", "subnet_len", "subnet_min", "subnet_max"),
    [
        ("10.0.0.0/8", 24, "10.0.1.0", "10.255.255.0"),
        ("10.244.0.0/16", 24, "10.244.1.0", "10.244.255.0"),
        ("10.244.0.0/22", 24, "10.244.1.0", "10.244.3.0"),
        ("10.244.0.0/23", 25, "10.244.0.128", "10.244.1.128"),
        ("10.244.0.0/24", 26, "10.244.0.64", "10.244.0.192"),
        ("10.244.0.0/28", 30, "10.244.0.4", "10.244.0.12"),
        ("255.255.255.0/24", 26, "255.255.255.64", "255.255.255.192"),  # top of the space
        ("0.0.0.0/0", 24, "0.0.1.0", "255.255.255.0"),
    ],
)
def test_subnet_len_min_max_defaults(
    network: str, subnet_len: int, subnet_min: str, subnet_max: str
) -> None:
    cfg = parse({"Network": network})
    assert cfg.subnet_len == subnet_len
    assert cfg.subnet_min == IPv4Address(subnet_min)
    assert cfg.subnet_max == IPv4Address(subnet_max)


def test_zero_subnet_len_means_automatic_as_in_flannel() -> None:
    assert parse({"Network": "10.244.0.0/16", "SubnetLen": 0}).subnet_len == 24


def test_explicit_subnet_len_min_max() -> None:
    cfg = parse(
        {
            "Network": "10.244.0.0/16",
            "SubnetLen": 26,
            "SubnetMin": "10.244.4.0",
            "SubnetMax": "10.244.8.192",
        }
    )
    assert cfg.subnet_len == 26
    assert cfg.subnet_min == IPv4Address("10.244.4.0")
    assert cfg.subnet_max == IPv4Address("10.244.8.192")


def test_subnet_min_may_equal_max_and_the_first_subnet() -> None:
    cfg = parse({"Network": "10.244.0.0/16", "SubnetMin": "10.244.0.0", "SubnetMax": "10.244.0.0"})
    assert cfg.subnet_min == cfg.subnet_max == IPv4Address("10.244.0.0")


def test_network_host_bits_are_dropped_like_gos_parsecidr() -> None:
    assert parse({"Network": "10.244.7.9/16"}).network == IPv4Network("10.244.0.0/16")


def test_keys_are_case_insensitive_at_top_level_and_in_backend() -> None:
    cfg = parse(
        {
            "network": "10.10.0.0/16",
            "SUBNETLEN": 25,
            "enableipv6": True,
            "ipv6network": "fd00:10::/48",
            "enablenftables": True,
            "backend": {
                "type": "VXLAN",
                "vni": 4,
                "port": 4789,
                "gbp": True,
                "learning": True,
                "directrouting": True,
                "mtu": 1400,
            },
        }
    )
    assert cfg.network == IPv4Network("10.10.0.0/16")
    assert cfg.subnet_len == 25
    assert cfg.ipv6_network == IPv6Network("fd00:10::/48")
    assert cfg.enable_nftables is True
    assert cfg.backend_defaulted is False
    assert cfg.backend.type == "vxlan"
    assert (cfg.backend.vni, cfg.backend.port, cfg.backend.effective_port) == (4, 4789, 4789)
    assert (cfg.backend.gbp, cfg.backend.learning, cfg.backend.direct_routing) == (
        True,
        True,
        True,
    )
    assert cfg.backend.mtu == 1400


def test_host_gw_backend() -> None:
    cfg = parse({"Network": "10.244.0.0/16", "Backend": {"Type": "host-gw"}})
    assert cfg.backend.type == "host-gw"
    assert cfg.backend_defaulted is False


def test_null_backend_is_absent() -> None:
    cfg = parse({"Network": "10.244.0.0/16", "Backend": None})
    assert cfg.backend_defaulted is True
    assert cfg.backend.type == "vxlan"


def test_unknown_keys_are_kept_in_raw() -> None:
    doc = {
        "Network": "10.244.0.0/16",
        "Pools": [{"Name": "a"}],
        "Backend": {"Type": "vxlan", "VNI": 2, "NodeOverride": {"n1": "host-gw"}},
    }
    cfg = parse(doc)
    assert cfg.raw == doc
    assert cfg.raw["Pools"] == [{"Name": "a"}]
    assert cfg.backend.raw["NodeOverride"] == {"n1": "host-gw"}


@pytest.mark.parametrize("mtu", [None, 0])
def test_backend_mtu_unset_or_zero_means_the_interfaces(mtu: int | None) -> None:
    cfg = parse({"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan", "MTU": mtu}})
    assert cfg.backend.mtu is None


@pytest.mark.parametrize(
    ("options", "attr", "expected"),
    [
        ({"VNI": 1}, "vni", 1),
        ({"VNI": 16777215}, "vni", 16777215),
        ({"Port": 0}, "port", 0),
        ({"Port": 65535}, "port", 65535),
        ({"MTU": 68}, "mtu", 68),
        ({"MTU": 65535}, "mtu", 65535),
        ({"GBP": False}, "gbp", False),
    ],
)
def test_backend_option_bounds_accepted(options: dict[str, Any], attr: str, expected: Any) -> None:
    cfg = parse({"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan", **options}})
    assert getattr(cfg.backend, attr) == expected


def test_bytes_input_and_utf8_bom() -> None:
    raw = b'\xef\xbb\xbf{"Network": "10.244.0.0/16"}'
    assert parse_network_config(raw).network == IPv4Network("10.244.0.0/16")


@pytest.mark.parametrize(
    ("ipv6_network", "subnet_len", "subnet_min", "subnet_max"),
    [
        ("fd00:10:244::/48", 64, "fd00:10:244:1::", "fd00:10:244:ffff::"),
        ("fd00::/62", 64, "fd00:0:0:1::", "fd00:0:0:3::"),
        ("fd00::/63", 65, "fd00::8000:0:0:0", "fd00:0:0:1:8000::"),
        ("fd00::/124", 126, "fd00::4", "fd00::c"),
    ],
)
def test_ipv6_defaults(
    ipv6_network: str, subnet_len: int, subnet_min: str, subnet_max: str
) -> None:
    cfg = parse({"Network": "10.244.0.0/16", "EnableIPv6": True, "IPv6Network": ipv6_network})
    assert cfg.enable_ipv6 is True
    assert cfg.ipv6_network == IPv6Network(ipv6_network)
    assert cfg.ipv6_subnet_len == subnet_len
    assert cfg.ipv6_subnet_min == IPv6Address(subnet_min)
    assert cfg.ipv6_subnet_max == IPv6Address(subnet_max)


def test_ipv6_explicit_range() -> None:
    cfg = parse(
        {
            "EnableIPv4": False,
            "EnableIPv6": True,
            "IPv6Network": "fd00:10::/48",
            "IPv6SubnetLen": 56,
            "IPv6SubnetMin": "fd00:10:0:200::",
            "IPv6SubnetMax": "fd00:10:0:ff00::",
        }
    )
    assert cfg.ipv6_subnet_len == 56
    assert cfg.ipv6_subnet_min == IPv6Address("fd00:10:0:200::")
    assert cfg.ipv6_subnet_max == IPv6Address("fd00:10:0:ff00::")


def test_ipv6_only_leaves_ipv4_fields_empty() -> None:
    cfg = parse({"EnableIPv4": False, "EnableIPv6": True, "IPv6Network": "fd00::/48"})
    assert cfg.enable_ipv4 is False
    assert cfg.network is None
    assert cfg.subnet_len == 0
    assert cfg.subnet_min == cfg.subnet_max == IPv4Address(0)


def test_disabled_ipv6_ignores_ipv6_keys() -> None:
    cfg = parse({"Network": "10.244.0.0/16", "IPv6Network": "fd00::/48"})
    assert cfg.ipv6_network is None


# --------------------------------------------------------------------------- errors

_NET = {"Network": "10.244.0.0/16"}


def _vx(**options: Any) -> dict[str, Any]:
    return {**_NET, "Backend": {"Type": "vxlan", **options}}


@pytest.mark.parametrize(
    ("doc", "expected"),
    [
        pytest.param([1, 2], "document must be a JSON object", id="not-object"),
        pytest.param({}, '"Network" is required when EnableIPv4 is true', id="no-network"),
        pytest.param({"Network": None}, '"Network" is required', id="null-network"),
        pytest.param({"Network": 5}, '"Network" must be a string, not 5', id="network-int"),
        pytest.param({"Network": "10.244.0.0"}, "is not a CIDR", id="network-no-prefix"),
        pytest.param({"Network": "10.244.0.0/33"}, "is not a CIDR", id="network-bad-prefix"),
        pytest.param({"Network": "banana/16"}, "is not a CIDR", id="network-garbage"),
        pytest.param({"Network": "fd00::/48"}, "is not an IPv4 CIDR", id="network-v6"),
        pytest.param(
            {"Network": "10.244.0.0/29"},
            'net-conf.json: "Network" 10.244.0.0/29 is too small; use a /28 or larger network',
            id="network-too-small",
        ),
        pytest.param(
            {**_NET, "SubnetLen": 31},
            'net-conf.json: "SubnetLen" 31 is too long: it must be between 18 and 30 '
            "for Network 10.244.0.0/16",
            id="subnetlen-too-long",
        ),
        pytest.param(
            {**_NET, "SubnetLen": 17},
            'net-conf.json: "SubnetLen" 17 is too short: it must be between 18 and 30 '
            "for Network 10.244.0.0/16",
            id="subnetlen-too-short",
        ),
        pytest.param({**_NET, "SubnetLen": "24"}, "must be a whole number", id="subnetlen-str"),
        pytest.param({**_NET, "SubnetLen": 24.0}, "must be a whole number", id="subnetlen-float"),
        pytest.param({**_NET, "SubnetLen": True}, "must be a whole number", id="subnetlen-bool"),
        pytest.param({**_NET, "SubnetLen": -1}, "is too short", id="subnetlen-negative"),
        pytest.param(
            {**_NET, "SubnetMin": "10.0.0.0"},
            '"SubnetMin" 10.0.0.0 is outside Network 10.244.0.0/16',
            id="min-outside",
        ),
        pytest.param(
            {**_NET, "SubnetMax": "10.245.0.0"},
            '"SubnetMax" 10.245.0.0 is outside Network',
            id="max-outside",
        ),
        pytest.param(
            {**_NET, "SubnetMin": "10.244.1.5"},
            '"SubnetMin" 10.244.1.5 is not aligned to SubnetLen 24; use 10.244.1.0',
            id="min-unaligned",
        ),
        pytest.param(
            {**_NET, "SubnetMax": "10.244.9.128"},
            '"SubnetMax" 10.244.9.128 is not aligned to SubnetLen 24; use 10.244.9.0',
            id="max-unaligned",
        ),
        pytest.param({**_NET, "SubnetMin": "10.244"}, "is not an IP address", id="min-garbage"),
        pytest.param({**_NET, "SubnetMin": 5}, '"SubnetMin" must be a string', id="min-int"),
        pytest.param({**_NET, "SubnetMin": "fd00::"}, "is outside Network", id="min-v6"),
        pytest.param(
            {**_NET, "SubnetMin": "10.244.9.0", "SubnetMax": "10.244.3.0"},
            '"SubnetMin" 10.244.9.0 is above "SubnetMax" 10.244.3.0',
            id="min-above-max",
        ),
        pytest.param({**_NET, "EnableIPv4": "yes"}, "must be true or false", id="enable-str"),
        pytest.param({**_NET, "EnableNFTables": 1}, "must be true or false", id="nft-int"),
        pytest.param(
            {**_NET, "EnableIPv4": False}, "enable at least one address family", id="none-on"
        ),
        pytest.param(
            {**_NET, "EnableIPv6": True},
            '"IPv6Network" is required when EnableIPv6 is true',
            id="v6-no-network",
        ),
        pytest.param(
            {**_NET, "EnableIPv6": True, "IPv6Network": "10.0.0.0/8"},
            "is not an IPv6 CIDR",
            id="v6-network-v4",
        ),
        pytest.param(
            {**_NET, "EnableIPv6": True, "IPv6Network": "fd00::/125"},
            "is too small; use a /124 or larger",
            id="v6-too-small",
        ),
        pytest.param(
            {**_NET, "EnableIPv6": True, "IPv6Network": "fd00::/48", "IPv6SubnetLen": 127},
            '"IPv6SubnetLen" 127 is too long: it must be between 50 and 126 '
            "for IPv6Network fd00::/48",
            id="v6-len-too-long",
        ),
        pytest.param(
            {**_NET, "EnableIPv6": True, "IPv6Network": "fd00::/48", "IPv6SubnetLen": 49},
            '"IPv6SubnetLen" 49 is too short',
            id="v6-len-too-short",
        ),
        pytest.param(
            {**_NET, "EnableIPv6": True, "IPv6Network": "fd00::/48", "IPv6SubnetMin": "fd00::1"},
            '"IPv6SubnetMin" fd00::1 is not aligned to IPv6SubnetLen 64; use fd00::',
            id="v6-min-unaligned",
        ),
        pytest.param(
            {**_NET, "EnableIPv6": True, "IPv6Network": "fd00::/48", "IPv6SubnetMax": "fd01::"},
            '"IPv6SubnetMax" fd01:: is outside IPv6Network fd00::/48',
            id="v6-max-outside",
        ),
        pytest.param(
            {
                **_NET,
                "EnableIPv6": True,
                "IPv6Network": "fd00::/48",
                "IPv6SubnetMin": "fd00:0:0:9::",
                "IPv6SubnetMax": "fd00:0:0:2::",
            },
            '"IPv6SubnetMin" fd00:0:0:9:: is above "IPv6SubnetMax" fd00:0:0:2::',
            id="v6-min-above-max",
        ),
        pytest.param(
            {"Network": "10.244.0.0/16", "network": "10.1.0.0/16"},
            'keys "Network" and "network" differ only in case',
            id="dup-case-top",
        ),
        pytest.param(
            _vx(VNI=1, vni=2), 'Backend keys "VNI" and "vni" differ only in case', id="dup-case-be"
        ),
        pytest.param({**_NET, "Backend": "vxlan"}, '"Backend" must be a JSON object', id="be-str"),
        pytest.param({**_NET, "Backend": {}}, 'Backend has no "Type"', id="be-no-type"),
        pytest.param({**_NET, "Backend": {"Type": ""}}, 'Backend has no "Type"', id="be-empty"),
        pytest.param(
            {**_NET, "Backend": {"Type": 5}}, 'Backend "Type" must be a string', id="be-type-int"
        ),
        pytest.param(
            {**_NET, "Backend": {"Type": "vxlan2"}},
            'Backend "Type" "vxlan2" is not a known backend; set it to one of: '
            "host-gw, vxlan, wireguard",
            id="be-unknown",
        ),
        pytest.param(_vx(VNI="one"), 'Backend "VNI" must be a whole number, not "one"', id="vni"),
        pytest.param(_vx(VNI=0), 'Backend "VNI" 0 is out of range; use 1..16777215', id="vni0"),
        pytest.param(_vx(VNI=1 << 24), "is out of range; use 1..16777215", id="vni-big"),
        pytest.param(_vx(VNI=1.5), "must be a whole number", id="vni-float"),
        pytest.param(_vx(Port=-1), 'Backend "Port" -1 is out of range; use 0..65535', id="port-"),
        pytest.param(_vx(Port=65536), "out of range; use 0..65535", id="port-big"),
        pytest.param(_vx(Port="8472"), "must be a whole number", id="port-str"),
        pytest.param(_vx(MTU=67), 'Backend "MTU" 67 is out of range; use 68..65535', id="mtu"),
        pytest.param(_vx(MTU=65536), 'Backend "MTU" 65536 is out of range', id="mtu-big"),
        pytest.param(_vx(MTU=-1), 'Backend "MTU" -1 is out of range', id="mtu-negative"),
        pytest.param(_vx(MTU="1500"), "must be a whole number", id="mtu-str"),
        pytest.param(_vx(GBP="yes"), 'Backend "GBP" must be true or false', id="gbp"),
        pytest.param(_vx(Learning=1), 'Backend "Learning" must be true or false', id="learn"),
        pytest.param(_vx(DirectRouting="true"), "must be true or false", id="direct"),
    ],
)
def test_config_errors(doc: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_network_config(json.dumps(doc))
    message = str(exc.value)
    assert expected in message
    assert message.startswith("net-conf.json: ")
    assert_one_sentence(message)


@pytest.mark.parametrize("backend", sorted(FLANNEL_ONLY_BACKENDS))
def test_flannel_backends_we_do_not_support(backend: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse({**_NET, "Backend": {"Type": backend.upper()}})
    assert str(exc.value) == (
        f'net-conf.json: flannelpy does not support the "{backend}" backend; '
        'set Backend "Type" to one of: host-gw, vxlan, wireguard'
    )


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ('{\n  "Network": "10.244.0.0/16",\n}', "line 3 column 1"),
        ('{"Network": "10.244.0.0/16"', "line 1 column 28"),
        ("", "line 1 column 1"),
        ('{"Network": "10.244.0.0/16", "SubnetLen": NaN}', "NaN is not valid JSON"),
        (b'{"Network": "\xff"}', "not valid JSON"),
    ],
)
def test_invalid_json(raw: str | bytes, expected: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_network_config(raw)
    assert expected in str(exc.value)
    assert str(exc.value).startswith("net-conf.json: ")


# --------------------------------------------------------------------------- properties

ipv4_networks = st.builds(
    lambda addr, prefix: IPv4Network((addr, prefix), strict=False),
    st.integers(0, 2**32 - 1),
    st.integers(0, 28),
)


def _count(cfg: NetworkConfig) -> int:
    size = 1 << (32 - cfg.subnet_len)
    return (int(cfg.subnet_max) - int(cfg.subnet_min)) // size + 1


@given(ipv4_networks)
def test_derived_range_is_every_subnet_but_the_first(network: IPv4Network) -> None:
    cfg = parse({"Network": str(network)})
    expected_len = 24 if network.prefixlen <= 22 else network.prefixlen + 2
    assert cfg.subnet_len == expected_len
    for bound in (cfg.subnet_min, cfg.subnet_max):
        assert bound in network
        assert IPv4Network((bound, cfg.subnet_len)).network_address == bound
    assert int(cfg.subnet_min) == int(network.network_address) + (1 << (32 - cfg.subnet_len))
    assert _count(cfg) == 2 ** (cfg.subnet_len - network.prefixlen) - 1
    assert _count(cfg) >= 3


@given(ipv4_networks, st.data())
def test_explicit_subnet_len_in_range_is_kept(network: IPv4Network, data: st.DataObject) -> None:
    subnet_len = data.draw(st.integers(network.prefixlen + 2, 30))
    cfg = parse({"Network": str(network), "SubnetLen": subnet_len})
    assert cfg.subnet_len == subnet_len
    assert _count(cfg) == 2 ** (subnet_len - network.prefixlen) - 1
    assert IPv4Network((cfg.subnet_max, subnet_len)).broadcast_address == network.broadcast_address


@given(ipv4_networks, st.data())
def test_explicit_subnet_len_out_of_range_is_refused(
    network: IPv4Network, data: st.DataObject
) -> None:
    subnet_len = data.draw(st.one_of(st.integers(1, network.prefixlen + 1), st.integers(31, 128)))
    with pytest.raises(ConfigError, match="SubnetLen"):
        parse({"Network": str(network), "SubnetLen": subnet_len})


@given(ipv4_networks, st.data())
def test_explicit_aligned_bounds_round_trip(network: IPv4Network, data: st.DataObject) -> None:
    subnet_len = data.draw(st.integers(network.prefixlen + 2, 30))
    subnets = 2 ** (subnet_len - network.prefixlen)
    low, high = sorted(data.draw(st.lists(st.integers(0, subnets - 1), min_size=2, max_size=2)))
    size = 1 << (32 - subnet_len)
    lo_addr = network.network_address + low * size
    hi_addr = network.network_address + high * size
    cfg = parse(
        {
            "Network": str(network),
            "SubnetLen": subnet_len,
            "SubnetMin": str(lo_addr),
            "SubnetMax": str(hi_addr),
        }
    )
    assert (cfg.subnet_min, cfg.subnet_max) == (lo_addr, hi_addr)
    assert _count(cfg) == high - low + 1


@given(
    st.builds(
        lambda addr, prefix: IPv6Network((addr, prefix), strict=False),
        st.integers(0, 2**128 - 1),
        st.integers(1, 124),
    )
)
def test_ipv6_derived_range(network: IPv6Network) -> None:
    cfg = parse({**_NET, "EnableIPv6": True, "IPv6Network": str(network)})
    assert cfg.ipv6_subnet_len == (64 if network.prefixlen <= 62 else network.prefixlen + 2)
    assert cfg.ipv6_subnet_min is not None and cfg.ipv6_subnet_max is not None
    size = 1 << (128 - cfg.ipv6_subnet_len)
    assert int(cfg.ipv6_subnet_min) == int(network.network_address) + size
    assert int(cfg.ipv6_subnet_max) == int(network.broadcast_address) + 1 - size
    for bound in (cfg.ipv6_subnet_min, cfg.ipv6_subnet_max):
        assert bound in network
        assert int(bound) % size == 0


# --------------------------------------------------------------------------- agent flags


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flannelpy")
    add_agent_arguments(parser)
    return parser


def settings(argv: list[str], env: dict[str, str] | None = None) -> AgentSettings:
    environ = {"NODE_NAME": "node-a", **(env or {})}
    return settings_from_args(make_parser().parse_args(argv), environ)


def test_defaults_match_the_dataclass() -> None:
    assert settings([]) == AgentSettings(node_name="node-a")


def test_node_name_defaults_to_the_hostname_without_node_name_env() -> None:
    s = settings_from_args(make_parser().parse_args([]), {})
    assert s.node_name == socket.gethostname()


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], {"NODE_NAME": "from-env"}, "from-env"),
        ([], {"NODE_NAME": "from-env", "FLANNELD_NODE_NAME": "flanneld-env"}, "flanneld-env"),
        (["--node-name", "flag"], {"FLANNELD_NODE_NAME": "flanneld-env"}, "flag"),
    ],
)
def test_node_name_precedence(argv: list[str], env: dict[str, str], expected: str) -> None:
    assert settings_from_args(make_parser().parse_args(argv), env).node_name == expected


def test_every_setting_has_a_kebab_case_flag() -> None:
    parser = make_parser()
    options = {opt for action in parser._actions for opt in action.option_strings}
    for f in fields(AgentSettings):
        assert "--" + f.name.replace("_", "-") in options


def test_help_renders() -> None:
    text = make_parser().format_help()
    assert "--subnet-lease-renew-margin" in text
    assert "FLANNELD_ETCD_ENDPOINTS" in text


@pytest.mark.parametrize(
    ("argv", "env", "field", "expected"),
    [
        (
            ["--etcd-endpoints", "http://a:2379, https://b:2379"],
            {},
            "etcd_endpoints",
            ("http://a:2379", "https://b:2379"),
        ),
        (
            [],
            {"FLANNELD_ETCD_ENDPOINTS": "http://a:2379,http://b:2379"},
            "etcd_endpoints",
            ("http://a:2379", "http://b:2379"),
        ),
        (
            ["--etcd-endpoints=http://flag:2379"],
            {"FLANNELD_ETCD_ENDPOINTS": "http://env:2379"},
            "etcd_endpoints",
            ("http://flag:2379",),
        ),
        ([], {"FLANNELD_PUBLIC_IP": "192.0.2.1"}, "public_ip", IPv4Address("192.0.2.1")),
        (
            ["--public-ip", "192.0.2.2"],
            {"FLANNELD_PUBLIC_IP": "192.0.2.1"},
            "public_ip",
            IPv4Address("192.0.2.2"),
        ),
        ([], {"FLANNELD_PUBLIC_IP": ""}, "public_ip", None),
        (["--public-ip="], {"FLANNELD_PUBLIC_IP": "192.0.2.1"}, "public_ip", None),
        (["--etcd-prefix", "/my/net/"], {}, "etcd_prefix", "/my/net"),
        ([], {"FLANNELD_ETCD_PREFIX": "/env/net"}, "etcd_prefix", "/env/net"),
        (["--etcd-keyfile", "k", "--etcd-certfile", "c"], {}, "etcd_certfile", "c"),
        ([], {"FLANNELD_ETCD_CAFILE": "/ca.pem"}, "etcd_cafile", "/ca.pem"),
        ([], {"FLANNELD_ETCD_USERNAME": "u"}, "etcd_username", "u"),
        (["--etcd-password", "p"], {}, "etcd_password", "p"),
        ([], {"FLANNELD_KUBE_API_URL": "https://k:6443"}, "kube_api_url", "https://k:6443"),
        (["--kubeconfig-file", "/kc"], {}, "kubeconfig_file", "/kc"),
        (
            ["--kube-annotation-prefix", "x.example.com"],
            {},
            "kube_annotation_prefix",
            "x.example.com",
        ),
        (["--net-config-path", "/n.json"], {}, "net_config_path", "/n.json"),
        ([], {"FLANNELD_SUBNET_FILE": "/s.env"}, "subnet_file", "/s.env"),
        (["--iface-can-reach", "192.0.2.9"], {}, "iface_can_reach", "192.0.2.9"),
        ([], {"FLANNELD_SUBNET_LEASE_RENEW_MARGIN": "30"}, "subnet_lease_renew_margin", 30),
        (["--subnet-lease-renew-margin", "1439"], {}, "subnet_lease_renew_margin", 1439),
        (["--iptables-resync", "2.5"], {}, "iptables_resync", 2.5),
        ([], {"FLANNELD_HEALTHZ_IP": "::1"}, "healthz_ip", "::1"),
        (["--healthz-port", "8285"], {"FLANNELD_HEALTHZ_PORT": "1"}, "healthz_port", 8285),
        (["--state-dir", "/st"], {}, "state_dir", "/st"),
        ([], {"FLANNELD_RUN_DIR": "/r"}, "run_dir", "/r"),
        (["--resync-interval", "30"], {}, "resync_interval", 30.0),
        (["--subnet-lease-ttl", "7200"], {}, "subnet_lease_ttl", 7200),
        (["--log-format", "JSON"], {}, "log_format", "json"),
        ([], {"FLANNELD_LOG_LEVEL": "WARN"}, "log_level", "warning"),
        (["--log-level", "debug"], {"FLANNELD_LOG_LEVEL": "error"}, "log_level", "debug"),
    ],
)
def test_values_from_flags_and_env(
    argv: list[str], env: dict[str, str], field: str, expected: Any
) -> None:
    assert getattr(settings(argv, env), field) == expected


@pytest.mark.parametrize(
    ("argv", "env", "iface", "iface_regex"),
    [
        (["--iface", "eth0", "--iface", "10.0.0.1"], {}, ("eth0", "10.0.0.1"), ()),
        ([], {"FLANNELD_IFACE": "eth0, eth1"}, ("eth0", "eth1"), ()),
        (["--iface", "eth2"], {"FLANNELD_IFACE": "eth0,eth1"}, ("eth2",), ()),
        (["--iface=eth0,eth1"], {}, ("eth0", "eth1"), ()),
        (["--iface-regex", "^en", "--iface-regex", "^eth"], {}, (), ("^en", "^eth")),
        # A regex may contain a comma, so the variable is one regex.
        ([], {"FLANNELD_IFACE_REGEX": "^eth[0-9]{1,2}$"}, (), ("^eth[0-9]{1,2}$",)),
        (["--iface-regex", "^en"], {"FLANNELD_IFACE_REGEX": "^eth"}, (), ("^en",)),
    ],
)
def test_repeatable_iface_flags(
    argv: list[str],
    env: dict[str, str],
    iface: tuple[str, ...],
    iface_regex: tuple[str, ...],
) -> None:
    s = settings(argv, env)
    assert (s.iface, s.iface_regex) == (iface, iface_regex)


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        ([], {}, False),
        (["--ip-masq"], {}, True),
        (["--ip-masq=true"], {}, True),
        (["--ip-masq=True"], {}, True),
        (["--ip-masq=1"], {}, True),
        (["--ip-masq=false"], {}, False),
        (["--ip-masq=0"], {}, False),
        (["--ip-masq", "false"], {}, False),
        ([], {"FLANNELD_IP_MASQ": "true"}, True),
        ([], {"FLANNELD_IP_MASQ": "false"}, False),
        (["--ip-masq=false"], {"FLANNELD_IP_MASQ": "true"}, False),
        (["--ip-masq"], {"FLANNELD_IP_MASQ": "false"}, True),
    ],
)
def test_boolean_flag_forms(argv: list[str], env: dict[str, str], expected: bool) -> None:
    assert settings(argv, env).ip_masq is expected


@pytest.mark.parametrize(
    ("argv", "env", "field", "expected"),
    [
        ([], {}, "iptables_forward_rules", True),
        (["--iptables-forward-rules=false"], {}, "iptables_forward_rules", False),
        ([], {"FLANNELD_IPTABLES_FORWARD_RULES": "false"}, "iptables_forward_rules", False),
        (["--kube-subnet-mgr"], {}, "kube_subnet_mgr", True),
        ([], {"FLANNELD_KUBE_SUBNET_MGR": "true"}, "kube_subnet_mgr", True),
        (["--allow-overlap"], {}, "allow_overlap", True),
        ([], {"FLANNELD_ALLOW_OVERLAP": "1"}, "allow_overlap", True),
    ],
)
def test_other_booleans(argv: list[str], env: dict[str, str], field: str, expected: bool) -> None:
    assert getattr(settings(argv, env), field) is expected


def test_bool_flag_does_not_swallow_the_next_flag() -> None:
    s = settings(["--ip-masq", "--kube-subnet-mgr", "--public-ip", "192.0.2.1"])
    assert (s.ip_masq, s.kube_subnet_mgr, s.public_ip) == (True, True, IPv4Address("192.0.2.1"))


@pytest.mark.parametrize(
    ("argv", "env", "expected"),
    [
        (["--public-ip", "10.0.0"], {}, "--public-ip '10.0.0' is not an IPv4 address"),
        ([], {"FLANNELD_PUBLIC_IP": "fd00::1"}, "FLANNELD_PUBLIC_IP 'fd00::1' is not an IPv4"),
        (["--iface-can-reach", "eth0"], {}, "--iface-can-reach 'eth0' is not an IPv4 address"),
        (
            ["--subnet-lease-renew-margin", "0"],
            {},
            "--subnet-lease-renew-margin 0 is out of range; use 1..1439 minutes",
        ),
        (
            [],
            {"FLANNELD_SUBNET_LEASE_RENEW_MARGIN": "1440"},
            "FLANNELD_SUBNET_LEASE_RENEW_MARGIN 1440 is out of range; use 1..1439 minutes",
        ),
        (["--subnet-lease-renew-margin", "1h"], {}, "'1h' is not a whole number"),
        (["--log-format", "xml"], {}, "--log-format 'xml' is not a log format; use text or json"),
        ([], {"FLANNELD_LOG_FORMAT": "yaml"}, "FLANNELD_LOG_FORMAT 'yaml' is not a log format"),
        (["--log-level", "verbose"], {}, "--log-level 'verbose' is not a log level"),
        (["--healthz-port", "70000"], {}, "--healthz-port 70000 is out of range; use 0..65535"),
        ([], {"FLANNELD_HEALTHZ_PORT": "-1"}, "FLANNELD_HEALTHZ_PORT -1 is out of range"),
        (["--healthz-ip", "localhost"], {}, "--healthz-ip 'localhost' is not an IP address"),
        (["--iptables-resync", "0"], {}, "--iptables-resync 0.0 must be positive"),
        (["--iptables-resync", "nan"], {}, "'nan' is not a number of seconds"),
        ([], {"FLANNELD_RESYNC_INTERVAL": "soon"}, "FLANNELD_RESYNC_INTERVAL 'soon' is not"),
        (["--subnet-lease-ttl", "0"], {}, "--subnet-lease-ttl 0 must be positive"),
        (["--ip-masq=maybe"], {}, "--ip-masq 'maybe' is not a boolean; use true or false"),
        ([], {"FLANNELD_IP_MASQ": "yes please"}, "FLANNELD_IP_MASQ 'yes please' is not a boolean"),
        (["--etcd-endpoints", "etcd-0"], {}, "entry 'etcd-0' is not an etcd URL"),
        (["--etcd-endpoints", ","], {}, "--etcd-endpoints is empty"),
        ([], {"FLANNELD_ETCD_ENDPOINTS": "ftp://x"}, "FLANNELD_ETCD_ENDPOINTS entry 'ftp://x'"),
        (["--etcd-prefix", "/"], {}, "--etcd-prefix '/' has no key path"),
        (["--subnet-file="], {}, "--subnet-file is empty"),
        (["--iface-regex", "("], {}, "--iface-regex '(' is not a valid regex"),
        (["--kube-annotation-prefix", "Bad_Prefix"], {}, "'Bad_Prefix' is not an annotation"),
        (["--etcd-keyfile", "k"], {}, "--etcd-keyfile and --etcd-certfile go together"),
        ([], {"FLANNELD_ETCD_CERTFILE": "c"}, "--etcd-keyfile and --etcd-certfile go together"),
        (
            ["--subnet-lease-ttl", "3600"],
            {},
            "--subnet-lease-renew-margin 60 minutes is not shorter than the lease lifetime "
            "(--subnet-lease-ttl 3600 seconds = 60 minutes)",
        ),
        (
            ["--subnet-lease-renew-margin", "120"],
            {"FLANNELD_SUBNET_LEASE_TTL": "3600"},
            "--subnet-lease-renew-margin 120 minutes is not shorter than the lease lifetime "
            "(FLANNELD_SUBNET_LEASE_TTL 3600 seconds",
        ),
    ],
)
def test_flag_errors(argv: list[str], env: dict[str, str], expected: str) -> None:
    with pytest.raises(ConfigError) as exc:
        settings(argv, env)
    assert expected in str(exc.value)
    assert_one_sentence(str(exc.value))


def test_short_ttl_with_small_margin_is_fine() -> None:
    s = settings(["--subnet-lease-ttl", "3600", "--subnet-lease-renew-margin", "59"])
    assert (s.subnet_lease_ttl, s.subnet_lease_renew_margin) == (3600, 59)


def test_settings_from_a_namespace_without_agent_flags_uses_env_and_defaults() -> None:
    s = settings_from_args(argparse.Namespace(), {"FLANNELD_IP_MASQ": "true", "NODE_NAME": "n"})
    assert s == AgentSettings(ip_masq=True, node_name="n")
