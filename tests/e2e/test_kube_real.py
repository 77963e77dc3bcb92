"""The netns lab in Kubernetes mode against the real control plane (``lab up --kube``).

kube-apiserver with RBAC, kube-controller-manager's node IPAM controller and the real
kubectl, built by scripts/build-kube.sh (flannelpy_lab.kube). The agents authenticate
with the manifests' ServiceAccount, so the ClusterRole and the Role in manifests/ are
what the API server enforces.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from ipaddress import IPv4Interface, IPv4Network
from typing import Any

import pytest
from flannelpy_lab import Lab, plan, procs
from flannelpy_lab import kube as control_plane
from flannelpy_lab.errors import LabError

from flannelpy.store.kube.api import NAMESPACED_RBAC_RULES, RBAC_RULES
from tests.support.lab_util import (
    host_snapshot,
    lab_residue,
    nodes_json,
    running_real_kube_lab,
    unique_lab_name,
    wait_until,
)

pytestmark = [pytest.mark.lab]

PREFIX = "flannel.alpha.coreos.com"
SERVICE_ACCOUNT = f"system:serviceaccount:{control_plane.NAMESPACE}:{control_plane.SERVICE_ACCOUNT}"


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with running_real_kube_lab() as lab:
        yield lab


def test_leases_are_the_pod_cidrs_of_the_node_ipam_controller(lab: Lab) -> None:
    nodes = nodes_json(lab)
    cidrs = {name: IPv4Network(n["spec"]["podCIDR"]) for name, n in nodes.items()}
    assert sorted(cidrs) == ["n1", "n2", "n3"]
    assert len(set(cidrs.values())) == 3
    for node in lab.nodes:
        assert cidrs[node.name].subnet_of(IPv4Network(lab.state.network))
        assert node.overlay_address is not None
        assert IPv4Interface(node.overlay_address).network == cidrs[node.name], node.name
        (pod,) = [p for p in lab.pods if p.node == node.name]
        assert pod.ip in cidrs[node.name]
        # Registered as a kubelet would, and nothing has marked it unreachable.
        status = nodes[node.name]["status"]
        assert {"type": "InternalIP", "address": str(node.ip)} in status["addresses"]
        ready = [c for c in status["conditions"] if c["type"] == "Ready"]
        assert ready and ready[0]["status"] == "True"
        assert not nodes[node.name]["spec"].get("taints")


def test_agents_write_annotations_through_the_service_account(lab: Lab) -> None:
    for name, node in nodes_json(lab).items():
        annotations = node["metadata"]["annotations"]
        assert annotations[f"{PREFIX}/kube-subnet-manager"] == "true"
        assert annotations[f"{PREFIX}/backend-type"] == "vxlan"
        assert annotations[f"{PREFIX}/public-ip"] == str(lab.node(name).ip)
        assert json.loads(annotations[f"{PREFIX}/backend-data"])["VtepMAC"]
        conditions = {c["type"]: c for c in node["status"]["conditions"]}
        assert conditions["NetworkUnavailable"]["status"] == "False"
        assert conditions["NetworkUnavailable"]["reason"] == "FlannelIsUp"
    # The agents' kubeconfig holds the ServiceAccount's token, not the admin's.
    with open(lab.state.extra["kube_kubeconfig"], encoding="utf-8") as f:
        token = json.load(f)["users"][0]["user"]["token"]
    who = lab.kubectl("auth", "whoami", "-o", "json", "--token", token).stdout
    assert json.loads(who)["status"]["userInfo"]["username"] == SERVICE_ACCOUNT


def test_pods_and_nodes_on_different_nodes_reach_each_other(lab: Lab) -> None:
    matrix = lab.status()["pod_matrix"]
    assert len(matrix) == 3
    assert all(ok for row in matrix.values() for ok in row.values()), matrix
    for a in lab.nodes:
        for b in lab.nodes:
            if a.name != b.name:
                assert lab.ping(a.name, b.name, attempts=3), (a.name, b.name)


def can_i(lab: Lab, verb: str, resource: str, namespace: str | None = "default") -> bool:
    """``kubectl auth can-i`` as the agents' ServiceAccount in ``namespace`` (None: in every
    namespace); "nodes/status" is the status subresource (kubectl would read it as the
    Node named "status")."""
    resource, _, sub = resource.partition("/")
    where = ["--subresource", sub] if sub else []
    where += ["-n", namespace] if namespace else ["--all-namespaces"]
    proc = lab.kubectl(
        "auth", "can-i", verb, resource, *where, "--as", SERVICE_ACCOUNT, check=False
    )
    return proc.stdout.strip() == "yes"


def test_service_account_can_do_exactly_what_the_agent_uses(lab: Lab) -> None:
    def can(verb: str, resource: str) -> bool:
        return can_i(lab, verb, resource)

    for group, resource, verbs in RBAC_RULES:
        for verb in verbs:  # kubectl reads a bare "events" as the core group's
            assert can(verb, f"{resource}.{group}" if group else resource), (verb, resource)
    for verb, resource in [
        ("patch", "nodes"),
        ("update", "nodes"),
        ("delete", "nodes"),
        ("update", "nodes/status"),
        ("list", "pods"),
        ("get", "secrets"),
        ("get", "configmaps"),
        ("create", "nodes"),
        ("create", "events"),
        ("delete", "events.events.k8s.io"),
    ]:
        assert not can(verb, resource), (verb, resource)
    # Leases in the agents' namespace only (the Role): not the kubelets' heartbeats in
    # kube-node-lease, nor another namespace's leader elections, nor cluster-wide.
    ours = control_plane.NAMESPACE
    for group, resource, verbs in NAMESPACED_RBAC_RULES:
        name = f"{resource}.{group}"
        for verb in verbs:
            assert can_i(lab, verb, name, ours), (verb, name, ours)
            for elsewhere in ("kube-node-lease", "default", "kube-system"):
                assert not can_i(lab, verb, name, elsewhere), (verb, name, elsewhere)
            assert not can_i(lab, verb, name, None), (verb, name, "every namespace")
        for verb in ("get", "list", "watch", "update", "delete", "deletecollection"):
            assert not can_i(lab, verb, name, ours), (verb, name, ours)


def test_rbac_without_patch_nodes_status_is_forbidden_and_restoring_recovers(lab: Lab) -> None:
    role = json.loads(lab.kubectl("get", "clusterrole", "flannelpy", "-o", "json").stdout)
    index = next(i for i, r in enumerate(role["rules"]) if r["resources"] == ["nodes/status"])
    node = lab.node("n1")
    lab.kill_agent("n1")
    # Without its annotations the restarted agent must write them (else it writes nothing).
    lab.kubectl("annotate", "node", "n1", f"{PREFIX}/backend-data-", f"{PREFIX}/public-ip-")
    lab.kubectl(
        "patch",
        "clusterrole",
        "flannelpy",
        "--type",
        "json",
        "-p",
        json.dumps([{"op": "remove", "path": f"/rules/{index}"}]),
    )
    try:
        wait_until(
            lambda: not can_i(lab, "patch", "nodes/status"),
            timeout=10,
            what="RBAC dropping patch nodes/status",
        )
        log_start = os.path.getsize(node.agent_log)
        lab.start_agent("n1")
        ref = procs.ref_of(node.agent_pid, node.agent_start_ticks)
        wait_until(
            lambda: not procs.alive(ref),
            timeout=60,
            what="n1's agent giving up on the forbidden write",
        )
        with open(node.agent_log, encoding="utf-8") as f:
            f.seek(log_start)
            lines = [line for line in f.read().splitlines() if "forbidden" in line]
        assert lines, "n1's agent did not report the Forbidden"
        print("n1's agent:", lines[-1])
        assert 'cannot patch resource "nodes/status"' in lines[-1], lines[-1]
        assert SERVICE_ACCOUNT.split(":", 1)[1] in lines[-1], lines[-1]
        with pytest.raises(LabError, match="forbidden"):
            lab.wait_ready("n1", timeout=1)
    finally:
        lab.kubectl(
            "patch",
            "clusterrole",
            "flannelpy",
            "--type",
            "merge",
            "-p",
            json.dumps({"rules": role["rules"]}),
        )
    wait_until(
        lambda: can_i(lab, "patch", "nodes/status"),
        timeout=10,
        what="RBAC allowing patch nodes/status again",
    )
    lab.start_agent("n1")
    lab.wait_ready("n1")
    annotations = nodes_json(lab)["n1"]["metadata"]["annotations"]
    assert annotations[f"{PREFIX}/public-ip"] == str(node.ip)
    wait_until(
        lambda: all(ok for row in lab.status()["pod_matrix"].values() for ok in row.values()),
        timeout=15,
        what="every pod pair reaching again",
    )


def test_a_refused_status_lease_is_named_once_and_the_agent_runs_on(lab: Lab) -> None:
    """Without the RoleBinding the Lease write is refused (403): the agent says which
    permission is missing, once, and serves its node all the same."""
    ns = control_plane.NAMESPACE
    saved = json.loads(
        lab.kubectl("get", "rolebinding", "flannelpy", "-n", ns, "-o", "json").stdout
    )
    meta = saved["metadata"]
    restore = {**saved, "metadata": {k: meta[k] for k in ("name", "namespace", "labels")}}
    node = lab.node("n1")
    lab.kill_agent("n1")
    lab.kubectl("delete", "rolebinding", "flannelpy", "-n", ns)
    try:
        wait_until(
            lambda: not can_i(lab, "patch", "leases.coordination.k8s.io", ns),
            timeout=10,
            what="RBAC dropping patch leases",
        )
        log_start = os.path.getsize(node.agent_log)
        lab.start_agent("n1")
        lab.wait_ready("n1")
        said = f"may not patch leases.coordination.k8s.io in namespace {ns}"

        def lines() -> list[str]:
            with open(node.agent_log, encoding="utf-8") as f:
                f.seek(log_start)
                return [line for line in f.read().splitlines() if said in line]

        wait_until(lines, timeout=30, what="n1's agent naming the missing permission")
        print("n1's agent:", lines()[0])
        assert len(lines()) == 1, lines()
        assert "Role" in lines()[0], lines()[0]
        wait_until(
            lambda: all(ok for row in lab.status()["pod_matrix"].values() for ok in row.values()),
            timeout=15,
            what="every pod pair reaching, n1's too",
        )
        assert procs.alive(procs.ref_of(node.agent_pid, node.agent_start_ticks))
    finally:
        lab.kubectl("apply", "-f", "-", stdin=json.dumps(restore))
    wait_until(
        lambda: can_i(lab, "patch", "leases.coordination.k8s.io", ns),
        timeout=10,
        what="RBAC allowing patch leases again",
    )


def our_routes(lab: Lab, node: str) -> set[str]:
    out = lab.exec(node, ["ip", "-j", "route", "show", "proto", "75"]).stdout
    return {r["dst"] for r in json.loads(out or "[]")}


def test_a_deleted_node_leaves_every_peer_within_2s(lab: Lab) -> None:
    cidr = nodes_json(lab)["n3"]["spec"]["podCIDR"]
    assert all(cidr in our_routes(lab, n) for n in ("n1", "n2"))
    lab.kill_agent("n3")
    start = time.monotonic()
    lab.kubectl("delete", "node", "n3")
    for node in ("n1", "n2"):

        def route_gone(node: str = node) -> bool:
            return cidr not in our_routes(lab, node)

        wait_until(
            route_gone,
            timeout=max(0.1, 2.0 - (time.monotonic() - start)),
            interval=0.02,
            what=f"{node} dropping the deleted Node's route",
        )


def test_down_removes_the_control_plane(lab: Lab) -> None:
    refs = control_plane.process_refs(lab.state)
    assert len(refs) == 3 and all(procs.alive(r) for r in refs)
    before = host_snapshot()
    lab.down()
    assert not any(procs.alive(r) for r in refs)
    assert not os.path.exists(lab.state.lab_dir)
    assert lab_residue(before, host_snapshot(), lab.name) == []


def test_a_partial_start_is_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure after kube-apiserver came up: up removes everything it started."""
    started: list[procs.ProcessRef] = []

    def fail(state: Any) -> None:
        started.extend(control_plane.process_refs(state))
        raise LabError("registering the Nodes failed (injected)")

    monkeypatch.setattr(control_plane, "register_nodes", fail)
    name = unique_lab_name()
    before = host_snapshot()
    with pytest.raises(LabError, match="injected"):
        Lab.up(name, 2, "vxlan", kube=True)
    assert len(started) == 3
    assert not any(procs.alive(r) for r in started)
    assert not os.path.exists(os.path.join(plan.LAB_ROOT, name))
    assert lab_residue(before, host_snapshot(), name) == []


def test_down_without_a_state_file_removes_the_control_plane() -> None:
    """The state file lost (a crashed up, a hand-deleted lab directory): down still finds
    kube-apiserver, kube-controller-manager and the ConfigMap projector by their command
    lines. Before, only the etcds and agents were swept, and those three ran on."""
    from flannelpy_lab.lab import down

    name = unique_lab_name()
    before = host_snapshot()
    lab = Lab.up(name, 2, "vxlan", kube=True)
    try:
        refs = [*control_plane.process_refs(lab.state), control_plane.projector_ref(lab.state)]
        assert len(refs) == 4 and all(procs.alive(r) for r in refs)
        os.unlink(os.path.join(lab.state.lab_dir, "state.json"))
        down(name)
        assert not any(procs.alive(r) for r in refs)
        assert lab_residue(before, host_snapshot(), name) == []
    finally:
        down(name)
