"""`flannelpy doctor`: the node runbook as a pure function, ``diagnose(facts) -> findings``.

The I/O layer (:mod:`flannelpy.ops.doctor_cli`) gathers :class:`NodeFacts`:
the network config and every lease from the store, the kernel's links and our
routes/neighbours/FDB entries, the firewall chains, the agent's
``status.json`` and the drop counters of the previous run. Everything here is
pure, so each check is tested on synthetic facts.

The desired data plane is computed exactly as the agent computes it (the same
backend planner, the VTEP MAC of the live device) and diffed against the
kernel with the reconciler's own :func:`~flannelpy.dataplane.diff.diff`: a
missing entry is what the agent should have programmed, a stale one is ours
(route protocol 75, or on our vxlan device) but no longer wanted.

Each :class:`Finding` says what was found and what it means (``message``) and
what to do (``action``). ``ok`` findings say what was checked, so a healthy
report lists every check.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from ipaddress import IPv4Address, IPv4Network
from typing import Any, Literal

from flannelpy.backend.base import Backend, NodeContext
from flannelpy.backend.registry import get_backend
from flannelpy.backend.vxlan import device_name
from flannelpy.config.netconf import NetworkConfig
from flannelpy.config.settings import AgentSettings
from flannelpy.control.change import wanted_config
from flannelpy.control.records import NodeOverride
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
from flannelpy.dataplane.kernel import ForeignRoute
from flannelpy.dataplane.state import (
    Changes,
    DesiredState,
    FdbEntry,
    Neighbour,
    ObservedState,
    Route,
    UnderlayInterface,
)
from flannelpy.errors import ConfigError
from flannelpy.observe import mtu as mtu_check
from flannelpy.subnet.lease import Lease
from flannelpy.subnet.survey import find_overlaps

Severity = Literal["ok", "warning", "error"]

BRIDGE = "cni0"  # the pod bridge (flannel's CNI default, ours too)
VETHS = "pod veths"  # the counter group of every pod veth on the bridge, summed
LEASE_CRITICAL_SECONDS = 600.0  # a lease this close to expiry is an error, not a warning
RENEW_SLACK_SECONDS = 300.0  # renewal runs at expiry - margin; allow it this much lateness
STATUS_STALE_MIN_SECONDS = 30.0  # status.json older than max(this, 3 × resync) is stale
LOSS_WARNING = 0.1  # probe loss above this share of the prober's window is worth a look...
LOSS_MIN_PROBES = 10  # ...once that many rounds ran: one lost at start-up is not a trend
DROPS_NOTICE = 10  # new drops on one interface (group) since the last run worth a warning
LIST_LIMIT = 4  # subjects named in one line; the rest are counted
COUNTER_FIELDS = ("rx_dropped", "tx_dropped", "rx_errors", "tx_errors")
SNAPSHOT_VERSION = 1


@dataclass(frozen=True)
class Finding:
    severity: Severity
    check: str  # short name of the check: "routes", "mtu", "firewall", ...
    message: str  # what was found and what it means
    action: str = ""  # what to do; empty for ok findings
    subject: str | None = None  # the peer(s), device(s) or chain(s) concerned


@dataclass(frozen=True)
class LinkCounters:
    rx_dropped: int = 0
    tx_dropped: int = 0
    rx_errors: int = 0
    tx_errors: int = 0

    def __add__(self, other: LinkCounters) -> LinkCounters:
        return LinkCounters(
            *(getattr(self, f) + getattr(other, f) for f in COUNTER_FIELDS)
        )


@dataclass(frozen=True)
class LinkInfo:
    """One kernel link as ``ip -d -s link`` shows it."""

    name: str
    kind: str | None  # "vxlan", "bridge", "veth"; None for a plain device
    mtu: int
    up: bool  # administratively up (IFF_UP); a bridge without ports has no carrier
    master: str | None = None
    counters: LinkCounters = field(default_factory=LinkCounters)
    carrier: bool = True  # IFF_LOWER_UP: the link can pass packets


@dataclass(frozen=True)
class CounterSnapshot:
    """Drop counters of a previous run (``<run_dir>/doctor-last.json``)."""

    taken_at: float  # unix time
    counters: Mapping[str, LinkCounters]


@dataclass(frozen=True)
class NodeFacts:
    """Everything diagnose() looks at. ``None`` means unknown (not gathered or failed);
    the ``*_error`` fields say why, and the checks that need the value report it."""

    settings: AgentSettings
    now: float  # unix time of the gathering
    # the store
    config: NetworkConfig | None = None
    leases: tuple[Lease, ...] = ()
    pool_networks: tuple[IPv4Network, ...] = ()  # address pools beyond Network (etcd mode)
    store_error: str | None = None
    own_lease_ttl: float | None = None  # seconds left on our lease; None: unknown / reservation
    # the kernel
    underlay: UnderlayInterface | None = None
    underlay_error: str | None = None
    kernel_error: str | None = None
    vtep_mac: str | None = None  # of the live vxlan device
    observed: ObservedState | None = None
    links: tuple[LinkInfo, ...] = ()
    foreign: tuple[ForeignRoute, ...] = ()
    # the firewall: "table/chain" -> `iptables -S` lines (empty: no such chain)
    chains: Mapping[str, tuple[str, ...]] | None = None
    firewall_error: str | None = None
    random_fully: bool = True
    # the agent
    status: Mapping[str, Any] | None = None
    status_error: str | None = None
    status_mtime: float | None = None
    previous: CounterSnapshot | None = None


# --- the plan, as the agent makes it ------------------------------------------------------


@dataclass(frozen=True)
class _Plan:
    backend: Backend
    ctx: NodeContext
    own: Lease | None
    peers: tuple[Lease, ...]
    own_all: tuple[Lease, ...]  # every lease of this node (own first); () without own
    overlay_mtu: int
    desired: DesiredState | None  # None without our own lease
    device: str  # flannel.<VNI>: ours under vxlan, stale under host-gw


def _plan(facts: NodeFacts) -> _Plan | str:
    """The agent's view of this node, or why it cannot be computed."""
    if facts.config is None or facts.config.network is None:
        return "the network config is unknown"
    if facts.underlay is None:
        return "the underlay interface is unknown"
    config = facts.config
    running = (facts.status or {}).get("backend_config")
    try:
        if isinstance(running, Mapping):
            # The node may run an override (a rollout in progress): judge it by what it
            # runs; the change itself is the rollout's and the policy's business.
            config = wanted_config(json.dumps(config.raw).encode(), NodeOverride(running, 0))
        backend = get_backend(config.backend.type)
    except ConfigError as e:
        return str(e)
    settings = facts.settings
    ctx = NodeContext(
        config=config,
        underlay=facts.underlay,
        public_ip=settings.public_ip or facts.underlay.ip,
        node_name=settings.node_name or "",
    )
    own = own_lease(facts, ctx.public_ip)
    reported = (facts.status or {}).get("leases") or []
    others = tuple(
        lease for lease in facts.leases
        if own is not None and lease.key != own.key and str(lease.subnet) in reported
    )  # fmt: skip
    own_all = (own, *others) if own is not None else ()
    own_keys = {lease.key for lease in own_all}
    peers = tuple(lease for lease in facts.leases if lease.key not in own_keys)
    vtep_mac = facts.vtep_mac if backend.needs_vtep(ctx, peers) else None
    desired = backend.plan(ctx, list(own_all), list(peers), vtep_mac) if own else None
    return _Plan(
        backend, ctx, own, peers, own_all, backend.mtu(ctx), desired,
        device_name(config.backend.vni),
    )  # fmt: skip


def own_lease(facts: NodeFacts, public_ip: IPv4Address) -> Lease | None:
    """Our lease: the subnet the agent reports, else the one advertising our address
    (Flannel's identity of a node), else the one carrying our node name."""
    reported = (facts.status or {}).get("lease")
    for lease in facts.leases:
        if reported and str(lease.subnet) == reported:
            return lease
    for lease in facts.leases:
        if lease.attrs.public_ip == public_ip:
            return lease
    name = facts.settings.node_name
    return next((lease for lease in facts.leases if name and lease.attrs.node_name == name), None)


def peer_name(lease: Lease) -> str:
    return lease.attrs.node_name or str(lease.attrs.public_ip)


# --- the checks -------------------------------------------------------------------------------


def diagnose(facts: NodeFacts) -> list[Finding]:
    """Every check, in runbook order: store and lease, agent, links and MTU, data plane,
    firewall, overlap, drops, reachability."""
    plan = _plan(facts)
    findings = check_sources(facts)
    if isinstance(plan, str):
        findings.append(
            Finding("error", "plan", f"cannot compute what this node should have: {plan}",
                    "fix the findings above first")
        )  # fmt: skip
    else:
        findings += check_lease(facts, plan)
    findings += check_agent(facts)
    findings += check_links(facts, plan)
    if not isinstance(plan, str):
        findings += check_mtu(facts, plan)
        findings += check_dataplane(facts, plan)
        findings += check_firewall(facts, plan)
    findings += check_overlap(facts)
    findings += check_drops(facts, plan)
    findings += check_probes(facts, plan)
    return findings


def check_sources(facts: NodeFacts) -> list[Finding]:
    """Could the store and the kernel be read at all?"""
    findings: list[Finding] = []
    if facts.store_error:
        flags = (
            "--kube-api-url/--kubeconfig-file/--net-config-path" if facts.settings.kube_subnet_mgr
            else "--etcd-endpoints/--etcd-prefix"
        )
        action = f"give the doctor the agent's {flags} and check the store's health"
        findings.append(
            Finding("error", "store", f"cannot read the network config and leases: "
                    f"{facts.store_error}", action)
        )  # fmt: skip
    else:
        findings.append(
            Finding("ok", "store", f"network config and {len(facts.leases)} lease(s) read")
        )
    if facts.kernel_error:
        findings.append(
            Finding("error", "kernel", f"cannot read the node's network state: "
                    f"{facts.kernel_error}",
                    "run the doctor as root on the node (or in its network namespace)")
        )  # fmt: skip
    elif facts.underlay_error:
        findings.append(
            Finding("error", "underlay", f"no underlay interface: {facts.underlay_error}",
                    "pass the agent's --iface/--iface-regex/--public-ip flags to the doctor; "
                    "if they are the agent's, the agent cannot start either")
        )  # fmt: skip
    return findings


def check_lease(facts: NodeFacts, plan: _Plan) -> list[Finding]:
    if plan.own is None:
        return [
            Finding("error", "lease", f"this node ({plan.ctx.node_name}, {plan.ctx.public_ip}) "
                    "holds no lease: it has no subnet, so no pod here can be reached",
                    "start the agent (or look at its log for why it cannot acquire a lease)")
        ]  # fmt: skip
    own = plan.own
    findings: list[Finding] = []
    twins = [
        lease for lease in plan.peers if lease.attrs.public_ip == plan.ctx.public_ip
    ]
    if twins:
        names = ", ".join(str(t.subnet) for t in twins)
        findings.append(
            Finding("warning", "lease", f"{len(twins)} other lease(s) advertise this node's "
                    f"address {plan.ctx.public_ip} ({names}): leftovers of an earlier run; "
                    "peers route those subnets here", "delete the stale lease key(s) from etcd",
                    names)
        )  # fmt: skip
    ttl = facts.own_lease_ttl
    margin = facts.settings.subnet_lease_renew_margin * 60.0
    if facts.settings.kube_subnet_mgr:
        findings.append(Finding("ok", "lease", f"{own.subnet} held (the Node's podCIDR; it "
                                "does not expire)"))  # fmt: skip
    elif own.store_lease_id is None:
        findings.append(Finding("ok", "lease", f"{own.subnet} is a reservation (never expires)"))
    elif ttl is None:
        findings.append(
            Finding("ok", "lease", f"{own.subnet} held; its expiry could not be read")
        )
    elif ttl < LEASE_CRITICAL_SECONDS:
        findings.append(
            Finding("error", "lease", f"{own.subnet} expires in {_duration(ttl)}: the agent is "
                    "not renewing it, and when it expires another node may take the subnet",
                    "start the agent or look at its log for renewal errors", str(own.subnet))
        )  # fmt: skip
    elif ttl < margin - RENEW_SLACK_SECONDS:
        findings.append(
            Finding("warning", "lease", f"{own.subnet} expires in {_duration(ttl)}, past the "
                    f"renewal point ({_duration(margin)} before expiry): renewals are failing",
                    "look at the agent log for renewal errors and at the store's health",
                    str(own.subnet))
        )  # fmt: skip
    else:
        findings.append(Finding("ok", "lease", f"{own.subnet} held, expires in {_duration(ttl)}"))
    return findings


def check_agent(facts: NodeFacts) -> list[Finding]:
    status = facts.status
    if status is None:
        return [
            Finding("warning", "agent", f"no agent status: {facts.status_error or 'unknown'}",
                    "check that the agent runs with the same --run-dir as the doctor")
        ]  # fmt: skip
    findings: list[Finding] = []
    last = status.get("last_reconcile")
    seen = last if isinstance(last, int | float) else facts.status_mtime
    stale_after = max(STATUS_STALE_MIN_SECONDS, 3 * facts.settings.resync_interval)
    if seen is not None and facts.now - seen > stale_after:
        findings.append(
            Finding("warning", "agent", f"the agent's last reconcile was "
                    f"{_duration(facts.now - seen)} ago (it runs every "
                    f"{facts.settings.resync_interval:g} s): it is stopped or stuck, and "
                    "nothing repairs the data plane", "check that the agent runs; see its log")
        )  # fmt: skip
    if status.get("ready") is False:
        findings.append(
            Finding("error", "agent", "the agent reports not ready: the CNI refuses new pods",
                    "see the agent log for what it waits on")
        )  # fmt: skip
    failures = status.get("failures") or []
    if status.get("converged") is False or failures:
        first = "; ".join(str(f) for f in failures[:2]) or "no details"
        findings.append(
            Finding("error", "agent", f"the agent's last reconcile failed ({len(failures)} "
                    f"failure(s): {first}): some peers are not programmed",
                    "see the agent log; a failure that repeats names what blocks it")
        )  # fmt: skip
    blocked = status.get("blocked") or []
    if blocked:
        findings.append(
            Finding("warning", "agent", f"{len(blocked)} change(s) blocked by the disruption "
                    f"policy: {_names([_blocked_text(b) for b in blocked])}",
                    "apply them in a maintenance window, or change the policy")
        )  # fmt: skip
    if not findings:
        findings.append(Finding("ok", "agent", "the agent is ready and its last reconcile "
                                "converged"))  # fmt: skip
    return findings


def _blocked_text(item: object) -> str:
    if isinstance(item, Mapping):
        return str(item.get("sentence") or item.get("change") or item.get("reason") or item)
    return str(item)


def check_links(facts: NodeFacts, plan: _Plan | str) -> list[Finding]:
    links = {link.name: link for link in facts.links}
    if facts.kernel_error:
        return []
    wanted: list[tuple[str, str]] = []  # (name, role)
    underlay_name = facts.underlay.name if facts.underlay is not None else None
    if underlay_name is not None:
        wanted.append((underlay_name, "the underlay interface"))
    if not isinstance(plan, str) and plan.backend.type_name == "vxlan":
        wanted.append((plan.device, "the vxlan device"))
    wanted.append((BRIDGE, "the pod bridge"))
    findings: list[Finding] = []
    for name, role in wanted:
        link = links.get(name)
        if link is None:
            findings.append(
                Finding("error", "links", f"{role} {name} does not exist: no overlay traffic "
                        "passes here", "start the agent; it creates it", name)
            )  # fmt: skip
        elif not link.up:
            findings.append(
                Finding("error", "links", f"{role} {name} is down: nothing passes it",
                        f"ip link set {name} up; find out what set it down", name)
            )  # fmt: skip
        elif name == underlay_name and not link.carrier:
            findings.append(
                Finding("error", "links", f"{role} {name} has no carrier: no packet leaves "
                        "this node", "check the cable, the switch port or the virtual NIC", name)
            )  # fmt: skip
    down = sorted(v.name for v in _pod_veths(facts.links) if not v.up)
    if down:
        findings.append(
            Finding("warning", "links", f"{len(down)} pod veth(s) down ({_names(down)}): those "
                    "pods are cut off", "delete and re-create the pods concerned", ", ".join(down))
        )  # fmt: skip
    if not findings:
        names = ", ".join(name for name, _ in wanted)
        findings.append(Finding("ok", "links", f"{names} and {len(_pod_veths(facts.links))} pod "
                                "veth(s) up"))  # fmt: skip
    return findings


def _pod_veths(links: Iterable[LinkInfo]) -> list[LinkInfo]:
    return [link for link in links if link.kind == "veth" and link.master == BRIDGE]


def check_mtu(facts: NodeFacts, plan: _Plan) -> list[Finding]:
    links = {link.name: link for link in facts.links}
    want = plan.overlay_mtu
    underlay_mtu = facts.config.backend.mtu if facts.config and facts.config.backend.mtu else None
    basis = (
        f"net-conf.json's MTU {underlay_mtu}" if underlay_mtu
        else f"{plan.ctx.underlay.name}'s MTU {plan.ctx.underlay.mtu}"
    )
    if plan.backend.type_name == "vxlan":
        basis += " minus 50 for VXLAN"
    findings: list[Finding] = []
    wrong: list[str] = []
    devices = [plan.device] if plan.backend.type_name == "vxlan" else []
    for name in [*devices, BRIDGE]:
        link = links.get(name)
        if link is not None and link.mtu != want:
            wrong.append(f"{name} {link.mtu}")
    veths = [v for v in _pod_veths(facts.links) if v.mtu != want]
    wrong += [f"{v.name} {v.mtu}" for v in sorted(veths, key=lambda v: v.name)]
    if wrong:
        findings.append(
            Finding("error", "mtu", f"{len(wrong)} device(s) with an MTU other than the overlay "
                    f"MTU {want} ({basis}): {_names(wrong)}; larger packets are dropped "
                    "silently and connections hang",
                    "restart the agent after an underlay MTU change (it sets the vxlan device "
                    "and cni0); re-create pods whose veth differs",
                    ", ".join(w.split()[0] for w in wrong))
        )  # fmt: skip
    if underlay_mtu and underlay_mtu > plan.ctx.underlay.mtu:
        findings.append(
            Finding("error", "mtu", f"net-conf.json's Backend.MTU {underlay_mtu} is larger "
                    f"than {plan.ctx.underlay.name}'s MTU {plan.ctx.underlay.mtu}: full-size "
                    "packets cannot leave this node", "lower Backend.MTU to the smallest "
                    "underlay MTU of the cluster (or raise the underlay's) and restart the "
                    "agents", plan.ctx.underlay.name)
        )  # fmt: skip
    running = (facts.status or {}).get("mtu")
    if isinstance(running, int) and running != want:
        findings.append(
            Finding("error", "mtu", f"the agent runs with overlay MTU {running} but {basis} "
                    f"gives {want}: the underlay changed since the agent started",
                    "restart the agent so that it applies and advertises the new MTU; if the "
                    "underlay MTU was put back instead, run `ip route flush cache`: the kernel "
                    "keeps the smaller path MTU it learnt for 10 minutes")
        )  # fmt: skip
    report = mtu_check.mtu_mismatches(want, plan.peers)
    findings += _peer_mtus(plan, report)
    if not findings:
        unknown = len(report.unknown)
        also = f"; {unknown} advertise none (flanneld), probes verify those" if unknown else ""
        findings.append(Finding("ok", "mtu", f"overlay MTU {want} ({basis}) on every device, "
                                f"the same for {len(plan.peers) - unknown} peer(s){also}"))
    return findings


def _peer_mtus(plan: _Plan, report: mtu_check.MtuReport) -> list[Finding]:
    if report.consistent:
        return []
    by_subnet = {lease.subnet: lease for lease in plan.peers}
    names = [peer_name(by_subnet[p.subnet]) for p in report.mismatched]
    lines = [f"{name} {p.advertised}" for name, p in zip(names, report.mismatched, strict=True)]
    return [
        Finding("error", "mtu", f"{len(lines)} peer(s) advertise an overlay MTU other than "
                f"ours ({plan.overlay_mtu}): {_names(lines)}; packets of the larger MTU are "
                "dropped silently on the way to the smaller",
                "give every node the same underlay MTU (or set Backend.MTU in net-conf.json) "
                "and restart the agents", ", ".join(names))
    ]  # fmt: skip


def check_dataplane(facts: NodeFacts, plan: _Plan) -> list[Finding]:
    """Routes, neighbours, FDB entries, addresses and the vxlan device against the plan."""
    if plan.desired is None or facts.observed is None:
        return []
    changes = diff(plan.desired, facts.observed)
    findings = _link_findings(plan, facts.observed, changes)
    findings += _route_findings(plan, facts.observed, changes)
    findings += _entry_findings(plan, changes)
    findings += [
        Finding("error", "routes", f"peer {u.subnet} ({u.public_ip}) cannot be reached: "
                f"{u.reason}", "change the backend or the node's network", str(u.subnet))
        for u in sorted(plan.desired.unreachable, key=lambda u: u.subnet)
    ]  # fmt: skip
    if not findings:
        d = plan.desired
        findings.append(
            Finding("ok", "routes", f"{len(d.routes)} peer route(s), {len(d.neighbours)} "
                    f"neighbour(s) and {len(d.fdb)} FDB entr(ies) as planned, none stale")
        )  # fmt: skip
    return findings


def _link_findings(plan: _Plan, observed: ObservedState, changes: Changes) -> list[Finding]:
    findings: list[Finding] = []
    present = {link.name for link in observed.links}
    created = {link.name for link in changes.links_to_create}
    for name in sorted(created):
        if name in present:
            findings.append(
                Finding("error", "links", f"{name} has the wrong VNI, local address or port: "
                        "peers' packets do not arrive on it",
                        "restart the agent; it re-creates the device", name)
            )  # fmt: skip
    for name in sorted(set(changes.links_to_delete) - created):
        findings.append(
            Finding("warning", "links", f"{name} is left from another backend: harmless, but "
                    "it holds stale entries", "restart the agent (it removes it) or "
                    f"ip link del {name}", name)
        )  # fmt: skip
    if changes.addresses_to_add:
        findings.append(
            Finding("error", "addresses", f"{_names([_addr(a) for a in changes.addresses_to_add])}"
                    " missing: host-to-pod traffic to peers has no source address they route back",
                    "restart the agent, or let it repair (within a second when running)")
        )  # fmt: skip
    if changes.addresses_to_delete:
        stale = [_addr(a) for a in changes.addresses_to_delete]
        findings.append(
            Finding("warning", "addresses", f"{_names(stale)} stale on our device",
                    "let the agent remove it, or ip addr del it")
        )  # fmt: skip
    return findings


def _addr(a: Any) -> str:
    return f"{a.address} on {a.ifname}"


def _route_findings(plan: _Plan, observed: ObservedState, changes: Changes) -> list[Finding]:
    by_subnet = {lease.subnet: lease for lease in plan.peers}
    present = {route.dst for route in observed.routes}
    missing = [r for r in changes.routes_to_set if r.dst not in present]
    wrong = [r for r in changes.routes_to_set if r.dst in present]
    findings: list[Finding] = []

    def describe(route: Route) -> str:
        lease = by_subnet.get(route.dst)
        if lease is None:
            return f"{route.dst} via {route.gateway} dev {route.ifname}"
        return f"{route.dst} via {peer_name(lease)} {lease.attrs.public_ip}"

    def subjects(routes: Sequence[Route]) -> str:
        return ", ".join(
            peer_name(by_subnet[r.dst]) if r.dst in by_subnet else str(r.dst) for r in routes
        )

    if missing:
        findings.append(
            Finding("error", "routes", f"{_peers(len(missing))} no route ("
                    f"{_names([describe(r) for r in missing])}): the agent has not programmed "
                    "it or something deleted it; pods there are unreachable from here",
                    "check the agent log, it repairs within a second when running",
                    subjects(missing))
        )  # fmt: skip
    if wrong:
        findings.append(
            Finding("error", "routes", f"{len(wrong)} peer route(s) point the wrong way ("
                    f"{_names([describe(r) for r in wrong])} expected): traffic goes to the "
                    "wrong node or nowhere", "check the agent log, it repairs them when running; "
                    "something else may rewrite routes (a routing daemon?)", subjects(wrong))
        )  # fmt: skip
    if changes.routes_to_delete:
        stale = changes.routes_to_delete
        findings.append(
            Finding("warning", "routes", f"{len(stale)} stale route(s) of ours (protocol 75) to "
                    f"no current peer ({_names([describe(r) for r in stale])}): traffic to those "
                    "subnets goes to a node that no longer holds them",
                    "the agent removes them when running; else ip route del them",
                    ", ".join(str(r.dst) for r in stale))
        )  # fmt: skip
    return findings


def _entry_findings(plan: _Plan, changes: Changes) -> list[Finding]:
    by_vtep = {lease.vtep_ip: lease for lease in plan.peers}
    by_public = {lease.attrs.public_ip: lease for lease in plan.peers}

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
                Finding("error", check, f"{len(to_set)} entr(ies) missing or wrong "
                        f"({_names([show(e) for e in to_set])}): packets to those peers are "
                        "flooded or dropped", "check the agent log, it repairs within a second "
                        "when running", ", ".join(show(e) for e in to_set))
            )  # fmt: skip
        if to_delete:
            findings.append(
                Finding("warning", check, f"{len(to_delete)} stale entr(ies) "
                        f"({_names([show(e) for e in to_delete])}): left by peers that went "
                        "away or changed MAC", "the agent removes them when running",
                        ", ".join(show(e) for e in to_delete))
            )  # fmt: skip
    return findings


def firewall_rules(facts: NodeFacts, plan: _Plan) -> list[Rule]:
    """The rules the agent keeps, for what this node runs with."""
    assert facts.config is not None and facts.config.network is not None and plan.own
    networks = [facts.config.network, *facts.pool_networks]
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
        rules += masq_rules(networks, [x.subnet for x in plan.own_all], facts.random_fully)
    if forward:
        rules += forward_rules(networks)
    return rules


def check_firewall(facts: NodeFacts, plan: _Plan) -> list[Finding]:
    if plan.own is None or facts.config is None or facts.config.network is None:
        return []
    if facts.chains is None:
        return [
            Finding("warning", "firewall", f"cannot list iptables rules: "
                    f"{facts.firewall_error or 'unknown'}", "run the doctor as root on the node")
        ]  # fmt: skip
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
        return [Finding("ok", "firewall", f"{len(rules)} rules in {', '.join(by_chain)} present "
                        "and in order")]  # fmt: skip
    meaning = []
    if any(b.startswith("nat/") for b in bad):
        meaning.append("pod traffic leaving the overlay is not masqueraded (or pod-to-pod "
                       "traffic is)")  # fmt: skip
    if any(b.startswith("filter/") for b in bad):
        meaning.append("forwarded pod traffic may be dropped by the FORWARD policy")
    return [
        Finding("error", "firewall", f"iptables rules differ from the agent's ({'; '.join(bad)}):"
                f" {' and '.join(meaning)}", "the agent rewrites its chains every "
                "--iptables-resync seconds: start it; if it runs, find what else rewrites them "
                "(iptables-save)", ", ".join(b.split(":")[0] for b in bad))
    ]  # fmt: skip


def check_overlap(facts: NodeFacts) -> list[Finding]:
    if facts.config is None or facts.config.network is None or facts.kernel_error:
        return []
    network = facts.config.network
    overlaps = find_overlaps(network, list(facts.foreign))
    if not overlaps:
        return [Finding("ok", "overlap", f"Network {network} overlaps no other route or address "
                        "on this node")]  # fmt: skip
    severity: Severity = "warning" if facts.settings.allow_overlap else "error"
    return [
        Finding(severity, "overlap", f"Network {network} overlaps "
                f"{_names([o.description for o in overlaps])}: traffic to those addresses "
                "goes to the wrong place", "remove the conflicting route or address, or move "
                "the Network", ", ".join(str(o.network) for o in overlaps))
    ]  # fmt: skip


def counter_groups(facts: NodeFacts, plan: _Plan | str) -> dict[str, LinkCounters]:
    """Counters of the interfaces we manage; pod veths summed (they come and go)."""
    links = {link.name: link for link in facts.links}
    names = [BRIDGE]
    if facts.underlay is not None:
        names.insert(0, facts.underlay.name)
    if not isinstance(plan, str) and plan.backend.type_name == "vxlan":
        names.insert(0, plan.device)
    groups = {name: links[name].counters for name in names if name in links}
    total = LinkCounters()
    for veth in _pod_veths(facts.links):
        total = total + veth.counters
    groups[VETHS] = total
    return groups


def check_drops(facts: NodeFacts, plan: _Plan | str) -> list[Finding]:
    if facts.kernel_error:
        return []
    now = counter_groups(facts, plan)
    before = facts.previous
    if before is None:
        return [Finding("ok", "drops", "drop counters recorded; the next run shows whether "
                        "they rise")]  # fmt: skip
    rising: list[tuple[str, str]] = []  # (counter group, what grew)
    for name, counters in now.items():
        old = before.counters.get(name)
        if old is None:
            continue
        deltas = {f: getattr(counters, f) - getattr(old, f) for f in COUNTER_FIELDS}
        if any(d < 0 for d in deltas.values()):
            continue  # the device was re-created (or a pod left): counters restarted
        if _notable(deltas):
            rising.append((name, " ".join(f"{f} +{d}" for f, d in deltas.items() if d > 0)))
    since = _duration(max(0.0, facts.now - before.taken_at))
    if not rising:
        return [Finding("ok", "drops", f"no drops or errors worth a look on {', '.join(now)} "
                        f"in the last {since}")]  # fmt: skip
    return [
        Finding("warning", "drops", f"packets dropped in the last {since}: "
                f"{_names([f'{name} {grew}' for name, grew in rising])}; on the vxlan device or "
                "veths this is usually an MTU mismatch or a missing neighbour/FDB entry, on the "
                "underlay a faulty or saturated link", "compare with the mtu and routes "
                "findings; watch ip -s link show <device>", ", ".join(n for n, _ in rising))
    ]  # fmt: skip


def _notable(deltas: Mapping[str, int]) -> bool:
    """Any new error, or a handful of new drops: a NIC drops the odd frame it has no
    handler for (LLDP, say), which is no fault of the overlay."""
    dropped = deltas["rx_dropped"] + deltas["tx_dropped"]
    return dropped >= DROPS_NOTICE or deltas["rx_errors"] + deltas["tx_errors"] > 0


def check_probes(facts: NodeFacts, plan: _Plan | str) -> list[Finding]:
    probes = (facts.status or {}).get("probes")
    if not isinstance(probes, Mapping) or not probes:
        return [Finding("ok", "peers", "no probe results from the agent (probing is off or "
                        "has not run yet)")]  # fmt: skip
    names: dict[str, str] = {}
    if not isinstance(plan, str):
        names = {str(lease.subnet): peer_name(lease) for lease in plan.peers}

    def label(subnet: str) -> str:
        return f"{names[subnet]} ({subnet})" if subnet in names else subnet

    down, mtu_bad, lossy = [], [], []
    for subnet, result in sorted(probes.items()):
        if not isinstance(result, Mapping):
            continue
        if result.get("reachable") is False:
            err = result.get("error")
            down.append(f"{label(subnet)}{': ' + str(err) if err else ''}")
        elif result.get("mtu_ok") is False:
            mtu_bad.append(label(subnet))
        loss, rounds = result.get("loss"), result.get("probes")
        enough = not isinstance(rounds, int) or rounds >= LOSS_MIN_PROBES
        if result.get("reachable") is not False and isinstance(loss, int | float) \
                and loss > LOSS_WARNING and enough:
            lossy.append(f"{label(subnet)} {loss:.0%}")
    findings: list[Finding] = []
    if down:
        findings.append(
            Finding("error", "peers", f"{len(down)} peer(s) do not answer over the overlay: "
                    f"{_names(down)}", "run the doctor on those nodes; check the underlay path "
                    "between the nodes (UDP 8472 for vxlan)", ", ".join(d.split()[0] for d in down))
        )  # fmt: skip
    if mtu_bad:
        findings.append(
            Finding("error", "peers", f"full-size packets do not reach {_names(mtu_bad)} while "
                    "small ones do: connections with large packets hang silently",
                    "make the MTU consistent (see the mtu findings; underlay MTU minus 50 "
                    "everywhere for vxlan)", ", ".join(m.split()[0] for m in mtu_bad))
        )  # fmt: skip
    if lossy:
        findings.append(
            Finding("warning", "peers", f"probe loss to {_names(lossy)}: the path drops packets",
                    "check the underlay links and the drops findings on both nodes",
                    ", ".join(x.split()[0] for x in lossy))
        )  # fmt: skip
    if not findings:
        findings.append(Finding("ok", "peers", f"all {len(probes)} probed peer(s) reachable, "
                                "full-size packets pass"))  # fmt: skip
    return findings


# --- output ---------------------------------------------------------------------------------

_LABELS = {"ok": "OK", "warning": "WARN", "error": "ERROR"}


def healthy(findings: Iterable[Finding]) -> bool:
    return all(f.severity == "ok" for f in findings)


def exit_code(findings: Iterable[Finding]) -> int:
    """0 when every finding is ok, 1 when any is a warning or an error."""
    return 0 if healthy(findings) else 1


def render_line(finding: Finding) -> str:
    line = f"{_LABELS[finding.severity]:<6} {finding.check}: {finding.message}"
    return f"{line}; {finding.action}" if finding.action else line


def summary(node: str, findings: Sequence[Finding]) -> str:
    counts = {s: sum(1 for f in findings if f.severity == s) for s in _LABELS}
    if healthy(findings):
        return f"{node}: healthy ({counts['ok']} checks ok)"
    return (
        f"{node}: {counts['error']} error(s), {counts['warning']} warning(s), "
        f"{counts['ok']} ok"
    )


def render_text(node: str, findings: Sequence[Finding]) -> str:
    return "\n".join([*(render_line(f) for f in findings), summary(node, findings)]) + "\n"


def render_json(node: str, findings: Sequence[Finding]) -> str:
    doc = {
        "node": node,
        "healthy": healthy(findings),
        "summary": summary(node, findings),
        "findings": [asdict(f) for f in findings],
    }
    return json.dumps(doc, indent=1) + "\n"


# --- the drop-counter baseline ------------------------------------------------------------


def snapshot_json(facts: NodeFacts) -> str:
    """What ``doctor-last.json`` holds after this run."""
    groups = counter_groups(facts, _plan(facts))
    return json.dumps(
        {
            "version": SNAPSHOT_VERSION,
            "taken_at": facts.now,
            "counters": {name: asdict(c) for name, c in groups.items()},
        },
        indent=1,
    )


def parse_snapshot(raw: str) -> CounterSnapshot | None:
    """The previous run's counters; None for anything unreadable (start a new baseline)."""
    try:
        doc = json.loads(raw)
        counters = {
            str(name): LinkCounters(**{f: int(values.get(f, 0)) for f in COUNTER_FIELDS})
            for name, values in doc["counters"].items()
        }
        return CounterSnapshot(float(doc["taken_at"]), counters)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


# --- helpers --------------------------------------------------------------------------------


def _names(items: Sequence[str]) -> str:
    shown = ", ".join(items[:LIST_LIMIT])
    more = len(items) - LIST_LIMIT
    return f"{shown} and {more} more" if more > 0 else shown


def _peers(n: int) -> str:
    return "1 peer has" if n == 1 else f"{n} peers have"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


__all__ = [
    "CounterSnapshot",
    "Finding",
    "LinkCounters",
    "LinkInfo",
    "NodeFacts",
    "diagnose",
    "exit_code",
    "parse_snapshot",
    "render_json",
    "render_text",
    "snapshot_json",
]
