"""Faults of the real Kubernetes control plane, on a 3-node ``lab up --kube`` lab with one
pod per node (kube-apiserver, the node IPAM controller, the manifests' ServiceAccount).

- kube-apiserver restarted while every pod pair pings at 20/s: no echo lost, every
  agent's watch resumes (a Node registered after the restart reaches every kernel), no
  agent exits;
- a watch the real server expires: kube-apiserver restarted after etcd's revision moved
  on, so its new watch cache starts past every agent's resourceVersion and answers their
  resumed watch with 410 Gone; every agent re-lists and follows the Nodes again;
- a node moved to another podCIDR as an operator does it (the Node deleted and
  registered again with ``spec.podCIDR`` set): its peers route the new CIDR and drop the
  old, the node itself re-publishes its annotations and gives new pods the new CIDR.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from ipaddress import IPv4Interface, IPv4Network
from typing import Any

import pytest
from flannelpy_lab import Lab, procs
from flannelpy_lab import kube as control_plane

from tests.support.agent_events import log_counts, wait_for_log_lines
from tests.support.lab_util import print_agent_logs_if_failed, running_real_kube_lab, wait_until
from tests.support.traffic import PodTraffic

pytestmark = [pytest.mark.lab]

PREFIX = "flannel.alpha.coreos.com/"
OUTAGE_S = 4.0  # kube-apiserver down this long (its restart adds 4-6 s more)
RELISTED = "410 Gone); re-listing"  # the agent's log line for an expired watch
GHOST_CIDR = "10.244.250.0/24"  # a Node without a lab node, registered during the tests
MOVED_CIDR = "10.244.200.0/24"  # where n2 moves; the node IPAM controller hands out from 0


@pytest.fixture(scope="module")
def kube_lab() -> Iterator[Lab]:
    with running_real_kube_lab() as lab:
        yield lab


@pytest.fixture
def lab(request: pytest.FixtureRequest, kube_lab: Lab) -> Iterator[Lab]:
    """The module's lab; a failing test prints every agent's log tail."""
    yield kube_lab
    print_agent_logs_if_failed(request, kube_lab, lines=25)


def our_routes(lab: Lab, node: str) -> set[str]:
    out = lab.exec(node, ["ip", "-j", "route", "show", "proto", "75"]).stdout
    return {r["dst"] for r in json.loads(out or "[]")}


def agent_refs(lab: Lab) -> list[procs.ProcessRef]:
    refs = [procs.ref_of(n.agent_pid, n.agent_start_ticks) for n in lab.nodes]
    assert all(refs)
    return [r for r in refs if r]


def register_ghost(lab: Lab) -> None:
    """A Node no lab node backs, annotated as a Flannel vxlan peer: the agents must see it
    through their watch (its address is a free one of the lab's segment)."""
    segment = IPv4Network(lab.state.segments[0].subnet)
    doc: dict[str, Any] = control_plane.node_manifest("ghost", str(segment.network_address + 200))
    doc["spec"] = {"podCIDR": GHOST_CIDR, "podCIDRs": [GHOST_CIDR]}
    doc["metadata"]["annotations"].update(
        {
            PREFIX + "kube-subnet-manager": "true",
            PREFIX + "backend-type": "vxlan",
            PREFIX + "backend-data": json.dumps({"VNI": 1, "VtepMAC": "02:00:00:00:fa:01"}),
            PREFIX + "public-ip": str(segment.network_address + 200),
        }
    )
    lab.kubectl("create", "-f", "-", stdin=json.dumps(doc))


def wait_ghost(lab: Lab, present: bool, timeout: float = 15.0) -> None:
    verb = "adding" if present else "dropping"
    for node in lab.nodes:
        wait_until(
            lambda n=node.name: (GHOST_CIDR in our_routes(lab, n)) == present,
            timeout=timeout,
            interval=0.1,
            what=f"{node.name} {verb} the ghost Node",
        )


def test_apiserver_restart_under_pod_traffic_loses_nothing(lab: Lab) -> None:
    refs = agent_refs(lab)
    with PodTraffic(lab, rate=20, streams=2) as traffic:
        lab.stop_kube_apiserver()
        time.sleep(OUTAGE_S)  # the outage itself: traffic keeps being counted meanwhile
        ready_s = lab.start_kube_apiserver()
        # The watches resumed: a Node registered now reaches every agent, and goes again.
        register_ghost(lab)
        wait_ghost(lab, True)
        lab.kubectl("delete", "node", "ghost")
        wait_ghost(lab, False)
        report = traffic.stop()
    print(f"kube-apiserver back in {ready_s:.1f} s;", report.summary())
    assert report.sent > 0 and report.lost == 0, report.summary()
    assert not report.broken_streams, report.summary()
    assert all(procs.alive(r) for r in refs), "an agent exited during the restart"


def test_an_expired_watch_from_the_real_server_is_re_listed(lab: Lab) -> None:
    refs = agent_refs(lab)
    before = log_counts(lab.nodes, RELISTED)
    lab.stop_kube_apiserver()
    # While it is down, etcd's revision moves on without any Node changing: the restarted
    # watch cache starts there, past every agent's resourceVersion.
    lab.bump_kube_etcd_revision(writes=3)
    lab.start_kube_apiserver()
    wait_for_log_lines(lab.nodes, RELISTED, before, more=1, timeout=30)
    register_ghost(lab)
    wait_ghost(lab, True)
    lab.kubectl("delete", "node", "ghost")
    wait_ghost(lab, False)
    assert all(procs.alive(r) for r in refs), "an agent exited after the 410"
    matrix = lab.status()["pod_matrix"]
    assert all(ok for row in matrix.values() for ok in row.values()), matrix


def test_a_node_re_registered_with_another_pod_cidr_is_followed(lab: Lab) -> None:
    old = json.loads(lab.kubectl("get", "node", "n2", "-o", "json").stdout)["spec"]["podCIDR"]
    assert old != MOVED_CIDR and old in our_routes(lab, "n1")
    refs = agent_refs(lab)
    lab.recreate_kube_node("n2", MOVED_CIDR)
    for node in ("n1", "n3"):
        wait_until(
            lambda n=node: MOVED_CIDR in (r := our_routes(lab, n)) and old not in r,
            timeout=15,
            interval=0.1,
            what=f"{node} following n2's new podCIDR",
        )
    gateway = str(IPv4Interface(f"{IPv4Network(MOVED_CIDR).network_address + 1}/24"))
    wait_until(
        lambda: gateway in lab.exec("n2", ["ip", "-4", "addr", "show", "cni0"]).stdout,
        timeout=15,
        what="n2's cni0 gateway on the new podCIDR",
    )
    # The re-registered Node lost the old object's annotations: n2's agent wrote them again.
    node = json.loads(lab.kubectl("get", "node", "n2", "-o", "json").stdout)
    assert node["metadata"]["annotations"][PREFIX + "public-ip"] == str(lab.node("n2").ip)
    conditions = {c["type"]: c["status"] for c in node["status"]["conditions"]}
    assert conditions["NetworkUnavailable"] == "False"
    pod = lab.add_pod("n2", "n2-moved")
    assert pod.ip is not None and pod.ip in IPv4Network(MOVED_CIDR)
    wait_until(
        lambda: lab.status()["pod_matrix"]["n1-p1"]["n2-moved"],
        timeout=10,
        what="a pod on n1 reaching the new pod on n2",
    )
    assert all(procs.alive(r) for r in refs), "an agent exited while its Node was re-registered"
    # A pod on the old podCIDR is routed by nobody now (as with Flannel): the kubelet
    # re-creates it; its DEL works from the agent's record.
    lab.delete_pod("n2-p1")
