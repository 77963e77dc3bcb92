"""IPv6-only leases (EnableIPv4 false) in Flannel's formats: the key is MakeSubnetKey
with an empty IPv4 subnet, ``0.0.0.0-0&fd10:244:0:5::-64``, and the value has
``"PublicIP":"0.0.0.0"`` (Go's zero ip.IP4) beside PublicIPv6."""

from __future__ import annotations

import json
from ipaddress import IPv6Address, IPv6Network

import pytest

from flannelpy.subnet.keys import key_to_subnet, lease_key, subnet_to_key
from flannelpy.subnet.lease import Lease, LeaseAttrs

V6 = IPv6Network("fd10:244:0:5::/64")
# What flanneld v0.28.9 writes for an IPv6-only vxlan lease (BackendData absent).
FLANNELD_VALUE = (
    '{"PublicIP":"0.0.0.0","PublicIPv6":"fd00:64:1::2","BackendType":"vxlan",'
    '"BackendV6Data":{"VNI":1,"VtepMAC":"c6:d2:32:6f:8f:44"}}'
)


def test_an_ipv6_only_key_is_flannels_and_parses_back() -> None:
    assert subnet_to_key(None, V6) == "0.0.0.0-0&fd10:244:0:5::-64"
    assert lease_key("/coreos.com/network", None, V6) == (
        "/coreos.com/network/subnets/0.0.0.0-0&fd10:244:0:5::-64"
    )
    assert key_to_subnet("0.0.0.0-0&fd10:244:0:5::-64") == (None, V6)


@pytest.mark.parametrize("key", ["0.0.0.0-0", "0.0.0.0-0&", "0.0.0.0-0&10.0.0.0-8"])
def test_a_key_without_any_subnet_is_refused(key: str) -> None:
    with pytest.raises(ValueError):
        key_to_subnet(key)


def test_a_lease_needs_a_subnet_of_one_family() -> None:
    attrs = LeaseAttrs(public_ip=None, backend_type="vxlan", public_ipv6=IPv6Address("fd00::2"))
    with pytest.raises(ValueError, match="IPv4 or an IPv6 subnet"):
        Lease(None, attrs)
    lease = Lease(None, attrs, ipv6_subnet=V6)
    assert lease.key == "0.0.0.0-0&fd10:244:0:5::-64"
    assert (lease.vtep_ip, lease.gateway) == (None, None)
    assert lease.vtep_ip6 == V6.network_address and lease.subnets == (V6,)
    with pytest.raises(ValueError, match="no IPv4 subnet"):
        _ = lease.ipv4_subnet


def test_the_value_is_flannels_byte_for_byte_and_flanneld_s_parses() -> None:
    attrs = LeaseAttrs.from_json(FLANNELD_VALUE)
    assert attrs.public_ip is None and attrs.public_ipv6 == IPv6Address("fd00:64:1::2")
    assert attrs.vtep_mac_v6 == "c6:d2:32:6f:8f:44" and attrs.backend_data is None
    ours = LeaseAttrs(
        public_ip=None,
        backend_type="vxlan",
        public_ipv6=IPv6Address("fd00:64:1::2"),
        backend_v6_data={"VNI": 1, "VtepMAC": "c6:d2:32:6f:8f:44"},
    )
    assert ours.to_json() == FLANNELD_VALUE
    assert json.loads(ours.to_json())["PublicIP"] == "0.0.0.0"


def test_a_value_with_neither_address_is_refused() -> None:
    with pytest.raises(ValueError, match="neither a PublicIP nor a PublicIPv6"):
        LeaseAttrs.from_json('{"PublicIP":"0.0.0.0","PublicIPv6":null,"BackendType":"vxlan"}')
