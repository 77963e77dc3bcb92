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

This module holds the runbook's order and its first check (can the store and the
kernel be read at all). The plan lives in :mod:`.plan`; the checks in :mod:`.lease_checks`,
:mod:`.agent_check`, :mod:`.link_checks`, :mod:`.mtu_checks`, :mod:`.wireguard_check`,
:mod:`.kernel_checks` (data plane and firewall), :mod:`.policy_check` (NetworkPolicy) and
:mod:`.traffic_checks` (drops and probes, and the counter baseline); the rendering in
:mod:`.report`.

Each :class:`~.facts.Finding` says what was found and what it means (``message``) and
what to do (``action``). ``ok`` findings say what was checked, so a healthy
report lists every check.
"""

from __future__ import annotations

from flannelpy.doctor.agent_check import check_agent
from flannelpy.doctor.facts import Finding, NodeFacts
from flannelpy.doctor.kernel_checks import check_dataplane, check_firewall
from flannelpy.doctor.lease_checks import check_lease, check_peer_leases
from flannelpy.doctor.link_checks import check_links, check_overlap
from flannelpy.doctor.mtu_checks import check_mtu
from flannelpy.doctor.plan import plan_node
from flannelpy.doctor.policy_check import check_policy
from flannelpy.doctor.traffic_checks import check_drops, check_probes
from flannelpy.doctor.wireguard_check import check_wireguard


def diagnose(facts: NodeFacts) -> list[Finding]:
    """Every check, in runbook order: store and lease, agent, links and MTU, data plane,
    firewall, NetworkPolicy, overlap, drops, reachability."""
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
    findings += check_policy(facts)
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
