"""The NetworkPolicy compiler: selection, peers, ports, isolation, union, stability, order."""

from __future__ import annotations

import random
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from flannelpy.netpol.compile import (
    ADDR_PORTS,
    CIDRS,
    PODS,
    Allow,
    NodePolicy,
    PortMatch,
    compile_node,
    peer_set_name,
    set_name,
)
from flannelpy.netpol.model import (
    EGRESS,
    INGRESS,
    Namespace,
    Pod,
    Policy,
    parse_namespace,
    parse_pod,
    parse_policy,
)

NODE = "n1"


def pod(
    namespace: str,
    name: str,
    labels: dict[str, str],
    ips: list[str],
    node: str = NODE,
    ports: list[tuple[str, int, str]] = [],  # noqa: B006 - read only
    host_network: bool = False,
) -> Pod:
    container_ports = [{"name": n, "containerPort": p, "protocol": pr} for n, p, pr in ports]
    return parse_pod(
        {
            "metadata": {"namespace": namespace, "name": name, "labels": labels},
            "spec": {
                "nodeName": node,
                "hostNetwork": host_network,
                "containers": [{"ports": container_ports}],
            },
            "status": {"podIPs": [{"ip": ip} for ip in ips], "phase": "Running"},
        }
    )


def policy(name: str, spec: dict[str, Any], namespace: str = "shop") -> Policy:
    return parse_policy({"metadata": {"namespace": namespace, "name": name}, "spec": spec})


def namespace(name: str, **labels: str) -> Namespace:
    return parse_namespace({"metadata": {"name": name, "labels": labels}})


NAMESPACES = [namespace("shop", team="a"), namespace("bank", team="b"), namespace("dev")]
WEB = pod("shop", "web", {"app": "web"}, ["10.244.1.2", "fd10:1::2"], ports=[("http", 8080, "TCP")])
DB = pod("shop", "db", {"app": "db"}, ["10.244.1.3"], ports=[("sql", 5432, "TCP")])
API = pod("shop", "api", {"app": "api"}, ["10.244.2.2"], node="n2", ports=[("http", 9090, "TCP")])
TELLER = pod("bank", "teller", {"app": "api"}, ["10.244.2.3"], node="n2")
DEVBOX = pod("dev", "box", {"app": "api"}, ["10.244.3.2"], node="n3", ports=[("http", 80, "TCP")])
HOSTNET = pod("shop", "agent", {"app": "api"}, ["192.168.1.10"], node="n2", host_network=True)
PODS_ALL = [WEB, DB, API, TELLER, DEVBOX, HOSTNET]


def run(policies: list[Policy], pods: list[Pod] = PODS_ALL) -> NodePolicy:
    return compile_node(policies, pods, NAMESPACES, NODE)


def rules_of(compiled: NodePolicy, key: str) -> tuple[Any, Any]:
    found = {p.key: (p.ingress, p.egress) for p in compiled.pods}
    return found.get(key, (None, None))


def elements(compiled: NodePolicy, name: str) -> tuple[str, ...]:
    return {s.name: s.elements for s in compiled.sets}[name]


def sname(pol: str, direction: str, rule: int, kind: str, family: int) -> str:
    return set_name(f"shop/{pol}", direction, rule, kind, family)


def pset(pol: Policy, direction: str, rule: int, family: int, peer: int = 0) -> str:
    """The shared set of the pods that peer ``peer`` of a rule selects."""
    rules = pol.ingress if direction == INGRESS else pol.egress
    return peer_set_name(rules[rule].peers[peer], pol.namespace, family)


def test_no_policy_means_nothing_isolated() -> None:
    assert run([]) == NodePolicy()


def test_a_pod_selected_with_no_rule_is_isolated_for_ingress_only() -> None:
    compiled = run([policy("deny", {"podSelector": {"matchLabels": {"app": "web"}}})])
    assert rules_of(compiled, "shop/web") == ((), None)  # ingress isolated, egress open
    assert rules_of(compiled, "shop/db") == (None, None)
    assert compiled.sets == ()


def test_egress_only_isolation() -> None:
    compiled = run([policy("deny-out", {"podSelector": {}, "policyTypes": ["Egress"]})])
    assert rules_of(compiled, "shop/web") == (None, ())
    assert rules_of(compiled, "shop/db") == (None, ())


def test_pod_selector_peers_are_pods_of_the_policy_namespace() -> None:
    spec = {
        "podSelector": {"matchLabels": {"app": "db"}},
        "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "api"}}}]}],
    }
    db = policy("db", spec)
    compiled = run([db])
    # shop/api, not bank/teller nor dev/box (other namespaces), nor the host-network pod
    assert elements(compiled, pset(db, INGRESS, 0, 4)) == ("10.244.2.2",)
    assert elements(compiled, pset(db, INGRESS, 0, 6)) == ()
    ingress, egress = rules_of(compiled, "shop/db")
    assert egress is None
    assert ingress == (
        Allow("shop/db", 0, 4, pset(db, INGRESS, 0, 4), PODS),
        Allow("shop/db", 0, 6, pset(db, INGRESS, 0, 6), PODS),
    )


def test_namespace_selector_alone_and_with_a_pod_selector() -> None:
    spec = {
        "podSelector": {"matchLabels": {"app": "db"}},
        "ingress": [
            {"from": [{"namespaceSelector": {"matchLabels": {"team": "b"}}}]},
            {
                "from": [
                    {
                        "namespaceSelector": {
                            "matchExpressions": [{"key": "team", "operator": "Exists"}]
                        },
                        "podSelector": {"matchLabels": {"app": "api"}},
                    }
                ]
            },
            {"from": [{"namespaceSelector": {}}]},  # every pod of every namespace
        ],
    }
    db = policy("db", spec)
    compiled = run([db])
    assert elements(compiled, pset(db, INGRESS, 0, 4)) == ("10.244.2.3",)
    assert elements(compiled, pset(db, INGRESS, 1, 4)) == ("10.244.2.2", "10.244.2.3")
    assert elements(compiled, pset(db, INGRESS, 2, 4)) == (
        "10.244.1.2",
        "10.244.1.3",
        "10.244.2.2",
        "10.244.2.3",
        "10.244.3.2",
    )
    assert elements(compiled, pset(db, INGRESS, 2, 6)) == ("fd10:1::2",)


def test_ip_blocks_with_excepts_become_disjoint_interval_elements() -> None:
    spec = {
        "podSelector": {"matchLabels": {"app": "db"}},
        "ingress": [
            {
                "from": [
                    {"ipBlock": {"cidr": "10.0.0.0/24", "except": ["10.0.0.0/25"]}},
                    {"ipBlock": {"cidr": "10.0.0.0/26"}},  # overlaps the first: merged
                    {"ipBlock": {"cidr": "fd00::/64", "except": ["fd00::/65"]}},
                ]
            }
        ],
    }
    compiled = run([policy("db", spec)])
    assert elements(compiled, sname("db", INGRESS, 0, CIDRS, 4)) == (
        "10.0.0.0/26",
        "10.0.0.128/25",
    )
    assert elements(compiled, sname("db", INGRESS, 0, CIDRS, 6)) == ("fd00::8000:0:0:0/65",)
    kinds = {(a.family, a.kind) for a in rules_of(compiled, "shop/db")[0]}
    assert kinds == {(4, CIDRS), (6, CIDRS)}  # no pod sets for a rule of ipBlocks only


def test_ports_numbers_ranges_protocols_merged() -> None:
    spec = {
        "podSelector": {"matchLabels": {"app": "db"}},
        "ingress": [
            {
                "ports": [
                    {"port": 80},
                    {"port": 81, "endPort": 90},
                    {"port": 85},
                    {"protocol": "UDP", "port": 53},
                    {"protocol": "SCTP"},
                    {"protocol": "SCTP", "port": 7},  # swallowed by every SCTP port
                ]
            }
        ],
    }
    (allow,) = rules_of(run([policy("db", spec)]), "shop/db")[0]
    assert allow == Allow(
        "shop/db",
        0,
        ports=(PortMatch("SCTP"), PortMatch("TCP", 80, 90), PortMatch("UDP", 53, 53)),
    )


def test_named_ingress_ports_resolve_on_the_local_pod() -> None:
    spec = {"podSelector": {}, "ingress": [{"ports": [{"port": "http"}, {"port": 443}]}]}
    compiled = run([policy("web", spec)])
    (web_allow,) = rules_of(compiled, "shop/web")[0]
    assert web_allow.ports == (PortMatch("TCP", 443, 443), PortMatch("TCP", 8080, 8080))
    (db_allow,) = rules_of(compiled, "shop/db")[0]  # db has no "http" port
    assert db_allow.ports == (PortMatch("TCP", 443, 443),)
    only_named = run(
        [policy("web", {"podSelector": {}, "ingress": [{"ports": [{"port": "sql"}]}]})]
    )
    assert rules_of(only_named, "shop/web")[0] == ()  # nothing resolves: isolated, no allow
    assert rules_of(only_named, "shop/db")[0] == (Allow("shop/web", 0, ports=(
        PortMatch("TCP", 5432, 5432),)),)  # fmt: skip


def test_named_egress_ports_expand_per_destination_pod() -> None:
    spec = {
        "podSelector": {"matchLabels": {"app": "web"}},
        "policyTypes": ["Egress"],
        "egress": [
            {
                "to": [{"namespaceSelector": {}, "podSelector": {"matchLabels": {"app": "api"}}}],
                "ports": [{"port": "http"}],
            },
            {"ports": [{"port": "http"}]},  # any destination: every pod naming the port
        ],
    }
    compiled = run([policy("web", spec)])
    # shop/api names http 9090, dev/box names it 80, bank/teller has no such port
    assert elements(compiled, sname("web", EGRESS, 0, ADDR_PORTS, 4)) == (
        "10.244.2.2 . tcp . 9090",
        "10.244.3.2 . tcp . 80",
    )
    assert elements(compiled, sname("web", EGRESS, 1, ADDR_PORTS, 4)) == (
        "10.244.1.2 . tcp . 8080",
        "10.244.2.2 . tcp . 9090",
        "10.244.3.2 . tcp . 80",
    )
    assert elements(compiled, sname("web", EGRESS, 1, ADDR_PORTS, 6)) == ("fd10:1::2 . tcp . 8080",)
    egress = rules_of(compiled, "shop/web")[1]
    assert {a.kind for a in egress} == {ADDR_PORTS}  # no address-only allow opens other ports
    assert {s.kind for s in compiled.sets} == {ADDR_PORTS}  # and no unused address set


def test_several_policies_are_a_union_in_policy_order() -> None:
    a = policy("a-web", {"podSelector": {"matchLabels": {"app": "web"}}, "ingress": [
        {"ports": [{"port": 80}]}]})  # fmt: skip
    b = policy("b-all", {"podSelector": {}, "ingress": [{"ports": [{"port": 443}]}]})
    deny = policy("c-deny", {"podSelector": {}})
    compiled = run([deny, b, a])
    assert rules_of(compiled, "shop/web")[0] == (
        Allow("shop/a-web", 0, ports=(PortMatch("TCP", 80, 80),)),
        Allow("shop/b-all", 0, ports=(PortMatch("TCP", 443, 443),)),
    )
    assert rules_of(compiled, "shop/db")[0] == (
        Allow("shop/b-all", 0, ports=(PortMatch("TCP", 443, 443),)),
    )


def test_only_local_selected_pods_get_rules_and_only_their_policies_get_sets() -> None:
    remote = policy("remote", {"podSelector": {"matchLabels": {"app": "api"}}, "ingress": [
        {"from": [{"podSelector": {}}]}]})  # fmt: skip
    other_ns = policy("x", {"podSelector": {}}, namespace="bank")
    compiled = run([remote, other_ns])
    assert compiled == NodePolicy()  # shop/api and bank/teller live on n2


def test_host_network_and_addressless_pods_are_neither_selected_nor_peers() -> None:
    hostnet_local = pod("shop", "hn", {"app": "web"}, ["192.168.1.1"], host_network=True)
    pending = pod("shop", "pending", {"app": "web"}, [])
    spec = {"podSelector": {"matchLabels": {"app": "web"}}, "ingress": [
        {"from": [{"podSelector": {}}]}]}  # fmt: skip
    web = policy("web", spec)
    compiled = run([web], [WEB, hostnet_local, pending, HOSTNET])
    assert [p.key for p in compiled.pods] == ["shop/web"]
    assert elements(compiled, pset(web, INGRESS, 0, 4)) == ("10.244.1.2",)


def changed_elements(a: NodePolicy, b: NodePolicy) -> int:
    sa = {s.name: set(s.elements) for s in a.sets}
    sb = {s.name: set(s.elements) for s in b.sets}
    return sum(len(sa.get(n, set()) ^ sb.get(n, set())) for n in set(sa) | set(sb))


def big_cluster(n_pods: int, n_policies: int) -> tuple[list[Pod], list[Policy]]:
    pods = [
        pod(
            "shop",
            f"p{i}",
            {"app": f"a{i % 50}", "tier": "t"},
            [f"10.{i // 250}.{i % 250}.1"],
            node=NODE if i < 50 or i % 7 == 0 else "n2",  # local pods of every app
        )
        for i in range(n_pods)
    ]
    policies = [
        policy(
            f"pol{j}",
            {
                "podSelector": {"matchLabels": {"app": f"a{j % 50}"}},
                "ingress": [
                    {"from": [{"podSelector": {"matchLabels": {"app": f"a{(j + 1) % 50}"}}}]}
                ],
                "egress": [
                    {
                        "to": [
                            {
                                "podSelector": {
                                    "matchExpressions": [
                                        {
                                            "key": "app",
                                            "operator": "NotIn",
                                            "values": [f"a{j % 50}"],
                                        }
                                    ]
                                }
                            }
                        ]
                    }
                ],
            },
        )
        for j in range(n_policies)
    ]
    return pods, policies


def test_one_pod_label_change_changes_a_constant_number_of_elements() -> None:
    counts = []
    for size in (200, 800):
        pods, policies = big_cluster(size, 100)
        before = run(policies, pods)
        moved = pods[57]  # a remote pod whose app label moves from a7 to a8
        assert moved.label_map["app"] == "a7" and moved.node == "n2"
        pods[57] = pod("shop", moved.name, {"app": "a8", "tier": "t"}, ["10.0.57.1"], node="n2")
        after = run(policies, pods)
        assert [s.name for s in before.sets] == [s.name for s in after.sets]
        assert before.pods == after.pods  # no chain changes: the pod is not local
        counts.append(changed_elements(before, after))
    # leaves the set of the a7 pods (which the 2 policies peering with a7 share), enters
    # a8's; leaves the egress "NotIn a8" set (shared by the 2 a8 policies), enters a7's
    assert counts == [4, 4]


@settings(max_examples=25, deadline=None)
@given(st.randoms(use_true_random=False))
def test_compiled_output_is_independent_of_input_order(rnd: random.Random) -> None:
    pods, policies = big_cluster(60, 12)
    pods += PODS_ALL
    policies.append(
        policy("named", {"podSelector": {}, "egress": [{"ports": [{"port": "http"}]}],
                         "ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/8"}}]}]})
    )  # fmt: skip
    expected = compile_node(policies, pods, NAMESPACES, NODE)
    rnd.shuffle(pods)
    rnd.shuffle(policies)
    namespaces = list(NAMESPACES)
    rnd.shuffle(namespaces)
    assert compile_node(policies, pods, namespaces, NODE) == expected


def test_a_pod_of_an_unread_namespace_matches_no_namespace_selector() -> None:
    spec = {"podSelector": {"matchLabels": {"app": "db"}}, "ingress": [{"from": [
        {"namespaceSelector": {"matchExpressions": [
            {"key": "team", "operator": "NotIn", "values": ["a"]}]}}]}]}  # fmt: skip
    stranger = pod("new", "x", {}, ["10.244.9.9"], node="n9")
    db = policy("db", spec)
    compiled = run([db], [DB, TELLER, stranger])
    # bank (team b) is in; "new" has no Namespace yet: its labels could be anything
    assert elements(compiled, pset(db, INGRESS, 0, 4)) == ("10.244.2.3",)


def test_a_named_egress_port_to_an_ip_block_resolves_on_the_pods_inside_it() -> None:
    spec = {"podSelector": {"matchLabels": {"app": "web"}}, "policyTypes": ["Egress"],
            "egress": [{"to": [{"ipBlock": {"cidr": "10.244.2.0/24"}}],
                        "ports": [{"port": "http"}]}]}  # fmt: skip
    compiled = run([policy("web", spec)])
    # shop/api (10.244.2.2) names http; bank/teller (10.244.2.3) has no such port;
    # dev/box names it but is outside the block
    assert elements(compiled, sname("web", EGRESS, 0, ADDR_PORTS, 4)) == (
        "10.244.2.2 . tcp . 9090",
    )
    assert elements(compiled, sname("web", EGRESS, 0, ADDR_PORTS, 6)) == ()


LABEL_KEYS, LABEL_VALUES = ("app", "tier", "team"), ("a", "b", "c")
labels_st = st.dictionaries(st.sampled_from(LABEL_KEYS), st.sampled_from(LABEL_VALUES))
requirement_st = st.builds(
    lambda key, op, values: {"key": key, "operator": op, "values": values},
    st.sampled_from(LABEL_KEYS),
    st.sampled_from(("In", "NotIn")),
    st.lists(st.sampled_from(LABEL_VALUES), min_size=1, max_size=2, unique=True),
) | st.builds(
    lambda key, op: {"key": key, "operator": op},
    st.sampled_from(LABEL_KEYS),
    st.sampled_from(("Exists", "DoesNotExist")),
)
selector_st = st.builds(
    lambda labels, expressions: {"matchLabels": labels, "matchExpressions": expressions},
    labels_st,
    st.lists(requirement_st, max_size=2),
)


@settings(max_examples=60)
@given(st.lists(labels_st, min_size=1, max_size=30), st.lists(selector_st, min_size=1, max_size=4))
def test_a_peer_set_holds_exactly_the_pods_its_selector_matches(
    pod_labels: list[dict[str, str]], selectors: list[dict[str, Any]]
) -> None:
    """The pods a peer selects are found through a label index: the same as looking at
    every pod of the namespace."""
    members = [(labels, f"10.244.2.{i + 2}") for i, labels in enumerate(pod_labels)]
    pods = [pod("shop", f"p{i}", labels, [ip], "n2") for i, (labels, ip) in enumerate(members)]
    pods.append(pod("shop", "db", {"role": "db"}, ["10.244.1.2"]))  # the one local pod
    members.append(({"role": "db"}, "10.244.1.2"))
    spec = {
        "podSelector": {"matchLabels": {"role": "db"}},
        "ingress": [{"from": [{"podSelector": s}]} for s in selectors],
    }
    compiled = compile_node([policy("db", spec)], pods, [namespace("shop")], NODE)
    for rule in policy("db", spec).ingress:
        (peer,) = rule.peers
        assert peer.pod_selector is not None
        matched = [ip for labels, ip in members if peer.pod_selector.matches(labels)]
        want = tuple(sorted(matched, key=lambda ip: tuple(int(b) for b in ip.split("."))))
        (found,) = [s for s in compiled.sets if s.name == peer_set_name(peer, "shop", 4)]
        assert found.elements == want
