"""Issue 6's "Must show" on real agents: backend rollouts under a disruption policy.

A 5-node vxlan lab on one L2 segment with 2 pods per node carries every test
but the last; each test leaves it as it found it (vxlan everywhere, no
overrides, the lab's own config). The rollouts run through the command line
as an operator runs them, except the maintenance-window test, which drives
the rollout in-process with a clock it moves. The last test builds a lab
with two segments, where host-gw cannot work.

The agents probe every second and publish their status every two, so a
rollout step is verified within seconds.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import partial
from ipaddress import IPv4Interface
from pathlib import Path
from typing import Any

import pytest
from flannelpy_lab import Lab

from flannelpy.agent.planning import LINGER_SECONDS
from flannelpy.control.records import NodeStatus
from flannelpy.rollout.driver import drive, make_plan, start
from flannelpy.rollout.record import RolloutRecord
from flannelpy.store.etcd.client import EtcdStore
from flannelpy.store.rollout_etcd import RolloutStore
from flannelpy.subnet.keys import config_key, override_key, rollout_key
from tests.e2e.test_observability import scrape
from tests.support.lab_util import lab_run_argv, running_lab, wait_until
from tests.support.traffic import PodTraffic, TrafficReport

pytestmark = [
    pytest.mark.lab,
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to build the netns lab"),
]

REPO = Path(__file__).resolve().parents[2]
NODES = 5
PODS_PER_NODE = 2
NAMES = tuple(f"n{i}" for i in range(1, NODES + 1))
AGENT_ARGS = ["--probe-interval", "1", "--status-publish-interval", "2"]
RATE = 20.0  # echoes per second per ordered pair of pods
STREAMS = 4
CLI_TIMEOUT = 600.0
BLOCKED = ("flannelpy_blocked_operations_total", frozenset({("kind", "backend_change")}))


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with running_lab(NODES, "vxlan", start_agents=False) as lab:
        lab.set_agent_args(AGENT_ARGS)
        lab.start_agents()
        for node in NAMES:
            for _ in range(PODS_PER_NODE):
                lab.add_pod(node)
        yield lab


@dataclass
class Cluster:
    lab: Lab
    store: EtcdStore
    rs: RolloutStore
    original_config: bytes

    @property
    def prefix(self) -> str:
        return self.lab.state.etcd_prefix

    def statuses(self) -> dict[str, NodeStatus]:
        return self.rs.read_nodes().statuses

    def backends(self) -> dict[str, str]:
        return {n: s.backend.type for n, s in sorted(self.statuses().items())}

    def overrides(self) -> dict[str, str]:
        return {n: str(o.backend.get("Type")) for n, o in self.rs.read_nodes().overrides.items()}

    def record(self) -> RolloutRecord:
        record, _ = self.rs.read_record()
        assert record is not None, "no rollout record in the store"
        return record

    def config(self) -> dict[str, Any]:
        kv = self.store.get(config_key(self.prefix))
        assert kv is not None
        doc: dict[str, Any] = json.loads(kv.value)
        return doc

    def put_config(self, doc: dict[str, Any]) -> None:
        self.store.put(config_key(self.prefix), json.dumps(doc).encode())

    def lease_types(self) -> dict[str, str]:
        items, _ = self.store.get_prefix(f"{self.prefix}/subnets/")
        docs = [json.loads(kv.value) for kv in items]
        return {d["Flannelpy"]["NodeName"]: d["BackendType"] for d in docs}


@pytest.fixture()
def cluster(lab: Lab) -> Iterator[Cluster]:
    store = EtcdStore([lab.etcd_endpoint])
    prefix = lab.state.etcd_prefix
    kv = store.get(config_key(prefix))
    assert kv is not None
    c = Cluster(lab, store, RolloutStore(store, prefix), kv.value)
    try:
        yield c
    finally:
        restore(c)
        store.close()


def restore(c: Cluster) -> None:
    """Back to the lab as built: its config, no overrides, no rollout in flight."""
    record, revision = c.rs.read_record()
    if record is not None and record.state not in ("done", "failed", "aborted"):
        # Its driver ended with the test; a new rollout could not start beside it.
        c.store.delete_if_mod_revision(rollout_key(c.prefix), revision)
    names = [node.name for node in c.lab.nodes]
    for node in names:
        c.rs.delete_override(node)
    c.store.put(config_key(c.prefix), c.original_config)

    def settled() -> bool:
        st = c.statuses()
        return len(st) == len(names) and all(
            s.backend.type == "vxlan"
            and not s.backend.direct_routing
            and s.blocked is None
            and s.applied_generation is None
            for s in st.values()
        )

    wait_until(settled, 60, what="every node back on the config's vxlan")
    wait_until(
        lambda: c.lease_types() == dict.fromkeys(names, "vxlan"),
        20,
        what="every lease back on vxlan",
    )


# --- helpers -------------------------------------------------------------------------


def flannelpy(lab: Lab, *args: str) -> subprocess.CompletedProcess[str]:
    """The command line, as an operator runs it on the lab (``flannelpy-lab run``)."""
    return subprocess.run(
        lab_run_argv(lab.name, *args),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT,
    )


def output(proc: subprocess.CompletedProcess[str]) -> str:
    return f"exit {proc.returncode}\n--- stdout\n{proc.stdout}--- stderr\n{proc.stderr}"


def subnet_of(lab: Lab, node: str) -> str:
    address = lab.node(node).overlay_address
    assert address, f"{node} has no overlay address"
    return str(IPv4Interface(address).network)


def peer_routes(lab: Lab, node: str) -> dict[str, str | None]:
    """For each peer's subnet, the device of ``node``'s route to it (None: no route)."""
    out = lab.exec(node, ["ip", "-j", "route", "show", "proto", "75"]).stdout
    routes = {r["dst"]: r.get("dev") for r in json.loads(out or "[]")}
    return {subnet_of(lab, p): routes.get(subnet_of(lab, p)) for p in NAMES if p != node}


def vxlan_devices(lab: Lab, node: str) -> list[str]:
    out = lab.exec(node, ["ip", "-j", "link", "show", "type", "vxlan"]).stdout
    return sorted(link["ifname"] for link in json.loads(out or "[]"))


def assert_dataplanes(lab: Lab, route_dev: str, vtep: bool) -> None:
    """Every node's route to every peer goes through ``route_dev``; a VTEP on every
    node (``vtep``) or, once its linger for peers still encapsulating is over, on none."""
    for node in NAMES:
        routes = peer_routes(lab, node)
        assert routes == dict.fromkeys(routes, route_dev), (node, routes)
    want = ["flannel.1"] if vtep else []
    wait_until(
        lambda: all(vxlan_devices(lab, node) == want for node in NAMES),
        LINGER_SECONDS + 5.0,
        what=f"VTEPs {want} on every node",
    )


def rollout_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if " verified in " in line]


def summary_line(text: str) -> str:
    """The driver's last word: ``rollout <id> <state>: ...``."""
    return [line for line in text.splitlines() if line.startswith("rollout ")][-1]


def blocked_status(c: Cluster, node: str) -> NodeStatus | None:
    status = c.statuses().get(node)
    return status if status is not None and status.blocked is not None else None


def when_lost(report: TrafficReport, spans: list[tuple[str, float, float]]) -> list[str]:
    """Each lost echo with about when it was sent: its sequence number over the rate,
    less the warm-up, against the rollouts' spans (to a tenth of a second or so)."""
    lines = []
    for p in report.pairs:
        for seq in p.lost_seqs:
            at = seq / report.rate - report.warmup_s
            during = next(
                (f"{name} rollout +{at - a:.1f} s" for name, a, b in spans if a <= at <= b),
                "between rollouts",
            )
            lines.append(f"lost {p.src}->{p.dst} seq {seq}: ~{at:.1f} s, {during}")
    return lines


# --- 1. the headline -------------------------------------------------------------------


ROLLOUTS = (
    # (CLI flags, the target's name in the summary, peer route device, VTEP everywhere)
    (["--backend", "host-gw"], "host-gw", "eth0", False),
    (["--backend", "vxlan", "--direct-routing"], "vxlan+DirectRouting", "eth0", True),
    (["--backend", "vxlan"], "vxlan", "flannel.1", True),
)


def test_three_rollouts_under_traffic_lose_no_echo_and_break_no_stream(
    cluster: Cluster,
) -> None:
    lab = cluster.lab
    assert_dataplanes(lab, "flannel.1", vtep=True)
    durations: list[tuple[str, float]] = []
    spans: list[tuple[str, float, float]] = []  # seconds into the measured interval
    with PodTraffic(lab, rate=RATE, streams=STREAMS) as traffic:
        measuring = time.monotonic()
        for flags, name, route_dev, vtep in ROLLOUTS:
            began = time.monotonic()
            proc = flannelpy(lab, "rollout", "start", *flags)
            took = time.monotonic() - began
            durations.append((name, took))
            spans.append((name, began - measuring, began - measuring + took))
            print(f"--- rollout to {name}: {took:.1f} s\n{proc.stdout}{proc.stderr}")
            assert proc.returncode == 0, output(proc)
            summary = summary_line(proc.stdout)
            assert re.search(
                rf" done: {NODES} of {NODES} nodes switched to {re.escape(name)} ", summary
            ), output(proc)
            verified = [line.split("] ")[1].split(":")[0] for line in rollout_lines(proc.stdout)]
            assert verified == list(NAMES), output(proc)
            record = cluster.record()
            assert record.state == "done" and record.config_written, record
            assert cluster.overrides() == {}
            running = {
                (s.backend.type, s.backend.direct_routing) for s in cluster.statuses().values()
            }
            assert running == {(name.split("+")[0], name.endswith("+DirectRouting"))}, running
            assert_dataplanes(lab, route_dev, vtep)
        report = traffic.stop()
    print(report.summary())
    print("rollout durations: " + ", ".join(f"{name} {took:.1f} s" for name, took in durations))
    for line in when_lost(report, spans):
        print(line)
    assert traffic.alive() == []

    assert report.measured_s >= sum(took for _, took in durations), report.summary()
    assert len(report.pairs) == NODES * PODS_PER_NODE * (NODES * PODS_PER_NODE - 1)
    for p in report.pairs:
        assert p.sent == p.received + p.lost and p.send_errors == 0, p
        assert p.measured_s >= report.measured_s - 0.2, p  # counted the whole time
        assert p.sent >= RATE * p.measured_s - 1, f"{p.src}->{p.dst} sent {p.rate:.2f}/s"
    assert report.lost == 0, report.summary()
    assert len(report.streams) == STREAMS and report.broken_streams == [], report.summary()
    assert all(s.echoed == s.sent > 0 for s in report.streams), report.summary()
    assert cluster.config()["Backend"]["Type"] == "vxlan"


# --- 2. Block ------------------------------------------------------------------------------


def test_block_refuses_the_rollout_and_no_agent_applies_a_change_written_to_the_store(
    cluster: Cluster,
) -> None:
    lab = cluster.lab
    proc = flannelpy(lab, "policy", "set", "Block")
    assert proc.returncode == 0, output(proc)
    record_before = cluster.rs.read_record()
    before = {node: scrape(lab, node)[1].get(BLOCKED, 0.0) for node in NAMES}

    proc = flannelpy(lab, "rollout", "start", "--backend", "host-gw")
    print(proc.stderr)
    assert proc.returncode == 2, output(proc)
    sentence = proc.stderr.strip().splitlines()[-1]
    assert sentence.startswith("flannelpy rollout: disruptive change (")
    assert "backend vxlan -> host-gw" in sentence.split(")")[0]
    assert "blocked by DisruptionPolicy Block;" in sentence
    assert "set the policy to Allow or AllowDuringMaintenanceWindow" in sentence
    assert '--force --reason "..."' in sentence
    assert cluster.overrides() == {}
    assert cluster.rs.read_record() == record_before  # no rollout was recorded

    # The same change written straight into the network config.
    doc = cluster.config()
    assert doc["DisruptionPolicy"] == {"Mode": "Block"}
    cluster.put_config({**doc, "Backend": {"Type": "host-gw"}})
    for node in NAMES:
        status = wait_until(
            partial(blocked_status, cluster, node), 20, what=f"{node} to report the blocked change"
        )
        assert status is not None and status.blocked is not None
        assert "backend vxlan -> host-gw" in status.blocked.change
        assert "blocked by DisruptionPolicy Block" in status.blocked.sentence
        assert status.backend.type == "vxlan" and status.applied_generation is None
        after = scrape(lab, node)[1].get(BLOCKED, 0.0)
        assert after == before[node] + 1, (node, before[node], after)
    print(
        "blocked operations per node: "
        + ", ".join(f"{n} {before[n]:g} -> {before[n] + 1:g}" for n in NAMES)
    )
    assert cluster.lease_types() == dict.fromkeys(NAMES, "vxlan")
    assert_dataplanes(lab, "flannel.1", vtep=True)


# --- 3. AllowDuringMaintenanceWindow with a test clock -----------------------------------

WINDOW = datetime(2026, 12, 5, 2, 0, tzinfo=UTC)  # a Saturday, 02:00 UTC, for one hour
NEXT_WINDOW = WINDOW + timedelta(days=7)


class TestClock:
    """The rollout's wall clock: stands where the test puts it."""

    __test__ = False  # not a test class

    def __init__(self, now: datetime) -> None:
        self.now = now

    def __call__(self) -> datetime:
        return self.now


def test_maintenance_window_waits_proceeds_pauses_and_resumes_in_the_next_one(
    cluster: Cluster,
) -> None:
    lab = cluster.lab
    proc = flannelpy(
        lab,
        "policy",
        "set",
        "AllowDuringMaintenanceWindow",
        "--days",
        "Sat",
        "--start",
        "02:00",
        "--duration",
        "1h",
        "--utc-offset",
        "+00:00",
    )
    assert proc.returncode == 0, output(proc)
    clock = TestClock(WINDOW - timedelta(minutes=30))
    lines: list[str] = []

    def display(line: str) -> None:
        print(line)
        lines.append(line)
        if " n1: verified in " in line:  # between n1 and n2, the window ends
            clock.now = WINDOW + timedelta(hours=1, minutes=1)

    def walk() -> RolloutRecord:
        return drive(cluster.rs, record.id, clock, time.sleep, display, poll=0.5)

    # Before the window: the rollout starts and waits, touching no node.
    plan = make_plan(cluster.rs, "host-gw", clock())
    assert plan.problems == () and plan.blocked is None, plan
    assert plan.decision is not None and plan.decision.next_window_start == WINDOW
    record = start(cluster.rs, plan, clock(), step_timeout=60)
    left = walk()
    assert left.state == "paused-window" and left.next_window == WINDOW.isoformat(), left
    assert [e.state for e in left.nodes] == ["pending"] * NODES
    assert cluster.overrides() == {}
    assert cluster.backends() == dict.fromkeys(NAMES, "vxlan")

    # Inside the window: n1 switches for real; then the clock passes the window's end.
    clock.now = WINDOW + timedelta(minutes=5)
    left = walk()
    assert left.state == "paused-window" and left.next_window == NEXT_WINDOW.isoformat(), left
    assert left.reason is not None and NEXT_WINDOW.isoformat() in left.reason, left.reason
    assert [e.state for e in left.nodes] == ["done"] + ["pending"] * (NODES - 1)
    assert cluster.overrides() == {"n1": "host-gw"}
    assert cluster.backends() == {"n1": "host-gw"} | dict.fromkeys(NAMES[1:], "vxlan")
    assert cluster.lease_types() == {"n1": "host-gw"} | dict.fromkeys(NAMES[1:], "vxlan")
    n1_routes = peer_routes(lab, "n1")
    assert n1_routes == dict.fromkeys(n1_routes, "eth0")  # host-gw: straight to each peer
    assert vxlan_devices(lab, "n1") == ["flannel.1"]  # kept while the peers are vxlan
    assert peer_routes(lab, "n2")[subnet_of(lab, "n1")] == "eth0"
    assert peer_routes(lab, "n2")[subnet_of(lab, "n3")] == "flannel.1"

    # The next window, with the operator's command: resume runs it to the end.
    proc = flannelpy(
        lab, "rollout", "resume", "--clock-start", (NEXT_WINDOW + timedelta(minutes=2)).isoformat()
    )
    print(proc.stdout + proc.stderr)
    assert proc.returncode == 0, output(proc)
    assert " done: 5 of 5 nodes switched to host-gw " in summary_line(proc.stdout), output(proc)
    assert cluster.record().state == "done"
    assert cluster.backends() == dict.fromkeys(NAMES, "host-gw")
    assert cluster.overrides() == {}
    assert cluster.config()["Backend"]["Type"] == "host-gw"
    assert_dataplanes(lab, "eth0", vtep=False)
    assert lab.status()["ok"]


# --- 5. a step that fails mid-rollout is rolled back -----------------------------------------


def test_a_node_that_fails_verification_is_rolled_back_and_the_rollout_stops(
    cluster: Cluster,
) -> None:
    lab = cluster.lab
    # n3's underlay drops unencapsulated pod traffic towards n4 and n5 (like a cloud's
    # source/destination check); VXLAN from n3's own address passes.
    rules = [
        ["-o", "eth0", "-s", lab.state.network, "-d", subnet_of(lab, peer), "-j", "DROP"]
        for peer in ("n4", "n5")
    ]
    try:
        for rule in rules:
            lab.exec("n3", ["iptables", "-t", "mangle", "-A", "POSTROUTING", *rule])
        assert lab.status()["ok"]  # nothing is lost while n3 encapsulates
        began = time.monotonic()
        proc = flannelpy(lab, "rollout", "start", "--backend", "host-gw", "--step-timeout", "20")
        took = time.monotonic() - began
        print(f"--- rollout with a failing n3: {took:.1f} s\n{proc.stdout}{proc.stderr}")
        assert proc.returncode == 1, output(proc)
        record = cluster.record()
        assert record.state == "failed", record
        assert [e.state for e in record.nodes] == [
            "done",
            "done",
            "rolled-back",
            "pending",
            "pending",
        ], record
        assert record.reason is not None and record.reason.startswith("n3 failed verification")
        assert re.search(r"n3 -> n[45]|n[45] -> n3", record.reason), record.reason
        summary = summary_line(proc.stdout)
        assert " failed: 2 of 5 nodes switched to host-gw (n1, n2); n3 " in summary, summary

        statuses = cluster.statuses()
        assert cluster.backends() == {
            "n1": "host-gw",
            "n2": "host-gw",
            "n3": "vxlan",
            "n4": "vxlan",
            "n5": "vxlan",
        }
        assert cluster.lease_types()["n3"] == "vxlan"
        assert statuses["n4"].applied_generation is None  # never touched
        assert statuses["n5"].applied_generation is None
        assert cluster.overrides() == {"n1": "host-gw", "n2": "host-gw"}  # n3's is gone
        assert peer_routes(lab, "n3")[subnet_of(lab, "n4")] == "flannel.1"
        # Whole again, with n3's underlay still dropping unencapsulated traffic.
        assert lab.status()["ok"]
    finally:
        for rule in rules:
            lab.exec("n3", ["iptables", "-t", "mangle", "-D", "POSTROUTING", *rule], check=False)


# --- 4. a target that cannot work is refused at plan -----------------------------------------


def test_host_gw_across_two_segments_is_refused_at_plan_and_start() -> None:
    with running_lab(4, "vxlan", segments=2) as lab:
        prefix = lab.state.etcd_prefix
        store = EtcdStore([lab.etcd_endpoint])
        try:
            rs = RolloutStore(store, prefix)
            wait_until(lambda: len(rs.read_nodes().statuses) == 4, 30, what="every node's status")
            segment = {n.name: n.segment for n in lab.nodes}
            across = {
                (a, b) for a in segment for b in segment if a < b and segment[a] != segment[b]
            }
            assert across, segment
            config_before = store.get(config_key(prefix))
            assert config_before is not None
            for command in ("plan", "start"):
                proc = flannelpy(lab, "rollout", command, "--backend", "host-gw")
                print(proc.stderr)
                assert proc.returncode == 2, output(proc)
                named = set()
                for line in proc.stderr.strip().splitlines():
                    m = re.fullmatch(
                        r"flannelpy rollout: host-gw cannot work: (n\d) \(\S+\) and (n\d) "
                        r"\(\S+\): the nodes are on different L2 segments and neither has a "
                        r"VTEP; host-gw needs every node on one L2 segment: use vxlan, or "
                        r"vxlan with DirectRouting",
                        line,
                    )
                    assert m, line
                    named.add((m[1], m[2]))
                assert named == across
                assert rs.read_record() == (None, 0)
                assert rs.read_nodes().overrides == {}
                kv = store.get(config_key(prefix))
                assert kv is not None and kv.mod_revision == config_before.mod_revision
                assert store.get(override_key(prefix, "n1")) is None
            assert {s.backend.type for s in rs.read_nodes().statuses.values()} == {"vxlan"}
            # What the refusal suggests is accepted.
            proc = flannelpy(lab, "rollout", "plan", "--backend", "vxlan", "--direct-routing")
            assert proc.returncode == 0, output(proc)
        finally:
            store.close()
