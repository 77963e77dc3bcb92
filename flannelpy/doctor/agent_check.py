"""The doctor's agent check (pure): whether the agent, as its ``status.json`` shows it,
still runs, is ready, converged on its last reconcile and has no change held back."""

from __future__ import annotations

from collections.abc import Mapping

from flannelpy.doctor.facts import STATUS_STALE_MIN_SECONDS, Finding, NodeFacts
from flannelpy.doctor.report import duration, listed


def check_agent(facts: NodeFacts) -> list[Finding]:
    status = facts.status
    if status is None:
        return [
            Finding(
                "warning",
                "agent",
                f"no agent status: {facts.status_error or 'unknown'}",
                "check that the agent runs with the same --run-dir as the doctor",
            )
        ]
    findings: list[Finding] = []
    last = status.get("last_reconcile")
    seen = last if isinstance(last, int | float) else facts.status_mtime
    stale_after = max(STATUS_STALE_MIN_SECONDS, 3 * facts.settings.resync_interval)
    if seen is not None and facts.now - seen > stale_after:
        findings.append(
            Finding(
                "warning",
                "agent",
                f"the agent's last reconcile was {duration(facts.now - seen)} ago (it runs "
                f"every {facts.settings.resync_interval:g} s): it is stopped or stuck, and "
                "nothing repairs the data plane",
                "check that the agent runs; see its log",
            )
        )
    if status.get("ready") is False:
        findings.append(
            Finding(
                "error",
                "agent",
                "the agent reports not ready: the CNI refuses new pods",
                "see the agent log for what it waits on",
            )
        )
    failures = status.get("failures") or []
    if status.get("converged") is False or failures:
        first = "; ".join(str(f) for f in failures[:2]) or "no details"
        findings.append(
            Finding(
                "error",
                "agent",
                f"the agent's last reconcile failed ({len(failures)} failure(s): {first}): "
                "some peers are not programmed",
                "see the agent log; a failure that repeats names what blocks it",
            )
        )
    blocked = status.get("blocked") or []
    if blocked:
        findings.append(
            Finding(
                "warning",
                "agent",
                f"{len(blocked)} change(s) blocked by the disruption policy: "
                f"{listed([_blocked_text(b) for b in blocked])}",
                "apply them in a maintenance window, or change the policy",
            )
        )
    if not findings:
        findings.append(
            Finding("ok", "agent", "the agent is ready and its last reconcile converged")
        )
    return findings


def _blocked_text(item: object) -> str:
    if isinstance(item, Mapping):
        return str(item.get("sentence") or item.get("change") or item.get("reason") or item)
    return str(item)
