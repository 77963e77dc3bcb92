"""The policy table as nftables values, and the one proportional transaction between two."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from flannelpy.netpol.compile import CIDRS, compile_node, peer_set_name, set_name
from flannelpy.netpol.model import INGRESS
from flannelpy.netpol.nft import (
    PREFIX,
    Ruleset,
    changed_elements,
    deny_counter,
    full_script,
    pod_chain,
    transaction,
)
from tests.support.netpol_cases import (
    DB_POLICY,
    NAMESPACES,
    NODE,
    pod,
    policy,
    random_table,
    table,
)

CLUSTER = [pod("db", "db", "10.244.1.3"), pod("api", "api", "10.244.2.2", node="n2")]


API_PEER = DB_POLICY.ingress[0].peers[0]  # podSelector app=api
P4 = peer_set_name(API_PEER, "shop", 4)
P6 = peer_set_name(API_PEER, "shop", 6)
C4 = set_name("shop/db", INGRESS, 0, CIDRS, 4)
RETURN = 'counter return comment "shop/db ingress 0"'
SET = f"add set {PREFIX}"
DB_DENY = deny_counter("shop", ("db",), "ingress").name
DB_DROP = f'counter name "{DB_DENY}" drop comment "shop/db in"'
DB_IN = pod_chain(compile_node([DB_POLICY], CLUSTER, NAMESPACES, NODE).pods[0], "in")


def test_the_first_load_creates_the_whole_table_in_one_script() -> None:
    script = full_script(table([DB_POLICY], CLUSTER))
    ports = "meta l4proto . th dport { tcp . 5432, tcp . 8080 }"
    assert script.splitlines() == [
        f"add table {PREFIX}",
        f'add counter {PREFIX} {DB_DENY} {{ comment "shop ingress db" ; }}',
        f"add map {PREFIX} egress4 {{ type ipv4_addr : verdict ; }}",
        f"add map {PREFIX} egress6 {{ type ipv6_addr : verdict ; }}",
        f"add map {PREFIX} ingress4 {{ type ipv4_addr : verdict ; }}",
        f"add map {PREFIX} ingress6 {{ type ipv6_addr : verdict ; }}",
        f'{SET} {P4} {{ type ipv4_addr ; comment "pods app=api of namespace shop" ; }}',
        f'{SET} {P6} {{ type ipv6_addr ; comment "pods app=api of namespace shop" ; }}',
        f'{SET} {C4} {{ type ipv4_addr ; flags interval ; comment "shop/db ingress rule 0" ; }}',
        f"add chain {PREFIX} forward {{ type filter hook forward priority filter ; "
        "policy accept ; }",
        f"add chain {PREFIX} input {{ type filter hook input priority filter ; policy accept ; }}",
        f"add chain {PREFIX} {DB_IN}",
        f"add element {PREFIX} {P4} {{ 10.244.2.2 }}",
        f"add element {PREFIX} {C4} {{ 192.168.0.0/24, 192.168.2.0/23, 192.168.4.0/22, "
        "192.168.8.0/21, 192.168.16.0/20, 192.168.32.0/19, 192.168.64.0/18, 192.168.128.0/17 }",
        f"add rule {PREFIX} forward ct state established,related accept",
        f"add rule {PREFIX} forward ip saddr vmap @egress4",
        f"add rule {PREFIX} forward ip6 saddr vmap @egress6",
        f"add rule {PREFIX} forward ip daddr vmap @ingress4",
        f"add rule {PREFIX} forward ip6 daddr vmap @ingress6",
        f"add rule {PREFIX} input ct state established,related accept",
        f"add rule {PREFIX} input ip saddr vmap @egress4",
        f"add rule {PREFIX} input ip6 saddr vmap @egress6",
        f"add rule {PREFIX} {DB_IN} ip saddr @{P4} {ports} {RETURN}",
        f"add rule {PREFIX} {DB_IN} ip saddr @{C4} {ports} {RETURN}",
        f"add rule {PREFIX} {DB_IN} ip6 saddr @{P6} {ports} {RETURN}",
        f"add rule {PREFIX} {DB_IN} {DB_DROP}",
        f"add element {PREFIX} ingress4 {{ 10.244.1.3 : jump {DB_IN} }}",
    ]  # fmt: skip


def test_nothing_changed_is_an_empty_transaction() -> None:
    assert transaction(table([DB_POLICY], CLUSTER), table([DB_POLICY], CLUSTER)) == ""


def test_a_peer_label_change_touches_one_element_only() -> None:
    before = table([DB_POLICY], [*CLUSTER, pod("web", "web", "10.244.2.9", node="n2")])
    after = table([DB_POLICY], [*CLUSTER, pod("web", "api", "10.244.2.9", node="n2")])
    assert transaction(before, after) == f"add element {PREFIX} {P4} {{ 10.244.2.9 }}\n"
    assert transaction(after, before) == f"delete element {PREFIX} {P4} {{ 10.244.2.9 }}\n"
    assert changed_elements(before, after) == 1


def test_a_port_edit_rewrites_only_the_chain_of_the_pod_it_selects() -> None:
    edited = policy(
        "db",
        {
            "podSelector": {"matchLabels": {"app": "db"}},
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "api"}}}],
                         "ports": [{"port": 5433}]}],
        },
    )  # fmt: skip
    lines = transaction(table([DB_POLICY], CLUSTER), table([edited], CLUSTER)).splitlines()
    ports = "meta l4proto . th dport { tcp . 5433 }"
    assert lines == [
        f"flush chain {PREFIX} {DB_IN}",
        f"add rule {PREFIX} {DB_IN} ip saddr @{P4} {ports} {RETURN}",
        f"add rule {PREFIX} {DB_IN} ip6 saddr @{P6} {ports} {RETURN}",
        f"add rule {PREFIX} {DB_IN} {DB_DROP}",
        f"delete set {PREFIX} {C4}",  # the ipBlock went: after the rules that used it
    ]  # fmt: skip


def test_a_new_local_pod_gets_its_chain_then_its_map_element() -> None:
    db2 = pod("db2", "db", "10.244.1.4")
    before, after = table([DB_POLICY], CLUSTER), table([DB_POLICY], [*CLUSTER, db2])
    chain = pod_chain(compile_node([DB_POLICY], [db2], NAMESPACES, NODE).pods[0], "in")
    lines = transaction(before, after).splitlines()
    assert lines[0] == f"add chain {PREFIX} {chain}"
    assert all(line.startswith(f"add rule {PREFIX} {chain} ") for line in lines[1:-1])
    assert lines[-1] == f"add element {PREFIX} ingress4 {{ 10.244.1.4 : jump {chain} }}"
    assert len(lines) == 6  # the chain, its 4 rules, its map element: db's chain is untouched


def test_a_local_pod_moving_to_another_address_changes_its_map_element() -> None:
    moved = [pod("db", "db", "10.244.1.7"), CLUSTER[1]]
    lines = transaction(table([DB_POLICY], CLUSTER), table([DB_POLICY], moved)).splitlines()
    assert lines == [
        f"delete element {PREFIX} ingress4 {{ 10.244.1.3 }}",
        f"add element {PREFIX} ingress4 {{ 10.244.1.7 : jump {DB_IN} }}",
    ]


def test_a_deleted_policy_goes_in_order_without_touching_the_table() -> None:
    lines = transaction(table([DB_POLICY], CLUSTER), table([], CLUSTER)).splitlines()
    assert lines == [
        f"delete element {PREFIX} ingress4 {{ 10.244.1.3 }}",  # nothing jumps to it any more
        f"flush chain {PREFIX} {DB_IN}",  # nothing refers to the sets any more
        f"delete chain {PREFIX} {DB_IN}",
        f"delete set {PREFIX} {P4}",
        f"delete set {PREFIX} {P6}",
        f"delete set {PREFIX} {C4}",
        f"delete counter {PREFIX} {DB_DENY}",  # after the rule that counted into it
    ]
    assert not any("table" in line for line in lines)


def test_an_egress_named_port_and_isolation_render_as_concatenations_and_a_drop() -> None:
    spec = {"podSelector": {"matchLabels": {"app": "db"}}, "policyTypes": ["Egress"],
            "egress": [{"to": [{"podSelector": {}}], "ports": [{"port": "http"}]}]}  # fmt: skip
    ruleset = table([policy("out", spec)], CLUSTER)
    (chain,) = [c for name, c in ruleset.chains.items() if name.startswith("pod_")]
    n4 = set_name("shop/out", "Egress", 0, "n", 4)
    assert chain.rules == (
        f'ip daddr . meta l4proto . th dport @{n4} counter return comment "shop/out egress 0"',
        f"ip6 daddr . meta l4proto . th dport @{n4[:-1]}6 "
        'counter return comment "shop/out egress 0"',
        f'counter name "{deny_counter("shop", ("out",), "egress").name}" drop '
        'comment "shop/db out"',
    )  # fmt: skip
    assert ruleset.sets[n4].type == "ipv4_addr . inet_proto . inet_service"
    assert ruleset.sets[n4].elements == (
        ("10.244.1.3 . tcp . 8080", ""),
        ("10.244.2.2 . tcp . 8080", ""),
    )
    assert ruleset.sets["egress4"].elements == (("10.244.1.3", f"jump {chain.name}"),)


def test_two_local_pods_claiming_one_address_give_one_map_element() -> None:
    stale = pod("aaa-stale", "db", "10.244.1.3")  # an old pod still holding db's address
    ruleset = table([DB_POLICY], [*CLUSTER, stale])
    chains = [name for name in ruleset.chains if name.startswith("pod_")]
    assert len(chains) == 2
    (element,) = ruleset.sets["ingress4"].elements
    assert element[0] == "10.244.1.3" and element[1] in {f"jump {c}" for c in chains}
    assert "10.244.1.3 : jump" in full_script(ruleset)


def test_long_policy_names_keep_comments_within_nft_limits() -> None:
    long_name = "p" * 200
    ruleset = table([policy(long_name, {"podSelector": {}, "ingress": [
        {"from": [{"podSelector": {}}]}]})], CLUSTER)  # fmt: skip
    script = full_script(ruleset)
    comments = [part.split('"')[0] for part in script.split('comment "')[1:]]
    assert comments and all(len(c) <= 128 for c in comments)
    assert all(len(name) < 64 for name in [*ruleset.sets, *ruleset.chains])


class Kernel:
    """A model of what nft does with our scripts, strict where nft refuses: deleting
    what is absent, adding what is present, deleting what is still referred to."""

    def __init__(self) -> None:
        self.sets: dict[str, tuple[str, dict[str, str]]] = {}
        self.chains: dict[str, list[str]] = {}
        self.counters: set[str] = set()

    def run(self, script: str) -> int:
        """Apply ``script``; return how many elements its element lines named."""
        touched = 0
        for line in script.splitlines():
            if line == f"add table {PREFIX}":
                continue
            verb, what, rest = line.split(" ", 2)
            assert rest.startswith(PREFIX + " "), line
            name, _, body = rest.removeprefix(PREFIX + " ").partition(" ")
            items = body.strip("{} ").split(", ") if body.startswith("{") else []
            touched += len(items) if what == "element" else 0
            self._one(verb, what, name, body, items)
        return touched

    def _one(self, verb: str, what: str, name: str, body: str, items: list[str]) -> None:
        if (verb, what) in (("add", "set"), ("add", "map")):
            assert name not in self.sets
            self.sets[name] = (body.split("type ")[1].split(" ;")[0], {})
        elif (verb, what) == ("add", "chain"):
            assert name not in self.chains
            self.chains[name] = []
        elif (verb, what) == ("add", "element"):
            for item in items:
                key, _, value = item.partition(" : ")
                assert key not in self.sets[name][1], item
                self.sets[name][1][key] = value
        elif (verb, what) == ("delete", "element"):
            for key in items:
                del self.sets[name][1][key]
        elif (verb, what) == ("add", "counter"):
            assert name not in self.counters
            self.counters.add(name)
        elif (verb, what) == ("delete", "counter"):
            self.counters.remove(name)
            assert all(f'"{name}"' not in r for rules in self.chains.values() for r in rules)
        elif (verb, what) == ("flush", "chain"):
            self.chains[name] = []
        elif (verb, what) == ("add", "rule"):
            self.chains[name].append(body)
            counted = body.split('counter name "')[1:]
            assert all(c.split('"')[0] in self.counters for c in counted), body
        elif (verb, what) == ("delete", "chain"):
            assert self.chains.pop(name) == []
            assert all(f"jump {name}" not in s[1].values() for s in self.sets.values())
        else:
            assert (verb, what) in (("delete", "set"), ("delete", "map")), (verb, what)
            del self.sets[name]
            assert all(f"@{name} " not in r for rules in self.chains.values() for r in rules)

    def state(self) -> tuple[dict[str, Any], dict[str, list[str]], set[str]]:
        return self.sets, self.chains, self.counters


def modelled(ruleset: Ruleset) -> tuple[dict[str, Any], dict[str, list[str]], set[str]]:
    sets = {n: (s.type, dict(s.elements)) for n, s in ruleset.sets.items()}
    return sets, {n: list(c.rules) for n, c in ruleset.chains.items()}, set(ruleset.counters)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_every_transaction_turns_the_old_table_into_the_new_one(data: Any) -> None:
    old, new = random_table(data), random_table(data)
    kernel = Kernel()
    kernel.run(full_script(old))
    assert kernel.state() == modelled(old)
    touched = kernel.run(transaction(old, new))
    assert kernel.state() == modelled(new)
    assert touched <= changed_elements(old, new)  # never more elements than differ
