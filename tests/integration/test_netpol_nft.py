"""The compiled policy table against real nftables, inside a network namespace of our own.

The first load (``nft -f``) and then one incremental transaction must leave exactly the
desired table (sets, maps and their elements, chains and their rules, per
``nft -j list table``); the transaction leaves another table and every chain it has no
reason to touch alone (the same rule handles). Random pairs of clusters then check the
same against the kernel, as the unit tier checks them against a model of nft.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flannelpy.netpol.nft import FAMILY, TABLE, Ruleset, full_script, transaction
from tests.support.netns_util import Netns, temp_netns
from tests.support.netpol_cases import pod, policy, random_table, table

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create network namespaces"),
]

POLICIES = [
    policy("db", {
        "podSelector": {"matchLabels": {"app": "db"}},
        "ingress": [
            {"from": [{"podSelector": {"matchLabels": {"app": "api"}}},
                      {"namespaceSelector": {"matchLabels": {"team": "b"}}},
                      {"ipBlock": {"cidr": "192.168.0.0/16", "except": ["192.168.1.0/24"]}},
                      {"ipBlock": {"cidr": "fd00::/48", "except": ["fd00::/64"]}}],
             "ports": [{"port": 5432}, {"protocol": "UDP", "port": 7000, "endPort": 7100},
                       {"port": "http"}, {"protocol": "SCTP"}]},
        ],
        "egress": [{"to": [{"podSelector": {}}], "ports": [{"port": "dns", "protocol": "UDP"}]},
                   {"to": [{"ipBlock": {"cidr": "0.0.0.0/0"}}], "ports": [{"port": 443}]}],
    }),
    policy("deny-web", {"podSelector": {"matchLabels": {"app": "web"}}}),
]  # fmt: skip
PODS = [
    pod("db", "db", "10.244.1.3", "fd10:1::3"),
    pod("web", "web", "10.244.1.4"),
    pod("api", "api", "10.244.2.2", "fd10:2::2", node="n2"),
    pod("teller", "teller", "10.244.3.2", node="n3", namespace="bank"),
]


def nft(ns: Netns, *args: str, script: str | None = None) -> str:
    argv = ["ip", "netns", "exec", ns.name, "nft", *args]
    proc = subprocess.run(argv, input=script, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"nft {' '.join(args)} failed: {proc.stderr}\n{script}"
    return proc.stdout


def element_text(e: Any) -> str:
    if isinstance(e, str | int):
        return str(e)
    if "prefix" in e:
        return f"{e['prefix']['addr']}/{e['prefix']['len']}"
    if "concat" in e:
        return " . ".join(element_text(x) for x in e["concat"])
    if "range" in e:
        return "-".join(element_text(x) for x in e["range"])
    if "elem" in e:
        return element_text(e["elem"]["val"])
    raise AssertionError(f"unexpected element {e!r}")


def observed(ns: Netns) -> tuple[dict[str, Any], dict[str, list[tuple[int, str]]]]:
    """Sets and maps (type, sorted elements) and chains ([(handle, comment)]) of our table."""
    listing = json.loads(nft(ns, "-j", "list", "table", FAMILY, TABLE))["nftables"]
    sets: dict[str, Any] = {}
    chains: dict[str, list[tuple[int, str]]] = {}
    for item in listing:
        kind, body = next(iter(item.items()))
        if kind in ("set", "map"):
            elems = []
            for e in body.get("elem", []):
                if kind == "map":
                    key, verdict = e
                    elems.append((element_text(key), f"jump {verdict['jump']['target']}"))
                else:
                    elems.append((element_text(e), ""))
            type_ = body["type"] if isinstance(body["type"], str) else " . ".join(body["type"])
            if kind == "map":
                type_ += f" : {body['map']}"
            sets[body["name"]] = (type_, sorted(elems))
        elif kind == "chain":
            chains[body["name"]] = []
        elif kind == "rule":
            chains[body["chain"]].append((body["handle"], body.get("comment", "")))
    return sets, chains


def desired(ruleset: Ruleset) -> tuple[dict[str, Any], dict[str, list[str]]]:
    sets = {n: (s.type, sorted(s.elements)) for n, s in ruleset.sets.items()}
    comments = {
        n: [r.split('comment "')[1].rstrip('"') if 'comment "' in r else "" for r in c.rules]
        for n, c in ruleset.chains.items()
    }
    return sets, comments


def assert_table_is(ns: Netns, ruleset: Ruleset) -> dict[str, list[tuple[int, str]]]:
    sets, chains = observed(ns)
    want_sets, want_comments = desired(ruleset)
    assert sets == want_sets
    assert {n: [c for _, c in rules] for n, rules in chains.items()} == want_comments
    return chains


def test_the_first_load_and_one_transaction_leave_exactly_the_desired_table() -> None:
    first = table(POLICIES, PODS)
    moved = [
        *PODS[:2],
        pod("api", "web", "10.244.2.2", "fd10:2::2", node="n2"),  # leaves a db peer set
        PODS[3],
        pod("db2", "db", "10.244.1.5"),  # a new local pod, selected
    ]
    second = table(POLICIES, moved)
    with temp_netns("npol") as ns:
        nft(ns, "-f", "-", script="add table inet bystander\nadd chain inet bystander c\n"
            "add rule inet bystander c counter accept\n")  # fmt: skip
        nft(ns, "-f", "-", script=full_script(first))
        before = assert_table_is(ns, first)
        script = transaction(first, second)
        assert "table" not in script  # never the whole table
        assert "delete element" in script and "add chain" in script
        nft(ns, "-f", "-", script=script)
        after = assert_table_is(ns, second)
        # chains whose rules did not change keep their rules (the same handles)
        assert {n: before[n] for n in before} == {n: after[n] for n in before}
        assert "bystander" in nft(ns, "list", "tables")
        nft(ns, "-f", "-", script=transaction(second, first))  # and back
        assert_table_is(ns, first)
        nft(ns, "-f", "-", script=transaction(first, table([], PODS)))
        sets, chains = observed(ns)
        assert sorted(chains) == ["forward", "input"]
        assert all(not elems for _, elems in sets.values())


@pytest.fixture(scope="module")
def shared_ns() -> Iterator[Netns]:
    """One namespace for every example: each starts by deleting the table."""
    with temp_netns("npolh") as ns:
        yield ns


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_random_transactions_leave_exactly_the_desired_table(shared_ns: Netns, data: Any) -> None:
    old, new = random_table(data), random_table(data)
    nft(shared_ns, "-f", "-", script=f"add table {FAMILY} {TABLE}\ndelete table {FAMILY} {TABLE}\n")
    nft(shared_ns, "-f", "-", script=full_script(old))
    assert_table_is(shared_ns, old)
    nft(shared_ns, "-f", "-", script=transaction(old, new))
    assert_table_is(shared_ns, new)


def test_editing_an_ip_block_swaps_interval_elements_in_place() -> None:
    def block(cidr: str, excepts: list[str]) -> Ruleset:
        spec = {
            "podSelector": {},
            "ingress": [{"from": [{"ipBlock": {"cidr": cidr, "except": excepts}}]}],
        }
        return table([policy("x", spec)], [pod("a", "db", "10.244.1.2")])  # fmt: skip

    steps = [
        block("10.0.0.0/8", []),
        block("10.0.0.0/8", ["10.1.0.0/16"]),
        block("10.0.0.0/7", ["10.0.0.0/9"]),  # keeps 10.128.0.0/9, beside it 11.0.0.0/8
        block("10.0.0.0/8", []),
    ]
    with temp_netns("npolc") as ns:
        nft(ns, "-f", "-", script=full_script(steps[0]))
        for old, new in itertools.pairwise(steps):
            script = transaction(old, new)
            assert all(line.split()[1] == "element" for line in script.splitlines())
            nft(ns, "-f", "-", script=script)
            assert_table_is(ns, new)
