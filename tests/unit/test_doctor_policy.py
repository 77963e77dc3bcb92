"""The doctor's NetworkPolicy check on synthetic facts: enforced, not synced yet, objects
refused, the table missing while on, and a table left behind while off."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from flannelpy.doctor.checks import diagnose
from flannelpy.doctor.facts import Finding, NodeFacts
from flannelpy.doctor.policy_check import check_policy
from tests.unit.test_doctor import SETTINGS, healthy_facts

POLICY_ON = replace(SETTINGS, enable_network_policy=True)
SYNCED = {"synced": True, "policies": 3, "pods": 40, "namespaces": 4, "selected_pods": 2,
          "set_elements": 17, "refused": []}  # fmt: skip
REFUSED = (
    "NetworkPolicy shop/db is refused: spec.podSelector is missing; use {} to select every pod"
)


def with_policy(status: dict[str, Any] | None, table: bool | None, on: bool = True) -> NodeFacts:
    facts = healthy_facts()
    assert facts.status is not None
    doc = {**facts.status, "network_policy": status}
    return replace(
        facts,
        settings=POLICY_ON if on else SETTINGS,
        status=doc,
        policy_table_present=table,
    )


def netpol(findings: list[Finding]) -> list[tuple[str, str]]:
    return [(f.severity, f.message) for f in findings if f.check == "netpol"]


def test_an_enforcing_node_says_what_it_enforces_and_stays_healthy() -> None:
    findings = diagnose(with_policy(SYNCED, table=True))
    assert netpol(findings) == [
        (
            "ok",
            "NetworkPolicy enforced: 3 policies, 2 pod(s) of this node isolated, 17 set element(s)",
        )
    ]
    assert all(f.severity == "ok" for f in findings)


def test_refused_objects_are_named_with_what_to_do() -> None:
    (finding,) = check_policy(with_policy({**SYNCED, "refused": [REFUSED]}, table=True))
    assert finding.severity == "warning"
    assert REFUSED in finding.message and "nothing of them is enforced" in finding.message
    assert finding.action == "fix or delete those objects"


def test_not_synced_yet_and_a_missing_table_are_told_apart() -> None:
    (waiting,) = check_policy(with_policy({**SYNCED, "synced": False}, table=True))
    assert waiting.severity == "warning" and "manifests/network-policy" in waiting.action
    (missing,) = check_policy(with_policy(SYNCED, table=False))
    assert missing.severity == "error"
    assert "no pod of this node is isolated" in missing.message


def test_policy_off_is_silent_unless_an_earlier_runs_table_still_enforces() -> None:
    assert check_policy(with_policy(None, table=False, on=False)) == []
    assert check_policy(with_policy(None, table=None, on=False)) == []
    (left,) = check_policy(with_policy(None, table=True, on=False))
    assert left.severity == "warning"
    assert left.action.startswith("remove it with `nft delete table inet flannelpy-policy`")
