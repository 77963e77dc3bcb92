"""``netpol explain``: one connection judged on the values the kernel gets, naming the
policy and rule that let it through or the policies that isolate the pod it dies at."""

from __future__ import annotations

from ipaddress import ip_address

import pytest

from flannelpy.netpol.explain import ExplainError, Explanation, explain, find_endpoint
from flannelpy.netpol.model import Pod, Policy
from tests.support.netpol_cases import DB_POLICY, NAMESPACES, POLICY_POOL, pod, policy

DB = pod("db", "db", "10.244.1.3", "fd10::3")
API = pod("api", "api", "10.244.2.2", node="n2")
WEB = pod("web", "web", "10.244.2.9", "fd10::9", node="n2")
PODS = [DB, API, WEB]


def judge(
    source: Pod | str,
    destination: Pod | str,
    port: int,
    protocol: str = "TCP",
    policies: list[Policy] | None = None,
) -> Explanation:
    ends = [e if isinstance(e, Pod) else ip_address(e) for e in (source, destination)]
    return explain(policies or [DB_POLICY], PODS, NAMESPACES, ends[0], ends[1], port, protocol)


def test_a_peer_the_rule_names_is_allowed_by_that_rule_and_its_own_side_is_open() -> None:
    answer = judge(API, DB, 5432)
    assert answer.allowed
    egress, ingress = answer.judgements
    assert (egress.direction, egress.allowed, egress.isolating) == ("egress", True, ())
    assert ingress.allowed_by == "shop/db ingress rule 0"
    assert ingress.isolating == ("shop/db",)
    assert (
        answer.lines()[0] == "shop/api (10.244.2.2) -> shop/db (10.244.1.3) port 5432/TCP: allowed"
    )


def test_a_pod_the_rule_does_not_name_or_a_port_it_does_not_open_is_denied_by_name() -> None:
    for source, port in ((WEB, 5432), (API, 5433), (API, 5432)):
        answer = judge(source, DB, port, "UDP" if source is API and port == 5432 else "TCP")
        assert not answer.allowed
        assert answer.judgements[-1].sentence() == (
            "ingress of shop/db (node n1): denied, isolated by shop/db and no rule of theirs "
            "matches"
        )


def test_ip_blocks_with_excepts_and_named_ports_resolve_as_the_kernel_sees_them() -> None:
    assert judge("192.168.2.5", DB, 8080).allowed  # "http" is db's 8080
    assert not judge("192.168.1.5", DB, 8080).allowed  # in the except
    assert not judge("10.9.0.1", DB, 8080).allowed
    (only,) = judge("192.168.2.5", DB, 8080).judgements
    assert only.direction == "ingress"


def test_egress_named_ports_resolve_on_the_destination_and_both_families_are_judged() -> None:
    out = POLICY_POOL[2]  # every pod but db: egress to db on http, 5432, UDP 53-60, ...
    assert judge(WEB, DB, 8080, policies=[out]).judgements[0].allowed_by == "shop/out egress rule 0"
    denied = judge(WEB, DB, 9999, policies=[out])
    assert not denied.allowed and denied.judgements[0].isolating == ("shop/out",)
    v6 = judge(WEB, "fd00:0:0:1::5", 5432, policies=[out])  # the ipBlock minus its except
    assert v6.allowed and v6.source_ip == "fd10::9"
    assert not judge(WEB, "fd00::5", 5432, policies=[out]).allowed


def test_every_policy_isolating_a_pod_is_named() -> None:
    deny = policy("deny-db", {"podSelector": {"matchLabels": {"app": "db"}}})
    answer = judge(WEB, DB, 5432, policies=[DB_POLICY, deny])
    assert answer.judgements[-1].isolating == ("shop/db", "shop/deny-db")
    assert not answer.allowed


def test_questions_about_what_does_not_exist_say_what_to_fix() -> None:
    with pytest.raises(ExplainError, match="no pod shop/nope in the cluster"):
        find_endpoint("shop/nope", PODS)
    with pytest.raises(ExplainError, match="neither namespace/pod nor an IP address"):
        find_endpoint("db", PODS)
    assert find_endpoint("shop/db", PODS) is DB
    with pytest.raises(ExplainError, match="share no address family"):
        judge(API, "fd10::3", 80)
    with pytest.raises(ExplainError, match="at least one end"):
        explain([], PODS, NAMESPACES, ip_address("10.0.0.1"), ip_address("10.0.0.2"), 80, "TCP")
