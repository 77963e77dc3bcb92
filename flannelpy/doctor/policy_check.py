"""The doctor's NetworkPolicy check (pure): whether the node enforces what the agent
compiled, and what it refused.

From ``status.json`` (``network_policy``: synced, counts, the refusals now) and whether
the kernel holds the table ``inet flannelpy-policy``. With policy off and no table,
there is nothing to say; a table left by an earlier run with policy on is still
enforced, which an operator who turned the flag off may not know.
"""

from __future__ import annotations

from collections.abc import Mapping

from flannelpy.doctor.facts import Finding, NodeFacts
from flannelpy.doctor.report import listed

CHECK = "netpol"
TABLE = "inet flannelpy-policy"


def check_policy(facts: NodeFacts) -> list[Finding]:
    status = facts.status.get("network_policy") if facts.status is not None else None
    on = facts.settings.enable_network_policy or isinstance(status, Mapping)
    if not on:
        if facts.policy_table_present:
            return [
                Finding(
                    "warning",
                    CHECK,
                    f"NetworkPolicy is off, but the kernel still holds the table {TABLE} "
                    "of an earlier run: its pods stay isolated as that run left them",
                    f"remove it with `nft delete table {TABLE}` if policy is meant to be off",
                )
            ]
        return []
    if not isinstance(status, Mapping):
        return [
            Finding(
                "warning",
                CHECK,
                "NetworkPolicy is on, but the agent reports no policy status yet",
                "wait for the agent to start; see its log",
            )
        ]
    findings: list[Finding] = []
    refused = [str(r) for r in status.get("refused") or []]
    if refused:
        findings.append(
            Finding(
                "warning",
                CHECK,
                f"{len(refused)} object(s) the agent cannot enforce: {listed(refused)}; "
                "nothing of them is enforced (an edit keeps the version accepted before it)",
                "fix or delete those objects",
            )
        )
    if not status.get("synced"):
        findings.append(
            Finding(
                "warning",
                CHECK,
                "the agent has not read every NetworkPolicy, Pod and Namespace yet: the "
                "kernel keeps the table it held, and new pods are not judged",
                "check that the agent reaches the API server and has the network-policy "
                "permissions (manifests/network-policy)",
            )
        )
    elif facts.policy_table_present is False:
        findings.append(
            Finding(
                "error",
                CHECK,
                f"NetworkPolicy is on, but the kernel has no table {TABLE}: no pod of this "
                "node is isolated",
                "the agent puts it back at its next pass; if it stays missing, see its log",
            )
        )
    if not findings:
        findings.append(
            Finding(
                "ok",
                CHECK,
                f"NetworkPolicy enforced: {status.get('policies', 0)} policies, "
                f"{status.get('selected_pods', 0)} pod(s) of this node isolated, "
                f"{status.get('set_elements', 0)} set element(s)",
            )
        )
    return findings
