"""A mixed cluster in Kubernetes mode: two nodes of ours beside two real flanneld nodes
with ``--kube-subnet-mgr``, against the lab's real kube-apiserver (``lab up --kube
--flanneld-nodes 2``).

flanneld runs as Flannel's DaemonSet runs it (kubeconfig with the flannelpy
ServiceAccount's token, NODE_NAME / POD_NAMESPACE, the ConfigMap's net-conf.json,
``--iface``); the pinned build is never skipped: without it the lab fails, naming the
build script. On a 4-node vxlan lab (n1, n2 ours; n3, n4 flanneld), one pod per node:

- every node pair and every pod pair reaches;
- each side reads the other's annotations: the flanneld nodes' Nodes carry Flannel's
  annotations written by flanneld itself (its managedFields entry), our reader turns them
  into leases, and every node's kernel (ours and flanneld's) holds exactly the routes,
  neighbours and FDB entries the other three Nodes ask for.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from ipaddress import IPv4Network
from typing import Any

import pytest
from flannelpy_lab import Lab, agents

from flannelpy.config.netconf import parse_network_config
from flannelpy.store.kube import node as kn
from tests.support.kernel_entries import (
    VXLAN_DEVICE,
    PeerLease,
    entry_mismatches,
    kernel_entries,
)
from tests.support.lab_util import print_agent_logs_if_failed, running_lab, wait_until

pytestmark = [pytest.mark.lab]

PREFIX = "flannel.alpha.coreos.com/"
OURS, THEIRS = ("n1", "n2"), ("n3", "n4")
CONVERGE = 20.0  # seconds for every agent to program every peer


@pytest.fixture(scope="module")
def mixed_lab() -> Iterator[Lab]:
    with running_lab(4, "vxlan", kube=True, flanneld_nodes=2, pods_per_node=1) as lab:
        assert [n.agent_kind for n in lab.nodes] == ["flannelpy"] * 2 + ["flanneld"] * 2
        yield lab


@pytest.fixture
def lab(request: pytest.FixtureRequest, mixed_lab: Lab) -> Iterator[Lab]:
    """The module's lab; a failing test prints every node's log tail."""
    yield mixed_lab
    print_agent_logs_if_failed(request, mixed_lab)


def nodes_json(lab: Lab) -> dict[str, dict[str, Any]]:
    items = json.loads(lab.kubectl("get", "nodes", "-o", "json", "--show-managed-fields").stdout)[
        "items"
    ]
    return {n["metadata"]["name"]: n for n in items}


def node_leases(lab: Lab) -> list[PeerLease]:
    """Every Node as a lease, read by our own reader (``node_to_lease``)."""
    with open(agents.kube_net_conf_path(lab.state), "rb") as f:
        config = parse_network_config(f.read())
    keys = kn.annotation_keys("flannel.alpha.coreos.com")
    leases = []
    for name, node in nodes_json(lab).items():
        lease = kn.node_to_lease(node, keys, config)
        assert lease is not None, f"Node {name} is not a usable peer yet"
        leases.append(PeerLease(name, lease.subnet, lease.attrs, 0))
    return leases


def annotation_writers(node: dict[str, Any]) -> set[str]:
    """The field managers that own one of Flannel's annotations on the Node."""
    writers = set()
    for entry in node["metadata"].get("managedFields") or []:
        owned = ((entry.get("fieldsV1") or {}).get("f:metadata") or {}).get("f:annotations")
        if owned and any(k.startswith(f"f:{PREFIX}") for k in owned):
            writers.add(str(entry.get("manager")))
    return writers


def test_every_node_pair_and_pod_pair_reaches(lab: Lab) -> None:
    wait_until(
        lambda: bool(lab.status()["ok"]), timeout=CONVERGE, interval=1.0, what="every pair reaching"
    )
    doc = lab.status()
    nodes = [ok for row in doc["matrix"].values() for ok in row.values()]
    pods = [ok for row in doc["pod_matrix"].values() for ok in row.values()]
    assert len(nodes) == 4 * 3 and all(nodes), doc["matrix"]
    assert len(pods) == 4 * 3 and all(pods), doc["pod_matrix"]
    # status reads every lease from the Nodes, flanneld's as well as ours.
    assert {n["name"]: (n["agent_kind"], n["lease"]) for n in doc["nodes"]} == {
        name: (lab.node(name).agent_kind, node["spec"]["podCIDR"])
        for name, node in nodes_json(lab).items()
    }


def test_flanneld_writes_flannels_annotations_through_the_service_account(lab: Lab) -> None:
    nodes = nodes_json(lab)
    for name in THEIRS:
        node, info = nodes[name], lab.node(name)
        notes = node["metadata"]["annotations"]
        assert notes[PREFIX + "kube-subnet-manager"] == "true"
        assert notes[PREFIX + "backend-type"] == "vxlan"
        assert notes[PREFIX + "public-ip"] == str(info.ip)
        link = json.loads(lab.exec(name, ["ip", "-j", "link", "show", VXLAN_DEVICE]).stdout)[0]
        assert json.loads(notes[PREFIX + "backend-data"]) == {"VNI": 1, "VtepMAC": link["address"]}
        assert PREFIX + "flannelpy-mtu" not in notes  # ours only
        conditions = {c["type"]: c for c in node["status"]["conditions"]}
        assert conditions["NetworkUnavailable"]["status"] == "False"
        assert conditions["NetworkUnavailable"]["reason"] == "FlannelIsUp"
        # flanneld wrote them itself (client-go names the manager after the binary).
        assert annotation_writers(node) == {"flanneld"}, node["metadata"]["managedFields"]
        # Its subnet is the podCIDR the node IPAM controller gave the Node.
        with open(info.subnet_env, encoding="ascii") as f:
            env = dict(line.split("=", 1) for line in f.read().split())
        subnet = IPv4Network(env["FLANNEL_SUBNET"], strict=False)
        assert subnet == IPv4Network(node["spec"]["podCIDR"])
    for name in OURS:
        assert "flanneld" not in annotation_writers(nodes[name])
        assert nodes[name]["metadata"]["annotations"][PREFIX + "public-ip"] == str(
            lab.node(name).ip
        )


def test_each_kernel_holds_exactly_what_the_other_nodes_ask_for(lab: Lab) -> None:
    """Ours route to the flanneld nodes from flanneld's annotations, and flanneld's routes,
    neighbours and FDB entries point at ours, from ours."""

    def mismatches() -> dict[str, str]:
        leases = node_leases(lab)
        assert len(leases) == 4, [lease.key for lease in leases]
        return entry_mismatches(lab, leases, "vxlan", lambda node: set())

    try:
        wait_until(
            lambda: not mismatches(),
            timeout=CONVERGE,
            interval=0.5,
            what="kernel entries matching the Nodes",
        )
    except AssertionError:
        pytest.fail(
            "kernel entries differ from the Nodes:\n"
            + "\n".join(f"  {where}: {diff}" for where, diff in mismatches().items())
        )
    # Each side holds the other's entries (not only its own kind's).
    leases = {lease.key: lease for lease in node_leases(lab)}
    for here, there in ((OURS[0], THEIRS[0]), (THEIRS[0], OURS[0])):
        fdb = kernel_entries(lab, lab.node(here)).fdb
        assert (leases[there].attrs.vtep_mac, str(lab.node(there).ip)) in fdb, (here, there)
