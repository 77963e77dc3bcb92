"""Kubernetes mode, pure part: Node JSON → leases, status patches, identity."""

from __future__ import annotations

from dataclasses import replace
from ipaddress import IPv4Address, IPv4Network, IPv6Network
from typing import Any

import pytest

from flannelpy.config.netconf import parse_network_config
from flannelpy.errors import ConfigError
from flannelpy.store.kube import node as kn
from flannelpy.subnet.lease import LeaseAttrs
from tests.support.kube_standin import json_merge, strategic_merge

KEYS = kn.annotation_keys("flannel.alpha.coreos.com")
P = "flannel.alpha.coreos.com/"
CONFIG = parse_network_config('{"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan"}}')
DUAL = parse_network_config(
    '{"Network": "10.244.0.0/16", "EnableIPv6": true, "IPv6Network": "fd00:10:244::/56"}'
)
MAC = "0e:00:00:00:00:01"


def node(
    name: str = "n1",
    pod_cidrs: list[str] | None = None,
    notes: dict[str, str] | None = None,
    conditions: list[dict[str, Any]] | None = None,
    legacy_cidr: str | None = None,
) -> dict[str, Any]:
    spec: dict[str, Any] = {}
    if pod_cidrs is not None:
        spec["podCIDRs"] = pod_cidrs
        spec["podCIDR"] = pod_cidrs[0] if pod_cidrs else None
    if legacy_cidr is not None:
        spec["podCIDR"] = legacy_cidr
    return {
        "metadata": {"name": name, "annotations": notes or {}, "resourceVersion": "7"},
        "spec": spec,
        "status": {"conditions": conditions or []},
    }


def managed(
    ip: str = "192.168.1.2", data: str = '{"VNI":1,"VtepMAC":"0e:00:00:00:00:01"}', **extra: str
) -> dict[str, str]:
    notes = {
        P + "kube-subnet-manager": "true",
        P + "backend-type": "vxlan",
        P + "backend-data": data,
        P + "public-ip": ip,
    }
    notes.update({P + k.replace("_", "-"): v for k, v in extra.items()})
    return notes


def attrs(ip: str = "192.168.1.1", mac: str = MAC, mtu: int | None = 1450) -> LeaseAttrs:
    return LeaseAttrs(IPv4Address(ip), "vxlan", {"VNI": 1, "VtepMAC": mac}, mtu=mtu)


UP = [{"type": "NetworkUnavailable", "status": "False", "reason": "FlannelIsUp"}]


# -- annotation keys -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("prefix", "managed_key"),
    [
        ("flannel.alpha.coreos.com", "flannel.alpha.coreos.com/kube-subnet-manager"),
        ("example.com/", "example.com/kube-subnet-manager"),
        ("example.com/net", "example.com/net-kube-subnet-manager"),
        ("example.com/net-", "example.com/net-kube-subnet-manager"),
    ],
)
def test_annotation_prefix_follows_flannel(prefix: str, managed_key: str) -> None:
    keys = kn.annotation_keys(prefix)
    assert keys.managed == managed_key
    assert keys.public_ip.endswith("public-ip") and keys.mtu.endswith("flannelpy-mtu")


def test_annotation_prefix_with_two_slashes_is_refused() -> None:
    with pytest.raises(ConfigError, match="more than one slash"):
        kn.annotation_keys("a.com/b/c")


def test_flannels_annotation_names() -> None:
    expected = kn.AnnotationKeys(
        managed=P + "kube-subnet-manager",
        backend_type=P + "backend-type",
        backend_data=P + "backend-data",
        backend_v6_data=P + "backend-v6-data",
        public_ip=P + "public-ip",
        public_ipv6=P + "public-ipv6",
        public_ip_overwrite=P + "public-ip-overwrite",
        public_ipv6_overwrite=P + "public-ipv6-overwrite",
        node_public_ip=P + "node-public-ip",
        node_public_ipv6=P + "node-public-ipv6",
        mtu=P + "flannelpy-mtu",
        direct_routing=P + "flannelpy-direct-routing",
    )
    assert expected == KEYS


# -- identity ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("configured", "environ", "expected"),
    [
        (None, {"NODE_NAME": "n1"}, kn.NodeIdentity(node_name="n1")),
        (
            "host",
            {"NODE_NAME": "n1", "POD_NAME": "p", "POD_NAMESPACE": "ns"},
            kn.NodeIdentity(node_name="n1"),
        ),
        (
            "host",
            {"POD_NAME": "p", "POD_NAMESPACE": "ns"},
            kn.NodeIdentity(pod_namespace="ns", pod_name="p"),
        ),
        (
            "explicit",
            {"POD_NAME": "p", "POD_NAMESPACE": "ns"},
            kn.NodeIdentity(node_name="explicit"),
        ),
        ("host", {"POD_NAME": "p"}, kn.NodeIdentity(node_name="host")),
        ("host", {}, kn.NodeIdentity(node_name="host")),
    ],
)
def test_identity_order(
    configured: str | None, environ: dict[str, str], expected: kn.NodeIdentity
) -> None:
    assert kn.resolve_identity(configured, environ, hostname="host") == expected


def test_no_identity_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="set NODE_NAME"):
        kn.resolve_identity(None, {"POD_NAME": "p"}, hostname="host")


# -- pod CIDRs ----------------------------------------------------------------------------


def test_pod_cidrs_dual_stack_and_legacy() -> None:
    dual = node(pod_cidrs=["10.244.1.0/24", "fd00:10:244:1::/64"])
    assert kn.pod_cidrs(dual) == (IPv4Network("10.244.1.0/24"), IPv6Network("fd00:10:244:1::/64"))
    assert kn.pod_cidrs(node(legacy_cidr="10.244.2.0/24")) == (IPv4Network("10.244.2.0/24"), None)
    assert kn.pod_cidrs(node()) == (None, None)
    assert kn.pod_cidrs(node(pod_cidrs=["fd00:10:244:1::/64"])) == (
        None,
        IPv6Network("fd00:10:244:1::/64"),
    )


@pytest.mark.parametrize(
    "cidrs", [["10.244.1.0/33"], ["garbage"], ["10.244.1.0/24", "10.244.2.0/24"]]
)
def test_bad_pod_cidrs(cidrs: list[str]) -> None:
    with pytest.raises(ValueError):
        kn.pod_cidrs(node(pod_cidrs=cidrs))
    with pytest.raises(ConfigError, match=r"fix spec\.podCIDRs"):
        kn.own_subnets(node(pod_cidrs=cidrs), CONFIG)


def test_own_subnets() -> None:
    assert kn.own_subnets(node(), CONFIG) is None
    assert kn.own_subnets(node(pod_cidrs=["10.244.1.0/24"]), CONFIG) == (
        IPv4Network("10.244.1.0/24"),
        None,
    )
    with pytest.raises(ConfigError, match=r"outside Network 10\.244\.0\.0/16.*--cluster-cidr"):
        kn.own_subnets(node(pod_cidrs=["10.9.1.0/24"]), CONFIG)
    v6 = node(pod_cidrs=["10.244.1.0/24", "fd00:10:244:1::/64"])
    assert kn.own_subnets(v6, CONFIG) == (IPv4Network("10.244.1.0/24"), None)
    assert kn.own_subnets(v6, DUAL) == (
        IPv4Network("10.244.1.0/24"),
        IPv6Network("fd00:10:244:1::/64"),
    )
    with pytest.raises(ConfigError, match="outside IPv6Network"):
        kn.own_subnets(node(pod_cidrs=["10.244.1.0/24", "fd00:99::/64"]), DUAL)


# -- nodes → leases ------------------------------------------------------------------------


def test_node_to_lease() -> None:
    lease = kn.node_to_lease(
        node("n2", ["10.244.2.0/24"], managed(flannelpy_mtu="1400")), KEYS, CONFIG
    )
    assert lease is not None
    assert lease.key == "10.244.2.0-24"
    assert lease.attrs == LeaseAttrs(
        public_ip=IPv4Address("192.168.1.2"),
        backend_type="vxlan",
        backend_data={"VNI": 1, "VtepMAC": MAC},
        node_name="n2",
        mtu=1400,
    )


@pytest.mark.parametrize(
    "subject",
    [
        node("n2", ["10.244.2.0/24"], {}),  # not managed
        node("n2", ["10.244.2.0/24"], {P + "kube-subnet-manager": "false"}),
        node("n2", None, managed()),  # no podCIDR yet
    ],
)
def test_nodes_that_are_not_peers(subject: dict[str, Any]) -> None:
    assert kn.node_to_lease(subject, KEYS, CONFIG) is None


@pytest.mark.parametrize(
    ("subject", "reason"),
    [
        (node("n2", ["10.244.2.0/24"], managed(ip="")), "not an IPv4 address"),
        (node("n2", ["10.244.2.0/24"], managed(ip="fd00::1")), "not an IPv4 address"),
        (node("n2", ["10.244.2.0/24"], managed(data="{not json")), "not a JSON object"),
        (node("n2", ["10.99.2.0/24"], managed()), "outside Network"),
        (node("n2", ["10.244.2.0/99"], managed()), "not a CIDR"),
    ],
)
def test_managed_nodes_with_bad_data(subject: dict[str, Any], reason: str) -> None:
    with pytest.raises(kn.NotALease, match=reason):
        kn.node_to_lease(subject, KEYS, CONFIG)


def test_overwrite_and_host_gw() -> None:
    notes = managed(data="null", public_ip_overwrite="203.0.113.5")
    notes[P + "backend-type"] = "host-gw"
    lease = kn.node_to_lease(node("n2", ["10.244.2.0/24"], notes), KEYS, CONFIG)
    assert lease is not None
    assert lease.attrs.public_ip == IPv4Address("203.0.113.5")
    assert lease.attrs.backend_type == "host-gw" and lease.attrs.backend_data is None
    # An overwrite that is not an address is ignored, as if absent.
    bad = managed(public_ip_overwrite="nope")
    lease = kn.node_to_lease(node("n2", ["10.244.2.0/24"], bad), KEYS, CONFIG)
    assert lease is not None and lease.attrs.public_ip == IPv4Address("192.168.1.2")


def test_dual_stack_lease_key_only_with_ipv6_enabled() -> None:
    subject = node("n2", ["10.244.2.0/24", "fd00:10:244:2::/64"], managed())
    v4 = kn.node_to_lease(subject, KEYS, CONFIG)
    dual = kn.node_to_lease(subject, KEYS, DUAL)
    assert v4 is not None and v4.key == "10.244.2.0-24"
    assert dual is not None and dual.key == "10.244.2.0-24&fd00:10:244:2::-64"


def test_collisions_keep_our_node_then_the_first_name() -> None:
    def lease(name: str, cidr: str) -> Any:
        return kn.node_to_lease(node(name, [cidr], managed()), KEYS, CONFIG)

    by_node = {
        "b": lease("b", "10.244.1.0/24"),
        "a": lease("a", "10.244.1.0/24"),
        "c": lease("c", "10.244.2.0/24"),
    }
    kept = kn.leases_by_key(by_node, own_node="b")
    assert {k: v.attrs.node_name for k, v in kept.items()} == {
        "10.244.1.0-24": "b",
        "10.244.2.0-24": "c",
    }
    assert kn.duplicate_claims(by_node, kept) == ["a"]
    kept = kn.leases_by_key(by_node, own_node="z")
    assert kept["10.244.1.0-24"].attrs.node_name == "a"
    assert kn.duplicate_claims(by_node, kept) == ["b"]


# -- our node ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ('{"VNI":1,"VtepMAC":"0E:00:00:00:00:AA"}', "0e:00:00:00:00:aa"),
        ('{"VNI":1}', None),
        ('{"VtepMAC":"0e:00:00:00:00"}', None),
        ("null", None),
        ("not json", None),
    ],
)
def test_own_vtep_mac(data: str, expected: str | None) -> None:
    assert kn.own_vtep_mac(node(notes={P + "backend-data": data}), KEYS) == expected


def test_node_public_ip() -> None:
    assert kn.node_public_ip(node(notes={P + "node-public-ip": "198.51.100.1"}), KEYS) == (
        IPv4Address("198.51.100.1")
    )
    assert kn.node_public_ip(node(notes={P + "node-public-ip": "x"}), KEYS) is None
    assert kn.node_public_ip(node(), KEYS) is None


def test_first_patch_writes_everything() -> None:
    own = attrs()
    patch = kn.status_patch(node(), own, KEYS, now=1_700_000_000)
    assert patch == {
        "metadata": {
            "annotations": {
                P + "kube-subnet-manager": "true",
                P + "backend-type": "vxlan",
                P + "backend-data": '{"VNI":1,"VtepMAC":"0e:00:00:00:00:01"}',
                P + "public-ip": "192.168.1.1",
                P + "flannelpy-mtu": "1450",
                P + "flannelpy-direct-routing": "false",
            }
        },
        "status": {
            "conditions": [
                {
                    "type": "NetworkUnavailable",
                    "status": "False",
                    "reason": "FlannelIsUp",
                    "message": "Flannel is running on this node",
                    "lastTransitionTime": "2023-11-14T22:13:20Z",
                    "lastHeartbeatTime": "2023-11-14T22:13:20Z",
                }
            ]
        },
    }
    assert kn.changed_keys(patch)[-1] == "condition/NetworkUnavailable"


def test_no_patch_when_nothing_differs() -> None:
    own = attrs()
    current = kn.desired_annotations(own, KEYS)
    current[P + "backend-data"] = '{"VtepMAC": "0e:00:00:00:00:01", "VNI": 1}'  # same JSON
    current["other.example.com/keep"] = "x"
    assert kn.status_patch(node(notes=current, conditions=UP), own, KEYS, now=0) is None


def test_patch_holds_only_what_differs() -> None:
    own = attrs()
    current = kn.desired_annotations(own, KEYS)
    current[P + "public-ip"] = "10.0.0.1"
    wrong_reason = [{"type": "NetworkUnavailable", "status": "False", "reason": "RouteCreated"}]
    patch = kn.status_patch(node(notes=current, conditions=wrong_reason), own, KEYS, now=0)
    assert patch is not None
    assert patch["metadata"] == {"annotations": {P + "public-ip": "192.168.1.1"}}
    assert patch["status"]["conditions"][0]["reason"] == "FlannelIsUp"


def test_host_gw_backend_data_is_null_and_no_mtu_key_without_mtu() -> None:
    own = LeaseAttrs(IPv4Address("192.168.1.1"), "host-gw", None)
    wanted = kn.desired_annotations(own, KEYS)
    assert wanted[P + "backend-data"] == "null"
    assert P + "flannelpy-mtu" not in wanted


def test_advertised_attrs_apply_the_overwrite() -> None:
    subject = node("n1", notes={P + "public-ip-overwrite": "203.0.113.1"})
    advertised = kn.advertised_attrs(attrs(), subject, KEYS)
    assert advertised.public_ip == IPv4Address("203.0.113.1")
    assert advertised.node_name == "n1"
    assert kn.desired_annotations(advertised, KEYS)[P + "public-ip"] == "203.0.113.1"


# -- the stand-in's patch semantics (what the tests above rely on) ---------------------------


def test_strategic_merge_merges_conditions_by_type() -> None:
    before: dict[str, Any] = {
        "metadata": {"annotations": {"a": "1", "b": "2"}},
        "status": {
            "conditions": [
                {"type": "Ready", "status": "True"},
                {"type": "NetworkUnavailable", "status": "True"},
            ]
        },
    }
    patch = {
        "metadata": {"annotations": {"b": None, "c": "3"}},
        "status": {"conditions": [{"type": "NetworkUnavailable", "status": "False"}]},
    }
    after = strategic_merge(before, patch)
    assert after["metadata"]["annotations"] == {"a": "1", "c": "3"}
    assert after["status"]["conditions"] == [
        {"type": "Ready", "status": "True"},
        {"type": "NetworkUnavailable", "status": "False"},
    ]
    # A JSON merge patch replaces the list instead.
    replaced = json_merge(before, patch)
    assert replaced["status"]["conditions"] == [{"type": "NetworkUnavailable", "status": "False"}]
    assert before["metadata"]["annotations"] == {"a": "1", "b": "2"}


def test_direct_routing_travels_in_an_annotation_of_ours() -> None:
    """Both ends of a pair of our nodes must know each other's DirectRouting (etcd
    leases carry it in our extension; Node annotations in this one)."""
    own = replace(attrs(), direct_routing=True)
    notes = kn.desired_annotations(own, KEYS)
    assert notes[P + "flannelpy-direct-routing"] == "true"
    peer = node(notes={**notes}, pod_cidrs=["10.244.3.0/24"])
    lease = kn.node_to_lease(peer, KEYS, CONFIG)
    assert lease is not None and lease.attrs.direct_routing is True
    off = kn.desired_annotations(replace(own, direct_routing=None), KEYS)
    assert off[P + "flannelpy-direct-routing"] == "false"
