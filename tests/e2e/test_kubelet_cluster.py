"""The DaemonSet on a real 3-node cluster: kubelets, containerd and the scheduler.

``Lab.up(..., kubelets=True)`` (``flannelpy-lab up --kubelet``) runs the real control
plane with kube-scheduler, and on every node namespace a real kubelet and containerd
(``flannelpy_lab.kubelet``); ``manifests/`` is applied with its DaemonSet (only the image,
the API server's address and the interface set by the lab's kustomization), and a
Deployment of busybox pods is spread over the nodes by the scheduler. Every check goes
through Kubernetes: Node conditions, pod status, ``kubectl exec`` (the kubelet's
streaming) for the echoes between pods.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
from collections.abc import Iterator
from ipaddress import IPv4Address, IPv4Network
from typing import Any

import pytest
from flannelpy_lab import Lab, kubelet, procs
from flannelpy_lab import kube as control_plane

from tests.support.lab_util import unique_lab_name, wait_until

pytestmark = [pytest.mark.lab]

NODES = ("n1", "n2", "n3")
AGENT_SELECTOR = "app.kubernetes.io/component=agent"
# Exactly what the lab's kustomization adds to the agent's container.
LAB_ENV = {"KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "FLANNELD_IFACE"}


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    lab = Lab.up(unique_lab_name("k"), len(NODES), kubelets=True, progress=print)
    print("RSS KiB:", kubelet.component_rss(lab.state))
    try:
        yield lab
    finally:
        lab.down()


def items(lab: Lab, *args: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = json.loads(lab.kubectl("get", *args, "-o", "json").stdout)[
        "items"
    ]
    return found


def test_nodes_are_the_kubelets_and_ready(lab: Lab) -> None:
    nodes = {n["metadata"]["name"]: n for n in items(lab, "nodes")}
    assert set(nodes) == set(NODES)
    for name, node in nodes.items():
        assert kubelet.node_ready(node), node["status"]["conditions"]
        info = node["status"]["nodeInfo"]
        assert info["kubeletVersion"].startswith("v1.37"), info
        assert info["containerRuntimeVersion"].startswith("containerd://1.6"), info
        addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
        assert addresses["InternalIP"] == str(lab.node(name).ip)
        assert node["spec"]["podCIDR"], f"{name} has no podCIDR"
        # The agent, run by the DaemonSet, reported the network up on the kubelet's Node.
        conditions = {c["type"]: c for c in node["status"]["conditions"]}
        assert conditions["NetworkUnavailable"]["status"] == "False"
        assert conditions["NetworkUnavailable"]["reason"] == "FlannelIsUp"


def test_daemonset_pods_run_the_manifests_unchanged(lab: Lab) -> None:
    pods = items(lab, "pods", "-n", control_plane.NAMESPACE, "-l", AGENT_SELECTOR)
    assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(NODES)
    assert all(p["status"]["phase"] == "Running" and kubelet.pod_ready(p) for p in pods)
    # The DaemonSet in the API is the manifests' one but for the lab's image and env.
    rendered = json.loads(lab.kubectl("apply", "-k", control_plane.manifests_dir(),
                                      "--dry-run=client", "-o", "json").stdout)["items"]
    (want,) = [o for o in rendered if o["kind"] == "DaemonSet"]
    (have,) = items(lab, "daemonsets", "-n", control_plane.NAMESPACE)
    w, h = want["spec"]["template"]["spec"], have["spec"]["template"]["spec"]
    for key in ("hostNetwork", "serviceAccountName", "priorityClassName", "tolerations"):
        assert h.get(key) == w.get(key), key
    assert [v["name"] for v in h["volumes"]] == [v["name"] for v in w["volumes"]]
    for kind in ("initContainers", "containers"):
        for hc, wc in zip(h[kind], w[kind], strict=True):
            assert hc.get("securityContext") == wc.get("securityContext"), hc["name"]
            assert hc["volumeMounts"] == wc["volumeMounts"], hc["name"]
            assert hc["image"] == lab.state.extra["kubelet"]["image"]
            extra = {e["name"] for e in hc.get("env", [])} - {e["name"] for e in wc.get("env", [])}
            assert extra <= LAB_ENV, extra
    # The init containers installed the executable and conflist into each node's dirs.
    for name in NODES:
        node = lab.node(name)
        assert os.access(os.path.join(kubelet.host_source(node, "/opt/cni/bin"), "flannelpy"),
                         os.X_OK)  # fmt: skip
        conflist = os.path.join(kubelet.host_source(node, "/etc/cni/net.d"),
                                "10-flannelpy.conflist")  # fmt: skip
        with open(conflist, encoding="utf-8") as f:
            assert json.load(f)["plugins"][0]["type"] == "flannelpy"


def workload_pods(lab: Lab) -> list[dict[str, Any]]:
    return [p for p in items(lab, "pods", "-l", f"app={kubelet.WORKLOAD}")
            if p["status"].get("phase") == "Running" and p["status"].get("podIP")
            and not p["metadata"].get("deletionTimestamp")]  # fmt: skip


def test_the_scheduler_spreads_the_deployment_over_every_node(lab: Lab) -> None:
    pods = workload_pods(lab)
    assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(NODES)
    cidrs = {n["metadata"]["name"]: IPv4Network(n["spec"]["podCIDR"]) for n in items(lab, "nodes")}
    for p in pods:  # each address from its node's lease, through our CNI
        assert IPv4Address(p["status"]["podIP"]) in cidrs[p["spec"]["nodeName"]], p["status"]


def exec_ping(lab: Lab, pod: str, ip: str) -> subprocess.CompletedProcess[str]:
    return lab.kubectl("exec", pod, "--", "ping", "-c", "1", "-W", "2", ip, check=False)


def unreachable_pairs(lab: Lab, pods: list[dict[str, Any]]) -> list[str]:
    failed = []
    for a in pods:
        for b in pods:
            if a is not b:
                proc = exec_ping(lab, a["metadata"]["name"], b["status"]["podIP"])
                if proc.returncode != 0:
                    failed.append(f"{a['spec']['nodeName']} -> {b['spec']['nodeName']}: "
                                  f"{(proc.stdout + proc.stderr).strip()[-200:]}")  # fmt: skip
    return failed


def test_every_pod_pair_reaches_through_kubectl_exec(lab: Lab) -> None:
    pods = workload_pods(lab)
    assert len(pods) == len(NODES)
    assert unreachable_pairs(lab, pods) == []


ECHO_INTERVAL = 0.1  # seconds between echoes of one pair
_STATS = re.compile(r"(\d+) packets transmitted, (\d+) packets received")


def start_pings(lab: Lab, pods: list[dict[str, Any]], count: int) -> list[subprocess.Popen[str]]:
    """Every ordered pod pair: one ``ping`` of ``count`` echoes, run through kubectl exec."""
    binary = os.path.join(control_plane.record(lab.state)["bin_dir"], "kubectl")
    kubeconfig = control_plane.admin_kubeconfig(lab.state)
    return [
        subprocess.Popen(
            [binary, "--kubeconfig", kubeconfig, "exec", a["metadata"]["name"], "--", "ping",
             "-c", str(count), "-i", str(ECHO_INTERVAL), "-W", "1", b["status"]["podIP"]],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=control_plane._env(),
        )
        for a in pods
        for b in pods
        if a is not b
    ]


def test_rollout_restart_of_the_agent_loses_no_echo(lab: Lab) -> None:
    pods = workload_pods(lab)
    before = {p["metadata"]["uid"] for p in
              items(lab, "pods", "-n", control_plane.NAMESPACE, "-l", AGENT_SELECTOR)}
    pingers = start_pings(lab, pods, count=600)  # 60 s
    try:
        time.sleep(2)  # traffic flows before the first agent goes
        lab.kubectl("rollout", "restart", "daemonset", kubelet.DAEMONSET, "-n",
                    control_plane.NAMESPACE)  # fmt: skip
        lab.kubectl("rollout", "status", "daemonset", kubelet.DAEMONSET, "-n",
                    control_plane.NAMESPACE, "--timeout", "50s")  # fmt: skip
        agents = items(lab, "pods", "-n", control_plane.NAMESPACE, "-l", AGENT_SELECTOR)
        assert len(agents) == len(NODES) and not {p["metadata"]["uid"] for p in agents} & before
        outputs = [p.communicate(timeout=90)[0] for p in pingers]
    finally:
        for p in pingers:
            if p.poll() is None:
                p.kill()
                p.wait()
    lost = 0
    for out in outputs:
        match = _STATS.search(out)
        assert match, out[-300:]
        sent, received = map(int, match.groups())
        assert sent == 600, out[-300:]
        lost += sent - received
    assert lost == 0, f"{lost} of {600 * len(outputs)} echoes lost during the rollout"


def our_routes(lab: Lab, node: str) -> set[str]:
    out = lab.exec(node, ["ip", "-j", "route", "show", "proto", "75"]).stdout
    return {r["dst"] for r in json.loads(out or "[]")}


def test_a_drained_and_deleted_node_moves_its_pods_and_leaves_every_peer(lab: Lab) -> None:
    cidr = next(n["spec"]["podCIDR"] for n in items(lab, "nodes")
                if n["metadata"]["name"] == "n3")  # fmt: skip
    assert all(cidr in our_routes(lab, n) for n in ("n1", "n2"))
    lab.kubectl("drain", "n3", "--ignore-daemonsets", "--force", "--grace-period=1",
                "--timeout=60s")  # fmt: skip

    def moved() -> bool:
        pods = workload_pods(lab)
        return len(pods) == len(NODES) and "n3" not in {p["spec"]["nodeName"] for p in pods}

    wait_until(moved, timeout=60, what="the drained node's pod running elsewhere")
    kubelet.stop_node(lab.state, lab.node("n3"))  # the machine goes away
    lab.kubectl("delete", "node", "n3")
    for node in ("n1", "n2"):

        def route_gone(node: str = node) -> bool:
            return cidr not in our_routes(lab, node)

        wait_until(route_gone, timeout=10, what=f"{node} dropping the deleted node's route")
    cidrs = {n["metadata"]["name"]: IPv4Network(n["spec"]["podCIDR"]) for n in items(lab, "nodes")}
    pods = workload_pods(lab)
    for p in pods:  # the moved pod's address is from its new node's lease
        assert IPv4Address(p["status"]["podIP"]) in cidrs[p["spec"]["nodeName"]], p["status"]
    assert unreachable_pairs(lab, pods) == []


def test_down_stops_every_kubelet_containerd_and_pod(lab: Lab) -> None:
    rec = lab.state.extra["kubelet"]
    refs = [r for r in (procs.ref_of(*v) for v in rec["processes"].values()) if procs.alive(r)]
    assert len(refs) >= 4  # n3's went with its machine
    parents = [kubelet.cgroup_parent(lab.state, n) for n in lab.nodes]
    pod_pids = set().union(*(kubelet._cgroup_pids(p) for p in parents))
    assert pod_pids, "no pod process in the nodes' cgroups"
    # The kubelets mounted the pods' volumes in the nodes' mount namespaces only.
    containerd = {k.split("/")[1]: r for k, r in
                  ((k, procs.ref_of(*v)) for k, v in rec["processes"].items())
                  if k.startswith("containerd/") and r and procs.alive(r)}  # fmt: skip
    assert set(containerd) == {"n1", "n2"}
    namespaces = {os.stat(f"/proc/{r.pid}/ns/mnt").st_ino for r in containerd.values()}
    with open(f"/proc/{containerd['n1'].pid}/mountinfo", encoding="utf-8") as f:
        assert os.path.join(kubelet.node_base(lab.node("n1")), "kubelet", "pods") in f.read()
    lab.down()
    for pid in filter(str.isdigit, os.listdir("/proc")):  # the namespaces went with them
        with contextlib.suppress(OSError):  # gone, or not ours to look at
            assert os.stat(f"/proc/{pid}/ns/mnt").st_ino not in namespaces, pid
    assert not any(procs.alive(r) for r in refs)
    wait_until(lambda: not any(os.path.exists(f"/proc/{pid}") for pid in pod_pids), timeout=5,
               what="every pod process gone")  # fmt: skip
    for hierarchy in kubelet._hierarchies():
        assert not [d for d in os.listdir(hierarchy) if d.startswith(f"fpl-{lab.name}-")]
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        assert lab.state.lab_dir not in f.read()
    assert not os.path.exists(lab.state.lab_dir)
