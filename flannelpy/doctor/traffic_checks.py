"""The doctor's traffic checks (pure): drops and errors on our interfaces since the last
run, and what the agent's prober saw of each peer (reachable, full-size packets through,
little loss). Also the counter baseline the next run compares against."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field

from flannelpy.doctor.facts import (
    BRIDGE,
    COUNTER_FIELDS,
    DROPS_NOTICE,
    LOSS_MIN_PROBES,
    LOSS_WARNING,
    SNAPSHOT_VERSION,
    VETHS,
    Finding,
    LinkCounters,
    NodeFacts,
    pod_veths,
)
from flannelpy.doctor.plan import Plan, peer_name, plan_node
from flannelpy.doctor.report import duration, listed


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
    for veth in pod_veths(facts.links):
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


@dataclass
class _ProbeVerdicts:
    """The probed peers that fail, by how, each as "name (subnet)" (the bare subnet for a
    peer without a lease); a peer short of MTU can be lossy too."""

    down: list[str] = field(default_factory=list)  # with the prober's error, if any
    mtu_short: list[str] = field(default_factory=list)  # full-size IPv4 packets lost
    mtu_short_v6: list[str] = field(default_factory=list)  # full-size IPv6 packets lost
    lossy: list[str] = field(default_factory=list)  # with the share lost


def check_probes(facts: NodeFacts, plan: Plan | str) -> list[Finding]:
    probes = (facts.status or {}).get("probes")
    if not isinstance(probes, Mapping) or not probes:
        return [
            Finding(
                "ok",
                "peers",
                "no probe results from the agent (probing is off or has not run yet)",
            )
        ]
    verdicts = _judge_probes(probes, _peer_labels(plan))
    findings = [
        *_unanswered(verdicts.down),
        *_full_size_lost(verdicts.mtu_short),
        *_full_size_lost_v6(verdicts.mtu_short_v6),
        *_lossy(verdicts.lossy),
    ]
    if not findings:
        findings.append(
            Finding(
                "ok",
                "peers",
                f"all {len(probes)} probed peer(s) reachable, full-size packets pass",
            )
        )
    return findings


def _peer_labels(plan: Plan | str) -> dict[str, str]:
    """Probed subnet -> "name (subnet)". A dual-stack peer's IPv6 side is probed on its
    own, keyed by its IPv6 subnet."""
    if isinstance(plan, str):
        return {}
    names = {str(lease.subnet): peer_name(lease) for lease in plan.peers}
    names |= {
        str(lease.ipv6_subnet): peer_name(lease)
        for lease in plan.peers
        if lease.ipv6_subnet is not None
    }
    return {subnet: f"{name} ({subnet})" for subnet, name in names.items()}


def _judge_probes(probes: Mapping[str, object], labels: Mapping[str, str]) -> _ProbeVerdicts:
    verdicts = _ProbeVerdicts()
    for subnet, result in sorted(probes.items()):
        if not isinstance(result, Mapping):
            continue
        label = labels.get(subnet, subnet)
        if result.get("reachable") is False:
            err = result.get("error")
            verdicts.down.append(f"{label}{': ' + str(err) if err else ''}")
        elif result.get("mtu_ok") is False:
            (verdicts.mtu_short_v6 if ":" in subnet else verdicts.mtu_short).append(label)
        loss, rounds = result.get("loss"), result.get("probes")
        enough = not isinstance(rounds, int) or rounds >= LOSS_MIN_PROBES
        if (
            result.get("reachable") is not False
            and isinstance(loss, int | float)
            and loss > LOSS_WARNING
            and enough
        ):
            verdicts.lossy.append(f"{label} {loss:.0%}")
    return verdicts


def _unanswered(down: list[str]) -> list[Finding]:
    if not down:
        return []
    return [
        Finding(
            "error",
            "peers",
            f"{len(down)} peer(s) do not answer over the overlay: {listed(down)}",
            "run the doctor on those nodes; check the underlay path between the nodes "
            "(UDP 8472 for vxlan)",
            ", ".join(d.split()[0] for d in down),
        )
    ]


def _full_size_lost(mtu_short: list[str]) -> list[Finding]:
    if not mtu_short:
        return []
    return [
        Finding(
            "error",
            "peers",
            f"full-size packets do not reach {listed(mtu_short)} while small ones do: "
            "connections with large packets hang silently",
            "make the MTU consistent (see the mtu findings; underlay MTU minus 50 "
            "everywhere for vxlan)",
            ", ".join(m.split()[0] for m in mtu_short),
        )
    ]


def _full_size_lost_v6(mtu_short_v6: list[str]) -> list[Finding]:
    if not mtu_short_v6:
        return []
    return [
        Finding(
            "error",
            "peers",
            f"full-size IPv6 packets do not reach {listed(mtu_short_v6)} while small ones "
            "do: IPv6 connections with large packets hang silently",
            "give those nodes an overlay MTU of the underlay MTU minus 70 (vxlan over "
            "an IPv6 underlay; flanneld subtracts 50, see the mtu findings)",
            ", ".join(m.split()[0] for m in mtu_short_v6),
        )
    ]


def _lossy(lossy: list[str]) -> list[Finding]:
    if not lossy:
        return []
    return [
        Finding(
            "warning",
            "peers",
            f"probe loss to {listed(lossy)}: the path drops packets",
            "check the underlay links and the drops findings on both nodes",
            ", ".join(x.split()[0] for x in lossy),
        )
    ]


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
