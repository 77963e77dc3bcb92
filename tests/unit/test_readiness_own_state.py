"""/readyz is about this node's own state: a peer we have no path to does not hold
the node not ready (it would stall a DaemonSet rollout over one bad peer); it is
reported in status.json, the metrics and the doctor instead. What flanneld peers
lack (an advertised MTU) is said once, not warned."""

from __future__ import annotations

import logging
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

import pytest

from flannelpy.subnet.keys import lease_key
from flannelpy.subnet.lease import LeaseAttrs
from tests.support.agent_fakes import PREFIX, AgentHarness


def test_a_peer_without_a_path_leaves_the_node_ready(tmp_path: Path) -> None:
    h = AgentHarness(tmp_path)
    h.start()
    try:
        h.drain()
        assert h.writer.status.readiness() == (True, "ok")
        # Off our segment, with a VTEP of another VNI: no path (choose_path says why).
        far = LeaseAttrs(
            public_ip=IPv4Address("172.16.9.9"),
            backend_type="vxlan",
            backend_data={"VNI": 7, "VtepMAC": "02:00:00:00:00:07"},
        )
        h.store.put(lease_key(PREFIX, IPv4Network("10.244.77.0/24")), far.to_json().encode())
        h.deliver_leases()
        h.reconcile()

        unreachable = h.status()["unreachable"]
        assert [u["subnet"] for u in unreachable] == ["10.244.77.0/24"]
        assert "different VNIs" in unreachable[0]["reason"]
        assert h.writer.status.readiness() == (True, "ok")
        assert b"flannelpy_peers_without_path 1.0" in h.agent.metrics.exposition()
    finally:
        h.stop()


def test_a_flanneld_peer_s_unknown_mtu_is_said_once_at_info(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """flanneld leases carry no MTU: normal in a mixed cluster, so no warning per replan."""
    h = AgentHarness(tmp_path)
    h.start()
    try:
        h.drain()
        caplog.set_level(logging.INFO, logger="flannelpy")
        theirs = LeaseAttrs(
            public_ip=IPv4Address("192.168.1.30"),
            backend_type="vxlan",
            backend_data={"VNI": 1, "VtepMAC": "02:00:00:00:00:30"},
        )
        h.store.put(lease_key(PREFIX, IPv4Network("10.244.30.0/24")), theirs.to_json().encode())
        for _ in range(3):
            h.deliver_leases()
            h.reconcile()
        # Another node joins: the first one is not said again.
        other = LeaseAttrs(
            public_ip=IPv4Address("192.168.1.31"),
            backend_type="vxlan",
            backend_data={"VNI": 1, "VtepMAC": "02:00:00:00:00:31"},
        )
        h.store.put(lease_key(PREFIX, IPv4Network("10.244.31.0/24")), other.to_json().encode())
        h.deliver_leases()
        said = [r for r in caplog.records if "advertises no overlay MTU" in r.getMessage()]
        assert [r.levelno for r in said] == [logging.INFO, logging.INFO]
        assert "10.244.30.0/24" in said[0].getMessage()
        assert "10.244.31.0/24" in said[1].getMessage()
    finally:
        h.stop()
