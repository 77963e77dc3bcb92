"""The doctor's MTU checks (pure): this node's devices, its configured and running overlay
MTU, and the MTUs its peers advertise, against the overlay MTU the plan computes. A
mismatch drops full-size packets silently, so each finding names where."""

from __future__ import annotations

from flannelpy.backend import ipv6 as ipv6_plan
from flannelpy.backend.vxlan import vtep_mtu
from flannelpy.doctor.facts import BRIDGE, Finding, NodeFacts, pod_veths
from flannelpy.doctor.plan import Plan, peer_name
from flannelpy.doctor.report import listed
from flannelpy.observe import mtu as mtu_check


def check_mtu(facts: NodeFacts, plan: Plan) -> list[Finding]:
    want = plan.overlay_mtu
    configured = _configured_mtu(facts)
    basis = _mtu_basis(plan, configured)
    report = mtu_check.mtu_mismatches(want, plan.peers)
    findings = [
        *_devices_off_mtu(facts, plan, basis),
        *_configured_mtu_too_large(plan, configured),
        *_agent_mtu_outdated(facts, want, basis),
        *_peer_mtus(plan, report),
        *_flanneld_ipv6_mtus(plan),
    ]
    if not findings:
        unknown = report.unknown
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


def _configured_mtu(facts: NodeFacts) -> int | None:
    """net-conf.json's Backend.MTU, which stands in for the underlay's; None when unset."""
    return facts.config.backend.mtu if facts.config and facts.config.backend.mtu else None


def _mtu_basis(plan: Plan, configured: int | None) -> str:
    """Where the overlay MTU comes from, in words, for the findings to quote."""
    basis = (
        f"net-conf.json's MTU {configured}"
        if configured
        else f"{plan.ctx.underlay.name}'s MTU {plan.ctx.underlay.mtu}"
    )
    if plan.backend.type_name == "vxlan":
        dual = ipv6_plan.enabled(plan.ctx)
        basis += " minus 70 for VXLAN over IPv6" if dual else " minus 50 for VXLAN"
    return basis


def _expected_mtus(plan: Plan) -> dict[str, int]:
    """Our devices' MTUs: each VTEP carries its own underlay family's overhead; cni0 (and
    the pods) the overlay MTU, the smaller."""
    expected = {BRIDGE: plan.overlay_mtu}
    if plan.backend.type_name == "vxlan":
        expected[plan.device] = vtep_mtu(plan.ctx)
        if ipv6_plan.enabled(plan.ctx):
            device_v6 = ipv6_plan.device_name_v6(plan.ctx.config.backend.vni)
            expected[device_v6] = ipv6_plan.vtep6_mtu(plan.ctx)
    return expected


def _devices_off_mtu(facts: NodeFacts, plan: Plan, basis: str) -> list[Finding]:
    want = plan.overlay_mtu
    links = {link.name: link for link in facts.links}
    wrong = [
        f"{name} {links[name].mtu} (not {mtu})"
        for name, mtu in _expected_mtus(plan).items()
        if name in links and links[name].mtu != mtu
    ]
    veths = [v for v in pod_veths(facts.links) if v.mtu != want]
    wrong += [f"{v.name} {v.mtu}" for v in sorted(veths, key=lambda v: v.name)]
    if not wrong:
        return []
    return [
        Finding(
            "error",
            "mtu",
            f"{len(wrong)} device(s) with an MTU other than the overlay MTU {want} ({basis}): "
            f"{listed(wrong)}; larger packets are dropped silently and connections hang",
            "restart the agent after an underlay MTU change (it sets the vxlan device "
            "and cni0); re-create pods whose veth differs",
            ", ".join(w.split()[0] for w in wrong),
        )
    ]


def _configured_mtu_too_large(plan: Plan, configured: int | None) -> list[Finding]:
    underlay = plan.ctx.underlay
    if not configured or configured <= underlay.mtu:
        return []
    return [
        Finding(
            "error",
            "mtu",
            f"net-conf.json's Backend.MTU {configured} is larger than {underlay.name}'s "
            f"MTU {underlay.mtu}: full-size packets cannot leave this node",
            "lower Backend.MTU to the smallest underlay MTU of the cluster (or raise the "
            "underlay's) and restart the agents",
            underlay.name,
        )
    ]


def _agent_mtu_outdated(facts: NodeFacts, want: int, basis: str) -> list[Finding]:
    """The agent sets and advertises the MTU it computed at start: an underlay changed
    since leaves it behind."""
    running = (facts.status or {}).get("mtu")
    if not isinstance(running, int) or running == want:
        return []
    return [
        Finding(
            "error",
            "mtu",
            f"the agent runs with overlay MTU {running} but {basis} gives {want}: the "
            "underlay changed since the agent started",
            "restart the agent so that it applies and advertises the new MTU; if the "
            "underlay MTU was put back instead, run `ip route flush cache`: the kernel "
            "keeps the smaller path MTU it learnt for 10 minutes",
        )
    ]


def _peer_mtus(plan: Plan, report: mtu_check.MtuReport) -> list[Finding]:
    if report.consistent:
        return []
    by_subnet = {lease.primary_subnet: lease for lease in plan.peers}
    names = [peer_name(by_subnet[p.subnet]) for p in report.mismatched]
    lines = [f"{name} {p.advertised}" for name, p in zip(names, report.mismatched, strict=True)]
    return [
        Finding(
            "error",
            "mtu",
            f"{len(lines)} peer(s) advertise an overlay MTU other than ours "
            f"({plan.overlay_mtu}): {listed(lines)}; packets of the larger MTU are "
            "dropped silently on the way to the smaller",
            "give every node the same underlay MTU (or set Backend.MTU in net-conf.json) "
            "and restart the agents",
            ", ".join(names),
        )
    ]


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
        Finding(
            "warning",
            "mtu",
            f"{len(names)} flanneld peer(s) run VXLAN over IPv6 with pod MTU {flanneld_mtu} "
            f"(underlay {underlay} minus 50), but VXLAN over IPv6 costs 70 bytes, so only "
            f"{right} fits: their pods' full-size IPv6 packets are refused by their own VTEP "
            f"and get through only if ICMPv6 Packet Too Big reaches the sender ({listed(names)})",
            f"run flannelpy on those nodes, or give their pods MTU {right}",
            ", ".join(names),
        )
    ]
