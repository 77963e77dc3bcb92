"""How the doctor's findings are shown (text, JSON, exit code), and the short phrases
its messages share."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import asdict

from flannelpy.doctor.facts import LIST_LIMIT, Finding

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
    return f"{node}: {counts['error']} error(s), {counts['warning']} warning(s), {counts['ok']} ok"


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


# --- phrases shared by the checks ---------------------------------------------------------


def listed(items: Sequence[str]) -> str:
    shown = ", ".join(items[:LIST_LIMIT])
    more = len(items) - LIST_LIMIT
    return f"{shown} and {more} more" if more > 0 else shown


def peers_have(n: int) -> str:
    return "1 peer has" if n == 1 else f"{n} peers have"


def duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
