"""A subset of Kubernetes' own network e2e specs, run by the suite on every change.

The full selection (every ``[sig-network]`` ``[Conformance]`` spec and the Networking
Granular Checks, both kube-proxy modes) is ``scripts/conformance.sh``, run by hand before
a release and tabled in the README; it takes tens of minutes. This module runs the same
script, unchanged, on the same kind of cluster (a 3-node kubelet lab with kube-proxy,
CoreDNS and our DaemonSet) with a focus of one upstream spec for each path a user's
traffic takes: pod to pod across nodes, node to pod, pod to Service, NodePort, HostPort
and cluster DNS, and of five Netpol specs (the agents enforce NetworkPolicy, as with
``--enable-network-policy``). It asserts that each of them ran and passed: a focus that
matched nothing, or a spec that skipped itself, fails the test as a failed spec does.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from tests.support.lab_util import unique_lab_name

pytestmark = [pytest.mark.lab]

REPO = Path(__file__).resolve().parents[2]
# The pod network of this module's lab: the host routes it to the nodes, so no other lab
# of the suite may use it (scripts/conformance.sh itself defaults to 10.160.0.0/16).
NETWORK = "10.163.0.0/16"
# One spec per path, by the words of its upstream name (ginkgo matches the full text).
SPECS = {
    "pod to pod": "Granular Checks: Pods should function for intra-pod communication: http",
    "node to pod": "Granular Checks: Pods should function for node-pod communication: udp",
    "pod to Service": "Granular Checks: Services should function for pod-Service: http",
    "NodePort": "Services should be able to create a functioning NodePort service",
    "HostPort": "HostPort validates that there is no conflict between pods with same hostPort",
    "DNS": "DNS should provide DNS for services",
    # NetworkPolicy, which the lab's agents enforce (--enable-network-policy): ingress
    # isolation, egress by pod selector, a namespace selector, a named port, ipBlock/except.
    "policy: default deny": "NetworkPolicy between server and client should support a "
    "'default-deny-ingress' policy",
    "policy: egress": "should deny egress from pods based on PodSelector",
    "policy: namespaces": "should enforce policy to allow traffic only from a different "
    "namespace, based on NamespaceSelector",
    "policy: named port": "should allow ingress access on one named port",
    "policy: ipBlock": "should enforce except clause while egress access to server in CIDR block",
}
# The summary's line for one spec: "passed   [sig-network] <name>: 12.3 s".
SUMMARY_LINE = re.compile(r"^(passed|failed|skipped)\s+(\[sig-network\] .*)$")


def test_the_upstream_specs_of_every_traffic_path_pass(tmp_path: Path) -> None:
    focus = "|".join(re.escape(words) for words in SPECS.values())
    argv = [
        "bash",
        "scripts/conformance.sh",
        "--cni",
        "flannelpy",
        "--enable-network-policy",
        "--focus",
        focus,
        "--name",
        unique_lab_name("u"),
        "--network",
        NETWORK,
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=900)
    print(proc.stdout)
    log = tmp_path / "e2e.log"
    if proc.returncode != 0 and log.exists():
        print(log.read_text(encoding="utf-8", errors="replace")[-6000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {}
    for line in proc.stdout.splitlines():
        match = SUMMARY_LINE.match(line)
        if match:
            results[match.group(2)] = match.group(1)
    for path, words in SPECS.items():
        found = {name: result for name, result in results.items() if words in name}
        assert len(found) == 1, f"{path}: {words!r} selected {sorted(found) or 'no spec'}"
        assert set(found.values()) == {"passed"}, f"{path}: {found}"
    assert len(results) == len(SPECS), sorted(results)
