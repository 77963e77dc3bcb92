"""The Kubernetes rollout store over a fake API server: the record's compare-and-swap,
overrides as annotations, the cordon, the last step's wait; and how it reads the Nodes and
status Leases: listed once, then watched (events, bookmarks, 410 Gone, a broken watch, a
Node removed during a step), never listed again while the watch serves."""

from __future__ import annotations

import json
from typing import Any

import pytest

from flannelpy.control.policy import ALLOW
from flannelpy.control.records import NodeOverride
from flannelpy.rollout.cordon import is_cordoned
from flannelpy.rollout.steps import Fail, RollBack, Wait, next_action, record_after
from flannelpy.store.kube.node_status import STATUS_ANNOTATION, encode_summary
from tests.support.kube_fake_client import FakeApi
from tests.support.kube_lists import FakeKind
from tests.support.kube_standin import json_merge
from tests.unit.test_kube_rollout import status
from tests.unit.test_rollout import MONDAY_1AM, Env, first_write


class FakeCore(FakeApi):
    """The API calls KubeRolloutStore makes: ConfigMaps and Nodes with resourceVersions,
    merge patches with a resourceVersion precondition."""

    def __init__(self) -> None:
        super().__init__()
        self.rv = 10
        self.config_maps: dict[str, dict[str, Any]] = {}
        self.node_kind = FakeKind("nodes")
        self.lease_kind = FakeKind("leases")

    @property
    def nodes(self) -> dict[str, dict[str, Any]]:
        return self.node_kind.objects

    def add_node(self, name: str) -> None:
        node = self._bump({"metadata": {"name": name, "annotations": {}}, "spec": {}})
        self.node_kind.commit("ADDED", node)

    def set_lease(self, name: str, config_backend: dict[str, Any] | None = None) -> None:
        """The agent of ``name`` writes its status Lease."""
        text = encode_summary(status(name).to_json(), config_backend)
        meta = {"name": name, "annotations": {STATUS_ANNOTATION: text}}
        kind = "MODIFIED" if name in self.lease_kind.objects else "ADDED"
        self.lease_kind.commit(kind, self._bump({"metadata": meta}))

    def _bump(self, obj: dict[str, Any]) -> dict[str, Any]:
        self.rv += 1
        obj.setdefault("metadata", {})["resourceVersion"] = str(self.rv)
        return obj

    def _patch(self, obj: dict[str, Any], patch: dict[str, Any]) -> tuple[int, Any]:
        want = (patch.get("metadata") or {}).get("resourceVersion")
        if want is not None and want != obj["metadata"]["resourceVersion"]:
            return 409, "the object has been modified"
        patch = json.loads(json.dumps(patch))
        patch.get("metadata", {}).pop("resourceVersion", None)
        obj.update(json_merge(obj, patch))
        self._bump(obj)
        return 200, obj

    def handle(
        self, method: str, path: str, query: dict[str, str], body: Any, content_type: str | None
    ) -> tuple[int, Any]:
        parts = path.strip("/").split("/")
        if parts[:3] == ["api", "v1", "namespaces"] and parts[4] == "configmaps":
            return self._config_map(method, parts[5] if len(parts) > 5 else None, body)
        if parts[:3] == ["api", "v1", "nodes"] and len(parts) == 4:
            name = parts[3]
            if name not in self.nodes:
                return 404, f"nodes {name!r} not found"
            if method == "GET":
                return 200, self.nodes[name]
            assert method == "PATCH" and content_type == "application/merge-patch+json"
            status, doc = self._patch(self.nodes[name], body)
            if status == 200:
                self.node_kind.commit("MODIFIED", self.nodes[name])
            return status, doc
        return 404, f"no fake for {method} {path}"

    def _config_map(self, method: str, name: str | None, body: Any) -> tuple[int, Any]:
        if method == "POST":
            name = body["metadata"]["name"]
            if name in self.config_maps:
                return 409, "already exists"
            self.config_maps[name] = self._bump(body)
            return 201, self.config_maps[name]
        assert name is not None
        if name not in self.config_maps:
            return 404, f"configmaps {name!r} not found"
        cm = self.config_maps[name]
        if method == "GET":
            return 200, cm
        if method == "PUT":
            if body["metadata"].get("resourceVersion") != cm["metadata"]["resourceVersion"]:
                return 409, "the object has been modified"
            self.config_maps[name] = self._bump(body)
            return 200, self.config_maps[name]
        assert method == "PATCH"
        return self._patch(cm, body)


def kube_store(leases: dict[str, Any]) -> tuple[Any, FakeCore]:
    """The store over FakeCore, n1 and n2 with their Leases (``leases``: the Backend each
    one's net-conf.json holds)."""
    from flannelpy.store import rollout_kube as ks

    core = FakeCore()
    core.config_maps["kube-flannelpy-cfg"] = core._bump(
        {
            "metadata": {"name": "kube-flannelpy-cfg"},
            "data": {"net-conf.json": '{"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan"}}'},
        }
    )
    for name in ("n1", "n2"):
        core.add_node(name)
        core.set_lease(name, leases.get(name))
    clock = [0.0]
    store = ks.KubeRolloutStore(
        core,
        "flannel.alpha.coreos.com",
        sleep=lambda s: clock.__setitem__(0, clock[0] + s),
        monotonic=lambda: clock[0],
        resources=(core.node_kind.resource, core.lease_kind.resource),
    )
    return store, core


@pytest.fixture
def stores() -> Any:
    """Makes stores (as kube_store) and stops their watches after the test."""
    made: list[Any] = []

    def make(leases: dict[str, Any] | None = None) -> tuple[Any, FakeCore]:
        store, core = kube_store(leases or {})
        made.append(store)
        return store, core

    yield make
    for store in made:
        store.close()


def test_the_record_is_compare_and_swapped_in_its_config_map(stores: Any) -> None:
    store, _ = stores()
    assert store.read_record() == (None, 0)
    env = Env()
    record = env.start()
    first = store.put_record(record, 0)
    assert first and store.put_record(record, 0) is None  # created meanwhile: lost the race
    again, revision = store.read_record()
    assert again == record and revision == first
    assert store.put_record(record, revision) is not None
    assert store.put_record(record, revision) is None  # a stale revision loses


def test_overrides_are_node_annotations_removed_only_at_their_generation(stores: Any) -> None:
    store, core = stores()
    store.write_override("n1", NodeOverride({"Type": "host-gw"}, 3, rollout="r1"))
    snap = store.read_nodes()
    assert snap.overrides["n1"] == NodeOverride({"Type": "host-gw"}, 3, rollout="r1")
    assert set(snap.statuses) == {"n1", "n2"}
    assert store.delete_override("n1", generation=2) is False
    assert store.delete_override("n1", generation=3) is True
    assert "flannelpy.io/override" not in core.nodes["n1"]["metadata"]["annotations"]
    assert store.delete_override("n1") is False


def test_the_cordon_round_trip_through_the_store(stores: Any) -> None:
    store, core = stores()
    before = json.loads(json.dumps(core.nodes["n2"]))
    assert store.cordon("n2", "r1") is True and store.cordon("n2", "r1") is False
    assert is_cordoned(core.nodes["n2"])
    assert store.uncordon("n2") is True and store.uncordon("n2") is False
    after = core.nodes["n2"]
    assert after["spec"] == before["spec"]
    assert after["metadata"]["annotations"] == {} and not after["metadata"].get("labels")


def test_the_last_step_waits_until_every_agent_reads_the_new_config(stores: Any) -> None:
    from flannelpy.errors import StoreError

    target = {"Type": "host-gw", "DirectRouting": False}
    leases: dict[str, Any] = {"n1": target, "n2": {"Type": "vxlan"}}
    store, core = stores(leases)
    with pytest.raises(StoreError, match=r"n2 still reads the old net-conf.json 180 s after"):
        store.write_config_backend(target)
    written = json.loads(core.config_maps["kube-flannelpy-cfg"]["data"]["net-conf.json"])
    assert written == {"Network": "10.244.0.0/16", "Backend": target}
    core.set_lease("n2", target)
    core.lease_kind.settled()
    assert store.write_config_backend(target).backend.type == "host-gw"  # a resumed step


# --- the Nodes and Leases: listed once, then watched --------------------------------------


def test_the_nodes_and_leases_are_listed_once_then_every_look_reads_the_watch(
    stores: Any,
) -> None:
    store, core = stores()
    listed = (str(core.node_kind.rv), str(core.lease_kind.rv))
    for _ in range(100):
        snap = store.read_nodes()
    assert set(snap.statuses) == {"n1", "n2"} and snap.overrides == {}
    core.add_node("n3")
    core.set_lease("n3")
    override = NodeOverride({"Type": "host-gw"}, 4, rollout="r1").to_json()
    core.nodes["n1"]["metadata"]["annotations"]["flannelpy.io/override"] = override
    core.node_kind.commit("MODIFIED", core._bump(core.nodes["n1"]))
    core.node_kind.settled()
    core.lease_kind.settled()
    snap = store.read_nodes()
    assert set(snap.statuses) == {"n1", "n2", "n3"}
    assert snap.overrides["n1"].generation == 4
    assert (core.node_kind.lists, core.lease_kind.lists) == (1, 1)
    assert (core.node_kind.watched_from, core.lease_kind.watched_from) == ([listed[0]], [listed[1]])


def test_a_node_removed_during_a_step_leaves_the_snapshot_as_a_list_would(stores: Any) -> None:
    store, core = stores()
    store.write_override("n2", NodeOverride({"Type": "host-gw"}, 3, rollout="r1"))
    assert store.read_nodes().overrides["n2"].generation == 3
    core.node_kind.commit("DELETED", core._bump(core.nodes["n2"]))
    core.node_kind.settled()
    snap = store.read_nodes()
    # Its Lease outlives it: not a node to roll out, as a fresh list shows it.
    assert set(snap.statuses) == {"n1"} and "n2" not in snap.overrides
    assert snap.present == {"n1"}
    assert core.node_kind.lists == 1


def test_the_driver_writes_nothing_to_a_node_removed_during_its_step() -> None:
    env = Env()
    _, write, applying = first_write(env)
    snap = env.rs.read_nodes()
    others = frozenset(snap.statuses) - {"n1"}
    statuses = {n: s for n, s in snap.statuses.items() if n != "n1"}

    def decide(elapsed: float, present: frozenset[str]) -> Any:
        return next_action(applying, statuses, ALLOW, MONDAY_1AM, elapsed, {}, 1.0, present)

    # Not re-written (a 404) while its Node is gone, and not rolled back either.
    waiting = decide(5.0, others)
    assert isinstance(waiting, Wait) and "n1: its Node was removed" in waiting.what
    assert decide(31.0, others) == Fail(
        "n1 was removed from the cluster during its step and did not come back within 30 s; "
        "start a new rollout for the other nodes"
    )
    # Registered again (its kubelet), without the override: the same generation again.
    assert decide(5.0, others | {"n1"}) == write
    rolling_back = record_after(applying, RollBack("n1", {"Type": "vxlan"}, 2, "x"), MONDAY_1AM)
    gone = next_action(rolling_back, statuses, ALLOW, MONDAY_1AM, 5.0, {}, 1.0, others)
    assert isinstance(gone, Wait) and "its Node was removed" in gone.what


def test_a_bookmark_moves_the_watch_on_and_a_broken_watch_resumes_from_it(stores: Any) -> None:
    store, core = stores()
    store.read_nodes()
    listed = str(core.node_kind.rv)
    core.rv += 50  # other kinds changed meanwhile: only a bookmark tells this watch
    mark = {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": str(core.rv)}}}
    core.node_kind.send(mark, core.rv)
    core.node_kind.settled()
    core.node_kind.break_watch()
    core.add_node("n3")
    core.set_lease("n3")
    core.node_kind.settled()
    core.lease_kind.settled()
    assert set(store.read_nodes().statuses) == {"n1", "n2", "n3"}
    assert core.node_kind.watched_from == [listed, str(core.rv - 2)]  # from the bookmark
    assert core.node_kind.lists == 1


def test_410_gone_lists_again_and_the_new_list_replaces_the_mirror(stores: Any) -> None:
    store, core = stores()
    store.read_nodes()
    listed = str(core.node_kind.rv)
    del core.nodes["n2"]  # deleted while the watch was down, its event compacted away
    core.node_kind.rv = core.rv = core.rv + 1
    core.node_kind.compact()
    core.node_kind.break_watch()
    core.node_kind.settled()
    assert set(store.read_nodes().statuses) == {"n1"}
    assert core.node_kind.lists == 2
    assert core.node_kind.watched_from == [listed, listed, str(core.rv)]


def test_while_the_watch_is_down_a_look_raises_unavailable_not_stale_data(stores: Any) -> None:
    from flannelpy.errors import StoreUnavailable
    from tests.support.waiting import wait_until

    store, core = stores()
    store.read_nodes()
    core.lease_kind.unreachable = True
    core.lease_kind.break_watch()

    def refused() -> bool:
        try:
            store.read_nodes()
        except StoreUnavailable as e:
            return "the leases watch is down" in str(e) and "cannot reach" in str(e)
        return False

    wait_until(refused, 5.0, "a look while the watch is down")
    core.lease_kind.unreachable = False
    core.set_lease("n1", {"Type": "host-gw"})
    core.lease_kind.settled()
    snap = store.read_nodes()
    assert set(snap.statuses) == {"n1", "n2"}
    assert store.summaries["n1"].config_backend == {"Type": "host-gw"}
    assert core.lease_kind.lists == 1  # resumed from its resourceVersion


def test_a_look_after_a_write_reads_the_write_before_the_watch_brings_it(stores: Any) -> None:
    store, core = stores()
    store.read_nodes()
    core.node_kind.held = True
    store.write_override("n1", NodeOverride({"Type": "host-gw"}, 5, rollout="r1"))
    assert store.read_nodes().overrides["n1"].generation == 5
    assert store.cordon("n1", "r1") is True
    assert store.read_nodes().overrides["n1"].generation == 5
    core.node_kind.held = False  # the older events come now: they do not undo the writes
    core.node_kind.settled()
    node = store._nodes.objects()["n1"]
    assert is_cordoned(node) and node == core.nodes["n1"]


def test_the_mirror_keeps_the_latest_version_of_each_object_and_nothing_nameless() -> None:
    from flannelpy.store.kube.mirror import ObjectMirror

    def obj(name: str, rv: str, mark: str = "") -> dict[str, Any]:
        return {"metadata": {"name": name, "resourceVersion": rv, "labels": {"m": mark}}}

    mirror = ObjectMirror()
    mirror.replace_all("nodes", [obj("a", "5"), {"metadata": {}}, "junk", obj("b", "6")])
    assert sorted(mirror.objects()) == ["a", "b"] and mirror.listed
    held = mirror.objects()
    assert mirror.put("nodes", obj("a", "9", "written"))  # a write's answer
    assert not mirror.put("nodes", obj("a", "7", "older event"))  # the watch, behind it
    assert mirror.objects()["a"]["metadata"]["labels"] == {"m": "written"}
    assert held["a"]["metadata"]["resourceVersion"] == "5"  # a snapshot handed out stays
    assert mirror.put("nodes", obj("a", "9", "the same version from the watch"))
    assert mirror.delete("nodes", obj("b", "10")) and not mirror.delete("nodes", obj("b", "11"))
    assert not mirror.put("nodes", {"metadata": {"resourceVersion": "12"}})
    assert sorted(mirror.objects()) == ["a"]
