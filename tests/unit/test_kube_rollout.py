"""Kubernetes-mode rollouts, the pure parts: the status Lease's bound and write rate,
the cordon patches, and the driver's cordon steps (over the etcd FakeStore's
simulated agents, the cordon recorded)."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest

from flannelpy.control.records import (
    BackendSummary,
    BlockedChange,
    NodeOverride,
    NodeStatus,
    PeerProbe,
    ProbeSummary,
)
from flannelpy.rollout.cordon import (
    CORDON_ANNOTATION,
    EXCLUDE_LABEL,
    cordon_patch,
    is_cordoned,
    mark_of,
    uncordon_patch,
)
from flannelpy.rollout.record import RolloutRecord
from flannelpy.store.kube.node_status import (
    CONFIG_BACKEND_KEY,
    HEARTBEAT_SECONDS,
    MAX_SUMMARY_BYTES,
    MIN_WRITE_GAP,
    STATUS_ANNOTATION,
    LeasePublisher,
    StatusDeferred,
    WriteLimiter,
    decode_summary,
    encode_summary,
    override_rollout,
    parse_leases,
)
from flannelpy.store.rollout_etcd import RolloutStore
from tests.support.kube_fake_client import FakeApi
from tests.support.kube_standin import json_merge
from tests.unit.test_rollout import Env

# --- the status Lease: bounded ---------------------------------------------------------


def status(
    node: str = "n1",
    peers: int = 3,
    failing: int = 0,
    subnets: int = 1,
    sentence: str = "",
    underlay: int = 1,
) -> NodeStatus:
    probes = {
        f"10.{i // 250}.{i % 250}.0/24": PeerProbe(
            reachable=i >= failing,
            mtu_ok=True,
            ok=i >= failing,
            probes=10,
            at=100.0,
            passed_at=99.0,
        )
        for i in range(peers)
    }
    return NodeStatus(
        node=node,
        at=100.0,
        ready=True,
        public_ip="192.0.2.1",
        underlay_networks=tuple(f"192.0.{i}.0/24" for i in range(underlay)),
        backend=BackendSummary("vxlan", 1, 8472, False, 1450),
        vtep=True,
        applied_generation=4,
        applied_at=90.0,
        blocked=BlockedChange(5, "backend vxlan -> host-gw", sentence, 95.0) if sentence else None,
        subnets=tuple(f"10.244.{i}.0/24" for i in range(subnets)),
        probes=ProbeSummary.of(probes),
    )


def test_a_small_record_is_kept_whole_with_the_configs_backend() -> None:
    st = status()
    text = encode_summary(st.to_json(), {"Type": "host-gw"})
    raw, backend = decode_summary(text)
    assert NodeStatus.from_json(raw) == st
    assert backend == {"Type": "host-gw"}


@pytest.mark.parametrize("peers", [2, 100, 5000, 60000])
def test_the_record_does_not_grow_with_the_cluster(peers: int) -> None:
    text = encode_summary(status(peers=peers, failing=min(peers, 40)).to_json(), {"Type": "vxlan"})
    assert len(text.encode()) <= 700  # fixed: counts, five failing peers named
    back = NodeStatus.from_json(decode_summary(text)[0])
    assert back.probes.peers == peers and back.probes.failing == min(peers, 40)
    assert len(back.probes.failing_peers) == min(peers, 5)


def test_an_oversized_record_is_cut_to_the_bound_keeping_what_a_rollout_reads() -> None:
    st = status(node="n" * 253, subnets=300, underlay=300, sentence="x" * 10_000, failing=3)
    big_backend = {"Type": "vxlan", "Junk": "y" * 5000}
    text = encode_summary(st.to_json(), big_backend)
    assert len(text.encode()) <= MAX_SUMMARY_BYTES
    back = NodeStatus.from_json(decode_summary(text)[0])
    assert back.node == st.node and back.backend == st.backend and back.ready
    assert back.applied_generation == 4 and back.probes.peers == 3
    assert len(back.subnets) <= 8 and len(back.underlay_networks) <= 8
    assert CONFIG_BACKEND_KEY not in json.loads(text)  # over its own bound: left out
    assert back.blocked is None or len(back.blocked.sentence) <= 400


def test_lease_lists_are_read_as_input_from_other_machines() -> None:
    good = encode_summary(status("n2").to_json(), {"Type": "vxlan"})

    def item(name: str, raw: Any) -> dict[str, Any]:
        return {"metadata": {"name": name, "annotations": {STATUS_ANNOTATION: raw}}}

    doc = {
        "items": [
            item("n2", good),
            item("n3", "{not json"),
            item("n4", "[1]"),
            item("n5", "x" * (MAX_SUMMARY_BYTES * 2 + 1)),
            item("n6", 7),
            {"metadata": {"name": "n7"}},
            "junk",
        ]
    }
    found, errors = parse_leases(doc)
    assert set(found) == {"n2"} and found["n2"].config_backend == {"Type": "vxlan"}
    assert sorted(errors) == ["lease n3/status", "lease n4/status", "lease n5/status"]


def test_override_rollout_names_the_rollout_or_nothing() -> None:
    assert override_rollout(NodeOverride({"Type": "vxlan"}, 2, rollout="r1").to_json()) == "r1"
    assert override_rollout(NodeOverride({"Type": "vxlan"}, 2).to_json()) is None
    for raw in (None, "", "{", "[]", '{"Rollout": 3}', '{"Rollout": "' + "r" * 5000 + '"}'):
        assert override_rollout(raw) is None


# --- the status Lease: rate-limited -----------------------------------------------------


def test_the_limiter_writes_changes_at_once_but_never_twice_within_the_gap() -> None:
    lim = WriteLimiter()
    a, b = status().to_json(), status(peers=4).to_json()
    assert lim.due(0.0, a)
    lim.wrote(0.0, a)
    assert not lim.due(MIN_WRITE_GAP - 0.1, b)  # a change, too soon
    assert lim.due(MIN_WRITE_GAP, b)
    lim.wrote(MIN_WRITE_GAP, b)
    moved = json.loads(b)
    moved["At"] = 999.0  # only the write time differs: the same content
    assert not lim.due(MIN_WRITE_GAP + HEARTBEAT_SECONDS - 1, json.dumps(moved))
    assert lim.due(MIN_WRITE_GAP + HEARTBEAT_SECONDS, json.dumps(moved))


class CountingPublisher(LeasePublisher):
    def __init__(self, clock: list[float]) -> None:
        self.clock = clock
        super().__init__(None, "kube-flannelpy", monotonic=lambda: clock[0])  # type: ignore[arg-type]
        self.written: list[tuple[str, str]] = []

    def _write(self, node: str, text: str) -> None:
        self.written.append((node, text))


def test_the_publisher_defers_what_the_limiter_holds_back() -> None:
    clock = [0.0]
    pub = CountingPublisher(clock)
    pub.publish("n1", status().to_json(), None)
    with pytest.raises(StatusDeferred):
        pub.publish("n1", status(peers=5).to_json(), None)
    clock[0] = MIN_WRITE_GAP
    pub.publish("n1", status(peers=5).to_json(), None)
    # An hour of the same record every second: one write per heartbeat.
    for second in range(3600):
        clock[0] = MIN_WRITE_GAP + second
        with contextlib.suppress(StatusDeferred):
            pub.publish("n1", status(peers=5).to_json(), None)
    assert len(pub.written) == 2 + int(3599 // HEARTBEAT_SECONDS)
    assert all(len(text.encode()) <= MAX_SUMMARY_BYTES for _, text in pub.written)


# --- the cordon ------------------------------------------------------------------------


def node(
    unschedulable: bool = False, label: bool = False, mark: str | None = None
) -> dict[str, Any]:
    meta: dict[str, Any] = {
        "name": "n1",
        "labels": {"kubernetes.io/os": "linux"},
        "annotations": {},
    }
    if label:
        meta["labels"][EXCLUDE_LABEL] = "true"
    if mark is not None:
        meta["annotations"][CORDON_ANNOTATION] = mark
    return {"metadata": meta, "spec": {"unschedulable": True} if unschedulable else {}}


def test_cordon_takes_the_node_out_and_uncordon_puts_back_exactly_that() -> None:
    fresh = node()
    patch = cordon_patch(fresh, "r1")
    assert patch is not None
    out = json_merge(fresh, patch)
    assert is_cordoned(out) and mark_of(out) is not None
    assert cordon_patch(out, "r1") is None and cordon_patch(out, "r2") is None  # once only
    back = uncordon_patch(out)
    assert back is not None
    assert json_merge(out, back) == fresh
    assert uncordon_patch(fresh) is None


@pytest.mark.parametrize(("unschedulable", "label"), [(True, False), (False, True), (True, True)])
def test_what_an_operator_had_set_stays_set(unschedulable: bool, label: bool) -> None:
    before = node(unschedulable, label)
    patch = cordon_patch(before, "r1")
    assert patch is not None
    out = json_merge(before, patch)
    assert is_cordoned(out)
    back = uncordon_patch(out)
    assert back is not None
    assert json_merge(out, back) == before


def test_a_mark_someone_else_wrote_is_refused_and_not_undone() -> None:
    for raw in ("{", '{"Rollout": "r"}', "[]"):
        with pytest.raises(ValueError, match="remove it by hand"):
            cordon_patch(node(mark=raw), "r1")
        with pytest.raises(ValueError, match="remove it by hand"):
            uncordon_patch(node(mark=raw))


# --- the driver's cordon steps -----------------------------------------------------------


class CordonLog(RolloutStore):
    """The etcd adapter, with the cordon recorded among the override and record writes."""

    def __init__(self, env: Env, log: list[tuple[str, str]]) -> None:
        super().__init__(env.store, env.rs.prefix)
        self.log = log
        self.out: set[str] = set()

    def cordon(self, node: str, rollout: str) -> bool:
        if node in self.out:
            return False
        self.out.add(node)
        self.log.append(("cordon", node))
        return True

    def uncordon(self, node: str) -> bool:
        if node not in self.out:
            return False
        self.out.discard(node)
        self.log.append(("uncordon", node))
        return True

    def write_override(self, node: str, override: NodeOverride) -> None:
        self.log.append(("override", node))
        super().write_override(node, override)

    def put_record(self, record: RolloutRecord, mod_revision: int) -> int | None:
        for e in record.nodes:
            if e.state in ("done", "rolled-back") and ("done", e.node) not in self.log:
                self.log.append(("done", e.node))
        return super().put_record(record, mod_revision)


def test_each_node_is_out_from_before_its_override_until_it_is_verified() -> None:
    env = Env()
    log: list[tuple[str, str]] = []
    env.rs = CordonLog(env, log)
    record = env.start()
    done = env.drive(record.id)
    assert done.state == "done" and done.cordon
    nodes = ["n1", "n2", "n3", "n4", "n5"]
    expected = [
        step
        for n in nodes
        for step in (("cordon", n), ("override", n), ("uncordon", n), ("done", n))
    ]
    assert log == expected  # one node out at a time
    assert any(
        line.endswith("n1: cordoned (unschedulable, out of external load balancers)")
        for line in env.lines
    )


def test_a_node_rolled_back_is_returned_after_its_rollback() -> None:
    env = Env()
    env.sim.node("n2").ignore_type = "host-gw"
    log: list[tuple[str, str]] = []
    env.rs = CordonLog(env, log)
    record = env.start(timeout=20)
    failed = env.drive(record.id)
    assert failed.state == "failed"
    n2 = [step for step in log if step[1] == "n2"]
    assert n2 == [
        ("cordon", "n2"),
        ("override", "n2"),
        ("override", "n2"),
        ("uncordon", "n2"),
        ("done", "n2"),
    ]
    assert not env.rs.out  # type: ignore[attr-defined]


def test_no_cordon_is_kept_in_the_record() -> None:
    env = Env()
    log: list[tuple[str, str]] = []
    env.rs = CordonLog(env, log)
    from flannelpy.rollout.driver import make_plan, start

    plan = make_plan(env.rs, "host-gw", env.clocks.wall)
    record = start(env.rs, plan, env.clocks.wall, 30.0, None, cordon=False)
    assert RolloutRecord.from_json(record.to_json()).cordon is False
    assert env.drive(record.id).state == "done"
    assert [s for s in log if s[0] in ("cordon", "uncordon")] == []


class FakeLeases(FakeApi):
    """The publisher's two calls on coordination.k8s.io Leases, with a Lease store."""

    PREFIX = "/apis/coordination.k8s.io/v1/namespaces/kube-flannelpy/leases"

    def __init__(self, status: int = 0) -> None:
        super().__init__()
        self.leases: dict[str, dict[str, Any]] = {}
        self.status = status  # answer every call with this HTTP error

    def handle(
        self, method: str, path: str, query: dict[str, str], body: Any, content_type: str | None
    ) -> tuple[int, Any]:
        if self.status:
            return self.status, "leases is forbidden"
        if method == "PATCH":
            assert content_type == "application/merge-patch+json"
            name = path.removeprefix(self.PREFIX + "/")
            if name not in self.leases:
                return 404, f"leases {name!r} not found"
        else:
            assert method == "POST" and path == self.PREFIX
        self.leases[body["metadata"]["name"]] = body
        return 200, body


def test_the_first_write_creates_the_lease_and_later_ones_patch_it() -> None:
    clock = [0.0]
    fake = FakeLeases()
    pub = LeasePublisher(fake, "kube-flannelpy", monotonic=lambda: clock[0])
    pub.publish("n1", status().to_json(), {"Type": "vxlan"})
    lease = fake.leases["n1"]
    assert lease["metadata"]["namespace"] == "kube-flannelpy"
    assert lease["spec"]["holderIdentity"] == "n1"
    raw, backend = decode_summary(lease["metadata"]["annotations"][STATUS_ANNOTATION])
    assert NodeStatus.from_json(raw) == status() and backend == {"Type": "vxlan"}
    clock[0] = MIN_WRITE_GAP
    pub.publish("n1", status(peers=7).to_json(), None)
    assert pub.writes == 2


def test_a_forbidden_write_names_the_permission_once_and_is_retried_slowly(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from flannelpy.errors import StoreError

    clock = [0.0]
    fake = FakeLeases(status=403)
    pub = LeasePublisher(fake, "kube-flannelpy", monotonic=lambda: clock[0])

    def ticks(start: float, count: int) -> int:
        """A new record every 6 s; how many writes the API server refused."""
        refused = 0
        for i in range(count):
            clock[0] = start + 6.0 * i
            try:
                pub.publish("n1", status(peers=i).to_json(), None)
            except StatusDeferred:
                continue
            except StoreError as e:
                refused += 1
                assert "leases.coordination.k8s.io: create,patch" in str(e)
        return refused

    def warnings() -> list[str]:
        return [
            r.getMessage()
            for r in caplog.records
            if r.levelname == "WARNING" and "status Lease" in r.getMessage()
        ]

    assert ticks(0.0, 31) == 4  # at 0, 60, 120 and 180 s: not every tick
    assert warnings() == [
        "status Lease not written: the ServiceAccount may not patch "
        "leases.coordination.k8s.io in namespace kube-flannelpy; bind it to a Role there "
        "granting create and patch on leases (the Role flannelpy of "
        "manifests/kube-flannelpy.yml); the agent runs on without its status record and "
        "retries every 60 s"
    ]
    fake.status = 0  # the operator applies the Role: the next retry writes
    assert ticks(240.0, 1) == 0 and pub.writes == 1 and "n1" in fake.leases
    fake.status = 403  # revoked again later: said again, once
    assert ticks(300.0, 20) == 2 and len(warnings()) == 2
