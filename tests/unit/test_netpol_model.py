"""NetworkPolicy, Pod and Namespace parsing: the API's semantics, and refusals with a reason."""

from __future__ import annotations

import itertools
from ipaddress import IPv4Address, IPv4Network, IPv6Address, ip_network
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flannelpy.netpol.model import (
    EGRESS,
    INGRESS,
    ContainerPort,
    IPBlock,
    LabelSelector,
    PolicyRefused,
    Port,
    Requirement,
    parse_namespace,
    parse_pod,
    parse_policy,
)


def policy(spec: dict[str, Any], name: str = "p", namespace: str = "ns") -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": namespace}, "spec": spec}


def selector(raw: dict[str, Any]) -> LabelSelector:
    parsed = parse_policy(policy({"podSelector": raw})).pod_selector
    return parsed


LABELS = {"app": "web", "tier": "front"}


@pytest.mark.parametrize(
    ("raw", "labels", "selected"),
    [
        ({}, {}, True),  # an empty selector selects everything
        ({}, LABELS, True),
        ({"matchLabels": {"app": "web"}}, LABELS, True),
        ({"matchLabels": {"app": "db"}}, LABELS, False),
        ({"matchLabels": {"app": "web", "tier": "back"}}, LABELS, False),
        ({"matchExpressions": [{"key": "app", "operator": "In", "values": ["db", "web"]}]},
         LABELS, True),
        ({"matchExpressions": [{"key": "app", "operator": "In", "values": ["db"]}]},
         LABELS, False),
        ({"matchExpressions": [{"key": "app", "operator": "In", "values": ["web"]}]}, {}, False),
        ({"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["db"]}]},
         LABELS, True),
        ({"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["web"]}]},
         LABELS, False),
        # NotIn matches an object without the key
        ({"matchExpressions": [{"key": "app", "operator": "NotIn", "values": ["web"]}]}, {}, True),
        ({"matchExpressions": [{"key": "tier", "operator": "Exists"}]}, LABELS, True),
        ({"matchExpressions": [{"key": "zone", "operator": "Exists"}]}, LABELS, False),
        ({"matchExpressions": [{"key": "zone", "operator": "DoesNotExist"}]}, LABELS, True),
        ({"matchExpressions": [{"key": "tier", "operator": "DoesNotExist"}]}, LABELS, False),
        # matchLabels AND matchExpressions
        ({"matchLabels": {"app": "web"},
          "matchExpressions": [{"key": "tier", "operator": "DoesNotExist"}]}, LABELS, False),
    ],
)  # fmt: skip
def test_selectors_select_as_the_api_defines(
    raw: dict[str, Any], labels: dict[str, str], selected: bool
) -> None:
    assert selector(raw).matches(labels) is selected


def test_expressions_are_kept_sorted_and_deduplicated() -> None:
    raw = {
        "matchExpressions": [
            {"key": "b", "operator": "In", "values": ["y", "x", "x"]},
            {"key": "a", "operator": "Exists"},
            {"key": "a", "operator": "Exists"},
        ]
    }
    assert selector(raw).expressions == (
        Requirement("a", "Exists"),
        Requirement("b", "In", ("x", "y")),
    )


@pytest.mark.parametrize(
    ("spec", "types", "ingress_rules", "egress_rules"),
    [
        ({"podSelector": {}}, {INGRESS}, 0, 0),
        ({"podSelector": {}, "ingress": [{}]}, {INGRESS}, 1, 0),
        ({"podSelector": {}, "egress": [{}]}, {INGRESS, EGRESS}, 0, 1),
        ({"podSelector": {}, "ingress": [{}], "egress": [{}]}, {INGRESS, EGRESS}, 1, 1),
        ({"podSelector": {}, "egress": []}, {INGRESS}, 0, 0),  # empty list: no egress rules
        ({"podSelector": {}, "policyTypes": []}, {INGRESS}, 0, 0),
        ({"podSelector": {}, "policyTypes": ["Egress"]}, {EGRESS}, 0, 0),
        # rules of a direction not in policyTypes are ignored
        ({"podSelector": {}, "policyTypes": ["Egress"], "ingress": [{}]}, {EGRESS}, 0, 0),
        ({"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}, {INGRESS, EGRESS}, 0, 0),
    ],
)
def test_policy_types_default_as_the_api_defines(
    spec: dict[str, Any], types: set[str], ingress_rules: int, egress_rules: int
) -> None:
    parsed = parse_policy(policy(spec))
    assert parsed.policy_types == types
    assert (len(parsed.ingress), len(parsed.egress)) == (ingress_rules, egress_rules)


def test_peers_ports_and_ip_blocks_parse_to_values() -> None:
    parsed = parse_policy(
        policy(
            {
                "podSelector": {"matchLabels": {"app": "db"}},
                "ingress": [
                    {
                        "from": [
                            {"podSelector": {"matchLabels": {"app": "web"}}},
                            {"namespaceSelector": {}},
                            {"namespaceSelector": {}, "podSelector": {}},
                            {"ipBlock": {"cidr": "10.0.0.1/8", "except": ["10.1.0.0/16"]}},
                            {"ipBlock": {"cidr": "fd00::/8", "except": ["fd00:1::/32"]}},
                        ],
                        "ports": [
                            {"port": 80},
                            {"protocol": "UDP", "port": 53, "endPort": 60},
                            {"protocol": "SCTP"},
                            {"port": "http"},
                        ],
                    }
                ],
            }
        )
    )
    rule = parsed.ingress[0]
    web = LabelSelector((("app", "web"),))
    assert [(p.pod_selector, p.namespace_selector) for p in rule.peers[:3]] == [
        (web, None),
        (None, LabelSelector()),
        (LabelSelector(), LabelSelector()),
    ]
    # host bits are masked as the API server does
    assert rule.peers[3].ip_block == IPBlock(ip_network("10.0.0.0/8"), (ip_network("10.1.0.0/16"),))
    assert rule.peers[4].ip_block is not None and rule.peers[4].ip_block.cidr.version == 6
    assert rule.ports == (
        Port("TCP", 80),
        Port("UDP", 53, 60),
        Port("SCTP"),
        Port("TCP", "http"),
    )


def test_an_ip_block_minus_its_excepts_is_disjoint_networks() -> None:
    block = IPBlock(
        ip_network("10.0.0.0/24"), (ip_network("10.0.0.0/26"), ip_network("10.0.0.128/25"))
    )
    assert [str(n) for n in block.networks()] == ["10.0.0.64/26"]
    v6 = IPBlock(ip_network("fd00::/126"), (ip_network("fd00::1/128"),))
    assert [str(n) for n in v6.networks()] == ["fd00::/128", "fd00::2/127"]


REFUSALS = [
    ({"ingress": [{}]}, "spec.podSelector is missing"),
    ({"podSelector": {"matchExpressions": [{"key": "a", "operator": "Equals", "values": ["b"]}]}},
     "unknown operator 'Equals'"),
    ({"podSelector": {"matchExpressions": [{"key": "a", "operator": "In"}]}}, "has no values"),
    ({"podSelector": {"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["b"]}]}},
     "has values"),
    ({"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/33"}}]}]},
     "is not a CIDR"),
    ({"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/8",
                                                            "except": ["11.0.0.0/16"]}}]}]},
     "except 11.0.0.0/16 is not inside cidr 10.0.0.0/8"),
    ({"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/8",
                                                            "except": ["10.0.0.0/8"]}}]}]},
     "is not inside cidr"),
    ({"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/8",
                                                            "except": ["fd00::/16"]}}]}]},
     "is not inside cidr"),
    ({"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/8"},
                                                "podSelector": {}}]}]},
     "ipBlock beside a selector"),
    ({"podSelector": {}, "ingress": [{"from": [{}]}]}, "has no podSelector"),
    ({"podSelector": {}, "ingress": [{"ports": [{"port": 0}]}]}, "port 0 is not a number"),
    ({"podSelector": {}, "ingress": [{"ports": [{"port": 65536}]}]}, "port 65536"),
    ({"podSelector": {}, "ingress": [{"ports": [{"port": 80, "endPort": 79}]}]},
     "endPort 79 is below port 80"),
    ({"podSelector": {}, "ingress": [{"ports": [{"port": "http", "endPort": 90}]}]},
     "endPort is set with the named port 'http'"),
    ({"podSelector": {}, "ingress": [{"ports": [{"endPort": 90}]}]}, "endPort is set without"),
    ({"podSelector": {}, "ingress": [{"ports": [{"port": "Not_A_Name"}]}]}, "is not a port name"),
    ({"podSelector": {}, "ingress": [{"ports": [{"port": "80"}]}]}, "is not a port name"),
    ({"podSelector": {}, "ingress": [{"ports": [{"protocol": "ICMP"}]}]},
     "protocol 'ICMP' is not TCP, UDP or SCTP"),
    ({"podSelector": {}, "policyTypes": ["Both"]}, "policyType 'Both'"),
    ({"podSelector": {}, "ingress": {"from": []}}, "spec.ingress is not a list"),
    ({"podSelector": {"matchLabels": {"a": 1}}}, "label is not a string"),
    # fields this agent does not know might narrow a rule: refused, never ignored
    ({"podSelector": {}, "ingress": [{"from": [{"podSelector": {}, "nodeSelector": {}}]}]},
     "spec.ingress[0].from[0] has the field 'nodeSelector', which is not understood"),
    ({"podSelector": {}, "ingress": [{"ports": [{"port": 80, "portSet": "x"}]}]},
     "spec.ingress[0].ports[0] has the field 'portSet'"),
    ({"podSelector": {}, "egress": [{"to": [], "action": "Deny"}]},
     "spec.egress[0] has the field 'action'"),
    ({"podSelector": {}, "egress": [{"from": []}]}, "spec.egress[0] has the field 'from'"),
    ({"podSelector": {}, "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/8",
                                                            "exclude": []}}]}]},
     "ipBlock has the field 'exclude'"),
    ({"podSelector": {"matchExpressions": [{"key": "a", "operator": "Exists", "negate": True}]}},
     "has the field 'negate'"),
    ({"podSelector": {}, "priority": 1}, "spec has the field 'priority'"),
]  # fmt: skip


@pytest.mark.parametrize(("spec", "reason"), REFUSALS)
def test_what_cannot_be_represented_is_refused_naming_the_object(
    spec: dict[str, Any], reason: str
) -> None:
    with pytest.raises(PolicyRefused) as refused:
        parse_policy(policy(spec, name="web", namespace="shop"))
    assert str(refused.value).startswith("NetworkPolicy shop/web is refused: ")
    assert reason in str(refused.value)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize(
    "obj", [None, [], {"spec": {}}, {"metadata": {"name": "x"}}, {"metadata": {"namespace": "n"}}]
)
def test_objects_without_identity_are_refused(obj: Any) -> None:
    with pytest.raises(PolicyRefused, match="is refused: metadata"):
        parse_policy(obj)


@pytest.mark.parametrize(
    ("name", "namespace"),
    [('x"\nflush ruleset', "ns"), ("web", 'a"b'), ("Web", "ns"), ("web", "a.b"), ("-w", "ns"),
     ("w" * 254, "ns"), ("web", "n" * 64), ("web ", "ns")],
)  # fmt: skip
def test_names_the_api_would_not_accept_are_refused(name: str, namespace: str) -> None:
    with pytest.raises(
        PolicyRefused, match=r"is refused: metadata\.(name|namespace) is missing or not a DNS"
    ):
        parse_policy(policy({"podSelector": {}}, name=name, namespace=namespace))
    with pytest.raises(PolicyRefused, match="is refused: metadata"):
        parse_pod({"metadata": {"name": name, "namespace": namespace}})


def pod_obj(**status: Any) -> dict[str, Any]:
    return {
        "metadata": {"name": "w1", "namespace": "shop", "labels": {"app": "web"}},
        "spec": {
            "nodeName": "n1",
            "containers": [
                {"ports": [{"name": "http", "containerPort": 8080}, {"containerPort": 9}]},
                {"ports": [{"name": "dns", "containerPort": 53, "protocol": "UDP"}]},
            ],
        },
        "status": status,
    }


def test_a_pod_parses_to_labels_ips_node_and_named_ports() -> None:
    pod = parse_pod(pod_obj(podIPs=[{"ip": "10.244.1.2"}, {"ip": "fd10::2"}], phase="Running"))
    assert pod.key == "shop/w1" and pod.node == "n1" and pod.labels == (("app", "web"),)
    assert pod.ips == (IPv4Address("10.244.1.2"), IPv6Address("fd10::2"))
    assert pod.ports == (ContainerPort("http", 8080), ContainerPort("dns", 53, "UDP"))
    assert pod.named_port("dns", "UDP") == 53
    assert pod.named_port("dns", "TCP") is None
    assert parse_pod(pod_obj(podIP="10.244.1.3")).ips == (IPv4Address("10.244.1.3"),)
    # a finished pod's address may already be another pod's: it stands for nothing
    assert parse_pod(pod_obj(podIP="10.244.1.3", phase="Succeeded")).ips == ()


def test_a_pod_with_a_bad_ip_is_refused() -> None:
    with pytest.raises(PolicyRefused, match=r"Pod shop/w1 is refused: pod IP '10\.1' is not"):
        parse_pod(pod_obj(podIPs=[{"ip": "10.1"}]))


def test_a_namespace_carries_its_name_label_as_the_api_sets_it() -> None:
    ns = parse_namespace({"metadata": {"name": "shop", "labels": {"team": "a"}}})
    assert dict(ns.labels) == {"team": "a", "kubernetes.io/metadata.name": "shop"}


@settings(max_examples=200, deadline=None)
@given(
    st.integers(16, 28),
    st.lists(st.tuples(st.integers(0, 2**16 - 1), st.integers(17, 32)), max_size=6),
    st.lists(st.integers(0, 2**16 - 1), min_size=1, max_size=20),
)
def test_ip_block_networks_hold_exactly_the_cidr_minus_its_excepts(
    prefix: int, holes: list[tuple[int, int]], probes: list[int]
) -> None:
    base = int(IPv4Address("10.20.0.0"))
    cidr = IPv4Network(f"10.20.0.0/{prefix}")
    excepts = []
    for offset, length in holes:
        hole = IPv4Network(f"{IPv4Address(base + offset)}/{length}", strict=False)
        if length > prefix and hole.subnet_of(cidr):
            excepts.append(hole)
    block = IPBlock(cidr, tuple(excepts))
    nets = block.networks()
    for a, b in itertools.pairwise(nets):
        assert int(a.broadcast_address) < int(b.network_address)  # disjoint and sorted
    for probe in probes:
        addr = IPv4Address(base + probe)
        inside = addr in cidr and not any(addr in hole for hole in excepts)
        assert any(addr in net for net in nets) is inside
