"""`flannelpy doctor` on node nX of a real 3-node vxlan lab with pods (run there by
`flannelpy-lab run NAME --node nX`, with the settings of nX's agent).

Healthy first; then, with n1's agent stopped (so nothing repairs), a deleted
route, a flushed masquerade chain and a stale route of ours; then an MTU change
on n2's underlay that n2's restarted agent advertises. Each fault must be named
by the right check, with the peer or chain as subject.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from ipaddress import IPv4Interface, IPv4Network
from typing import Any

import pytest
from flannelpy_lab import Lab

from tests.support.lab_util import lab_run_argv, running_lab, wait_until

pytestmark = [
    pytest.mark.lab,
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to build the netns lab"),
]


def doctor(lab: Lab, node: str) -> tuple[int, dict[str, Any]]:
    """Run the real command; returns its exit code and its JSON report."""
    proc = subprocess.run(
        lab_run_argv(lab.name, "doctor", "--json", node=node),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode in (0, 1), f"doctor failed to run: {proc.stderr}"
    return proc.returncode, json.loads(proc.stdout)


def problems(report: dict[str, Any], check: str) -> list[dict[str, Any]]:
    return [f for f in report["findings"] if f["check"] == check and f["severity"] != "ok"]


def lease_of(lab: Lab, node: str) -> IPv4Network:
    address = lab.node(node).overlay_address
    assert address, f"{node} has no overlay address"
    return IPv4Interface(address).network


def peers_answer(lab: Lab, node: str) -> bool:
    """The agent's prober has seen every peer answer (a first round may predate a peer)."""
    try:
        with open(os.path.join(lab.node(node).run_dir, "status.json"), encoding="utf-8") as f:
            probes = json.load(f).get("probes") or {}
    except (OSError, ValueError):
        return False
    peers = [str(lease_of(lab, n.name)) for n in lab.nodes if n.name != node]
    return all((probes.get(p) or {}).get("reachable") for p in peers)


def test_doctor_names_each_fault_on_a_live_lab() -> None:
    with running_lab(3, "vxlan", pods_per_node=1) as lab:
        wait_until(lambda: peers_answer(lab, "n1"), timeout=30, what="n1's probes answered")
        code, report = doctor(lab, "n1")
        bad = [f for f in report["findings"] if f["severity"] != "ok"]
        assert (code, report["healthy"], bad) == (0, True, [])
        routes = next(f for f in report["findings"] if f["check"] == "routes")
        assert routes["message"].startswith("2 peer route(s)")

        # Nothing repairs n1 from now on.
        lab.kill_agent("n1")
        n3 = lease_of(lab, "n3")
        lab.exec("n1", ["ip", "route", "del", str(n3)])
        code, report = doctor(lab, "n1")
        (missing,) = [f for f in problems(report, "routes") if f["severity"] == "error"]
        assert code == 1 and missing["subject"] == "n3"
        assert f"{n3} via n3 {lab.node('n3').ip}" in missing["message"]

        lab.exec("n1", ["iptables", "-t", "nat", "-F", "FLANNEL-POSTRTG"])
        code, report = doctor(lab, "n1")
        (firewall,) = problems(report, "firewall")
        assert firewall["severity"] == "error"
        assert firewall["subject"] == "nat/FLANNEL-POSTRTG"
        assert "nat/FLANNEL-POSTRTG: missing" in firewall["message"]

        network = IPv4Network(lab.state.network)
        stale = list(network.subnets(new_prefix=24))[-1]
        assert stale not in {lease_of(lab, n.name) for n in lab.nodes}
        lab.exec(
            "n1",
            [
                "ip",
                "route",
                "add",
                str(stale),
                "via",
                str(stale.network_address),
                "dev",
                "flannel.1",
                "onlink",
                "proto",
                "75",
            ],
        )
        code, report = doctor(lab, "n1")
        (stale_finding,) = [f for f in problems(report, "routes") if f["severity"] == "warning"]
        assert stale_finding["subject"] == str(stale) and "stale" in stale_finding["message"]
        assert [f["subject"] for f in problems(report, "routes") if f["severity"] == "error"] == [
            "n3"
        ]

        # n2's underlay shrinks; its restarted agent advertises overlay MTU 1350.
        n2 = lab.node("n2")
        lab.exec("n2", ["ip", "link", "set", n2.underlay_iface, "mtu", "1400"])
        lab.kill_agent("n2")
        lab.start_agent("n2")
        lab.wait_ready("n2")
        code, report = doctor(lab, "n1")
        mtu = [f for f in problems(report, "mtu") if "advertise" in f["message"]]
        assert code == 1 and len(mtu) == 1 and mtu[0]["subject"] == "n2"
        assert "n2 1350" in mtu[0]["message"] and "ours (1450)" in mtu[0]["message"]

        # ... and n2 sees the others differ from it.
        code, report = doctor(lab, "n2")
        (mismatch,) = [f for f in problems(report, "mtu") if "advertise" in f["message"]]
        assert code == 1 and set(mismatch["subject"].split(", ")) == {"n1", "n3"}


def test_doctor_with_no_flags_uses_the_agents_settings() -> None:
    """As on a node or in the agent's pod: no flags, no FLANNELD_* but the run dir (the
    lab's is not the default), and a host name that is not the node's."""
    with running_lab(2, "vxlan", pods_per_node=1) as lab:
        wait_until(lambda: peers_answer(lab, "n1"), timeout=30, what="n1's probes answered")
        n1 = lab.node("n1")
        proc = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                n1.namespace,
                "env",
                "-i",
                f"PATH={os.environ['PATH']}",
                f"FLANNELD_RUN_DIR={n1.run_dir}",
                sys.executable,
                "-m",
                "flannelpy",
                "doctor",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode in (0, 1), f"doctor failed to run: {proc.stderr}"
        report = json.loads(proc.stdout)
        bad = [f for f in report["findings"] if f["severity"] != "ok"]
        assert (proc.returncode, report["healthy"], bad) == (0, True, [])
        assert report["node"] == "n1"
