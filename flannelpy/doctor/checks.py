"""`flannelpy doctor`: the node runbook as a pure function, ``diagnose(facts) -> findings``.

The I/O layer (:mod:`flannelpy.doctor.gather`) gathers :class:`~.facts.NodeFacts`:
the network config and every lease from the store, the kernel's links and our
routes/neighbours/FDB entries, the firewall chains, the agent's
``status.json`` and the drop counters of the previous run. Everything here is
pure, so each check is tested on synthetic facts.

The desired data plane is computed exactly as the agent computes it (the same
backend planner, the VTEP MAC of the live device) and diffed against the
kernel with the reconciler's own :func:`~flannelpy.dataplane.diff.diff`: a
missing entry is what the agent should have programmed, a stale one is ours
(route protocol 75, or on our vxlan device) but no longer wanted.

The plan lives in :mod:`.plan`, the data plane and firewall checks in
:mod:`.kernel_checks`, the rendering in :mod:`.report`.

Each :class:`~.facts.Finding` says what was found and what it means (``message``) and
what to do (``action``). ``ok`` findings say what was checked, so a healthy
report lists every check.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict

from flannelpy.backend import ipv6 as ipv6_plan
from flannelpy.backend.vxlan import vtep_mtu
from flannelpy.doctor.facts import (
    BRIDGE,
    COUNTER_FIELDS,
    DROPS_NOTICE,
    LEASE_CRITICAL_SECONDS,
    LOSS_MIN_PROBES,
    LOSS_WARNING,
    RENEW_SLACK_SECONDS,
    SNAPSHOT_VERSION,
    STATUS_STALE_MIN_SECONDS,
    VETHS,
    Finding,
    LinkCounters,
    LinkInfo,
    NodeFacts,
    Severity,
)
from flannelpy.doctor.kernel_checks import check_dataplane, check_firewall
from flannelpy.doctor.plan import Plan, peer_name, plan_node
from flannelpy.doctor.report import duration, listed
from flannelpy.doctor.wireguard_check import check_wireguard
from flannelpy.observe import mtu as mtu_check
from flannelpy.subnet.survey import find_overlaps


def diagnose(facts: NodeFacts) -> list[Finding]:
    """Every check, in runbook order: store and lease, agent, links and MTU, data plane,
    firewall, overlap, drops, reachability."""
    plan = plan_node(facts)
    findings = check_sources(facts)
    if isinstance(plan, str):
        findings.append(
            Finding(
                "error",
                "plan",
                f"cannot compute what this node should have: {plan}",
                "fix the findings above first",
            )
        )
    else:
        findings += check_lease(facts, plan)
    findings += check_agent(facts)
    findings += check_peer_leases(facts, plan)
    findings += check_links(facts, plan)
    if not isinstance(plan, str):
        findings += check_mtu(facts, plan)
        findings += check_wireguard(facts, plan)
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
            "--kube-api-url/--kubeconfig-file/--net-config-path"
            if facts.settings.kube_subnet_mgr
            else "--etcd-endpoints/--etcd-prefix"
        )
        action = f"give the doctor the agent's {flags} and check the store's health"
        findings.append(
            Finding(
                "error",
                "store",
                f"cannot read the network config and leases: {facts.store_error}",
                action,
            )
        )
    else:
        findings.append(
            Finding("ok", "store", f"network config and {len(facts.leases)} lease(s) read")
        )
    if facts.kernel_error:
        findings.append(
            Finding(
                "error",
                "kernel",
                f"cannot read the node's network state: {facts.kernel_error}",
                "run the doctor as root on the node (or in its network namespace)",
            )
        )
    elif facts.underlay_error:
        findings.append(
            Finding(
                "error",
                "underlay",
                f"no underlay interface: {facts.underlay_error}",
                "pass the agent's --iface/--iface-regex/--public-ip flags to the doctor; "
                "if they are the agent's, the agent cannot start either",
            )
        )
    return findings


def check_lease(facts: NodeFacts, plan: Plan) -> list[Finding]:
    if plan.own is None:
        return [
            Finding("error", "lease", f"this node ({plan.ctx.node_name}, {plan.ctx.public_ip}) "
                    "holds no lease: it has no subnet, so no pod here can be reached",
                    "start the agent (or look at its log for why it cannot acquire a lease)")
        ]  # fmt: skip
    own = plan.own
    held = own.primary_subnet
    findings: list[Finding] = []
    own_keys = {lease.key for lease in plan.own_all}
    # IPv6-only, a node is known by its IPv6 address (its leases have no IPv4 one).
    address = plan.ctx.public_ip if plan.ctx.config.enable_ipv4 else plan.ctx.public_ipv6
    twins = [
        lease for lease in facts.leases
        if lease.key not in own_keys and address is not None and address in (
            lease.attrs.public_ip, lease.attrs.public_ipv6)
    ]  # fmt: skip
    if twins:
        names = ", ".join(str(t.primary_subnet) for t in twins)
        findings.append(
            Finding("warning", "lease", f"{len(twins)} other lease(s) advertise this node's "
                    f"address {address} ({names}): leftovers of an earlier run; "
                    "peers route those subnets here", "delete the stale lease key(s) from etcd",
                    names)
        )  # fmt: skip
    ttl = facts.own_lease_ttl
    margin = facts.settings.subnet_lease_renew_margin * 60.0
    if facts.settings.kube_subnet_mgr:
        findings.append(Finding("ok", "lease", f"{held} held (the Node's podCIDR; it "
                                "does not expire)"))  # fmt: skip
    elif own.store_lease_id is None:
        findings.append(Finding("ok", "lease", f"{held} is a reservation (never expires)"))
    elif ttl is None:
        findings.append(Finding("ok", "lease", f"{held} held; its expiry could not be read"))
    elif ttl < LEASE_CRITICAL_SECONDS:
        findings.append(
            Finding("error", "lease", f"{held} expires in {duration(ttl)}: the agent is "
                    "not renewing it, and when it expires another node may take the subnet",
                    "start the agent or look at its log for renewal errors", str(held))
        )  # fmt: skip
    elif ttl < margin - RENEW_SLACK_SECONDS:
        findings.append(
            Finding("warning", "lease", f"{held} expires in {duration(ttl)}, past the "
                    f"renewal point ({duration(margin)} before expiry): renewals are failing",
                    "look at the agent log for renewal errors and at the store's health",
                    str(held))
        )  # fmt: skip
    else:
        findings.append(Finding("ok", "lease", f"{held} held, expires in {duration(ttl)}"))
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
                    f"{duration(facts.now - seen)} ago (it runs every "
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
                    f"policy: {listed([_blocked_text(b) for b in blocked])}",
                    "apply them in a maintenance window, or change the policy")
        )  # fmt: skip
    if not findings:
        findings.append(Finding("ok", "agent", "the agent is ready and its last reconcile "
                                "converged"))  # fmt: skip
    return findings


def check_peer_leases(facts: NodeFacts, plan: Plan | str) -> list[Finding]:
    """Peer leases the agent ignores (outside the networks, over this node's subnets or
    addresses, a bogus PublicIP, malformed values): as the agent reports them in
    status.json's ``rejected_leases``, and as the doctor judges the store's leases."""
    found: dict[str, str] = {}
    reported = (facts.status or {}).get("rejected_leases")
    if isinstance(reported, list):
        for item in reported[:1000]:
            if isinstance(item, Mapping) and isinstance(item.get("key"), str):
                found[item["key"]] = str(item.get("reason") or "invalid")
    if not isinstance(plan, str):
        for rejection in plan.rejected:
            found.setdefault(rejection.key, rejection.reason)
    if not found:
        return [Finding("ok", "leases", "every peer lease is valid for this node")]
    items = [f"{key} ({reason})" for key, reason in sorted(found.items())]
    return [
        Finding(
            "warning",
            "leases",
            f"{len(found)} peer lease(s) ignored as invalid and never programmed: {listed(items)}",
            "delete or correct those keys in the store; the agent log says why each one "
            "was refused",
            subject=", ".join(sorted(found)),
        )
    ]


def _blocked_text(item: object) -> str:
    if isinstance(item, Mapping):
        return str(item.get("sentence") or item.get("change") or item.get("reason") or item)
    return str(item)


def check_links(facts: NodeFacts, plan: Plan | str) -> list[Finding]:
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
            Finding("warning", "links", f"{len(down)} pod veth(s) down ({listed(down)}): those "
                    "pods are cut off", "delete and re-create the pods concerned", ", ".join(down))
        )  # fmt: skip
    if not findings:
        names = ", ".join(name for name, _ in wanted)
        findings.append(Finding("ok", "links", f"{names} and {len(_pod_veths(facts.links))} pod "
                                "veth(s) up"))  # fmt: skip
    return findings


def _pod_veths(links: Iterable[LinkInfo]) -> list[LinkInfo]:
    return [link for link in links if link.kind == "veth" and link.master == BRIDGE]


def check_mtu(facts: NodeFacts, plan: Plan) -> list[Finding]:
    links = {link.name: link for link in facts.links}
    want = plan.overlay_mtu
    underlay_mtu = facts.config.backend.mtu if facts.config and facts.config.backend.mtu else None
    basis = (
        f"net-conf.json's MTU {underlay_mtu}"
        if underlay_mtu
        else f"{plan.ctx.underlay.name}'s MTU {plan.ctx.underlay.mtu}"
    )
    dual = ipv6_plan.enabled(plan.ctx)
    if plan.backend.type_name == "vxlan":
        basis += " minus 70 for VXLAN over IPv6" if dual else " minus 50 for VXLAN"
    findings: list[Finding] = []
    wrong: list[str] = []
    # Each VTEP carries its own underlay family's overhead; cni0 and pods the smaller.
    expected = {BRIDGE: want}
    if plan.backend.type_name == "vxlan":
        expected[plan.device] = vtep_mtu(plan.ctx)
        if dual:
            expected[ipv6_plan.device_name_v6(plan.ctx.config.backend.vni)] = ipv6_plan.vtep6_mtu(
                plan.ctx
            )
    for name, mtu in expected.items():
        link = links.get(name)
        if link is not None and link.mtu != mtu:
            wrong.append(f"{name} {link.mtu} (not {mtu})")
    veths = [v for v in _pod_veths(facts.links) if v.mtu != want]
    wrong += [f"{v.name} {v.mtu}" for v in sorted(veths, key=lambda v: v.name)]
    if wrong:
        findings.append(
            Finding("error", "mtu", f"{len(wrong)} device(s) with an MTU other than the overlay "
                    f"MTU {want} ({basis}): {listed(wrong)}; larger packets are dropped "
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
    findings += _flanneld_ipv6_mtus(plan)
    if not findings:
        unknown = len(report.unknown)
        also = f"; {unknown} advertise none (flanneld), probes verify those" if unknown else ""
        findings.append(
            Finding(
                "ok",
                "mtu",
                f"overlay MTU {want} ({basis}) on every device, "
                f"the same for {len(plan.peers) - unknown} peer(s){also}",
            )
        )
    return findings


def _peer_mtus(plan: Plan, report: mtu_check.MtuReport) -> list[Finding]:
    if report.consistent:
        return []
    by_subnet = {lease.primary_subnet: lease for lease in plan.peers}
    names = [peer_name(by_subnet[p.subnet]) for p in report.mismatched]
    lines = [f"{name} {p.advertised}" for name, p in zip(names, report.mismatched, strict=True)]
    return [
        Finding("error", "mtu", f"{len(lines)} peer(s) advertise an overlay MTU other than "
                f"ours ({plan.overlay_mtu}): {listed(lines)}; packets of the larger MTU are "
                "dropped silently on the way to the smaller",
                "give every node the same underlay MTU (or set Backend.MTU in net-conf.json) "
                "and restart the agents", ", ".join(names))
    ]  # fmt: skip


def _flanneld_ipv6_mtus(plan: Plan) -> list[Finding]:
    """flanneld subtracts 50 for VXLAN over IPv6 too, 20 bytes short of the real 70: the
    kernel caps its flannel-v6 device at underlay−70, but its pods get underlay−50, so
    their full-size IPv6 packets are refused on their own node and depend on ICMPv6
    Packet Too Big reaching the sender (lost where ICMPv6 is filtered)."""
    if plan.backend.type_name != "vxlan" or not ipv6_plan.enabled(plan.ctx):
        return []
    theirs = [p for p in plan.peers if mtu_check.runs_flanneld_vxlan_v6(p)]
    if not theirs:
        return []
    underlay = plan.ctx.config.backend.mtu or plan.ctx.underlay.mtu
    flanneld_mtu = underlay - ipv6_plan.FLANNELD_VXLAN6_OVERHEAD
    right = underlay - ipv6_plan.VXLAN6_ENCAP_OVERHEAD
    names = [peer_name(p) for p in theirs]
    return [
        Finding("warning", "mtu", f"{len(names)} flanneld peer(s) run VXLAN over IPv6 with "
                f"pod MTU {flanneld_mtu} (underlay {underlay} minus 50), but VXLAN over IPv6 "
                f"costs 70 bytes, so only {right} fits: their pods' full-size IPv6 packets "
                "are refused by their own VTEP and get through only if ICMPv6 Packet Too Big "
                f"reaches the sender ({listed(names)})",
                f"run flannelpy on those nodes, or give their pods MTU {right}",
                ", ".join(names))
    ]  # fmt: skip


def check_overlap(facts: NodeFacts) -> list[Finding]:
    if facts.config is None or facts.config.network is None or facts.kernel_error:
        return []
    network = facts.config.network
    overlaps = find_overlaps(network, list(facts.foreign))
    if not overlaps:
        return [
            Finding(
                "ok",
                "overlap",
                f"Network {network} overlaps no other route or address on this node",
            )
        ]
    severity: Severity = "warning" if facts.settings.allow_overlap else "error"
    return [
        Finding(
            severity,
            "overlap",
            f"Network {network} overlaps "
            f"{listed([o.description for o in overlaps])}: traffic to those addresses "
            "goes to the wrong place",
            "remove the conflicting route or address, or move the Network",
            ", ".join(str(o.network) for o in overlaps),
        )
    ]


def counter_groups(facts: NodeFacts, plan: Plan | str) -> dict[str, LinkCounters]:
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


def check_drops(facts: NodeFacts, plan: Plan | str) -> list[Finding]:
    if facts.kernel_error:
        return []
    now = counter_groups(facts, plan)
    before = facts.previous
    if before is None:
        return [
            Finding("ok", "drops", "drop counters recorded; the next run shows whether they rise")
        ]
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
    since = duration(max(0.0, facts.now - before.taken_at))
    if not rising:
        return [
            Finding(
                "ok",
                "drops",
                f"no drops or errors worth a look on {', '.join(now)} in the last {since}",
            )
        ]
    return [
        Finding(
            "warning",
            "drops",
            f"packets dropped in the last {since}: "
            f"{listed([f'{name} {grew}' for name, grew in rising])}; on the vxlan device or "
            "veths this is usually an MTU mismatch or a missing neighbour/FDB entry, on the "
            "underlay a faulty or saturated link",
            "compare with the mtu and routes findings; watch ip -s link show <device>",
            ", ".join(n for n, _ in rising),
        )
    ]


def _notable(deltas: Mapping[str, int]) -> bool:
    """Any new error, or a handful of new drops: a NIC drops the odd frame it has no
    handler for (LLDP, say), which is no fault of the overlay."""
    dropped = deltas["rx_dropped"] + deltas["tx_dropped"]
    return dropped >= DROPS_NOTICE or deltas["rx_errors"] + deltas["tx_errors"] > 0


def check_probes(facts: NodeFacts, plan: Plan | str) -> list[Finding]:
    probes = (facts.status or {}).get("probes")
    if not isinstance(probes, Mapping) or not probes:
        return [Finding("ok", "peers", "no probe results from the agent (probing is off or "
                        "has not run yet)")]  # fmt: skip
    names: dict[str, str] = {}
    if not isinstance(plan, str):
        names = {str(lease.subnet): peer_name(lease) for lease in plan.peers}
        names |= {str(lease.ipv6_subnet): peer_name(lease)
                  for lease in plan.peers if lease.ipv6_subnet is not None}  # fmt: skip

    def label(subnet: str) -> str:
        """A dual-stack peer's IPv6 side is probed on its own, keyed by its IPv6 subnet."""
        return f"{names[subnet]} ({subnet})" if subnet in names else subnet

    down: list[str] = []
    mtu_bad: list[str] = []
    mtu_bad6: list[str] = []
    lossy: list[str] = []
    for subnet, result in sorted(probes.items()):
        if not isinstance(result, Mapping):
            continue
        if result.get("reachable") is False:
            err = result.get("error")
            down.append(f"{label(subnet)}{': ' + str(err) if err else ''}")
        elif result.get("mtu_ok") is False:
            (mtu_bad6 if ":" in subnet else mtu_bad).append(label(subnet))
        loss, rounds = result.get("loss"), result.get("probes")
        enough = not isinstance(rounds, int) or rounds >= LOSS_MIN_PROBES
        if (
            result.get("reachable") is not False
            and isinstance(loss, int | float)
            and loss > LOSS_WARNING
            and enough
        ):
            lossy.append(f"{label(subnet)} {loss:.0%}")
    findings: list[Finding] = []
    if down:
        findings.append(
            Finding("error", "peers", f"{len(down)} peer(s) do not answer over the overlay: "
                    f"{listed(down)}", "run the doctor on those nodes; check the underlay path "
                    "between the nodes (UDP 8472 for vxlan)", ", ".join(d.split()[0] for d in down))
        )  # fmt: skip
    if mtu_bad:
        findings.append(
            Finding("error", "peers", f"full-size packets do not reach {listed(mtu_bad)} while "
                    "small ones do: connections with large packets hang silently",
                    "make the MTU consistent (see the mtu findings; underlay MTU minus 50 "
                    "everywhere for vxlan)", ", ".join(m.split()[0] for m in mtu_bad))
        )  # fmt: skip
    if mtu_bad6:
        findings.append(
            Finding("error", "peers", f"full-size IPv6 packets do not reach {listed(mtu_bad6)} "
                    "while small ones do: IPv6 connections with large packets hang silently",
                    "give those nodes an overlay MTU of the underlay MTU minus 70 (vxlan over "
                    "an IPv6 underlay; flanneld subtracts 50, see the mtu findings)",
                    ", ".join(m.split()[0] for m in mtu_bad6))
        )  # fmt: skip
    if lossy:
        findings.append(
            Finding("warning", "peers", f"probe loss to {listed(lossy)}: the path drops packets",
                    "check the underlay links and the drops findings on both nodes",
                    ", ".join(x.split()[0] for x in lossy))
        )  # fmt: skip
    if not findings:
        findings.append(Finding("ok", "peers", f"all {len(probes)} probed peer(s) reachable, "
                                "full-size packets pass"))  # fmt: skip
    return findings


# --- the drop-counter baseline ------------------------------------------------------------


def snapshot_json(facts: NodeFacts) -> str:
    """What ``doctor-last.json`` holds after this run."""
    groups = counter_groups(facts, plan_node(facts))
    return json.dumps(
        {
            "version": SNAPSHOT_VERSION,
            "taken_at": facts.now,
            "counters": {name: asdict(c) for name, c in groups.items()},
        },
        indent=1,
    )
