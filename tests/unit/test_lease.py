"""Lease keys and lease JSON, byte-compatible with Flannel."""

from __future__ import annotations

import json
from ipaddress import IPv4Address, IPv4Network, IPv6Network

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flannelpy.subnet.keys import key_to_subnet, subnet_to_key
from flannelpy.subnet.lease import Lease, LeaseAttrs

FLANNEL_VXLAN = (
    '{"PublicIP":"192.168.64.3","PublicIPv6":null,"BackendType":"vxlan",'
    '"BackendData":{"VNI":1,"VtepMAC":"c6:d2:32:6f:8f:44"}}'
)


def test_flannel_vxlan_lease_value_parses() -> None:
    attrs = LeaseAttrs.from_json(FLANNEL_VXLAN)
    assert attrs.public_ip == IPv4Address("192.168.64.3")
    assert attrs.public_ipv6 is None
    assert attrs.backend_type == "vxlan"
    assert attrs.backend_data == {"VNI": 1, "VtepMAC": "c6:d2:32:6f:8f:44"}
    assert attrs.vtep_mac == "c6:d2:32:6f:8f:44"
    assert (attrs.node_name, attrs.mtu) == (None, None)


def test_flannel_vxlan_lease_value_round_trips_byte_for_byte() -> None:
    assert LeaseAttrs.from_json(FLANNEL_VXLAN).to_json() == FLANNEL_VXLAN


def test_host_gw_lease_has_no_backend_data() -> None:
    raw = '{"PublicIP":"10.0.0.2","PublicIPv6":null,"BackendType":"host-gw"}'
    attrs = LeaseAttrs.from_json(raw)
    assert (attrs.backend_type, attrs.backend_data, attrs.vtep_mac) == ("host-gw", None, None)
    assert attrs.to_json() == raw
    assert "BackendData" not in json.loads(attrs.to_json())


def test_extension_key_round_trips_and_flannel_keys_stay_as_they_are() -> None:
    attrs = LeaseAttrs(
        public_ip=IPv4Address("10.0.0.2"),
        backend_type="vxlan",
        backend_data={"VNI": 1, "VtepMAC": "aa:bb:cc:dd:ee:ff"},
        node_name="node-a",
        mtu=1450,
    )
    doc = json.loads(attrs.to_json())
    assert doc["Flannelpy"] == {"NodeName": "node-a", "MTU": 1450}
    assert doc["PublicIP"] == "10.0.0.2" and doc["BackendType"] == "vxlan"
    assert LeaseAttrs.from_json(attrs.to_json()) == attrs


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ("not json", "not JSON"),
        ("[1, 2]", "not a JSON object"),
        ('{"BackendType": "vxlan"}', "PublicIP"),
        ('{"PublicIP": "fd00::1", "BackendType": "vxlan"}', "PublicIP"),
    ],
)
def test_bad_lease_values_raise_value_error_naming_the_problem(raw: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LeaseAttrs.from_json(raw)


@pytest.mark.parametrize(
    ("v4", "v6", "key"),
    [
        ("10.244.1.0/24", None, "10.244.1.0-24"),
        ("10.12.13.0/24", "fd00:12:13::/56", "10.12.13.0-24&fd00:12:13::-56"),
    ],
)
def test_lease_keys_are_flannels(v4: str, v6: str | None, key: str) -> None:
    ipv6 = IPv6Network(v6) if v6 else None
    assert subnet_to_key(IPv4Network(v4), ipv6) == key
    assert key_to_subnet(key) == (IPv4Network(v4), ipv6)
    lease = Lease(IPv4Network(v4), LeaseAttrs(IPv4Address("10.0.0.1"), "vxlan"), ipv6_subnet=ipv6)
    assert lease.key == key


@pytest.mark.parametrize("key", ["config", "10.244.1.0", "10.244.1.1-24", "fd00::-64", "x-24"])
def test_non_lease_keys_are_rejected(key: str) -> None:
    with pytest.raises(ValueError):
        key_to_subnet(key)


@given(st.integers(0, 2**32 - 1), st.integers(8, 30))
def test_key_round_trip_for_any_subnet(address: int, prefixlen: int) -> None:
    subnet = IPv4Network((address, prefixlen), strict=False)
    assert key_to_subnet(subnet_to_key(subnet)) == (subnet, None)


def test_lease_vtep_ip_and_gateway() -> None:
    lease = Lease(IPv4Network("10.244.1.0/24"), LeaseAttrs(IPv4Address("10.0.0.1"), "vxlan"))
    assert str(lease.vtep_ip) == "10.244.1.0"
    assert str(lease.gateway) == "10.244.1.1"


def test_direct_routing_extension_is_written_only_when_true() -> None:
    data = {"VNI": 1, "VtepMAC": "aa:bb:cc:dd:ee:ff"}
    base = LeaseAttrs(IPv4Address("10.0.0.2"), "vxlan", data)
    with_dr = LeaseAttrs(IPv4Address("10.0.0.2"), "vxlan", data, direct_routing=True)
    doc = json.loads(with_dr.to_json())
    assert doc["Flannelpy"] == {"DirectRouting": True}
    assert {k: v for k, v in doc.items() if k != "Flannelpy"} == json.loads(base.to_json())
    assert LeaseAttrs.from_json(with_dr.to_json()) == with_dr
    assert "Flannelpy" not in json.loads(base.to_json())


@pytest.mark.parametrize("ext", ['{"DirectRouting": false}', '{"DirectRouting": "yes"}', "{}"])
def test_direct_routing_is_none_unless_the_extension_says_true(ext: str) -> None:
    raw = f'{{"PublicIP":"10.0.0.2","BackendType":"vxlan","Flannelpy":{ext}}}'
    assert LeaseAttrs.from_json(raw).direct_routing is None
