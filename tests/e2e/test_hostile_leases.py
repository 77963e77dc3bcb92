"""Hostile peer leases on the netns lab (issue 12, item 2): a lease for the underlay's
subnet and a value nested 3,000 deep, put straight into the lab's etcd.

Before: the underlay lease replaced n1's connected route (n1 lost its underlay and
its etcd), and the deep value killed every agent (RecursionError ended the watch).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from ipaddress import IPv4Network
from pathlib import Path
from typing import Any

import pytest
from flannelpy_lab import Lab
from flannelpy_lab.errors import LabError
from prometheus_client.parser import text_string_to_metric_families

from flannelpy.store.etcd.client import EtcdStore
from flannelpy.subnet.keys import subnet_to_key
from tests.support.agent_events import wait_for_reconcile_passes
from tests.support.lab_util import running_lab, segment_ip, wait_until

pytestmark = [
    pytest.mark.lab,
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to build the netns lab"),
]

METRICS_URL = "http://127.0.0.1:9403/metrics"
DEEP_KEY = "10.244.200.0-24"
_GET = (
    "import sys, urllib.request\n"
    "print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())"
)
_CONNECT = (
    "import socket, sys\nsocket.create_connection((sys.argv[1], int(sys.argv[2])), 3).close()"
)


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with running_lab(3, "vxlan", pods_per_node=1) as lab:
        yield lab


def alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def rejected(lab: Lab, node: str) -> dict[str, float]:
    body = lab.exec(node, [sys.executable, "-c", _GET, METRICS_URL]).stdout
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name == "flannelpy_rejected_leases_total":
                found[s.labels["reason"]] = s.value
    return found


def underlay_key(lab: Lab) -> str:
    """The lease key of the lab's own underlay segment (labs side by side differ)."""
    return subnet_to_key(IPv4Network(lab.state.segments[0].subnet))


def connected_route(lab: Lab, node: str) -> list[dict[str, Any]]:
    out = lab.exec(node, ["ip", "-j", "route", "show", lab.state.segments[0].subnet]).stdout
    return list(json.loads(out or "[]"))


def test_hostile_leases_are_ignored_counted_and_harm_no_node(lab: Lab) -> None:
    pids = {n.name: n.agent_pid for n in lab.nodes}
    assert connected_route(lab, "n1")[0].get("protocol") == "kernel"
    prefix = lab.state.etcd_prefix.rstrip("/")
    kv = EtcdStore([lab.etcd_endpoint])
    try:
        underlay = {
            "PublicIP": segment_ip(lab, 99),
            "BackendType": "vxlan",
            "BackendData": {"VNI": 1, "VtepMAC": "02:00:00:00:00:99"},
        }
        kv.put(f"{prefix}/subnets/{underlay_key(lab)}", json.dumps(underlay).encode())
        kv.put(f"{prefix}/subnets/{DEEP_KEY}", ("[" * 3000 + "]" * 3000).encode())

        def counted() -> bool:
            return all(
                rejected(lab, n.name).get(r) == 1.0
                for n in lab.nodes
                for r in ("outside-network", "undecodable")
            )

        wait_until(counted, timeout=20, interval=0.5, what="every agent counting both leases")
        # Two whole reconcile passes after both were counted: nothing has changed.
        wait_for_reconcile_passes(list(lab.nodes), passes=2)
        for node in lab.nodes:
            assert alive(pids[node.name]), f"the agent of {node.name} exited"
            assert lab.node(node.name).agent_pid == pids[node.name]
        route = connected_route(lab, "n1")
        assert len(route) == 1 and route[0].get("protocol") == "kernel", route
        assert route[0].get("dev") != "flannel.1"
        assert lab.ping_underlay("n1", "n2")
        host, port = lab.etcd_endpoint.split("://", 1)[-1].rsplit(":", 1)
        lab.exec("n1", [sys.executable, "-c", _CONNECT, host, port])  # raises if unreachable
        doc = lab.status()
        pairs = [ok for row in doc["pod_matrix"].values() for ok in row.values()]
        assert pairs and all(pairs), doc["pod_matrix"]
        # A restarted agent starts fine with both values still in etcd.
        lab.kill_agent("n2", signal.SIGTERM)
        lab.start_agent("n2")
        lab.wait_ready("n2")

        def n2_counts() -> bool:
            try:
                return rejected(lab, "n2").get("undecodable") == 1.0
            except LabError:  # its metrics server is not listening yet
                return False

        wait_until(n2_counts, timeout=30, interval=0.5, what="n2 back, counting again")
        assert alive(lab.node("n2").agent_pid) and lab.ping("n1", "n2", attempts=3)
    finally:
        for key in (underlay_key(lab), DEEP_KEY):
            found = kv.get(f"{prefix}/subnets/{key}")
            if found is not None:
                kv.delete_if_mod_revision(f"{prefix}/subnets/{key}", found.mod_revision)
        kv.close()
