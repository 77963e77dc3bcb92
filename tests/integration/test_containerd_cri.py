"""containerd's CRI drives the installed conflist as the kubelet does, pod namespaces under
its state dir.

containerd 1.6 (Debian's package) runs in a throwaway node namespace with
``netns_mounts_under_state_dir = true`` and, as its CNI config, the conflist we
install (``cni_plugin/10-flannelpy.conflist``: our executable, then ``portmap``)
pointing at a CNI server with real IPAM in the same node namespace. The pod
namespaces are bind mounts in containerd's mount namespace only: the agent, like
one in a DaemonSet, sees an empty file at the path CNI_NETNS names. Pods are
started and removed through the CRI over gRPC (RunPodSandbox, PodSandboxStatus,
StopPodSandbox, RemovePodSandbox); traffic stays inside the test's namespaces.
Both forms of the executable run: the static forwarder and the Python launcher.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from ipaddress import IPv4Address, IPv4Interface
from pathlib import Path

import pytest
from flannelpy_lab.pods import static_build

from cni_plugin.client import write_launcher
from tests.integration.test_cni_server import GATEWAY, SUBNET, Node, make_node
from tests.support.cri_containerd import Containerd, containerd_on_node
from tests.support.netns_util import is_root
from tests.support.waiting import wait_until

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(not is_root(), reason="containerd and network namespaces need root"),
]

REPO = Path(__file__).resolve().parents[2]
CONFLIST = REPO / "cni_plugin" / "10-flannelpy.conflist"
PLUGIN = "flannelpy"
REFERENCE_PLUGINS = ("loopback", "portmap")  # containerd adds loopback to every pod
REFERENCE_DIR = "/usr/lib/cni"

Cluster = tuple[Node, Containerd]


def install_cni(form: str, directory: str, agent_socket: str) -> tuple[str, str]:
    """Our executable (``form``), the reference plugins and our conflist naming
    ``agent_socket``, as a node install lays them out; returns (bin dir, conf dir)."""
    bin_dir, conf_dir = os.path.join(directory, "bin"), os.path.join(directory, "net.d")
    os.makedirs(bin_dir)
    os.makedirs(conf_dir)
    dest = os.path.join(bin_dir, PLUGIN)
    if form == "static":
        binary = static_build()
        assert binary is not None, (
            "the static CNI executable did not build: run scripts/build-cni.sh"
        )
        shutil.copy(binary, dest)
    else:
        write_launcher(dest)
    for plugin in REFERENCE_PLUGINS:
        shutil.copy(os.path.join(REFERENCE_DIR, plugin), bin_dir)
    doc = json.loads(CONFLIST.read_text(encoding="utf-8"))
    assert doc["plugins"][0]["type"] == PLUGIN
    doc["plugins"][0]["agentSocket"] = agent_socket
    with open(os.path.join(conf_dir, CONFLIST.name), "w", encoding="utf-8") as f:
        json.dump(doc, f)
    return bin_dir, conf_dir


@pytest.fixture(scope="module", params=["static", "python"])
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    cni_dir = tempfile.mkdtemp(prefix="fpcricni")
    try:
        with make_node() as node:
            bin_dir, conf_dir = install_cni(request.param, cni_dir, node.socket)
            with containerd_on_node(node.ns.name, bin_dir, conf_dir) as ctrd:
                yield node, ctrd
    finally:
        shutil.rmtree(cni_dir, ignore_errors=True)


@pytest.fixture
def pods(cluster: Cluster) -> Iterator[Containerd]:
    """The cluster's containerd; sandboxes the test leaves are stopped and removed after it."""
    _, ctrd = cluster
    try:
        yield ctrd
    finally:
        for sandbox_id in list(ctrd.sandboxes):
            ctrd.stop_and_remove(sandbox_id)


def allocated(node: Node) -> dict[str, IPv4Address]:
    return {a.container_id: a.ip for a in node.ipam.allocations()}


def assert_hidden_from_agent(ctrd: Containerd, sandbox_id: str, netns: str) -> None:
    """The case under test: the pod namespace lives under containerd's state dir, and
    the agent's mount namespace sees only the plain file it is mounted on."""
    assert netns.startswith(os.path.join(ctrd.base, "state") + os.sep), netns
    seen_by_agent = os.stat(netns)
    assert stat.S_ISREG(seen_by_agent.st_mode) and seen_by_agent.st_size == 0
    assert seen_by_agent.st_dev == os.stat(ctrd.base).st_dev  # the state dir's filesystem
    _, info = ctrd.status(sandbox_id)
    pause_netns = os.stat(f"/proc/{info['pid']}/ns/net")
    seen_by_containerd = os.stat(f"/proc/{ctrd.pid}/root{netns}")
    assert (seen_by_containerd.st_dev, seen_by_containerd.st_ino) == (
        pause_netns.st_dev,
        pause_netns.st_ino,
    )


def eth0_address(ctrd: Containerd, netns: str) -> IPv4Interface:
    proc = ctrd.in_netns(netns, ["ip", "-j", "-4", "addr", "show", "dev", "eth0"])
    assert proc.returncode == 0, proc.stderr
    (info,) = json.loads(proc.stdout)[0]["addr_info"]
    return IPv4Interface(f"{info['local']}/{info['prefixlen']}")


def pings(ctrd: Containerd, netns: str, target: IPv4Address) -> bool:
    return ctrd.in_netns(netns, ["ping", "-c", "1", "-W", "1", str(target)]).returncode == 0


def test_pods_get_addresses_reach_each_other_and_are_released(
    cluster: Cluster, pods: Containerd
) -> None:
    node, ctrd = cluster
    sandboxes = [pods.run_pod_sandbox("web-0"), pods.run_pod_sandbox("web-1")]

    netns = {sid: ctrd.netns_path(sid) for sid in sandboxes}
    addresses = {}
    for sid, path in netns.items():
        assert_hidden_from_agent(ctrd, sid, path)
        status, _ = ctrd.status(sid)
        ip = IPv4Address(status.network.ip)
        assert ip in SUBNET and ip != GATEWAY
        assert eth0_address(ctrd, path) == IPv4Interface(f"{ip}/{SUBNET.prefixlen}")
        addresses[sid] = ip
    assert len(set(addresses.values())) == 2
    assert allocated(node) == addresses  # the agent's IPAM holds each under the sandbox ID
    assert len(node.veths()) == 2

    first, second = sandboxes
    for sid, peer in ((first, addresses[second]), (second, addresses[first])):
        wait_until(
            functools.partial(pings, ctrd, netns[sid], peer),
            timeout=10,
            what=f"pod {sid[:12]} pinging {peer}",
        )
        assert pings(ctrd, netns[sid], GATEWAY), f"pod {sid[:12]} cannot ping the bridge gateway"

    for sid in sandboxes:
        pods.stop_and_remove(sid)
    assert node.veths() == []
    assert allocated(node) == {}
    assert node.records.list() == []
    for path in netns.values():
        assert not ctrd.sees(path), f"containerd kept the namespace {path}"

    # The node goes on serving: a new pod gets an address, not one of those cooling down.
    third = pods.run_pod_sandbox("web-2")
    status, _ = ctrd.status(third)
    ip = IPv4Address(status.network.ip)
    assert allocated(node) == {third: ip}
    assert ip in SUBNET and ip not in addresses.values()
    assert pings(ctrd, ctrd.netns_path(third), GATEWAY)


def test_a_container_in_the_pod_uses_its_network(cluster: Cluster, pods: Containerd) -> None:
    """A container started in the sandbox (CreateContainer, StartContainer) has the pod's
    eth0 and address, and reaches another pod and the gateway (ExecSync)."""
    node, ctrd = cluster
    sandbox, other = pods.run_pod_sandbox("app-0"), pods.run_pod_sandbox("app-1")
    container = pods.start_container(sandbox, "main", "/bin/sleep", "2147483647")
    ip = IPv4Address(ctrd.status(sandbox)[0].network.ip)
    peer = IPv4Address(ctrd.status(other)[0].network.ip)

    code, out = pods.exec_sync(container, "ip", "-4", "-o", "addr", "show", "dev", "eth0")
    assert code == 0, out
    assert f"inet {ip}/{SUBNET.prefixlen} " in out
    code, out = pods.exec_sync(container, "ping", "-c", "1", "-W", "2", str(peer))
    assert code == 0, out
    code, out = pods.exec_sync(container, "ping", "-c", "1", "-W", "2", str(GATEWAY))
    assert code == 0, out

    pods.stop_and_remove(sandbox)  # removes the container with it, as the kubelet's GC does
    assert allocated(node).keys() == {other}
