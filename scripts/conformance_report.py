"""One line per spec of an upstream e2e run (scripts/conformance.sh), from ginkgo's JUnit.

Every spec the run's focus selected is listed: ``passed``, ``failed`` with the first line
of its failure, or ``skipped`` with why — the reason the spec gave when it skipped itself
(a provider, a node count, a feature this cluster lacks), or, for a spec the run's skip
pattern left out, the reason tests/conformance/not-here.txt gives for it. The last line is
``conformance: N passed, N failed, N skipped``; the exit status is 1 when a spec failed.
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

# ginkgo's message for a spec its filters did not run (a spec that skipped itself has
# "skipped - <reason>").
FILTERED = "skipped"
# Suite-level nodes ginkgo reports beside the specs ([SynchronizedBeforeSuite], ...): listed
# only when they failed.
SUITE_NODE = re.compile(r"^\[[A-Za-z]+Suite\]")


@dataclass(frozen=True)
class Spec:
    name: str
    result: str  # passed, failed or skipped
    detail: str  # the failure's first line, the skip's reason, or the seconds taken


def not_here_reasons(path: Path) -> list[tuple[re.Pattern[str], str]]:
    """``PATTERN -- reason`` lines (``#`` starts a comment)."""
    reasons = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip() and not line.startswith("#"):
            pattern, _, reason = line.partition(" -- ")
            reasons.append((re.compile(pattern), reason.strip()))
    return reasons


def first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def spec_of(case: ET.Element, not_here: list[tuple[re.Pattern[str], str]]) -> Spec:
    name = case.get("name", "?").removeprefix("[It] ")  # ginkgo names the node kind first
    problem = case.find("failure")
    if problem is None:
        problem = case.find("error")
    if problem is not None:
        detail = first_line(problem.get("message") or problem.text or "") or "no message"
        return Spec(name, "failed", detail)
    skipped = case.find("skipped")
    if skipped is None:
        return Spec(name, "passed", f"{float(case.get('time') or 0):.1f} s")
    message = skipped.get("message") or ""
    if message.strip() != FILTERED:
        return Spec(name, "skipped", first_line(message.removeprefix("skipped - ")))
    reason = next((why for pattern, why in not_here if pattern.search(name)), None)
    return Spec(name, "skipped", reason or "left out by the run's skip pattern")


def read_specs(
    junit: Path, focus: re.Pattern[str], not_here: list[tuple[re.Pattern[str], str]]
) -> list[Spec]:
    specs = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        spec = spec_of(case, not_here)
        if SUITE_NODE.match(spec.name):
            if spec.result == "failed":
                specs.append(spec)
        elif focus.search(spec.name):
            specs.append(spec)
    return sorted(specs, key=lambda s: s.name)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("junit", type=Path, help="ginkgo's JUnit report (junit_01.xml)")
    parser.add_argument("--focus", required=True, help="the run's focus pattern")
    parser.add_argument("--not-here", type=Path, required=True, help="PATTERN -- reason lines")
    parser.add_argument("--title", default="", help="a first line")
    args = parser.parse_args(argv)

    if not args.junit.is_file():
        print(f"conformance: no JUnit report at {args.junit}: the run stopped before its end")
        return 1
    specs = read_specs(args.junit, re.compile(args.focus), not_here_reasons(args.not_here))
    if args.title:
        print(args.title)
    for spec in specs:
        print(f"{spec.result:<8} {spec.name}: {spec.detail}")
    counts = {r: sum(s.result == r for s in specs) for r in ("passed", "failed", "skipped")}
    print(f"conformance: {', '.join(f'{n} {r}' for r, n in counts.items())}")
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
