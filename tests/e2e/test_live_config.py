"""Issue 6 on real agents: live config changes under the disruption policy.

One 3-node vxlan lab with pods. Changes are written straight into etcd, the
way an operator's script (or a mistake) would, and each test reads what the
agents did: their routes, leases, status records, metrics and logs.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from flannelpy_lab import Lab

from flannelpy.control.records import ForceRecord, NodeOverride, NodeStatus
from flannelpy.store.etcd.client import EtcdStore
from flannelpy.subnet.keys import override_key, status_key
from tests.e2e.test_observability import scrape
from tests.support.lab_util import lab_run_argv, running_lab, wait_until

pytestmark = [
    pytest.mark.lab,
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to build the netns lab"),
]

PREFIX = "/coreos.com/network"
NODES = ("n1", "n2", "n3")


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with running_lab(3, "vxlan", pods_per_node=1) as lab:
        yield lab


@pytest.fixture()
def store(lab: Lab) -> Iterator[EtcdStore]:
    store = EtcdStore([lab.etcd_endpoint])
    yield store
    # Every test starts from the same cluster: vxlan everywhere, no overrides, Allow.
    for node in NODES:
        kv = store.get(override_key(PREFIX, node))
        if kv is not None:
            store.delete_if_mod_revision(kv.key, kv.mod_revision)
    write_config(store, {"Type": "vxlan"})
    for node in NODES:
        wait_until(lambda n=node: backend_of(store, n) == "vxlan", 20, what=f"{node} on vxlan")
    store.close()


def write_config(store: EtcdStore, backend: dict[str, Any], policy: Any = None) -> None:
    doc: dict[str, Any] = {"Network": "10.244.0.0/16", "Backend": backend}
    if policy is not None:
        doc["DisruptionPolicy"] = policy
    store.put(f"{PREFIX}/config", json.dumps(doc).encode())


def node_status(store: EtcdStore, node: str) -> NodeStatus | None:
    kv = store.get(status_key(PREFIX, node))
    return NodeStatus.from_json(kv.value) if kv else None


def backend_of(store: EtcdStore, node: str) -> str | None:
    status = node_status(store, node)
    return status.backend.type if status else None


def lease_types(store: EtcdStore) -> dict[str, str]:
    items, _ = store.get_prefix(f"{PREFIX}/subnets/")
    docs = [json.loads(kv.value) for kv in items]
    return {d["Flannelpy"]["NodeName"]: d["BackendType"] for d in docs}


def routes(lab: Lab, node: str) -> dict[str, str]:
    out = lab.exec(node, ["ip", "-j", "route", "show", "proto", "75"]).stdout
    return {r["dst"]: r["dev"] for r in json.loads(out or "[]")}


def all_pods_reach_each_other(lab: Lab) -> bool:
    """Every node pair and every pod pair answers a ping (``lab status``'s matrices)."""
    doc = lab.status()
    return bool(doc["ok"] and doc["pod_matrix"])


def blocked_count(lab: Lab, node: str) -> float:
    _, samples = scrape(lab, node)
    key = ("flannelpy_blocked_operations_total", frozenset({("kind", "backend_change")}))
    return samples.get(key, 0.0)


def test_block_keeps_every_node_on_its_config_and_counts_the_attempt(
    lab: Lab, store: EtcdStore
) -> None:
    write_config(store, {"Type": "vxlan"}, {"Mode": "Block"})
    before = {node: blocked_count(lab, node) for node in NODES}
    routes_before = {node: routes(lab, node) for node in NODES}
    # A disruptive change written straight into the store.
    write_config(store, {"Type": "host-gw"}, {"Mode": "Block"})
    for node in NODES:
        status = wait_until(
            lambda n=node: (s := node_status(store, n)) and s.blocked and s,
            20,
            what=f"{node} to report the blocked change",
        )
        assert "Block" in status.blocked.sentence and "vxlan -> host-gw" in status.blocked.change
        assert status.backend.type == "vxlan"
        assert blocked_count(lab, node) == before[node] + 1
    assert lease_types(store) == dict.fromkeys(NODES, "vxlan")
    assert {node: routes(lab, node) for node in NODES} == routes_before
    assert all(dev == "flannel.1" for node in NODES for dev in routes(lab, node).values())
    assert all_pods_reach_each_other(lab)
    # The doctor shows it too, as the policy's sentence.
    doctor = subprocess.run(
        lab_run_argv(lab.name, "doctor", node="n1"), capture_output=True, text=True, timeout=60
    )
    assert "blocked by DisruptionPolicy Block" in doctor.stdout, doctor.stdout + doctor.stderr

    # Changing the policy releases the pending change on every node.
    write_config(store, {"Type": "host-gw"}, {"Mode": "Allow"})
    for node in NODES:
        wait_until(lambda n=node: backend_of(store, n) == "host-gw", 20, what=f"{node} host-gw")
    wait_until(
        lambda: lease_types(store) == dict.fromkeys(NODES, "host-gw"),
        10,
        what="every lease to advertise host-gw",
    )
    # No node needs a VTEP any more: the transition state is gone.
    for node in NODES:
        wait_until(
            lambda n=node: (
                not lab.exec(n, ["ip", "-br", "link", "show", "type", "vxlan"]).stdout.strip()
            ),
            10,
            what=f"{node}'s VTEP to go",
        )
        assert all(dev == "eth0" for dev in routes(lab, node).values())
        assert node_status(store, node).blocked is None  # type: ignore[union-attr]
    assert all_pods_reach_each_other(lab)


def test_forced_override_applies_past_block_and_leaves_a_record(lab: Lab, store: EtcdStore) -> None:
    write_config(store, {"Type": "vxlan"}, {"Mode": "Block"})
    forced = NodeOverride(
        {"Type": "host-gw"},
        generation=1,
        force=ForceRecord(
            "incident 4711: vxlan offload bug on n2", "tester@lab", "2026-11-30T00:00:00Z"
        ),
    )
    store.put(override_key(PREFIX, "n2"), forced.to_json().encode())
    status = wait_until(
        lambda: (s := node_status(store, "n2")) and s.applied_generation == 1 and s,
        20,
        what="n2 to apply the forced override",
    )
    assert status.backend.type == "host-gw" and status.blocked is None
    events, _ = store.get_prefix(f"{PREFIX}/flannelpy/events/")
    records = [json.loads(kv.value) for kv in events]
    assert any(r["Node"] == "n2" and "incident 4711" in r["Reason"] for r in records), records
    with open(lab.node("n2").agent_log, encoding="utf-8") as f:
        assert "forced past the disruption policy" in f.read()
    # Mixed backends keep every pod reaching every pod: n1 and n3 stay on vxlan and
    # reach n2 directly (same segment), n2 keeps its VTEP while they are vxlan.
    assert backend_of(store, "n1") == "vxlan" and backend_of(store, "n3") == "vxlan"
    assert routes(lab, "n1")[str(status.subnets[0])] == "eth0"
    assert node_status(store, "n2").vtep  # type: ignore[union-attr]
    assert all_pods_reach_each_other(lab)


def test_restart_keeps_the_applied_backend_and_gates_what_changed_meanwhile(
    lab: Lab, store: EtcdStore
) -> None:
    write_config(store, {"Type": "vxlan"}, {"Mode": "Block"})
    lab.kill_agent("n3")
    write_config(store, {"Type": "host-gw"}, {"Mode": "Block"})
    lab.start_agent("n3")
    lab.wait_ready("n3")
    status = wait_until(
        lambda: (s := node_status(store, "n3")) and s.blocked and s,
        20,
        what="n3 to block the change made while it was down",
    )
    assert status.backend.type == "vxlan"
    assert lease_types(store)["n3"] == "vxlan"
    assert all_pods_reach_each_other(lab)
