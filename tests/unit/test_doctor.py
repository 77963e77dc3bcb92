"""diagnose() on synthetic node facts: a healthy node is all ok, each fault its finding."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from ipaddress import IPv4Address, IPv4Interface, IPv4Network
from typing import Any

import pytest

from flannelpy.backend.base import NodeContext
from flannelpy.backend.registry import get_backend
from flannelpy.config.settings import AgentSettings
from flannelpy.dataplane.firewall import forward_rules, masq_rules
from flannelpy.dataplane.kernel import ForeignRoute
from flannelpy.dataplane.state import (
    ROUTE_PROTOCOL,
    Address,
    DesiredState,
    FdbEntry,
    Neighbour,
    ObservedState,
    Route,
    UnderlayInterface,
    VxlanLink,
    blackhole_route,
)
from flannelpy.doctor.checks import diagnose
from flannelpy.doctor.facts import (
    CounterSnapshot,
    Finding,
    LinkCounters,
    LinkInfo,
    NodeFacts,
    parse_snapshot,
)
from flannelpy.doctor.gather import vtep_devices
from flannelpy.doctor.plan import Plan, plan_node
from flannelpy.doctor.report import exit_code, render_json, render_line, render_text
from flannelpy.doctor.traffic_checks import snapshot_json
from flannelpy.subnet.lease import Lease, LeaseAttrs
from tests.support.fakes import network_config, underlay

NOW = 1_700_000_000.0
NET = "10.244.0.0/16"
MAC = {1: "02:00:00:00:00:01", 2: "02:00:00:00:00:02", 3: "02:00:00:00:00:03"}
COUNTS = LinkCounters(rx_dropped=5, tx_dropped=1, rx_errors=0, tx_errors=0)


def node_lease(n: int, mtu: int | None = 1450, lease_id: int | None = 100) -> Lease:
    return Lease(
        subnet=IPv4Network(f"10.244.{n}.0/24"),
        attrs=LeaseAttrs(
            public_ip=IPv4Address(f"100.64.0.{n}"),
            backend_type="vxlan",
            backend_data={"VNI": 1, "VtepMAC": MAC[n]},
            node_name=f"n{n}",
            mtu=mtu,
        ),
        store_lease_id=lease_id,
    )


OWN, N2, N3 = node_lease(1), node_lease(2), node_lease(3)
SETTINGS = AgentSettings(node_name="n1", ip_masq=True)


def firewall_lines() -> dict[str, tuple[str, ...]]:
    """`iptables -S` of each chain, as the agent leaves them."""
    rules = masq_rules(IPv4Network(NET), [OWN.subnet], True) + forward_rules(IPv4Network(NET))
    chains: dict[str, list[str]] = {
        "nat/POSTROUTING": ["-P POSTROUTING ACCEPT"],
        "nat/FLANNEL-POSTRTG": ["-N FLANNEL-POSTRTG"],
        "filter/FORWARD": ["-P FORWARD DROP"],
        "filter/FLANNEL-FWD": ["-N FLANNEL-FWD"],
    }
    for rule in rules:
        chains[f"{rule.table}/{rule.chain}"].append(rule.line)
    chains["nat/POSTROUTING"].append("-A POSTROUTING -s 192.0.2.0/24 -j MASQUERADE")
    return {key: tuple(lines) for key, lines in chains.items()}


def healthy_facts(backend: str = "vxlan") -> NodeFacts:
    """A node exactly as its agent leaves it, with two vxlan peers."""
    config = network_config(backend)
    under = underlay("100.64.0.1", ("100.64.0.0/24",))
    ctx = NodeContext(config, under, under.ip, "n1")
    mac = MAC[1] if backend == "vxlan" else None
    desired = get_backend(backend).plan(ctx, [OWN], [N2, N3], mac)
    observed = ObservedState(
        links=desired.links,
        addresses=desired.addresses,
        routes=desired.routes,
        neighbours=desired.neighbours,
        fdb=desired.fdb,
    )
    mtu = 1450 if backend == "vxlan" else 1500
    links = [
        LinkInfo("lo", None, 65536, True),
        LinkInfo("eth0", None, 1500, True, counters=COUNTS),
        LinkInfo("cni0", "bridge", mtu, True, counters=COUNTS),
        LinkInfo("veth1", "veth", mtu, True, "cni0", COUNTS),
        LinkInfo("veth2", "veth", mtu, True, "cni0", COUNTS),
    ]
    if backend == "vxlan":
        links.append(LinkInfo("flannel.1", "vxlan", 1450, True, counters=COUNTS))
    facts = NodeFacts(
        settings=SETTINGS,
        now=NOW,
        config=config,
        leases=(OWN, N2, N3),
        own_lease_ttl=20 * 3600.0,
        underlay=under,
        vtep_mac=mac,
        observed=observed,
        links=tuple(links),
        foreign=(ForeignRoute(IPv4Network("100.64.0.0/24"), "route 100.64.0.0/24 dev eth0"),),
        chains=firewall_lines(),
        random_fully=True,
        status={
            "node": "n1",
            "backend": backend,
            "lease": "10.244.1.0/24",
            "mtu": mtu,
            "ready": True,
            "converged": True,
            "failures": [],
            "last_reconcile": NOW - 3,
            "probes": {
                str(p.subnet): {
                    "reachable": True,
                    "rtt_ms": 0.2,
                    "loss": 0.0,
                    "mtu_ok": True,
                    "error": None,
                    "probes": 20,
                }
                for p in (N2, N3)
            },
        },
    )
    return replace(facts, previous=parse_snapshot(snapshot_json(facts)))


def problems(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity != "ok"]


@pytest.mark.parametrize("backend", ["vxlan", "host-gw"])
def test_a_healthy_node_is_all_ok_and_exits_0(backend: str) -> None:
    facts = healthy_facts(backend)
    if backend == "host-gw":  # peers advertise the underlay MTU under host-gw
        peers = tuple(replace(p, attrs=replace(p.attrs, mtu=1500)) for p in facts.leases)
        facts = replace(facts, leases=peers)
    findings = diagnose(facts)
    assert problems(findings) == []
    checks = {f.check for f in findings}
    assert {
        "store",
        "lease",
        "agent",
        "links",
        "mtu",
        "routes",
        "firewall",
        "overlap",
        "drops",
        "peers",
    } <= checks
    assert exit_code(findings) == 0
    assert render_text("n1", findings).splitlines()[-1].startswith("n1: healthy")


def obs(facts: NodeFacts) -> ObservedState:
    assert facts.observed is not None
    return facts.observed


def und(facts: NodeFacts) -> UnderlayInterface:
    assert facts.underlay is not None
    return facts.underlay


def _route(n: int) -> Route:
    return Route(IPv4Network(f"10.244.{n}.0/24"), IPv4Address(f"10.244.{n}.0"), "flannel.1", True)


def _observed(facts: NodeFacts, **changes: Any) -> NodeFacts:
    assert facts.observed is not None
    return replace(facts, observed=replace(facts.observed, **changes))


def _link(facts: NodeFacts, name: str, **changes: Any) -> NodeFacts:
    links = tuple(replace(link, **changes) if link.name == name else link for link in facts.links)
    return replace(facts, links=links)


def _status(facts: NodeFacts, **changes: Any) -> NodeFacts:
    return replace(facts, status={**(facts.status or {}), **changes})


def _probe(subnet: str, **result: Any) -> Callable[[NodeFacts], NodeFacts]:
    def apply(facts: NodeFacts) -> NodeFacts:
        probes = dict((facts.status or {})["probes"])
        probes[subnet] = {**probes[subnet], **result}
        return _status(facts, probes=probes)

    return apply


def _without_link(name: str) -> Callable[[NodeFacts], NodeFacts]:
    return lambda f: replace(f, links=tuple(link for link in f.links if link.name != name))


def _peer(n: int, **attrs: Any) -> Callable[[NodeFacts], NodeFacts]:
    def apply(facts: NodeFacts) -> NodeFacts:
        leases = tuple(
            replace(lease, attrs=replace(lease.attrs, **attrs))
            if lease.attrs.node_name == f"n{n}"
            else lease
            for lease in facts.leases
        )
        return replace(facts, leases=leases)

    return apply


def _chain(key: str, lines: tuple[str, ...]) -> Callable[[NodeFacts], NodeFacts]:
    return lambda f: replace(f, chains={**(f.chains or {}), key: lines})


def _swap_first_two_rules(f: NodeFacts) -> NodeFacts:
    lines = list((f.chains or {})["nat/FLANNEL-POSTRTG"])
    lines[1], lines[2] = lines[2], lines[1]
    return _chain("nat/FLANNEL-POSTRTG", tuple(lines))(f)


def _counters(f: NodeFacts, name: str, **deltas: int) -> NodeFacts:
    old = next(link.counters for link in f.links if link.name == name)
    new = replace(old, **{k: getattr(old, k) + v for k, v in deltas.items()})
    return _link(f, name, counters=new)


STALE_ROUTE = Route(IPv4Network("10.244.250.0/24"), IPv4Address("10.244.250.0"), "flannel.1", True)
WRONG_VNI = VxlanLink("flannel.1", 7, IPv4Address("100.64.0.1"), "eth0", 8472, 1450, MAC[1])

# (case, fault, severity, check, words in the message, words in the subject)
FAULTS: list[tuple[str, Callable[[NodeFacts], NodeFacts], str, str, tuple[str, ...], str]] = [
    (
        "etcd down",
        lambda f: replace(f, store_error="no endpoint answered", config=None, leases=()),
        "error",
        "store",
        ("no endpoint",),
        "",
    ),
    (
        "netlink fails",
        lambda f: replace(f, kernel_error="Operation not permitted"),
        "error",
        "kernel",
        ("not permitted",),
        "",
    ),
    (
        "no underlay",
        lambda f: replace(f, underlay=None, underlay_error="no interface matches"),
        "error",
        "underlay",
        ("no interface matches",),
        "",
    ),
    (
        "no own lease",
        lambda f: _status(replace(f, leases=(N2, N3)), lease=None),
        "error",
        "lease",
        ("holds no lease",),
        "",
    ),
    (
        "stale twin lease",
        lambda f: replace(
            f, leases=(*f.leases, replace(node_lease(1), subnet=IPv4Network("10.244.9.0/24")))
        ),
        "warning",
        "lease",
        ("advertise this node's address",),
        "10.244.9.0/24",
    ),
    (
        "underlay lease",
        lambda f: replace(
            f, leases=(*f.leases, replace(node_lease(3), subnet=IPv4Network("100.64.0.0/24")))
        ),
        "warning",
        "leases",
        ("ignored as invalid", "outside-network"),
        "100.64.0.0-24",
    ),
    (
        "agent rejected a lease",
        lambda f: _status(f, rejected_leases=[{"key": "10.244.77.0-24", "reason": "undecodable"}]),
        "warning",
        "leases",
        ("10.244.77.0-24 (undecodable)",),
        "10.244.77.0-24",
    ),
    (
        "lease about to expire",
        lambda f: replace(f, own_lease_ttl=240.0),
        "error",
        "lease",
        ("expires in 4 min",),
        "10.244.1.0/24",
    ),
    (
        "renewal overdue",
        lambda f: replace(f, own_lease_ttl=1800.0),
        "warning",
        "lease",
        ("renewals are failing",),
        "10.244.1.0/24",
    ),
    (
        "no status.json",
        lambda f: replace(f, status=None, status_error="x does not exist"),
        "warning",
        "agent",
        ("does not exist",),
        "",
    ),
    (
        "agent stopped",
        lambda f: _status(f, last_reconcile=NOW - 600),
        "warning",
        "agent",
        ("10 min ago",),
        "",
    ),
    ("agent not ready", lambda f: _status(f, ready=False), "error", "agent", ("not ready",), ""),
    (
        "reconcile failing",
        lambda f: _status(f, converged=False, failures=["route x: EPERM"]),
        "error",
        "agent",
        ("route x: EPERM",),
        "",
    ),
    (
        "blocked change",
        lambda f: _status(f, blocked=[{"change": "backend vxlan -> host-gw"}]),
        "warning",
        "agent",
        ("backend vxlan -> host-gw",),
        "",
    ),
    (
        "vxlan device missing",
        _without_link("flannel.1"),
        "error",
        "links",
        ("flannel.1 does not exist",),
        "flannel.1",
    ),
    (
        "bridge down",
        lambda f: _link(f, "cni0", up=False),
        "error",
        "links",
        ("cni0 is down",),
        "cni0",
    ),
    (
        "underlay without carrier",
        lambda f: _link(f, "eth0", carrier=False),
        "error",
        "links",
        ("eth0 has no carrier",),
        "eth0",
    ),
    ("veth down", lambda f: _link(f, "veth2", up=False), "warning", "links", ("veth2",), "veth2"),
    (
        "vxlan device MTU",
        lambda f: _link(f, "flannel.1", mtu=1500),
        "error",
        "mtu",
        ("flannel.1 1500", "overlay MTU 1450"),
        "flannel.1",
    ),
    ("veth MTU", lambda f: _link(f, "veth1", mtu=1500), "error", "mtu", ("veth1 1500",), "veth1"),
    (
        "underlay MTU lowered",
        lambda f: replace(f, underlay=replace(und(f), mtu=1400)),
        "error",
        "mtu",
        ("agent runs with overlay MTU 1450", "gives 1350"),
        "",
    ),
    ("peer MTU differs", _peer(2, mtu=1350), "error", "mtu", ("n2 1350",), "n2"),
    (
        "route deleted",
        lambda f: _observed(f, routes=frozenset({_route(2)})),
        "error",
        "routes",
        ("1 peer has no route (10.244.3.0/24 via n3 100.64.0.3)",),
        "n3",
    ),
    (
        "route hijacked",
        lambda f: _observed(
            f,
            routes=frozenset(
                {_route(2), Route(IPv4Network("10.244.3.0/24"), IPv4Address("100.64.0.99"), "eth0")}
            ),
        ),
        "error",
        "routes",
        ("wrong way",),
        "n3",
    ),
    (
        "stale route",
        lambda f: _observed(f, routes=obs(f).routes | {STALE_ROUTE}),
        "warning",
        "routes",
        ("stale", "10.244.250.0/24"),
        "10.244.250.0/24",
    ),
    (
        "neighbour deleted",
        lambda f: _observed(
            f,
            neighbours=frozenset(n for n in obs(f).neighbours if n.ip != IPv4Address("10.244.2.0")),
        ),
        "error",
        "neighbours",
        ("10.244.2.0", "(n2)"),
        "n2",
    ),
    (
        "stale neighbour",
        lambda f: _observed(
            f,
            neighbours=obs(f).neighbours
            | {Neighbour("flannel.1", IPv4Address("10.244.7.0"), "02:00:00:00:00:07")},
        ),
        "warning",
        "neighbours",
        ("10.244.7.0",),
        "10.244.7.0",
    ),
    (
        "fdb entry deleted",
        lambda f: _observed(f, fdb=frozenset(e for e in obs(f).fdb if e.mac != MAC[3])),
        "error",
        "fdb",
        (MAC[3], "(n3)"),
        "n3",
    ),
    (
        "stale fdb entry",
        lambda f: _observed(
            f,
            fdb=obs(f).fdb
            | {FdbEntry("flannel.1", "02:00:00:00:00:07", IPv4Address("100.64.0.7"))},
        ),
        "warning",
        "fdb",
        ("100.64.0.7",),
        "02:00:00:00:00:07",
    ),
    (
        "vtep address missing",
        lambda f: _observed(f, addresses=frozenset()),
        "error",
        "addresses",
        ("10.244.1.0/32 on flannel.1",),
        "",
    ),
    (
        "vxlan device re-made wrong",
        lambda f: _observed(f, links=frozenset({WRONG_VNI})),
        "error",
        "links",
        ("wrong VNI",),
        "flannel.1",
    ),
    (
        "masq chain flushed",
        _chain("nat/FLANNEL-POSTRTG", ("-N FLANNEL-POSTRTG",)),
        "error",
        "firewall",
        ("nat/FLANNEL-POSTRTG: missing", "not masqueraded"),
        "nat/FLANNEL-POSTRTG",
    ),
    (
        "forward jump gone",
        _chain("filter/FORWARD", ("-P FORWARD DROP",)),
        "error",
        "firewall",
        ("filter/FORWARD: missing", "FORWARD policy"),
        "filter/FORWARD",
    ),
    (
        "masq rules out of order",
        _swap_first_two_rules,
        "error",
        "firewall",
        ("wrong order",),
        "nat/FLANNEL-POSTRTG",
    ),
    (
        "iptables unavailable",
        lambda f: replace(f, chains=None, firewall_error="not installed"),
        "warning",
        "firewall",
        ("not installed",),
        "",
    ),
    (
        "network overlaps a route",
        lambda f: replace(
            f,
            foreign=(
                *f.foreign,
                ForeignRoute(IPv4Network("10.244.0.0/20"), "route 10.244.0.0/20 dev eth1"),
            ),
        ),
        "error",
        "overlap",
        ("route 10.244.0.0/20 dev eth1",),
        "10.244.0.0/20",
    ),
    (
        "drops rising on the vxlan device",
        lambda f: _counters(f, "flannel.1", tx_dropped=12),
        "warning",
        "drops",
        ("flannel.1 tx_dropped +12",),
        "flannel.1",
    ),
    (
        "drops rising on pod veths",
        lambda f: _counters(f, "veth2", rx_errors=3),
        "warning",
        "drops",
        ("pod veths rx_errors +3",),
        "pod veths",
    ),
    (
        "peer unreachable",
        _probe("10.244.3.0/24", reachable=False, error="timed out"),
        "error",
        "peers",
        ("n3 (10.244.3.0/24): timed out",),
        "n3",
    ),
    (
        "full-size probe fails",
        _probe("10.244.2.0/24", mtu_ok=False),
        "error",
        "peers",
        ("full-size packets do not reach n2",),
        "n2",
    ),
    (
        "probe loss",
        _probe("10.244.2.0/24", loss=0.3),
        "warning",
        "peers",
        ("n2 (10.244.2.0/24) 30%",),
        "n2",
    ),
]


@pytest.mark.parametrize(
    ("fault", "severity", "check", "words", "subject"),
    [pytest.param(*case[1:], id=case[0]) for case in FAULTS],
)
def test_each_fault_is_named_by_its_check(
    fault: Callable[[NodeFacts], NodeFacts],
    severity: str,
    check: str,
    words: tuple[str, ...],
    subject: str,
) -> None:
    findings = diagnose(fault(healthy_facts()))
    matching = [
        f
        for f in problems(findings)
        if f.check == check and f.severity == severity and all(w in f.message for w in words)
    ]
    assert matching, f"no {severity} {check} finding saying {words} in {problems(findings)}"
    finding = matching[0]
    assert finding.action, "every problem says what to do"
    if subject:
        assert subject in (finding.subject or "")
    assert exit_code(findings) == 1


def test_route_finding_reads_as_one_runbook_line() -> None:
    facts = _observed(healthy_facts(), routes=frozenset({_route(2)}))
    (finding,) = [f for f in diagnose(facts) if f.check == "routes"]
    assert render_line(finding) == (
        "ERROR  routes: 1 peer has no route (10.244.3.0/24 via n3 100.64.0.3): the agent has "
        "not programmed it or something deleted it; pods there are unreachable from here; "
        "check the agent log, it repairs within a second when running"
    )


def test_a_fault_leaves_the_other_checks_ok() -> None:
    facts = _observed(healthy_facts(), routes=frozenset({_route(2)}))
    findings = diagnose(facts)
    assert [(f.severity, f.check) for f in problems(findings)] == [("error", "routes")]
    text = render_text("n1", findings)
    assert text.splitlines()[-1] == f"n1: 1 error(s), 0 warning(s), {len(findings) - 1} ok"


def test_many_missing_routes_are_counted_not_all_listed() -> None:
    facts = healthy_facts()
    extra = [
        replace(
            N2,
            subnet=IPv4Network(f"10.244.{n}.0/24"),
            attrs=replace(N2.attrs, public_ip=IPv4Address(f"100.64.0.{n}"), node_name=f"n{n}"),
        )
        for n in range(10, 20)
    ]
    findings = diagnose(replace(facts, leases=(*facts.leases, *extra)))
    routes = next(f for f in findings if f.check == "routes" and f.severity == "error")
    assert "10 peers have no route" in routes.message and "and 6 more" in routes.message
    assert routes.subject is not None and routes.subject.count(",") == 9


def test_a_reservation_never_expires_and_unknown_expiry_is_not_a_problem() -> None:
    own = node_lease(1, lease_id=None)
    facts = replace(healthy_facts(), leases=(own, N2, N3), own_lease_ttl=None)
    (lease,) = [f for f in diagnose(facts) if f.check == "lease"]
    assert lease.severity == "ok" and "reservation" in lease.message


def test_a_peer_advertising_no_mtu_is_unknown_not_a_mismatch() -> None:
    facts = _peer(3, mtu=None)(healthy_facts())
    mtu = [f for f in diagnose(facts) if f.check == "mtu"]
    assert [f.severity for f in mtu] == ["ok"] and "1 advertise none" in mtu[0].message


def test_configured_backend_mtu_sets_the_expected_device_mtu() -> None:
    facts = healthy_facts()
    facts = replace(facts, config=network_config("vxlan", mtu=1400))
    mtu = [f for f in diagnose(facts) if f.check == "mtu" and f.severity == "error"]
    assert any("net-conf.json's MTU 1400" in f.message and "1350" in f.message for f in mtu)


def test_backend_mtu_above_the_underlays_is_named() -> None:
    facts = replace(healthy_facts(), config=network_config("vxlan", mtu=9000))
    mtu = [f for f in diagnose(facts) if f.check == "mtu" and f.severity == "error"]
    assert any("Backend.MTU 9000 is larger than eth0's MTU 1500" in f.message for f in mtu)


def test_overlap_is_a_warning_when_the_agent_allows_it() -> None:
    facts = replace(healthy_facts(), settings=replace(SETTINGS, allow_overlap=True))
    facts = replace(facts, foreign=(ForeignRoute(IPv4Network("10.244.5.0/24"), "route x"),))
    (overlap,) = [f for f in diagnose(facts) if f.check == "overlap"]
    assert overlap.severity == "warning"


def test_a_few_drops_are_noise_but_any_error_is_not() -> None:
    facts = _counters(healthy_facts(), "eth0", rx_dropped=3)
    assert problems(diagnose(facts)) == []
    facts = _counters(healthy_facts(), "eth0", rx_errors=1)
    assert [f.subject for f in problems(diagnose(facts))] == ["eth0"]


def test_counters_that_fall_are_a_restart_not_drops() -> None:
    facts = _link(healthy_facts(), "flannel.1", counters=LinkCounters())
    (drops,) = [f for f in diagnose(facts) if f.check == "drops"]
    assert drops.severity == "ok"


def test_one_probe_lost_at_start_up_is_not_loss() -> None:
    facts = _probe("10.244.2.0/24", loss=1 / 9, probes=9)(healthy_facts())
    assert problems(diagnose(facts)) == []
    facts = _probe("10.244.2.0/24", loss=1 / 3, probes=3)(healthy_facts())
    assert problems(diagnose(facts)) == []


def test_first_run_records_a_baseline() -> None:
    facts = replace(healthy_facts(), previous=None)
    (drops,) = [f for f in diagnose(facts) if f.check == "drops"]
    assert drops.severity == "ok" and "recorded" in drops.message


def test_snapshot_round_trips_and_garbage_starts_a_new_baseline() -> None:
    facts = healthy_facts()
    snap = parse_snapshot(snapshot_json(facts))
    assert snap == CounterSnapshot(
        NOW, {"flannel.1": COUNTS, "eth0": COUNTS, "cni0": COUNTS, "pod veths": COUNTS + COUNTS}
    )
    for garbage in ("", "[]", '{"counters": {}}', '{"taken_at": 1, "counters": {"x": 3}}'):
        assert parse_snapshot(garbage) is None


def test_masq_rules_are_not_expected_when_the_agent_does_not_masquerade() -> None:
    facts = replace(healthy_facts(), settings=replace(SETTINGS, ip_masq=False))
    facts = _chain("nat/FLANNEL-POSTRTG", ())(facts)
    facts = _chain("nat/POSTROUTING", ("-P POSTROUTING ACCEPT",))(facts)
    (fw,) = [f for f in diagnose(facts) if f.check == "firewall"]
    assert fw.severity == "ok" and "FLANNEL-FWD" in fw.message and "POSTRTG" not in fw.message


def test_masq_rules_are_checked_when_the_chain_exists_whatever_our_flags() -> None:
    facts = replace(healthy_facts(), settings=replace(SETTINGS, ip_masq=False))
    facts = _chain("nat/FLANNEL-POSTRTG", ("-N FLANNEL-POSTRTG",))(facts)
    (fw,) = [f for f in diagnose(facts) if f.check == "firewall"]
    assert fw.severity == "error" and "nat/FLANNEL-POSTRTG: missing" in fw.message


def test_host_gw_reports_a_left_over_vxlan_device_and_peers_off_segment() -> None:
    facts = healthy_facts("host-gw")
    leases = tuple(replace(p, attrs=replace(p.attrs, mtu=1500)) for p in facts.leases)
    far = replace(
        node_lease(3),
        subnet=IPv4Network("10.244.30.0/24"),
        attrs=replace(N3.attrs, public_ip=IPv4Address("100.65.0.3"), mtu=1500),
    )
    link = VxlanLink("flannel.1", 1, IPv4Address("100.64.0.1"), "eth0", 8472, 1450, MAC[1])
    facts = replace(facts, leases=(*leases, far))
    facts = _observed(
        facts,
        links=frozenset({link}),
        addresses=frozenset({Address("flannel.1", IPv4Interface("10.244.1.0/32"))}),
    )
    found = {(f.severity, f.check, f.subject) for f in problems(diagnose(facts))}
    assert ("warning", "links", "flannel.1") in found
    assert ("error", "routes", "10.244.30.0/24") in found


def test_route_protocol_is_ours() -> None:
    assert ROUTE_PROTOCOL == 75  # stale-route findings say "protocol 75"


def test_json_output_is_machine_readable() -> None:
    findings = diagnose(_observed(healthy_facts(), routes=frozenset({_route(2)})))
    doc = json.loads(render_json("n1", findings))
    assert doc["node"] == "n1" and doc["healthy"] is False
    errors = [f for f in doc["findings"] if f["severity"] == "error"]
    assert errors == [
        {
            "severity": "error",
            "check": "routes",
            "subject": "n3",
            "message": errors[0]["message"],
            "action": errors[0]["action"],
        }
    ]


def test_a_node_with_two_leases_in_two_pools_is_healthy_and_a_missing_rule_is_named() -> None:
    """The agent's second lease (a new pool) and its rules are expected, not stale."""
    second = replace(OWN, subnet=IPv4Network("10.250.7.0/24"))
    pool = IPv4Network("10.250.0.0/16")
    facts = healthy_facts()
    ctx = NodeContext(facts.config, facts.underlay, facts.underlay.ip, "n1")  # type: ignore[arg-type]
    desired = get_backend("vxlan").plan(ctx, [OWN, second], [N2, N3], MAC[1])
    rules = masq_rules([IPv4Network(NET), pool], [OWN.subnet, second.subnet], True)
    rules += forward_rules([IPv4Network(NET), pool])
    chains = {
        key: tuple(line for line in lines if not line.startswith("-A FLANNEL"))
        for key, lines in firewall_lines().items()
    }
    for rule in rules:
        if rule.chain.startswith("FLANNEL"):
            key = f"{rule.table}/{rule.chain}"
            chains[key] = (*chains[key], rule.line)
    facts = replace(
        facts,
        leases=(OWN, second, N2, N3),
        pool_networks=(pool,),
        observed=replace(facts.observed, addresses=desired.addresses),  # type: ignore[arg-type]
        chains=chains,
        status={**facts.status, "leases": ["10.244.1.0/24", "10.250.7.0/24"]},  # type: ignore[dict-item]
    )
    assert problems(diagnose(facts)) == []
    # Without the pool's forward rules, the doctor says the chain is not as the agent keeps it.
    broken = dict(chains)
    broken["filter/FLANNEL-FWD"] = tuple(
        line for line in chains["filter/FLANNEL-FWD"] if "10.250.0.0/16" not in line
    )
    found = problems(diagnose(replace(facts, chains=broken)))
    assert [f.check for f in found] == ["firewall"]


def _nft_mode(facts: NodeFacts, drop_rule: str | None = None) -> NodeFacts:
    """The node in nftables mode: no iptables chains, the table as the agent writes it."""
    from flannelpy.dataplane.nftables import forward_rules as nft_forward
    from flannelpy.dataplane.nftables import masq_rules as nft_masq

    assert facts.config is not None and facts.config.network is not None
    rules = [
        *nft_masq(facts.config.network, [OWN.subnet], True),
        *nft_forward(facts.config.network),
    ]
    body = "\n".join(f"\t\t{rule}" for rule in rules if rule != drop_rule)
    listing = f"table ip flannel-ipv4 {{\n\tchain postrtg {{\n{body}\n\t}}\n}}\n"
    config = replace(facts.config, enable_nftables=True)
    return replace(facts, config=config, chains=None, nft_tables={"ip flannel-ipv4": listing})


def test_nftables_mode_checks_the_flannel_table_not_iptables() -> None:
    findings = diagnose(_nft_mode(healthy_facts()))
    (finding,) = [f for f in findings if f.check == "firewall"]
    assert finding.severity == "ok" and "flannel-ipv4" in finding.message
    assert problems(findings) == []


def test_nftables_mode_names_a_missing_rule() -> None:
    rule = "ip saddr 10.244.0.0/16 accept"
    (finding,) = [f for f in diagnose(_nft_mode(healthy_facts(), rule)) if f.check == "firewall"]
    assert finding.severity == "error" and rule in finding.message and finding.action


def test_the_blackhole_route_of_ip_blackhole_route_is_planned_not_stale() -> None:
    facts = healthy_facts()
    own_hole = blackhole_route(OWN.subnet)
    with_hole = _observed(facts, routes=obs(facts).routes | {own_hole})
    flagged = replace(with_hole, settings=replace(SETTINGS, ip_blackhole_route=True))
    assert problems(diagnose(flagged)) == []
    # Without the flag the same route is one of ours left over: stale.
    (stale,) = problems(diagnose(with_hole))
    assert stale.check == "routes" and str(OWN.subnet) in stale.message
    # With the flag and the route gone, it is missing.
    (missing,) = problems(diagnose(replace(facts, settings=flagged.settings)))
    assert missing.check == "routes"


def _dual_facts(flanneld_peer: bool) -> NodeFacts:
    """healthy_facts in dual stack: IPv6 underlay fd00:64::1, every lease with its /64;
    n3 a flanneld node (no MTU of ours) when ``flanneld_peer``."""
    import json as _json
    from ipaddress import IPv6Address, IPv6Network

    from flannelpy.config.netconf import parse_network_config

    config = parse_network_config(
        _json.dumps(
            {
                "Network": "10.244.0.0/16",
                "EnableIPv6": True,
                "IPv6Network": "fc00::/48",
                "Backend": {"Type": "vxlan"},
            }
        )
    )

    def dual(lease: Lease, n: int, mtu: int | None) -> Lease:
        return replace(
            lease,
            ipv6_subnet=IPv6Network(f"fc00:0:0:{n}::/64"),
            attrs=replace(
                lease.attrs,
                public_ipv6=IPv6Address(f"fd00:64::{n}"),
                mtu=mtu,
                backend_v6_data=lease.attrs.backend_data,
            ),
        )

    facts = healthy_facts()
    under = replace(
        facts.underlay,
        ip6=IPv6Address("fd00:64::1"),  # type: ignore[type-var]
        networks6=(IPv6Network("fd00:64::/64"),),
    )
    links = [
        replace(x, mtu=1430) if x.name in ("cni0", "veth1", "veth2") else x for x in facts.links
    ] + [LinkInfo("flannel-v6.1", "vxlan", 1430, True, counters=COUNTS)]
    return replace(
        facts,
        config=config,
        underlay=under,
        links=tuple(links),
        leases=(
            dual(OWN, 1, 1430),
            dual(N2, 2, 1430),
            dual(N3, 3, None if flanneld_peer else 1430),
        ),
        status={**(facts.status or {}), "mtu": 1430},
    )


def test_dual_stack_device_mtus_are_per_family_and_flanneld_v6_is_named() -> None:
    mtu = [f for f in diagnose(_dual_facts(flanneld_peer=False)) if f.check == "mtu"]
    # flannel.1 1450 (IPv4 underlay), flannel-v6.1 and pods 1430 (IPv6 underlay): all right.
    assert [f.severity for f in mtu] == ["ok"], mtu
    assert "minus 70 for VXLAN over IPv6" in mtu[0].message
    mtu = [f for f in diagnose(_dual_facts(flanneld_peer=True)) if f.check == "mtu"]
    (warning,) = [f for f in mtu if f.severity == "warning"]
    assert "run VXLAN over IPv6 with pod MTU 1450" in warning.message
    assert "only 1430 fits" in warning.message and warning.subject == "n3"


def test_a_peer_whose_ipv6_path_fails_full_size_packets_is_named() -> None:
    facts = _dual_facts(flanneld_peer=True)
    ok = {
        "reachable": True,
        "rtt_ms": 0.2,
        "loss": 0.0,
        "mtu_ok": True,
        "error": None,
        "probes": 20,
    }
    probes = {
        **(facts.status or {})["probes"],
        "fc00:0:0:2::/64": ok,
        "fc00:0:0:3::/64": {**ok, "mtu_ok": False},
    }
    peers = [f for f in diagnose(_status(facts, probes=probes)) if f.check == "peers"]
    (bad,) = [f for f in peers if f.severity == "error"]
    assert bad.message.startswith("full-size IPv6 packets do not reach n3 (fc00:0:0:3::/64)")
    assert "minus 70" in bad.action and bad.subject == "n3"


def _as_read(desired: DesiredState, devices: tuple[str, ...]) -> ObservedState:
    """What NetlinkKernel.observe(devices, devices) finds where the agent programmed
    ``desired``: our routes on any device, everything else only on the devices read."""
    return ObservedState(
        links=frozenset(x for x in desired.links if x.name in devices),
        addresses=frozenset(x for x in desired.addresses if x.ifname in devices),
        routes=desired.routes,
        neighbours=frozenset(x for x in desired.neighbours if x.ifname in devices),
        fdb=frozenset(x for x in desired.fdb if x.ifname in devices),
    )


def test_dual_stack_kernel_is_read_on_the_ipv6_vtep_too() -> None:
    facts = _dual_facts(flanneld_peer=False)
    plan = plan_node(facts)
    assert isinstance(plan, Plan) and plan.desired is not None
    desired = plan.desired
    assert "flannel-v6.1" in {x.name for x in desired.links}
    kernel = ("addresses", "routes", "neighbours", "fdb", "links")

    # Reading flannel.1 alone, the IPv6 half the agent programmed looks missing.
    only_v4 = replace(facts, observed=_as_read(desired, ("flannel.1",)))
    wrong = {f.check for f in diagnose(only_v4) if f.severity == "error"}
    assert wrong == {"addresses", "routes", "neighbours", "fdb"}

    devices = vtep_devices(facts.config.backend.vni)  # type: ignore[union-attr]
    read = replace(facts, observed=_as_read(desired, devices))
    assert [f for f in problems(diagnose(read)) if f.check in kernel] == []
    ok = [f for f in diagnose(read) if f.check == "routes"]
    assert [f.severity for f in ok] == ["ok"]
    assert f"{len(desired.routes)} peer route(s)" in ok[0].message


def test_a_device_kept_during_a_wireguard_rollout_is_planned_not_stale() -> None:
    """n1 switched back from wireguard to vxlan while n2 still runs wireguard: n1 keeps
    flannel-wg for that pair and routes the Network through it, as its agent plans (the
    kernel below holds that plan). Before, the doctor planned vxlan alone: the route
    through flannel-wg was "stale" and n2 "had no route"."""
    from flannelpy.backend.wireguard import keeping_context, plan_kept, with_kept_key
    from flannelpy.backend.wireguard_config import WireguardConfig, WireguardIdentity
    from flannelpy.dataplane.wgkeys import generate_private_key, public_key

    n2 = replace(
        N2,
        attrs=LeaseAttrs(
            public_ip=IPv4Address("100.64.0.2"),
            backend_type="wireguard",
            backend_data={"PublicKey": public_key(generate_private_key()), "Port": 51820},
            node_name="n2",
            mtu=1440,
        ),
    )
    facts = healthy_facts()
    assert facts.underlay is not None and facts.config is not None
    identity = WireguardIdentity(public_key(generate_private_key()), WireguardConfig())
    base = NodeContext(facts.config, facts.underlay, facts.underlay.ip, "n1")
    ctx = keeping_context(replace(base, wireguard_identity=identity), "vxlan", [n2, N3], True)
    assert ctx.keeps_wireguard
    vxlan = get_backend("vxlan")
    own = replace(OWN, attrs=with_kept_key(ctx, vxlan.lease_attrs(ctx, MAC[1])))
    planned = plan_kept(ctx, [own], [n2, N3], vxlan.plan(ctx, [own], [n2, N3], MAC[1]))
    through_wg = [r for r in planned.routes if r.ifname == "flannel-wg"]
    assert [str(r.dst) for r in through_wg] == [NET]  # what the agent programs
    facts = _observed(replace(facts, leases=(own, n2, N3)), routes=planned.routes)

    findings = [f for f in diagnose(facts) if f.check == "routes"]
    assert problems(findings) == [], findings
