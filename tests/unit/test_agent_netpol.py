"""NetworkPolicy through the agent: the store's policy inputs reach the kernel's table
only through the writer (one coalesced event) and the reconciler (one nft transaction),
never before the first full sync, and refusals are counted."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from flannelpy.agent.events import PolicyInputsChanged
from flannelpy.dataplane.policy_table import PolicyTable
from flannelpy.dataplane.reconciler import BRIDGE_NF_SYSCTLS
from flannelpy.netpol.nft import TABLE
from flannelpy.store.policy_inputs import NAMESPACES, PODS, POLICIES, PolicyCache, PolicySnapshot
from tests.support.agent_fakes import NODE, AgentHarness
from tests.support.fake_nft import FakeNft
from tests.support.fakes import FakeKernel
from tests.support.waiting import wait_until


def raw_pod(name: str, app: str, ip: str, node: str = NODE) -> dict[str, Any]:
    return {
        "metadata": {"namespace": "shop", "name": name, "labels": {"app": app}},
        "spec": {"nodeName": node},
        "status": {"podIP": ip, "phase": "Running"},
    }


DB_ONLY_FROM_API: dict[str, Any] = {
    "metadata": {"namespace": "shop", "name": "db"},
    "spec": {
        "podSelector": {"matchLabels": {"app": "db"}},
        "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "api"}}}]}],
    },
}
SHOP = {"metadata": {"name": "shop"}}


class FakePolicySource:
    """The store's cache, fed by the test instead of watches."""

    def __init__(self, on_refused: Callable[[str], None]) -> None:
        self.cache = PolicyCache(on_refused)
        self.on_change: Callable[[], None] | None = None
        self.watching = threading.Event()

    def snapshot(self) -> PolicySnapshot:
        return self.cache.snapshot()

    def watch(self, on_change: Callable[[], None], stop: threading.Event) -> None:
        self.on_change = on_change
        self.watching.set()
        stop.wait()

    def changed(self) -> None:
        assert self.watching.wait(5.0) and self.on_change is not None
        self.on_change()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[tuple[AgentHarness, FakePolicySource, FakeNft]]:
    nft = FakeNft()
    nft.table = ["add rule left by the previous run"]
    holder: list[AgentHarness] = []
    source = FakePolicySource(lambda kind: holder[0].agent.metrics.policy_refused(kind))
    harness = AgentHarness(
        tmp_path, kernel=FakeKernel(), policy_source=source, policy_table=PolicyTable(run=nft)
    )
    holder.append(harness)
    harness.start()
    # The control watch's first snapshot, so that the queue holds only what tests put.
    wait_until(
        lambda: harness.drain() or harness.writer.counts.events()["control"], 10.0, "control"
    )
    source.watching.wait(5.0)
    try:
        yield harness, source, nft
    finally:
        harness.stop()


def sync(source: FakePolicySource, *pods: dict[str, Any]) -> None:
    source.cache.replace_all(POLICIES, [DB_ONLY_FROM_API])
    source.cache.replace_all(NAMESPACES, [SHOP])
    source.cache.replace_all(PODS, list(pods))
    source.changed()


def test_nothing_is_written_before_the_first_full_sync(agent: Any) -> None:
    harness, source, nft = agent
    source.cache.replace_all(POLICIES, [DB_ONLY_FROM_API])  # pods and namespaces not yet
    source.changed()
    assert harness.drain() == 1
    harness.reconcile()
    assert nft.scripts == []
    assert nft.table == ["add rule left by the previous run"]  # the kernel's table is kept
    assert harness.writer.state.policy is None
    assert harness.status()["network_policy"]["synced"] is False


def test_a_policy_event_leads_to_exactly_one_nft_transaction(agent: Any) -> None:
    harness, source, nft = agent
    sync(source, raw_pod("db", "db", "10.244.1.3"), raw_pod("api", "api", "10.244.2.2", "n2"))
    assert harness.drain() == 1
    harness.reconcile()
    (replace,) = nft.scripts  # the previous run's table replaced whole, atomically
    assert replace.startswith(f"add table inet {TABLE}\ndelete table inet {TABLE}\n")
    assert "10.244.2.2" in replace and "10.244.1.3 : jump pod_" in replace
    assert all(harness.kernel.sysctls.get(name) == "1" for name in BRIDGE_NF_SYSCTLS)
    # A new peer pod: one event, one transaction adding one element, nothing else.
    assert source.cache.put(PODS, raw_pod("api2", "api", "10.244.2.9", "n2"))
    source.changed()
    assert harness.drain() == 1
    harness.reconcile()
    harness.reconcile()
    assert len(nft.scripts) == 2
    assert nft.scripts[1].splitlines() == [
        line for line in nft.scripts[1].splitlines() if line.startswith("add element")
    ]
    assert "10.244.2.9" in nft.scripts[1]
    assert harness.writer.counts.events()["policy"] == 2


def test_a_policy_change_hands_over_the_last_plan_without_planning_the_peers_again(
    agent: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    harness, source, nft = agent
    sync(source, raw_pod("db", "db", "10.244.1.3"))
    harness.drain()
    harness.reconcile()
    planner = harness.writer.planner
    before = harness.writer.reconciler.desired
    plans: list[object] = []
    monkeypatch.setattr(planner, "check_peers", lambda: plans.append("peers"))
    assert source.cache.put(PODS, raw_pod("api", "api", "10.244.2.2", "n2"))
    source.changed()
    assert harness.drain() == 1
    harness.reconcile()
    assert plans == []  # no lease was looked at again
    after = harness.writer.reconciler.desired
    assert after is not None and before is not None
    assert after.policy is harness.writer.state.policy and after.policy != before.policy
    assert (after.routes, after.neighbours, after.fdb) == (
        before.routes,
        before.neighbours,
        before.fdb,
    )
    assert "10.244.2.2" in nft.scripts[-1]


def test_a_burst_of_changes_is_one_event(agent: Any) -> None:
    harness, source, _ = agent
    sync(source, raw_pod("db", "db", "10.244.1.3"))
    for i in range(20):
        source.cache.put(PODS, raw_pod(f"api{i}", "api", f"10.244.2.{i + 2}", "n2"))
        source.changed()
    queued = [harness.writer.queue.get_nowait() for _ in range(harness.writer.queue.qsize())]
    assert [type(e) for e in queued] == [PolicyInputsChanged]


def test_a_refused_edit_is_counted_once_and_keeps_the_enforced_version(agent: Any) -> None:
    harness, source, nft = agent
    sync(source, raw_pod("db", "db", "10.244.1.3"), raw_pod("api", "api", "10.244.2.2", "n2"))
    harness.drain()
    harness.reconcile()
    broken = {**DB_ONLY_FROM_API, "spec": {**DB_ONLY_FROM_API["spec"], "podSelector": None}}
    # The first refusal makes a new snapshot due (the refusals are reported); the same
    # refusal again does not, and is said and counted once.
    assert [source.cache.put(POLICIES, broken) for _ in range(3)] == [True, False, False]
    source.changed()
    harness.drain()
    harness.reconcile()
    assert len(nft.scripts) == 1  # the db pod stays isolated by the accepted version
    text = harness.agent.metrics.exposition().decode()
    assert 'flannelpy_policy_refused_objects_total{kind="networkpolicy"} 1.0' in text
    assert source.snapshot().refused == (
        "NetworkPolicy shop/db is refused: spec.podSelector is missing; use {} to select every pod",
    )


def test_a_table_deleted_by_hand_is_back_after_the_next_pass(agent: Any) -> None:
    harness, source, nft = agent
    sync(source, raw_pod("db", "db", "10.244.1.3"))
    harness.drain()
    harness.reconcile()
    written = nft.table
    nft.delete_table()
    harness.reconcile()
    assert nft.table == written
    assert harness.writer.reconciler.policy_rebuilds == 2  # at start, and the repair


def test_metrics_show_the_denials_by_policy_and_the_size_of_the_table(agent: Any) -> None:
    harness, source, nft = agent
    sync(source, raw_pod("db", "db", "10.244.1.3"), raw_pod("api", "api", "10.244.2.2", "n2"))
    harness.drain()
    harness.reconcile()
    (counter,) = nft.counters()  # db isolated for ingress by the one policy "db"
    nft.packets[counter] = 7
    text = harness.agent.metrics.exposition().decode()
    assert (
        'flannelpy_policy_denied_packets_total{direction="ingress",namespace="shop",policy="db"}'
        " 7.0" in text
    )
    assert "flannelpy_policy_policies 1.0" in text
    assert "flannelpy_policy_selected_pods 1.0" in text
    # The peer set holds api's address; the ingress map holds db's.
    assert "flannelpy_policy_set_elements 2.0" in text


def cni(command: str, name: str, container: str, ip: str = "") -> tuple[Any, ...]:
    env = {
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": container,
        "CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME={name}",
    }
    result = {"cniVersion": "1.0.0", "ips": [{"address": f"{ip}/24"}] if ip else []}
    return env, b"{}", None, json.dumps(result).encode()


def test_a_pod_attached_before_its_pod_object_is_read_is_denied_until_it_is(agent: Any) -> None:
    harness, source, nft = agent
    sync(source, raw_pod("db", "db", "10.244.1.3"), raw_pod("api", "api", "10.244.2.2", "n2"))
    harness.drain()
    harness.reconcile()
    netpol = harness.writer.netpol
    netpol.on_cni(*cni("ADD", "late", "c-late", "10.244.1.9"))  # the watch has not seen it
    assert harness.drain() == 1
    harness.reconcile()
    assert "10.244.1.9 : jump pod_" in nft.scripts[-1]  # in both maps: denied both ways
    assert nft.scripts[-1].count("10.244.1.9") == 2
    # Its Pod object arrives with the address: no policy selects "web", it is let go.
    source.cache.put(PODS, raw_pod("late", "web", "10.244.1.9"))
    source.changed()
    harness.drain()
    harness.reconcile()
    assert "delete element" in nft.scripts[-1] and "10.244.1.9" in nft.scripts[-1]
    assert harness.writer.state.policy is not None
    assert all("10.244.1.9" not in str(s.elements) for s in netpol.table.sets.values())


def test_an_attached_pod_of_a_namespace_without_policies_is_left_open(agent: Any) -> None:
    harness, source, nft = agent
    sync(source, raw_pod("db", "db", "10.244.1.3"))
    harness.drain()
    harness.reconcile()
    written = len(nft.scripts)
    env, stdin, fd, result = cni("ADD", "x", "c-x", "10.244.1.7")
    env["CNI_ARGS"] = "K8S_POD_NAMESPACE=other;K8S_POD_NAME=x"
    harness.writer.netpol.on_cni(env, stdin, fd, result)
    harness.drain()
    harness.reconcile()
    assert len(nft.scripts) == written  # nothing to write: no policy in "other"
    # And a DEL of an older sandbox of a pod keeps the newer one's addresses denied.
    netpol = harness.writer.netpol
    netpol.on_cni(*cni("ADD", "late", "c-new", "10.244.1.9"))
    netpol.on_cni(*cni("DEL", "late", "c-old"))
    harness.drain()
    harness.reconcile()
    assert "10.244.1.9" in nft.scripts[-1]
    netpol.on_cni(*cni("DEL", "late", "c-new"))
    harness.drain()
    harness.reconcile()
    assert nft.scripts[-1].startswith(f"delete element inet {TABLE} ")
