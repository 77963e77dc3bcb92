"""Rollouts in Kubernetes mode against the real API server (``lab up --kube``).

A 4-node vxlan lab, one pod per node, agents authenticated as the manifests'
ServiceAccount. ``flannelpy rollout`` runs as the operator (the admin kubeconfig)
from the host, vxlan -> host-gw -> vxlan, while every ordered pod pair pings at
20/s. A poller reads the Node objects and the status Leases the whole time, so the
test sees when each node was cordoned and when its change was in flight.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from flannelpy_lab import Lab
from flannelpy_lab import kube as control_plane
from kubernetes import client as kclient
from kubernetes import config as kconfig

from flannelpy.rollout.cordon import CORDON_ANNOTATION, EXCLUDE_LABEL
from flannelpy.store.kube.node_status import (
    MAX_SUMMARY_BYTES,
    MIN_WRITE_GAP,
    STATUS_ANNOTATION,
)
from tests.support.kube_rollout import rollout
from tests.support.lab_util import running_lab, wait_until
from tests.support.traffic import PodTraffic

pytestmark = [pytest.mark.lab]

REPO = Path(__file__).resolve().parents[2]
NAMES = ("n1", "n2", "n3", "n4")
AGENT_ARGS = ["--probe-interval", "1", "--status-publish-interval", "2"]
RATE = 20.0
OVERRIDE = "flannelpy.io/override"


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with running_lab(len(NAMES), "vxlan", kube=True, start_agents=False) as lab:
        lab.set_agent_args(AGENT_ARGS)
        lab.start_agents()
        lab.install_cni()
        for node in NAMES:
            lab.add_pod(node)
        yield lab


def admin_client(lab: Lab) -> kclient.ApiClient:
    cfg = kclient.Configuration()
    kconfig.load_kube_config(
        config_file=control_plane.admin_kubeconfig(lab.state),
        client_configuration=cfg,
        persist_config=False,
    )
    return kclient.ApiClient(cfg)


@dataclass
class Sample:
    at: float
    cordoned: dict[str, tuple[bool, bool]]  # node -> (unschedulable, exclude label)
    override_generation: dict[str, int]  # node -> its override's Generation
    applied: dict[str, tuple[int | None, str]]  # node -> (AppliedGeneration, backend type)
    lease_versions: dict[str, str]  # node -> its status Lease's resourceVersion


@dataclass
class Poller:
    """Reads the Nodes, then the status Leases, every 0.1 s. The order matters: the
    rollout uncordons a node only after its Lease shows the change applied, so a sample
    whose Nodes show it uncordoned also shows, in the Leases read after, the change."""

    api: kclient.ApiClient
    samples: list[Sample] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        core, coord = kclient.CoreV1Api(self.api), kclient.CoordinationV1Api(self.api)
        while not self.stop.is_set():
            try:
                nodes = core.list_node()
                leases = coord.list_namespaced_lease(control_plane.NAMESPACE)
            except Exception as e:  # the assertion names it
                self.errors.append(repr(e))
                self.stop.wait(0.1)
                continue
            applied, versions = {}, {}
            for lease in leases.items:
                versions[lease.metadata.name] = lease.metadata.resource_version
                raw = (lease.metadata.annotations or {}).get(STATUS_ANNOTATION)
                if raw:
                    doc = json.loads(raw)
                    applied[lease.metadata.name] = (
                        doc["AppliedGeneration"],
                        doc["Backend"]["Type"],
                    )
            cordoned, generations = {}, {}
            for node in nodes.items:
                name = node.metadata.name
                cordoned[name] = (
                    bool(node.spec.unschedulable),
                    EXCLUDE_LABEL in (node.metadata.labels or {}),
                )
                override = (node.metadata.annotations or {}).get(OVERRIDE)
                if override:
                    generations[name] = int(json.loads(override)["Generation"])
            self.samples.append(Sample(time.monotonic(), cordoned, generations, applied, versions))
            self.stop.wait(0.1)


def intervals(samples: list[Sample], node: str) -> list[tuple[float, float]]:
    """The spans over which ``node`` was cordoned (either mark): from the first sample
    showing it cordoned to the first showing it back (or the last sample)."""
    spans: list[tuple[float, float]] = []
    start: float | None = None
    for s in samples:
        out = any(s.cordoned.get(node, (False, False)))
        if out and start is None:
            start = s.at
        if not out and start is not None:
            spans.append((start, s.at))
            start = None
    if start is not None:
        spans.append((start, samples[-1].at))
    return spans


def changes(samples: list[Sample], node: str) -> list[tuple[float, float, int]]:
    """Each of ``node``'s changes: from the first sample showing a new override generation
    to the first one showing its status applied it (start, end, generation)."""
    found: list[tuple[float, float, int]] = []
    open_gen: int | None = None
    start = 0.0
    previous: int | None = None
    for s in samples:
        gen = s.override_generation.get(node)
        if gen is not None and gen != previous and open_gen is None:
            open_gen, start = gen, s.at  # an override appeared, or a new generation
        previous = gen
        applied = s.applied.get(node, (None, ""))[0]
        if open_gen is not None and applied == open_gen:
            found.append((start, s.at, open_gen))
            open_gen = None
    return found


def test_rollouts_cordon_one_node_at_a_time_and_lose_no_echo(lab: Lab) -> None:
    api = admin_client(lab)
    poller = Poller(api)
    thread = threading.Thread(target=poller.run, daemon=True)
    try:
        thread.start()
        # The first rollout's first node is cordoned for a few seconds only: the poller
        # must be reading before it starts (its first list can take seconds under load).
        wait_until(lambda: poller.samples, 60, "the poller's first sample")
        with PodTraffic(lab, rate=RATE, streams=2) as traffic:
            for backend, route_dev in (("host-gw", "eth0"), ("vxlan", "flannel.1")):
                proc = rollout(lab, "start", "--backend", backend)
                print(f"--- rollout to {backend}\n{proc.stdout}{proc.stderr}")
                assert proc.returncode == 0, proc.stdout + proc.stderr
                last = [ln for ln in proc.stdout.splitlines() if ln.startswith("rollout ")][-1]
                assert f" done: 4 of 4 nodes switched to {backend} " in last, last
                for node in NAMES:
                    mine = [ln for ln in proc.stdout.splitlines() if f"] {node}: " in ln]
                    steps = [
                        w
                        for w in ("cordoned", "switching", "uncordoned", "verified")
                        if any(f"{node}: {w}" in ln for ln in mine)
                    ]
                    assert steps == ["cordoned", "switching", "uncordoned", "verified"], mine
                for node in NAMES:  # the dataplane follows
                    out = lab.exec(node, ["ip", "-j", "route", "show", "proto", "75"]).stdout
                    devs = {r.get("dev") for r in json.loads(out or "[]")}
                    assert devs == {route_dev}, (node, devs)
            report = traffic.stop()
    finally:
        poller.stop.set()
        thread.join(timeout=5)
    print(report.summary())
    assert report.lost == 0, report.summary()
    assert len(report.pairs) == len(NAMES) * (len(NAMES) - 1)
    assert all(p.sent >= RATE * p.measured_s - 1 for p in report.pairs), report.summary()
    assert report.broken_streams == [], report.summary()

    samples = poller.samples
    assert len(samples) > 100 and len(poller.errors) < 5, poller.errors[:5]
    spans = {node: intervals(samples, node) for node in NAMES}
    print(
        "cordoned:",
        {
            n: [(round(a - samples[0].at, 1), round(b - samples[0].at, 1)) for a, b in s]
            for n, s in spans.items()
        },
    )
    for node in NAMES:
        # Once per rollout, both marks together, and each span covers the node's change:
        # the override shows up no earlier than the cordon, and the change is seen
        # applied no later than the node is seen back.
        assert len(spans[node]) == 2, (node, spans[node])
        for s in samples:
            marks = s.cordoned.get(node)
            assert marks in ((True, True), (False, False)), (node, marks)
        moves = changes(samples, node)
        assert len(moves) == 2, (node, moves)
        for (start, end, gen), (c_start, c_end) in zip(moves, spans[node], strict=True):
            assert c_start <= start and end <= c_end, (node, gen, (start, end), (c_start, c_end))
    every = sorted((a, b, n) for n, s in spans.items() for a, b in s)
    for (_, b1, n1), (a2, _, n2) in itertools.pairwise(every):
        # One Node list is one snapshot: a sample showing both cordoned ends n1's span
        # after it starts n2's.
        assert b1 <= a2, f"{n1} cordoned until {b1:.1f}, {n2} from {a2:.1f}: they overlap"

    # Left as found: schedulable, no marks, no overrides, the config back on vxlan.
    for node in kclient.CoreV1Api(api).list_node().items:
        assert not node.spec.unschedulable, node.metadata.name
        assert EXCLUDE_LABEL not in (node.metadata.labels or {})
        notes = node.metadata.annotations or {}
        assert CORDON_ANNOTATION not in notes and OVERRIDE not in notes, notes
        assert STATUS_ANNOTATION not in notes  # the status is in a Lease, not on the Node
    cm = kclient.CoreV1Api(api).read_namespaced_config_map(
        control_plane.CONFIG_MAP, control_plane.NAMESPACE
    )
    assert json.loads(cm.data[control_plane.NET_CONF_KEY])["Backend"]["Type"] == "vxlan"
    # Each agent wrote its Lease at most once per MIN_WRITE_GAP, rollouts or not.
    took = samples[-1].at - samples[0].at
    for node in NAMES:
        writes = len({s.lease_versions.get(node) for s in samples}) - 1
        print(f"{node}: {writes} status Lease writes in {took:.0f} s")
        assert 0 < writes <= took / MIN_WRITE_GAP + 1, (node, writes, took)
    status = rollout(lab, "status")
    assert status.returncode == 0, status.stdout + status.stderr
    rows = [
        ln.split()[:3]
        for ln in status.stdout.splitlines()
        if ln.split()[:1] in [[n] for n in NAMES]
    ]
    assert rows == [[n, "done", "vxlan"] for n in NAMES], status.stdout
    # One bounded status Lease per node, in the flannelpy namespace.
    leases = kclient.CoordinationV1Api(api).list_namespaced_lease(control_plane.NAMESPACE)
    by_name = {x.metadata.name: x for x in leases.items}
    assert set(NAMES) <= set(by_name)
    for node in NAMES:
        raw = by_name[node].metadata.annotations[STATUS_ANNOTATION]
        assert len(raw.encode()) <= MAX_SUMMARY_BYTES
        assert json.loads(raw)["Backend"]["Type"] == "vxlan"
    api.close()
