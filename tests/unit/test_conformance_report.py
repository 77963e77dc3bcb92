"""The summary of an upstream e2e run (scripts/conformance_report.py): every focused spec on
one line with its result and why, from a JUnit report shaped as ginkgo writes it."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

REPO = Path(__file__).resolve().parents[2]

PASSED = "[sig-network] Services should serve a basic endpoint from pods  [Conformance]"
FAILED = (
    "[sig-network] Networking Granular Checks: Pods should function for node-pod "
    "communication: udp [NodeConformance] [Conformance]"
)
FILTERED = "[sig-network] Networking Granular Checks: Services sctp [Feature:SCTPConnectivity]"
SELF_SKIPPED = "[sig-network] Services should have session affinity for LoadBalancer"
OUT_OF_FOCUS = "[sig-apps] Deployment should not be listed"
# As ginkgo v2 writes it: one testcase per spec, named after its node kind ([It]), the
# suite nodes among them.
JUNIT = f"""<?xml version="1.0" encoding="UTF-8"?>
<testsuites tests="6" disabled="0" errors="0" failures="1" time="120.5">
  <testsuite name="Kubernetes e2e suite" tests="6" skipped="3" failures="1">
    <testcase name="[SynchronizedBeforeSuite]" status="passed" time="2.1"></testcase>
    <testcase name="[It] {PASSED}" status="passed" time="14.25"></testcase>
    <testcase name="[It] {FAILED}" status="failed" time="301.0">
      <failure message="[FAILED] failed to reach 10.244.2.5:8081 over udp&#xA;more"
        type="failed">[FAILED] failed to reach 10.244.2.5:8081 over udp</failure>
    </testcase>
    <testcase name="[It] {FILTERED}" status="skipped" time="0">
      <skipped message="skipped"></skipped></testcase>
    <testcase name="[It] {SELF_SKIPPED}" status="skipped" time="0.3">
      <skipped message="skipped - Only supported for providers [gce] (not skeleton)">
      </skipped></testcase>
    <testcase name="[It] {OUT_OF_FOCUS}" status="skipped" time="0">
      <skipped message="skipped"></skipped></testcase>
  </testsuite>
</testsuites>
"""


@pytest.fixture(scope="module")
def report() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "conformance_report", REPO / "scripts" / "conformance_report.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass resolves annotations through it
    spec.loader.exec_module(module)
    return module


def _run(report: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    junit = tmp_path / "junit_01.xml"
    junit.write_text(JUNIT, encoding="utf-8")
    not_here = tmp_path / "not-here.txt"
    not_here.write_text("# comment\nSCTP -- this kernel has no SCTP module\n", encoding="utf-8")
    rc = report.main(
        [str(junit), "--focus", r"\[sig-network\]", "--not-here", str(not_here), "--title", "T"]
    )
    assert rc == 1  # a spec failed
    return capsys.readouterr().out.splitlines()


def test_each_focused_spec_gets_one_line_with_why(
    report: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines = _run(report, tmp_path, capsys)
    assert lines[0] == "T"
    # Sorted by name; the out-of-focus spec and the passed suite node are not listed.
    assert lines[1:-1] == [
        f"failed   {FAILED}: [FAILED] failed to reach 10.244.2.5:8081 over udp",
        f"skipped  {FILTERED}: this kernel has no SCTP module",
        f"skipped  {SELF_SKIPPED}: Only supported for providers [gce] (not skeleton)",
        f"passed   {PASSED}: 14.2 s",
    ]
    assert lines[-1] == "conformance: 1 passed, 1 failed, 2 skipped"


def test_a_missing_report_says_the_run_stopped(report: ModuleType, tmp_path: Path) -> None:
    not_here = tmp_path / "not-here.txt"
    not_here.write_text("", encoding="utf-8")
    missing = tmp_path / "junit_01.xml"
    assert report.main([str(missing), "--focus", "x", "--not-here", str(not_here)]) == 1


def test_the_default_reasons_file_parses_and_names_sctp(report: ModuleType) -> None:
    reasons = report.not_here_reasons(REPO / "tests" / "conformance" / "not-here.txt")
    assert reasons and all(why for _, why in reasons)
    opens_sctp = (
        "[sig-network] Networking Granular Checks: Pods should function for intra-pod "
        "communication: sctp [LinuxOnly] [Feature:SCTPConnectivity]",
        "[sig-network] Networking should allow creating a Pod with an SCTP HostPort [LinuxOnly]",
        "[sig-network] Services should allow creating a basic SCTP service with pod and endpoints",
    )
    for name in opens_sctp:
        assert any(p.search(name) for p, _ in reasons), name
    # A policy naming SCTP, judged on TCP: no SCTP socket, so it runs here.
    policy_only = (
        "[sig-network] Netpol NetworkPolicy between server and client should not mistakenly "
        "treat 'protocol: SCTP' as 'protocol: TCP', even if the plugin doesn't support SCTP"
    )
    assert not any(p.search(policy_only) for p, _ in reasons)
