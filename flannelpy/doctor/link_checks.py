"""The doctor's checks of the node's own network, which the overlay rests on (pure): the
underlay, the vxlan device, the pod bridge and the pod veths up, and the Network clear of
every other route and address on the node."""

from __future__ import annotations

from flannelpy.doctor.facts import BRIDGE, Finding, NodeFacts, Severity, pod_veths
from flannelpy.doctor.plan import Plan
from flannelpy.doctor.report import listed
from flannelpy.subnet.survey import find_overlaps


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
                Finding(
                    "error",
                    "links",
                    f"{role} {name} does not exist: no overlay traffic passes here",
                    "start the agent; it creates it",
                    name,
                )
            )
        elif not link.up:
            findings.append(
                Finding(
                    "error",
                    "links",
                    f"{role} {name} is down: nothing passes it",
                    f"ip link set {name} up; find out what set it down",
                    name,
                )
            )
        elif name == underlay_name and not link.carrier:
            findings.append(
                Finding(
                    "error",
                    "links",
                    f"{role} {name} has no carrier: no packet leaves this node",
                    "check the cable, the switch port or the virtual NIC",
                    name,
                )
            )
    down = sorted(v.name for v in pod_veths(facts.links) if not v.up)
    if down:
        findings.append(
            Finding(
                "warning",
                "links",
                f"{len(down)} pod veth(s) down ({listed(down)}): those pods are cut off",
                "delete and re-create the pods concerned",
                ", ".join(down),
            )
        )
    if not findings:
        names = ", ".join(name for name, _ in wanted)
        findings.append(
            Finding("ok", "links", f"{names} and {len(pod_veths(facts.links))} pod veth(s) up")
        )
    return findings


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
