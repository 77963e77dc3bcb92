"""Kubernetes Services over the overlay: kube-proxy (iptables mode) on the kubelet lab.

``Lab.up(..., kubelets=True)`` runs a real kube-proxy on every node and the
controller-manager's endpoints and EndpointSlice controllers; this module puts three
backends and three Services on it (``tests/support/kube_services.py``) and sends real
requests, counting what comes back and from which backend:

- pod → ClusterIP → pod: every test pod's requests all answered, by every backend,
  among them backends on other nodes, each seeing the client pod's own address;
- hairpin: a backend calling the Service it alone backs, answered by itself each time;
- NodePort from another node's namespace, on every node: all answered, by every
  backend, the source translated by kube-proxy;
- ``externalTrafficPolicy: Local``: the node with the endpoint answers with the client
  node's own address kept; the nodes without one answer nothing;
- ``hostPort`` (the conflist's ``portmap``): answered from another node's namespace, the
  client's address kept, and from a pod on another node, masqueraded to its node's
  address by the agent with ``--ip-masq`` and keeping its own without;

first with the agent's ``--ip-masq`` (the manifests' default), then without it (the
DaemonSet patched and rolled out; neither Flannel nor we remove the masquerade rules
when the flag goes, so the test removes them as an operator would). ``lab status`` is
checked on the same cluster: leases from the Nodes, agents as the DaemonSet's pods,
every node and pod pair reaching. ``test_kube_services_nftables.py`` runs the same
tests with kube-proxy in nftables mode.
"""

from __future__ import annotations

import json
import shlex
import time
from collections.abc import Iterator

import pytest
from flannelpy_lab import Lab, cli, kubelet
from flannelpy_lab import kube as control_plane

from tests.support import kube_services as ks
from tests.support.kube_rollout import rollout
from tests.support.lab_util import unique_lab_name, wait_until

pytestmark = [pytest.mark.lab]

PROXY_MODE = "iptables"
COUNT = 30  # requests per client and check
MASQ_COMMENT = "flanneld masq"


@pytest.fixture(scope="module")
def lab(request: pytest.FixtureRequest) -> Iterator[Lab]:
    mode = getattr(request.module, "PROXY_MODE", PROXY_MODE)
    lab = Lab.up(
        unique_lab_name("s"), len(ks.NODES), kubelets=True, proxy_mode=mode, progress=print
    )
    try:
        t0 = time.monotonic()
        ks.deploy(lab)
        print(f"backends and Services ready in {time.monotonic() - t0:.1f} s")
        yield lab
    finally:
        lab.down()


def test_status_tells_the_truth_on_the_kubelet_lab(
    lab: Lab, capsys: pytest.CaptureFixture[str]
) -> None:
    capsys.readouterr()
    assert cli.main(["status", "--name", lab.name, "--json"]) == 0, capsys.readouterr().out
    doc = json.loads(capsys.readouterr().out)
    nodes = {n["metadata"]["name"]: n for n in ks.items(lab, "nodes")}
    agents = {
        p["spec"]["nodeName"]: p["metadata"]["name"]
        for p in ks.items(
            lab, "pods", "-n", control_plane.NAMESPACE, "-l", "app.kubernetes.io/component=agent"
        )
    }
    assert doc["store"] == "kubernetes" and doc["etcd_error"] is None
    assert {(lease["node_name"], lease["subnet"]) for lease in doc["leases"]} == {
        (name, node["spec"]["podCIDR"]) for name, node in nodes.items()
    }
    for node in doc["nodes"]:
        assert node["lease"] == nodes[node["name"]]["spec"]["podCIDR"], node
        assert node["agent_running"] and node["agent_pod"]["name"] == agents[node["name"]], node
    # cni0 is up on every node (a test pod is attached): node pairs pinged between them.
    assert all(ok for row in doc["matrix"].values() for ok in row.values()), doc["matrix"]
    assert {w for row in doc["matrix_judged_by"].values() for w in row.values()} == {"ping"}
    assert all(p.startswith("cni0 ") for p in doc["probe_points"].values()), doc["probe_points"]
    assert len(doc["pod_matrix"]) == len(ks.NODES) and doc["ok"]
    text = status_text(lab, capsys)
    assert f"leases on the Nodes: {len(ks.NODES)}" in text
    assert all(f"pod {name}" in text for name in agents.values()), text
    assert f"all {len(ks.NODES) * 2} node pairs reach each other" in text


def status_text(lab: Lab, capsys: pytest.CaptureFixture[str]) -> str:
    assert cli.main(["status", "--name", lab.name]) == 0
    text = capsys.readouterr().out
    print(text)
    return text


def check_kube_proxy_mode(lab: Lab, c: ks.Cluster, mode: str) -> None:
    """The rules are the asked mode's: the ClusterIP in its tables, nothing in the other's."""
    for node in ks.NODES:
        nat = lab.exec(node, ["iptables-save", "-t", "nat"]).stdout
        tables = lab.exec(node, ["nft", "list", "tables"]).stdout
        if mode == "iptables":
            assert c.cluster_ips["web"] in nat and "kube-proxy" not in tables, (node, tables)
        else:
            rules = lab.exec(node, ["nft", "list", "table", "ip", "kube-proxy"]).stdout
            assert c.cluster_ips["web"] in rules and "KUBE-SERVICES" not in nat, node


def check_cluster_ip(lab: Lab, c: ks.Cluster) -> list[str]:
    url = f"http://{c.cluster_ips['web']}{ks.PATH}"
    seen: set[str] = set()
    lines = []
    for node, client in sorted(c.clients.items()):
        a = ks.from_pod(lab, client["name"], url, COUNT)
        lines.append(f"ClusterIP web from the test pod on {node}: {a.summary()}")
        assert a.answered == a.sent, lines[-1]
        assert a.backends - {f"web-{node}"}, f"no backend on another node answered: {lines[-1]}"
        assert a.sources == {client["ip"]}, f"the client's address was translated: {lines[-1]}"
        seen |= a.backends
    assert seen == set(c.backends), lines
    return lines


def check_hairpin(lab: Lab, c: ks.Cluster) -> list[str]:
    a = ks.from_pod(lab, "web-n1", f"http://{c.cluster_ips['web-n1']}{ks.PATH}", COUNT)
    line = f"hairpin: web-n1 calling ClusterIP web-n1: {a.summary()}"
    assert a.answered == a.sent and a.backends == {"web-n1"}, line
    # kube-proxy masquerades a pod's traffic to itself: it comes back from the bridge.
    assert a.sources == {ks.gateway(c, "n1")}, line
    return [line]


def check_node_port(lab: Lab, c: ks.Cluster) -> list[str]:
    seen: set[str] = set()
    lines = []
    for i, node in enumerate(ks.NODES):
        client = ks.NODES[(i + 1) % len(ks.NODES)]
        url = f"http://{c.node_ips[node]}:{c.node_ports['web']}{ks.PATH}"
        a = ks.from_node(lab, client, url, COUNT)
        lines.append(f"NodePort web on {node} from node {client}: {a.summary()}")
        assert a.answered == a.sent, lines[-1]
        # externalTrafficPolicy Cluster: kube-proxy translates the source to the node's
        # own address toward the backend (cni0's or the VTEP's).
        assert c.node_ips[client] not in a.sources, lines[-1]
        assert all(ks.in_pod_network(lab, s) for s in a.sources), lines[-1]
        seen |= a.backends
    assert seen == set(c.backends), lines
    return lines


def check_local_policy(lab: Lab, c: ks.Cluster) -> list[str]:
    port = c.node_ports["web-local"]
    a = ks.from_node(lab, "n2", f"http://{c.node_ips['n1']}:{port}{ks.PATH}", COUNT)
    lines = [f"NodePort web-local (Local) on n1 from node n2: {a.summary()}"]
    assert a.answered == a.sent and a.backends == {"web-n1"}, lines[-1]
    assert a.sources == {c.node_ips["n2"]}, f"the client's address was not kept: {lines[-1]}"
    for node in ("n2", "n3"):  # no local endpoint there: kube-proxy drops
        a = ks.from_node(lab, "n1", f"http://{c.node_ips[node]}:{port}{ks.PATH}", 2)
        lines.append(f"NodePort web-local (Local) on {node} from node n1: {a.summary()}")
        assert a.answered == 0, lines[-1]
    return lines


def check_host_port(lab: Lab, c: ks.Cluster, masq: bool) -> list[str]:
    url = f"http://{c.node_ips[ks.HOST_PORT_NODE]}:{ks.HOST_PORT}{ks.PATH}"
    a = ks.from_node(lab, "n1", url, COUNT)
    lines = [f"hostPort {ks.HOST_PORT} on {ks.HOST_PORT_NODE} from node n1: {a.summary()}"]
    assert a.answered == a.sent and a.backends == {ks.HOST_PORT_POD}, lines[-1]
    assert a.sources == {c.node_ips["n1"]}, f"the client's address was not kept: {lines[-1]}"
    client = c.clients["n1"]
    a = ks.from_pod(lab, client["name"], url, COUNT)
    lines.append(
        f"hostPort {ks.HOST_PORT} on {ks.HOST_PORT_NODE} from the pod on n1: {a.summary()}"
    )
    assert a.answered == a.sent and a.backends == {ks.HOST_PORT_POD}, lines[-1]
    # A pod's traffic to a node's address leaves the overlay: the agent masquerades it to
    # its node's address with --ip-masq, and leaves the pod's own address without.
    assert a.sources == {c.node_ips["n1"] if masq else client["ip"]}, lines[-1]
    return lines


CHECKS = (check_cluster_ip, check_hairpin, check_node_port, check_local_policy)


def run_checks(lab: Lab, label: str, masq: bool) -> None:
    c = ks.cluster(lab)
    lines = [line for check in CHECKS for line in check(lab, c)]
    lines += check_host_port(lab, c, masq)
    print(f"--- {label}\n" + "\n".join(lines))


def masq_rules(lab: Lab, node: str) -> list[str]:
    nat = lab.exec(node, ["iptables-save", "-t", "nat"]).stdout
    return [ln for ln in nat.splitlines() if MASQ_COMMENT in ln and "MASQUERADE" in ln]


def test_services_with_ip_masq(lab: Lab, request: pytest.FixtureRequest) -> None:
    c = ks.cluster(lab)
    check_kube_proxy_mode(lab, c, getattr(request.module, "PROXY_MODE", PROXY_MODE))
    assert all(masq_rules(lab, n) for n in ks.NODES), "the agents' masquerade rules are missing"
    run_checks(lab, "with --ip-masq", masq=True)


def test_a_service_answers_every_request_through_a_backend_rollout(lab: Lab) -> None:
    """A client pod on every node calls the ClusterIP Service ``web`` (a backend on every
    node) back to back while ``flannelpy rollout`` moves the nodes vxlan -> host-gw ->
    vxlan one by one: every request answered, by every backend, on every data path."""
    c = ks.cluster(lab)
    load = ks.ServiceLoad(
        lab, [c.clients[n]["name"] for n in ks.NODES], f"http://{c.cluster_ips['web']}{ks.PATH}"
    )
    load.start()
    try:
        for backend, route_dev in (("host-gw", "eth0"), ("vxlan", "flannel.1")):
            proc = rollout(lab, "start", "--backend", backend)
            print(f"--- rollout to {backend}\n{proc.stdout}{proc.stderr}")
            assert proc.returncode == 0, proc.stdout + proc.stderr
            last = [ln for ln in proc.stdout.splitlines() if ln.startswith("rollout ")][-1]
            n = len(ks.NODES)
            assert f" done: {n} of {n} nodes switched to {backend} " in last, last
            for node in ks.NODES:  # the data path did change under the Service
                out = lab.exec(node, ["ip", "-j", "route", "show", "proto", "75"]).stdout
                assert {r.get("dev") for r in json.loads(out or "[]")} == {route_dev}, node
    finally:
        answers = load.stop()
    lines = [f"{pod}: {a.summary()}" for pod, a in sorted(answers.items())]
    print("--- ClusterIP web through vxlan -> host-gw -> vxlan\n" + "\n".join(lines))
    for node, line in zip(ks.NODES, lines, strict=True):
        a = answers[c.clients[node]["name"]]
        # About 10 requests a second for the two rollouts (tens of seconds each).
        assert a.sent >= 200 and a.answered == a.sent, line
        assert a.backends == set(c.backends), line
        assert a.sources == {c.clients[node]["ip"]}, line


def drop_ip_masq(lab: Lab) -> None:
    """The DaemonSet without ``--ip-masq``, rolled out; then the chain the old agents left
    removed by hand (``iptables -D`` of the POSTROUTING jump, ``-F``/``-X`` of the chain)."""
    (ds,) = ks.items(lab, "daemonsets", "-n", control_plane.NAMESPACE)
    container = ds["spec"]["template"]["spec"]["containers"][0]
    assert container["name"] == "kube-flannelpy", container["name"]
    path = f"/spec/template/spec/containers/0/args/{container['args'].index('--ip-masq')}"
    patch = [{"op": "test", "path": path, "value": "--ip-masq"}, {"op": "remove", "path": path}]
    ns = ("-n", control_plane.NAMESPACE)
    lab.kubectl(
        "patch", "daemonset", kubelet.DAEMONSET, *ns, "--type", "json", "-p", json.dumps(patch)
    )
    lab.kubectl(
        "rollout", "status", "daemonset", kubelet.DAEMONSET, *ns, "--timeout", "120s", timeout=130
    )
    for node in ks.NODES:
        nat = lab.exec(node, ["iptables-save", "-t", "nat"]).stdout
        for line in nat.splitlines():
            if line.startswith("-A POSTROUTING") and "-j FLANNEL-POSTRTG" in line:
                lab.exec(node, ["iptables", "-t", "nat", "-D", *shlex.split(line)[1:]])
        lab.exec(node, ["iptables", "-t", "nat", "-F", "FLANNEL-POSTRTG"])
        lab.exec(node, ["iptables", "-t", "nat", "-X", "FLANNEL-POSTRTG"])


def test_services_without_ip_masq(lab: Lab) -> None:
    drop_ip_masq(lab)
    for node in ks.NODES:  # the new agents say so, and write no masquerade rule
        path = f"{kubelet.host_source(lab.node(node), '/run/flannel')}/subnet.env"

        def says_no_masq(path: str = path) -> bool:
            with open(path, encoding="utf-8") as f:
                return "FLANNEL_IPMASQ=false" in f.read()

        wait_until(says_no_masq, timeout=30, interval=0.5, what=f"{node}'s agent without --ip-masq")
    run_checks(lab, "without --ip-masq", masq=False)
    assert not any(masq_rules(lab, n) for n in ks.NODES), "a masquerade rule came back"
