"""The end of a test run: the counts of every tier, the slowest modules, one closing line.

Reads the JUnit files scripts/test.sh leaves in one directory (one per tier). A module's
time is the sum of its tests' times (setup, call and teardown: its labs included), so under
parallel workers the figures add up to more than the wall time. The last line is
``suite: N passed, N failed, N skipped`` over every tier; errors count as failed.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Tally:
    passed: int = 0
    failed: int = 0
    skipped: int = 0
    seconds: float = 0.0
    skip_reasons: list[str] = field(default_factory=list)


def module_of(case: ET.Element) -> str:
    """``tests.e2e.test_pods`` from a case's classname (a class inside a module is dropped)."""
    parts = case.get("classname", "").split(".")
    while parts and not parts[-1].startswith("test_"):
        parts.pop()
    return ".".join(parts) or case.get("classname", "?")


def read_tier(path: Path, modules: dict[str, float]) -> Tally:
    tally = Tally()
    for case in ET.parse(path).getroot().iter("testcase"):
        seconds = float(case.get("time") or 0.0)
        tally.seconds += seconds
        modules[module_of(case)] += seconds
        outcome = {child.tag for child in case}
        if outcome & {"failure", "error"}:
            tally.failed += 1
        elif "skipped" in outcome:
            tally.skipped += 1
            skipped = case.find("skipped")
            reason = skipped.get("message", "") if skipped is not None else ""
            tally.skip_reasons.append(f"{case.get('classname')}::{case.get('name')}: {reason}")
        else:
            tally.passed += 1
    return tally


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("results", type=Path, help="the directory of JUnit files")
    parser.add_argument("--slowest", type=int, default=15, help="modules to list")
    parser.add_argument("--seconds", type=int, default=None, help="the run's wall time")
    args = parser.parse_args(argv)

    modules: dict[str, float] = defaultdict(float)
    total = Tally()
    files = sorted(args.results.glob("*.xml"), key=lambda p: p.stat().st_mtime)
    if not files:
        print("suite: no tier ran (no JUnit file in " + str(args.results) + ")")
        return 1
    print("\n== tiers")
    for path in files:
        tally = read_tier(path, modules)
        print(
            f"  {path.stem:<12} {tally.passed:>5} passed {tally.failed:>4} failed "
            f"{tally.skipped:>4} skipped  {tally.seconds:8.1f} s of tests"
        )
        total.passed += tally.passed
        total.failed += tally.failed
        total.skipped += tally.skipped
        total.skip_reasons += tally.skip_reasons
    for reason in total.skip_reasons:
        print(f"  skipped: {reason}")
    print(f"\n== the {args.slowest} slowest modules (seconds of tests, labs included)")
    for name, seconds in sorted(modules.items(), key=lambda kv: -kv[1])[: args.slowest]:
        print(f"  {seconds:8.1f}  {name}")
    if args.seconds is not None:
        print(f"\n== wall time of the tiers: {args.seconds // 60} min {args.seconds % 60} s")
    print(f"suite: {total.passed} passed, {total.failed} failed, {total.skipped} skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
