"""A real container runtime drives the plugin: podman on two lab nodes.

Podman (Debian's package, CNI network backend) runs containers on each node's
flannelpy network (the node's conflist: our plugin, then the reference
``portmap``). The containers reach each other across nodes, a published port
answers on the node's underlay address from the other node, and removing a
container (or its exiting by itself) releases its address in the agent's IPAM.
All traffic stays inside the lab's namespaces.
"""

from __future__ import annotations

import os
import secrets
import sys
import time
from collections.abc import Callable, Iterator
from ipaddress import IPv4Address, IPv4Interface

import pytest
from flannelpy_lab import Lab

from tests.support.lab_util import running_lab, wait_until
from tests.support.podman_util import PodmanNode, node_allocations, node_pools, podman_on_nodes

pytestmark = [pytest.mark.lab]

HOST_PORT = 8080
# An HTTP/1.0 GET from inside a node namespace; prints the whole response.
HTTP_GET = """\
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=3) as s:
    s.sendall(b"GET /index.html HTTP/1.0\\r\\n\\r\\n")
    data = b""
    while chunk := s.recv(4096):
        data += chunk
print(data.decode(errors="replace"))
"""

PodmanLab = tuple[Lab, dict[str, PodmanNode]]
Run = Callable[..., str]


@pytest.fixture(scope="module")
def podman_lab() -> Iterator[PodmanLab]:
    with running_lab(nodes=2, pods_per_node=0) as lab:
        lab.install_cni()
        with podman_on_nodes(lab, ["n1", "n2"]) as nodes:
            yield lab, nodes


@pytest.fixture
def run(podman_lab: PodmanLab) -> Iterator[Run]:
    """``run(node, name, *command, publish=...)``; the test's containers are removed after it."""
    _, nodes = podman_lab
    started: list[tuple[PodmanNode, str]] = []

    def start(node: str, name: str, *command: str, publish: tuple[str, ...] = ()) -> str:
        name = f"{name}-{secrets.token_hex(3)}"
        started.append((nodes[node], name))
        nodes[node].run(name, *command, publish=publish)
        return name

    try:
        yield start
    finally:
        for pm, name in started:
            pm.podman("rm", "--force", "--ignore", "--time", "0", name, check=False)


def allocated(pm: PodmanNode, container_id: str) -> IPv4Address | None:
    """The address the node's agent holds for the container, if any."""
    for allocation in node_allocations(pm.node):
        if allocation.container_id == container_id:
            return allocation.ip
    return None


def counts(pm: PodmanNode) -> tuple[int, int]:
    """(assigned, cooling) addresses on the node, any release in the last hour cooling."""
    now = time.time()
    numbers = [pool.accounting(now, cooldown=3600) for pool in node_pools(pm.node)]
    return sum(n.assigned for n in numbers), sum(n.cooling for n in numbers)


def pings(pm: PodmanNode, container: str, address: IPv4Address) -> bool:
    return pm.exec(container, "ping", "-c", "1", "-W", "1", str(address)).returncode == 0


def dnat_rules(lab: Lab, node: str) -> str:
    return lab.exec(node, ["iptables", "-t", "nat", "-S", "CNI-HOSTPORT-DNAT"]).stdout


def test_containers_on_two_nodes_reach_each_other(podman_lab: PodmanLab, run: Run) -> None:
    lab, nodes = podman_lab
    a, b = nodes["n1"], nodes["n2"]
    c1, c2 = run("n1", "one", "sleep", "600"), run("n2", "two", "sleep", "600")

    ip1, ip2 = a.address(c1), b.address(c2)
    assert ip1 in IPv4Interface(lab.node("n1").overlay_address).network
    assert ip2 in IPv4Interface(lab.node("n2").overlay_address).network
    # The agent's IPAM holds each address under podman's container ID.
    assert allocated(a, a.inspect(c1)["Id"]) == ip1
    assert allocated(b, b.inspect(c2)["Id"]) == ip2
    # Podman requires the interface's MAC in the result; it must be the real one.
    mac = a.exec(c1, "cat", "/sys/class/net/eth0/address").stdout.strip()
    assert mac and a.network_settings(c1)["MacAddress"] == mac

    wait_until(lambda: pings(a, c1, ip2), timeout=10, what=f"{c1} on n1 pinging {ip2} on n2")
    wait_until(lambda: pings(b, c2, ip1), timeout=10, what=f"{c2} on n2 pinging {ip1} on n1")


def test_published_port_answers_on_the_node_address_from_another_node(
    podman_lab: PodmanLab, run: Run
) -> None:
    lab, nodes = podman_lab
    a = nodes["n1"]
    token = secrets.token_hex(8)
    web = run(
        "n1",
        "web",
        "sh",
        "-c",
        f"echo {token} > /tmp/index.html && exec httpd -f -p 80 -h /tmp",
        publish=(f"{HOST_PORT}:80",),
    )
    # The chained portmap plugin got podman's port mapping and wrote the DNAT rule.
    assert a.inspect(web)["Id"] in dnat_rules(lab, "n1")

    node_a = str(lab.node("n1").ip)

    def fetch() -> str:
        proc = lab.exec("n2", [sys.executable, "-c", HTTP_GET, node_a, str(HOST_PORT)], check=False)
        return proc.stdout if token in proc.stdout else ""

    reply = wait_until(fetch, timeout=10, what=f"GET {node_a}:{HOST_PORT} from n2 answering")
    assert reply.startswith("HTTP/1.") and " 200 " in reply.splitlines()[0]


def test_podman_rm_releases_the_address(podman_lab: PodmanLab, run: Run) -> None:
    lab, nodes = podman_lab
    a, b = nodes["n1"], nodes["n2"]
    web = run("n1", "gone", "sleep", "600", publish=(f"{HOST_PORT + 1}:80",))
    peer = run("n2", "gone", "sleep", "600")
    removed = []
    for pm, name in ((a, web), (b, peer)):
        info = pm.inspect(name)
        sandbox = info["NetworkSettings"]["SandboxKey"]
        removed.append((pm, name, info["Id"], pm.address(name), sandbox))
    counts_before = [(pm, counts(pm)) for pm in (a, b)]

    for pm, name, *_ in removed:
        pm.remove(name)

    for pm, name, container_id, address, sandbox in removed:
        assert allocated(pm, container_id) is None, f"{name} still holds {address}"
        assert sandbox and not os.path.exists(sandbox), f"{name}'s namespace {sandbox} is left"
    assert removed[0][2] not in dnat_rules(lab, "n1")
    # Released means cooling down, not free at once (counted with a cooldown
    # longer than the lab lives, so no earlier release leaves cooling meanwhile).
    for pm, (assigned, cooling) in counts_before:
        assert counts(pm) == (assigned - 1, cooling + 1), pm.node.name


def test_a_container_that_exits_releases_its_address(podman_lab: PodmanLab, run: Run) -> None:
    _, nodes = podman_lab
    b = nodes["n2"]
    short = run("n2", "short", "sleep", "2")
    container_id = b.inspect(short)["Id"]
    assert allocated(b, container_id) is not None
    # Nobody calls podman: conmon's exit command tears the network down (CNI DEL
    # from the node's namespace, which conmon inherited).
    wait_until(
        lambda: allocated(b, container_id) is None,
        timeout=15,
        what=f"the address of exited container {short} being released",
    )
    assert b.inspect(short)["State"]["Status"] == "exited"
