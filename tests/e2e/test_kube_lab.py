"""The netns lab in Kubernetes mode: real agents against the API-server stand-in.

The stand-in (tests/support/kube_standin.py) stays for what the real API server
cannot be made to do on demand: change a podCIDR in place, end an open watch
with 410 Gone, go unreachable. tests/e2e/test_kube_real.py runs the agents
against the real kube-apiserver and kube-controller-manager. The stand-in serves
Node list/watch/GET and nodes/status PATCH to the real `kubernetes` client on the
host's lab address, so the agents in the node namespaces reach it over the underlay.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
from flannelpy_lab import Lab

from tests.support.agent_events import log_counts, wait_for_log_lines
from tests.support.kube_standin import KubeStandin
from tests.support.lab_util import wait_until

pytestmark = [pytest.mark.lab]

PREFIX = "flannel.alpha.coreos.com"
WATCH_FAILED = "node watch failed"  # the agent's log line for a failed node watch


def our_routes(lab: Lab, node: str) -> set[str]:
    out = lab.exec(node, ["ip", "-j", "route", "show", "proto", "75"]).stdout
    return {r["dst"] for r in json.loads(out or "[]")}


def test_pods_on_three_nodes_reach_each_other(kube_lab: tuple[Lab, KubeStandin]) -> None:
    lab, api = kube_lab
    matrix = lab.status()["pod_matrix"]
    assert all(ok for row in matrix.values() for ok in row.values()), matrix
    # Pod addresses come from each Node's podCIDR, as the controller-manager assigned it.
    for i, node in enumerate(lab.nodes, start=1):
        (pod,) = [p for p in lab.pods if p.node == node.name]
        assert str(pod.ip).startswith(f"10.244.{i}.")
    # Flannel's annotations were written, and the node marked network-available.
    n1 = api.node("n1")
    assert n1 is not None
    annotations = n1["metadata"]["annotations"]
    assert annotations[f"{PREFIX}/kube-subnet-manager"] == "true"
    assert annotations[f"{PREFIX}/backend-type"] == "vxlan"
    assert annotations[f"{PREFIX}/public-ip"] == str(lab.node("n1").ip)
    assert json.loads(annotations[f"{PREFIX}/backend-data"])["VtepMAC"]
    conditions = {c["type"]: c for c in n1["status"]["conditions"]}
    assert conditions["NetworkUnavailable"]["status"] == "False"
    assert conditions["NetworkUnavailable"]["reason"] == "FlannelIsUp"


def test_pod_cidr_change_moves_routes(kube_lab: tuple[Lab, KubeStandin]) -> None:
    lab, api = kube_lab
    api.set_pod_cidr("n2", "10.244.20.0/24")
    wait_until(lambda: "10.244.20.0/24" in our_routes(lab, "n1")
               and "10.244.2.0/24" not in our_routes(lab, "n1"),
               timeout=5, interval=0.05, what="n1 following n2's new podCIDR")
    # n2 itself moved onto the new subnet: its bridge carries the new gateway.
    wait_until(lambda: "10.244.20.1/24" in lab.exec("n2", ["ip", "-4", "addr", "show", "cni0"])
               .stdout, timeout=5, what="n2's cni0 gateway on the new subnet")
    pod = lab.add_pod("n2", "n2-moved")
    assert str(pod.ip).startswith("10.244.20.")
    wait_until(lambda: lab.status()["pod_matrix"]["n1-p1"]["n2-moved"], timeout=5,
               what="a pod on n1 reaching the new pod on n2")
    # A pod still on the old podCIDR is routed by nobody now (as with Flannel): it has to
    # be re-created, which the kubelet does. Its DEL works from the agent's record.
    lab.delete_pod("n2-p1")


def test_api_unreachable_keeps_the_data_plane_and_recovers(
    kube_lab: tuple[Lab, KubeStandin],
) -> None:
    lab, api = kube_lab
    failed = log_counts(lab.nodes, WATCH_FAILED)
    api.set_unreachable(True)
    try:
        # Every agent has lost its watch and had a retry refused too.
        wait_for_log_lines(lab.nodes, WATCH_FAILED, failed, more=2, timeout=15)
        matrix = lab.status()["pod_matrix"]
        assert all(ok for row in matrix.values() for ok in row.values()), matrix
    finally:
        api.set_unreachable(False)
    # After the outage the watch resumes: a new node is seen by everyone.
    api.add_node("ghost", pod_cidr="10.244.77.0/24", annotations={
        f"{PREFIX}/kube-subnet-manager": "true", f"{PREFIX}/backend-type": "vxlan",
        f"{PREFIX}/backend-data": json.dumps({"VNI": 1, "VtepMAC": "02:00:00:00:77:01"}),
        f"{PREFIX}/public-ip": "100.127.77.1"})
    for node in ("n1", "n3"):
        wait_until(lambda node=node: "10.244.77.0/24" in our_routes(lab, node), timeout=15,
                   interval=0.1, what=f"{node} seeing the node added after the outage")


def test_deleted_node_disappears_from_peers_within_2s(kube_lab: tuple[Lab, KubeStandin]) -> None:
    lab, api = kube_lab
    assert "10.244.3.0/24" in our_routes(lab, "n1")
    lab.kill_agent("n3")
    api.delete_node("n3")
    start = time.monotonic()
    for node in ("n1", "n2"):
        wait_until(lambda node=node: "10.244.3.0/24" not in our_routes(lab, node),
                   timeout=max(0.1, 2.0 - (time.monotonic() - start)), interval=0.02,
                   what=f"{node} dropping the deleted node's route")


def _python_paths() -> list[str]:
    """Every place a Python interpreter or its library could be found on this host."""
    found = {os.path.realpath(sys.executable), sys.executable}
    for name in ("python3", "python", "python3.11"):
        for directory in ("/usr/bin", "/usr/local/bin", "/bin"):
            candidate = os.path.join(directory, name)
            if os.path.exists(candidate):
                found.add(candidate)
    which = shutil.which("python3")
    if which:
        found.add(which)
    return sorted(found)


def test_static_executable_needs_no_python(kube_lab: tuple[Lab, KubeStandin]) -> None:
    """Run the lab's CNI executable where no Python interpreter can be found or run."""
    lab, _ = kube_lab
    node = lab.node("n1")
    assert lab.state.extra["cni_exec"] == "static"
    binary = os.path.join(lab.state.cni_bin_dir, "flannelpy")
    launcher = os.path.join(lab.state.lab_dir, "python-launcher")
    from cni_plugin.client import write_launcher

    write_launcher(launcher)
    hide = []
    for path in _python_paths():
        hide.append(f"mount --bind /dev/null {path}")
    for directory in ("/root/.pyenv", "/usr/lib/python3", "/usr/lib/python3.11",
                      "/usr/local/lib/python3.11", str(Path(sys.prefix))):
        if os.path.isdir(directory):
            hide.append(f"mount -t tmpfs none {directory}")
    conf = json.loads(Path(node.conflist).read_text())
    plugin = {**conf["plugins"][0], "cniVersion": conf["cniVersion"], "name": conf["name"]}
    subprocess.run(["ip", "netns", "add", "fpl-nopy-pod"], check=True)
    try:
        def run(executable: str, command: str) -> subprocess.CompletedProcess[bytes]:
            script = "; ".join([*hide, f"exec ip netns exec {node.namespace} {executable}"])
            env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "CNI_COMMAND": command,
                   "CNI_CONTAINERID": "nopython", "CNI_NETNS": "/run/netns/fpl-nopy-pod",
                   "CNI_IFNAME": "eth0", "CNI_PATH": lab.state.cni_path}
            return subprocess.run(["unshare", "--mount", "--propagation", "private",
                                   "sh", "-c", script], input=json.dumps(plugin).encode(),
                                  env=env, capture_output=True, timeout=30)

        probe = subprocess.run(
            ["unshare", "--mount", "--propagation", "private", "sh", "-c",
             "; ".join([*hide, "python3 -c 'print(1)' || exit 42"])],
            capture_output=True, timeout=30)
        assert probe.returncode != 0, "the test failed to hide Python"
        assert run(launcher, "VERSION").returncode != 0  # the Python form cannot run here
        added = run(binary, "ADD")
        assert added.returncode == 0, added.stdout + added.stderr
        address = json.loads(added.stdout)["ips"][0]["address"]
        assert address.startswith("10.244.1.")
        assert run(binary, "DEL").returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", "fpl-nopy-pod"], check=False)
