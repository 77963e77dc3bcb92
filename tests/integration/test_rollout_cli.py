"""`flannelpy rollout` against a real etcd, with simulated agents in threads.

The agents follow the store contract (config, override and rollout record in;
status with probe results out), so these tests cover the command line, the etcd
adapter and the driver end to end; the lab test covers real data planes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from flannelpy.cli import main
from flannelpy.config.settings import AgentSettings
from flannelpy.control.records import NodeOverride
from flannelpy.rollout.record import RolloutRecord
from flannelpy.store.etcd.client import EtcdStore, connect_etcd
from flannelpy.store.rollout_etcd import RolloutStore
from flannelpy.subnet.keys import config_key, node_of_key, nodes_prefix
from tests.support.etcd_server import EtcdServer
from tests.support.rollout_agents import AgentThreads, SimCluster, config_json, five_nodes
from tests.support.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]


class Cluster:
    def __init__(self, server: EtcdServer, prefix: str, two_segments: bool = False) -> None:
        self.settings = AgentSettings(etcd_endpoints=(server.endpoint,), etcd_prefix=prefix)
        self.store: EtcdStore = connect_etcd(self.settings)
        self.store.put(config_key(prefix), config_json({"Type": "vxlan", "VNI": 1}).encode())
        self.sim = SimCluster(self.store, prefix, five_nodes(two_segments), time.time)
        self.rs = RolloutStore(self.store, prefix)
        self.flags = ["--etcd-endpoints", server.endpoint, "--etcd-prefix", prefix]

    def record(self) -> RolloutRecord:
        record, _ = self.rs.read_record()
        assert record is not None
        return record

    def config(self) -> dict[str, object]:
        kv = self.store.get(config_key(self.settings.etcd_prefix))
        assert kv is not None
        doc: dict[str, object] = json.loads(kv.value)
        return doc

    def override_history(self) -> dict[str, list[int | None]]:
        """Per node, the generation of every override write (None: a delete), from etcd's
        history."""
        prefix = nodes_prefix(self.settings.etcd_prefix)
        _, now = self.store.get_prefix(prefix)
        stop = threading.Event()
        history: dict[str, list[int | None]] = {}
        for batch in self.store.watch_prefix(prefix, 1, stop):
            for event in batch.events:
                found = node_of_key(self.settings.etcd_prefix, event.key)
                if found and found[1] == "override":
                    generation = (
                        NodeOverride.from_json(event.value).generation
                        if event.kind == "put"
                        else None
                    )
                    history.setdefault(found[0], []).append(generation)
            if batch.revision >= now:
                stop.set()
        return history


@pytest.fixture
def cluster(etcd_server: EtcdServer, etcd_prefix: str) -> Iterator[Cluster]:
    c = Cluster(etcd_server, etcd_prefix)
    try:
        with AgentThreads(c.sim, interval=0.1) as agents:
            yield c
        assert agents.errors == []
    finally:
        c.store.close()


def node_state(c: Cluster, node: str) -> str | None:
    record, _ = c.rs.read_record()
    return record.entry(node).state if record else None


def test_plan_refuses_host_gw_across_two_segments(
    etcd_server: EtcdServer, etcd_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    c = Cluster(etcd_server, etcd_prefix, two_segments=True)
    try:
        c.sim.tick()
        assert main(["rollout", "plan", "--backend", "host-gw", *c.flags]) == 2
        out, err = capsys.readouterr()
        assert "1. n1: vxlan (MTU 1450) -> host-gw (MTU 1500)" in out
        assert err.splitlines()[0] == (
            "flannelpy rollout: host-gw cannot work: n1 (100.64.0.2) and n4 (100.64.1.5): the "
            "nodes are on different L2 segments and neither has a VTEP; host-gw needs every "
            "node on one L2 segment: use vxlan, or vxlan with DirectRouting"
        )
        assert len(err.splitlines()) == 6  # every pair across the segments
        assert main(["rollout", "start", "--backend", "host-gw", *c.flags]) == 2
        assert c.rs.read_record() == (None, 0)  # nothing was started
        assert main(["rollout", "plan", "--backend", "vxlan", "--direct-routing", *c.flags]) == 0
    finally:
        c.store.close()


def test_start_walks_every_node_to_done(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(["rollout", "start", "--backend", "host-gw", "--step-timeout", "20", *cluster.flags])
        == 0
    )
    out = capsys.readouterr().out
    assert "done: 5 of 5 nodes switched to host-gw (n1, n2, n3, n4, n5)" in out
    verified = [line.split("] ")[1] for line in out.splitlines() if "verified in" in line]
    assert [line.split(":")[0] for line in verified] == ["n1", "n2", "n3", "n4", "n5"]
    assert cluster.config()["Backend"] == {"Type": "host-gw", "VNI": 1, "DirectRouting": False}
    assert cluster.sim.lost == []
    history = cluster.override_history()
    assert history == {f"n{i}": [1, None] for i in range(1, 6)}  # written once, then removed
    wait_until(
        lambda: all(not s.vtep for s in cluster.rs.read_nodes().statuses.values()),
        what="every node reporting its VTEP gone",
    )
    assert main(["rollout", "status", *cluster.flags]) == 0
    status = capsys.readouterr().out
    assert "n3    done     host-gw (MTU 1500)  -           yes    -" in status


def test_a_killed_driver_is_resumed(cluster: Cluster, capsys: pytest.CaptureFixture[str]) -> None:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "flannelpy",
            "rollout",
            "start",
            "--backend",
            "host-gw",
            "--step-timeout",
            "20",
            *cluster.flags,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_until(
            lambda: node_state(cluster, "n2") in ("applying", "verifying"),
            60,
            "n2 applying the change",
        )
    finally:
        proc.kill()
        proc.communicate()
    left = cluster.record()
    assert left.state == "running" and left.entry("n2").state in ("applying", "verifying")
    assert main(["rollout", "resume", *cluster.flags]) == 0
    out = capsys.readouterr().out
    assert f"resuming rollout {left.id} (running)" in out
    assert cluster.record().state == "done"
    # The killed driver's step was finished, not started over with a new generation.
    assert cluster.override_history()["n2"] == [1, None]
    assert cluster.sim.lost == []


def test_abort_stops_after_the_current_node_and_says_how_to_go_back(
    cluster: Cluster, capsys: pytest.CaptureFixture[str]
) -> None:
    result: list[int] = []
    driver = threading.Thread(
        target=lambda: result.append(
            main(
                ["rollout", "start", "--backend", "host-gw", "--step-timeout", "20", *cluster.flags]
            )
        )
    )
    driver.start()
    try:
        wait_until(
            lambda: node_state(cluster, "n2") in ("applying", "verifying"),
            what="n2 applying the change",
        )
        assert main(["rollout", "abort", *cluster.flags]) == 0
    finally:
        driver.join(60)
    assert result == [1]
    record = cluster.record()
    assert record.state == "aborted"
    assert [e.state for e in record.nodes] == ["done", "done", "pending", "pending", "pending"]
    out = capsys.readouterr().out
    assert "abort requested; the driver stops after the current step (n2 " in out
    hint = (
        "n1, n2 keep host-gw through their overrides; to go back to the config's vxlan, "
        "run `flannelpy rollout start --backend vxlan`"
    )
    assert hint in out
    assert cluster.config()["Backend"] == {"Type": "vxlan", "VNI": 1}
    # The suggested command walks n1 and n2 back; n3..n5 already run vxlan.
    assert (
        main(["rollout", "start", "--backend", "vxlan", "--step-timeout", "20", *cluster.flags])
        == 0
    )
    back = cluster.record()
    assert [e.skipped for e in back.nodes] == [False, False, True, True, True]
    assert all(s.backend.type == "vxlan" for s in cluster.rs.read_nodes().statuses.values())
    assert cluster.rs.read_nodes().overrides == {}
    assert cluster.sim.lost == []


def test_store_errors_are_one_sentence(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["rollout", "status", "--etcd-endpoints", "http://127.0.0.1:1"])
    err = capsys.readouterr().err
    assert code == 3
    assert err.startswith("flannelpy rollout: ") and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err
