"""The doctor's kernel checks (pure): routes, neighbours, FDB entries, addresses, the
vxlan device and the firewall chains against the plan.

Diffed with the reconciler's own :func:`~flannelpy.dataplane.diff.diff`: a missing
entry is what the agent should have programmed, a stale one is ours (route
protocol 75, or on our vxlan device) but no longer wanted.
"""

from __future__ import annotations

from collections.abc import Sequence
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import Any

from flannelpy.dataplane.diff import diff
from flannelpy.dataplane.firewall import (
    BUILTIN_CHAINS,
    MASQ_CHAIN,
    Rule,
    forward_rules,
    masq_rules,
    plan_chain,
    plan_jumps,
)
from flannelpy.dataplane.nftables import IPV4_TABLE as NFT_IPV4_TABLE
from flannelpy.dataplane.nftables import forward_rules as nft_forward_rules
from flannelpy.dataplane.nftables import masq_rules as nft_masq_rules
from flannelpy.dataplane.state import (
    Changes,
    FdbEntry,
    Neighbour,
    ObservedState,
    Route,
)
from flannelpy.doctor.facts import Finding, NodeFacts
from flannelpy.doctor.plan import Plan, peer_name
from flannelpy.doctor.report import listed, peers_have
from flannelpy.subnet.lease import Lease


def check_dataplane(facts: NodeFacts, plan: Plan) -> list[Finding]:
    """Routes, neighbours, FDB entries, addresses and the vxlan device against the plan."""
    if plan.desired is None or facts.observed is None:
        return []
    changes = diff(plan.desired, facts.observed)
    findings = _link_findings(plan, facts.observed, changes)
    findings += _route_findings(plan, facts.observed, changes)
    findings += _entry_findings(plan, changes)
    findings += [
        Finding(
            "error",
            "routes",
            f"peer {u.subnet} ({u.public_ip}) cannot be reached: {u.reason}",
            "change the backend or the node's network",
            str(u.subnet),
        )
        for u in sorted(plan.desired.unreachable, key=lambda u: u.subnet)
    ]
    if not findings:
        d = plan.desired
        findings.append(
            Finding(
                "ok",
                "routes",
                f"{len(d.routes)} peer route(s), {len(d.neighbours)} "
                f"neighbour(s) and {len(d.fdb)} FDB entr(ies) as planned, none stale",
            )
        )
    return findings


def _link_findings(plan: Plan, observed: ObservedState, changes: Changes) -> list[Finding]:
    findings: list[Finding] = []
    present = {link.name for link in observed.links}
    created = {link.name for link in changes.links_to_create}
    for name in sorted(created):
        if name in present:
            findings.append(
                Finding(
                    "error",
                    "links",
                    f"{name} has the wrong VNI, local address or port: "
                    "peers' packets do not arrive on it",
                    "restart the agent; it re-creates the device",
                    name,
                )
            )
    for name in sorted(set(changes.links_to_delete) - created):
        findings.append(
            Finding(
                "warning",
                "links",
                f"{name} is left from another backend: harmless, but it holds stale entries",
                f"restart the agent (it removes it) or ip link del {name}",
                name,
            )
        )
    if changes.addresses_to_add:
        findings.append(
            Finding(
                "error",
                "addresses",
                f"{listed([_addr(a) for a in changes.addresses_to_add])}"
                " missing: host-to-pod traffic to peers has no source address they route back",
                "restart the agent, or let it repair (within a second when running)",
            )
        )
    if changes.addresses_to_delete:
        stale = [_addr(a) for a in changes.addresses_to_delete]
        findings.append(
            Finding(
                "warning",
                "addresses",
                f"{listed(stale)} stale on our device",
                "let the agent remove it, or ip addr del it",
            )
        )
    return findings


def _addr(a: Any) -> str:
    return f"{a.address} on {a.ifname}"


def _route_findings(plan: Plan, observed: ObservedState, changes: Changes) -> list[Finding]:
    by_subnet: dict[IPv4Network | IPv6Network, Lease] = {
        lease.primary_subnet: lease for lease in plan.peers
    }
    by_subnet.update({x.ipv6_subnet: x for x in plan.peers if x.ipv6_subnet is not None})
    present = {route.dst for route in observed.routes}
    missing = [r for r in changes.routes_to_set if r.dst not in present]
    wrong = [r for r in changes.routes_to_set if r.dst in present]
    findings: list[Finding] = []

    def describe(route: Route) -> str:
        lease = by_subnet.get(route.dst)
        if route.blackhole:
            return f"blackhole {route.dst} of --ip-blackhole-route"
        if lease is None:
            return f"{route.dst} via {route.gateway} dev {route.ifname}"
        return f"{route.dst} via {peer_name(lease)} {lease.attrs.public_ip}"

    def subjects(routes: Sequence[Route]) -> str:
        return ", ".join(
            peer_name(by_subnet[r.dst]) if r.dst in by_subnet else str(r.dst) for r in routes
        )

    if missing:
        findings.append(
            Finding(
                "error",
                "routes",
                f"{peers_have(len(missing))} no route ("
                f"{listed([describe(r) for r in missing])}): the agent has not programmed "
                "it or something deleted it; pods there are unreachable from here",
                "check the agent log, it repairs within a second when running",
                subjects(missing),
            )
        )
    if wrong:
        findings.append(
            Finding(
                "error",
                "routes",
                f"{len(wrong)} peer route(s) point the wrong way ("
                f"{listed([describe(r) for r in wrong])} expected): traffic goes to the "
                "wrong node or nowhere",
                "check the agent log, it repairs them when running; "
                "something else may rewrite routes (a routing daemon?)",
                subjects(wrong),
            )
        )
    if changes.routes_to_delete:
        stale = changes.routes_to_delete
        findings.append(
            Finding(
                "warning",
                "routes",
                f"{len(stale)} stale route(s) of ours (protocol 75) to "
                f"no current peer ({listed([describe(r) for r in stale])}): traffic to those "
                "subnets goes to a node that no longer holds them",
                "the agent removes them when running; else ip route del them",
                ", ".join(str(r.dst) for r in stale),
            )
        )
    return findings


def _entry_findings(plan: Plan, changes: Changes) -> list[Finding]:
    by_vtep: dict[IPv4Address | IPv6Address, Lease] = {
        x.vtep_ip: x for x in plan.peers if x.vtep_ip is not None
    }
    by_vtep.update({x.vtep_ip6: x for x in plan.peers if x.vtep_ip6 is not None})
    by_public: dict[IPv4Address | IPv6Address, Lease] = {
        x.attrs.public_ip: x for x in plan.peers if x.attrs.public_ip is not None
    }
    by_public.update({x.attrs.public_ipv6: x for x in plan.peers if x.attrs.public_ipv6})

    def neigh(n: Neighbour) -> str:
        lease = by_vtep.get(n.ip)
        return f"{n.ip} {n.mac}" + (f" ({peer_name(lease)})" if lease else "")

    def fdb(f: FdbEntry) -> str:
        lease = by_public.get(f.dst)
        return f"{f.mac} dst {f.dst}" + (f" ({peer_name(lease)})" if lease else "")

    findings: list[Finding] = []
    kinds: list[tuple[str, Sequence[Any], Sequence[Any], Any]] = [
        ("neighbours", changes.neighbours_to_set, changes.neighbours_to_delete, neigh),
        ("fdb", changes.fdb_to_set, changes.fdb_to_delete, fdb),
    ]
    for check, to_set, to_delete, show in kinds:
        if to_set:
            findings.append(
                Finding(
                    "error",
                    check,
                    f"{len(to_set)} entr(ies) missing or wrong "
                    f"({listed([show(e) for e in to_set])}): packets to those peers are "
                    "flooded or dropped",
                    "check the agent log, it repairs within a second when running",
                    ", ".join(show(e) for e in to_set),
                )
            )
        if to_delete:
            findings.append(
                Finding(
                    "warning",
                    check,
                    f"{len(to_delete)} stale entr(ies) "
                    f"({listed([show(e) for e in to_delete])}): left by peers that went "
                    "away or changed MAC",
                    "the agent removes them when running",
                    ", ".join(show(e) for e in to_delete),
                )
            )
    return findings


def firewall_rules(facts: NodeFacts, plan: Plan) -> list[Rule]:
    """The rules the agent keeps, for what this node runs with."""
    assert facts.config is not None and facts.config.network is not None and plan.own
    networks = [facts.config.network, *_ipv4_pools(facts)]
    status = facts.status or {}
    chains = facts.chains or {}
    # The agent's flags are not always known here: its status says, else our flags do,
    # else the presence of its chain (someone set it up, so it is meant to be whole).
    masq = status.get("ip_masq")
    if not isinstance(masq, bool):
        masq = facts.settings.ip_masq or bool(chains.get(f"nat/{MASQ_CHAIN}"))
    forward = status.get("iptables_forward_rules")
    if not isinstance(forward, bool):
        forward = facts.settings.iptables_forward_rules
    rules: list[Rule] = []
    if masq:
        own4 = [x.subnet for x in plan.own_all if x.subnet is not None]
        rules += masq_rules(networks, own4, facts.random_fully)
    if forward:
        rules += forward_rules(networks)
    return rules


def check_firewall(facts: NodeFacts, plan: Plan) -> list[Finding]:
    if plan.own is None or facts.config is None or facts.config.network is None:
        return []
    if facts.config.enable_nftables:
        return check_nft_tables(facts, plan)
    if facts.chains is None:
        return [
            Finding(
                "warning",
                "firewall",
                f"cannot list iptables rules: {facts.firewall_error or 'unknown'}",
                "run the doctor as root on the node",
            )
        ]
    rules = firewall_rules(facts, plan)
    if not rules:
        return [Finding("ok", "firewall", "no masquerade or forward rules expected")]
    by_chain: dict[str, list[Rule]] = {}
    for rule in rules:
        by_chain.setdefault(f"{rule.table}/{rule.chain}", []).append(rule)
    bad: list[str] = []
    for key, chain_rules in by_chain.items():
        observed = list(facts.chains.get(key, ()))
        chain = key.split("/", 1)[1]
        check = plan_jumps if chain in BUILTIN_CHAINS else plan_chain
        result = check(chain_rules, observed)
        if not result.in_sync:
            bad.append(f"{key}: {result.reason}")
    if not bad:
        return [
            Finding(
                "ok",
                "firewall",
                f"{len(rules)} rules in {', '.join(by_chain)} present and in order",
            )
        ]
    meaning = []
    if any(b.startswith("nat/") for b in bad):
        meaning.append(
            "pod traffic leaving the overlay is not masqueraded (or pod-to-pod traffic is)"
        )
    if any(b.startswith("filter/") for b in bad):
        meaning.append("forwarded pod traffic may be dropped by the FORWARD policy")
    return [
        Finding(
            "error",
            "firewall",
            f"iptables rules differ from the agent's ({'; '.join(bad)}): {' and '.join(meaning)}",
            "the agent rewrites its chains every "
            "--iptables-resync seconds: start it; if it runs, find what else rewrites them "
            "(iptables-save)",
            ", ".join(b.split(":")[0] for b in bad),
        )
    ]


def check_nft_tables(facts: NodeFacts, plan: Plan) -> list[Finding]:
    """nftables mode (EnableNFTables): every rule the agent keeps is in flannel-ipv4."""
    assert facts.config is not None and facts.config.network is not None
    if facts.nft_tables is None:
        return [
            Finding(
                "warning",
                "firewall",
                f"cannot list the nftables tables: {facts.firewall_error or 'unknown'}",
                "run the doctor as root on the node",
            )
        ]
    status = facts.status or {}
    masq = status.get("ip_masq")
    forward = status.get("iptables_forward_rules")
    networks = [facts.config.network, *_ipv4_pools(facts)]
    expected: list[str] = []
    if masq if isinstance(masq, bool) else facts.settings.ip_masq:
        subnets = [x.subnet for x in plan.own_all if x.subnet is not None]
        expected += nft_masq_rules(networks, subnets, facts.random_fully)
    if forward if isinstance(forward, bool) else facts.settings.iptables_forward_rules:
        expected += nft_forward_rules(networks)
    table = f"ip {NFT_IPV4_TABLE}"
    listed_lines = {line.strip() for line in facts.nft_tables.get(table, "").splitlines()}
    missing = [rule for rule in expected if rule not in listed_lines]
    if not missing:
        return [Finding("ok", "firewall", f"{len(expected)} rules present in table {table}")]
    return [
        Finding(
            "error",
            "firewall",
            f"{len(missing)} of {len(expected)} rules are missing from "
            f"nftables table {table} (first: {missing[0]}): pod traffic may be masqueraded "
            "wrongly or dropped",
            "the agent rebuilds its tables at every firewall tick: "
            "start it; if it runs, find what else changes them (nft list ruleset)",
        )
    ]


def _ipv4_pools(facts: NodeFacts) -> list[IPv4Network]:
    """The IPv4 pools beyond Network: the firewall checks here read the IPv4 table."""
    return [n for n in facts.pool_networks if isinstance(n, IPv4Network)]
