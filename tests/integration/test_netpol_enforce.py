"""NetworkPolicy enforced by the reconciler's adapter, judged by real packets.

A "node" namespace holds the bridge cni0; two "pods" (namespaces with a veth into it)
are web 10.244.1.2 and db 10.244.1.3, which serves TCP 8080. The policy lets only pods
labelled ``api`` reach db. The reconciler (fake netlink kernel, real ``nft`` and sysctls
in the node namespace) applies the compiled table: a TCP connect from web to db succeeds
without policy, fails once the policy is applied (the drop is counted in db's chain),
succeeds after one incremental transaction relabels web as api, and after the table is
deleted by hand (the connect gets through) the next pass puts it back (it fails again).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack

import pytest

from flannelpy.dataplane.libnft import LibNftables
from flannelpy.dataplane.netlink_host import set_sysctl
from flannelpy.dataplane.netns import netns_path, run_in_netns
from flannelpy.dataplane.nfgen import RulesetGeneration, ruleset_generation
from flannelpy.dataplane.policy_table import PolicyTable
from flannelpy.dataplane.reconciler import BRIDGE_NF_SYSCTLS, Reconciler
from flannelpy.dataplane.state import DesiredState
from flannelpy.netpol.compile import compile_node
from flannelpy.netpol.nft import TABLE, Ruleset, render
from tests.support.fakes import FakeKernel
from tests.support.netns_util import Netns, sh, temp_netns, unique_name
from tests.support.netpol_cases import NAMESPACES, NODE, pod, policy

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to create network namespaces"),
]

WEB, DB, PORT = "10.244.1.2", "10.244.1.3", 8080
ONLY_API_TO_DB = policy("db", {
    "podSelector": {"matchLabels": {"app": "db"}},
    "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "api"}}}],
                 "ports": [{"port": PORT}]}],
})  # fmt: skip
SERVER = (
    "import socket\n"
    "s = socket.socket()\n"
    "s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    f"s.bind(('0.0.0.0', {PORT}))\n"
    "s.listen()\n"
    "print('ready', flush=True)\n"
    "while True:\n"
    "    c, _ = s.accept()\n"
    "    c.sendall(b'hello')\n"
    "    c.close()\n"
)
CLIENT = (
    "import socket\n"
    f"s = socket.create_connection(('{DB}', {PORT}), timeout=1.0)\n"
    "print(s.recv(5).decode())\n"
)


def table(web_app: str) -> Ruleset:
    pods = [pod("web", web_app, WEB), pod("db", "db", DB)]
    return render(compile_node([ONLY_API_TO_DB], pods, NAMESPACES, NODE))


def connects(web: Netns) -> bool:
    """A TCP connect from web to db's port, answered within a second."""
    done = web.exec(["python3", "-c", CLIENT], check=False)
    return done.returncode == 0 and done.stdout.strip() == "hello"


class NodeKernel(FakeKernel):
    """No links, routes or neighbours to manage; sysctls written in the node namespace."""

    def __init__(self, node: Netns) -> None:
        super().__init__()
        self.node = node

    def set_sysctl(self, name: str, value: str) -> None:
        self.node.call(set_sysctl, name, value)


def plug(node: Netns, pod_ns: Netns, address: str) -> None:
    host = unique_name("vnp")
    node.ip(f"link add {host} type veth peer name eth0 netns {pod_ns.name}")
    node.ip(f"link set {host} master cni0 up")
    pod_ns.ip(f"addr add {address}/24 dev eth0")
    pod_ns.ip("link set eth0 up")


@pytest.fixture
def cluster() -> Iterator[tuple[Netns, Netns, Netns]]:
    with ExitStack() as stack:
        node = stack.enter_context(temp_netns("npnode"))
        web = stack.enter_context(temp_netns("npweb"))
        db = stack.enter_context(temp_netns("npdb"))
        node.ip("link add cni0 type bridge")
        node.ip("addr add 10.244.1.1/24 dev cni0")
        node.ip("link set cni0 up")
        plug(node, web, WEB)
        plug(node, db, DB)
        for name in BRIDGE_NF_SYSCTLS:  # off, as on a node where nothing set them yet
            node.exec(["sysctl", "-qw", f"{name}=0"])
        server = subprocess.Popen(
            ["ip", "netns", "exec", db.name, "python3", "-c", SERVER],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert server.stdout is not None
        stack.callback(server.stdout.close)
        stack.callback(server.wait, 10)
        stack.callback(server.kill)
        assert server.stdout.readline().strip() == "ready"
        yield node, web, db


def test_real_connections_follow_the_policy_and_a_deleted_table_comes_back(
    cluster: tuple[Netns, Netns, Netns],
) -> None:
    node, web, _ = cluster
    assert connects(web)  # the path works: no policy yet
    adapter = PolicyTable(command_prefix=("ip", "netns", "exec", node.name))
    reconciler = Reconciler(NodeKernel(node), 10.0, policy=adapter)

    reconciler.set_desired(DesiredState(policy=table("web")))
    assert reconciler.reconcile_once("test").converged  # type: ignore[union-attr]
    for name in BRIDGE_NF_SYSCTLS:
        assert node.exec(["sysctl", "-n", name]).stdout.strip() == "1"
    assert not connects(web)
    # Dropped by db's chain, into the named counter of the policy that isolates db.
    (deny,) = table("web").counters.values()
    assert (deny.namespace, deny.policy, deny.direction) == ("shop", "db", "ingress")
    assert adapter.counters(f"inet {TABLE}")[deny.name] >= 1

    reconciler.set_desired(DesiredState(policy=table("api")))  # web relabelled
    reconciler.reconcile_once("test")
    assert (adapter.transactions, reconciler.policy_rebuilds) == (2, 1)  # incremental
    assert connects(web)

    reconciler.set_desired(DesiredState(policy=table("web")))
    reconciler.reconcile_once("test")
    assert not connects(web)
    sh(["ip", "netns", "exec", node.name, "nft", "delete", "table", "inet", TABLE])
    assert connects(web)  # open while the table is gone
    reconciler.reconcile_once("periodic resync")
    assert reconciler.policy_rebuilds == 2  # replaced whole, in one transaction
    assert adapter.apply(table("web")) is None  # and as desired: nothing more to write
    assert not connects(web)


def test_in_process_with_the_generation_a_change_skips_the_read_back_but_not_a_hand_edit(
    cluster: tuple[Netns, Netns, Netns],
) -> None:
    node, web, _ = cluster

    def generation() -> int | None:
        return run_in_netns(netns_path(node.name), ruleset_generation)

    first = generation()
    assert first is not None
    # The agent's way: libnftables in-process, its context made in the node's namespace.
    nft = run_in_netns(netns_path(node.name), LibNftables.load)
    assert nft is not None
    adapter = PolicyTable(run=nft, generation=generation)
    reconciler = Reconciler(NodeKernel(node), 10.0, policy=adapter)
    reconciler.set_desired(DesiredState(policy=table("web")))
    reconciler.reconcile_once("test")
    assert generation() == first + 1  # our one transaction
    assert not connects(web)

    read = adapter.listings
    reconciler.set_desired(DesiredState(policy=table("api")))  # web relabelled
    reconciler.reconcile_once("test")
    assert adapter.listings == read + 1  # the reference after the write, no read before
    assert connects(web)
    reconciler.set_desired(DesiredState(policy=table("web")))  # and back
    reconciler.reconcile_once("test")
    assert not connects(web)

    # kube-proxy's kind of write, to another table: one read, found intact, no rebuild.
    sh(["ip", "netns", "exec", node.name, "nft", "add", "table", "ip", "elsewhere"])
    read = adapter.listings
    reconciler.reconcile_once("periodic resync")
    reconciler.reconcile_once("periodic resync")
    assert adapter.listings == read + 1
    assert (adapter.transactions, reconciler.policy_rebuilds) == (3, 1)

    # A rule slipped into our table by hand moves the generation: found and replaced.
    hand = ["nft", "insert", "rule", "inet", TABLE, "forward", "accept"]
    sh(["ip", "netns", "exec", node.name, *hand])
    assert connects(web)  # opened by the hand-made rule
    reconciler.reconcile_once("periodic resync")
    assert reconciler.policy_rebuilds == 2
    assert not connects(web)


def test_a_change_written_at_once_is_read_back_later_and_a_hand_edit_before_it_is_undone(
    cluster: tuple[Netns, Netns, Netns],
) -> None:
    """The agent's way for a policy change: written on the writer's thread at once
    (``set_desired_policy``), the read-back left to the reconciler's loop. A rule slipped
    in by hand before that read-back cannot be told from ours: the next change replaces
    the table whole, and the connection the hand opened is denied again."""
    node, web, _ = cluster
    nft = run_in_netns(netns_path(node.name), LibNftables.load)
    asker = run_in_netns(netns_path(node.name), lambda: _opened(RulesetGeneration()))
    assert nft is not None
    adapter = PolicyTable(run=nft, generation=asker)
    reconciler = Reconciler(NodeKernel(node), 10.0, policy=adapter)
    reconciler.set_desired(DesiredState(policy=table("web")))
    reconciler.reconcile_once("test")
    assert not connects(web)

    read = adapter.listings
    reconciler.set_desired_policy(DesiredState(policy=table("api")))  # web relabelled
    assert connects(web)  # in force before any read-back
    assert adapter.listings == read
    reconciler.set_desired_policy(DesiredState(policy=table("web")))  # and back
    assert not connects(web) and adapter.listings == read

    hand = ["nft", "insert", "rule", "inet", TABLE, "forward", "accept"]
    sh(["ip", "netns", "exec", node.name, *hand])
    assert connects(web)  # opened by the hand-made rule
    adapter.remember()  # the loop's read-back: the generation moved, none is taken
    assert adapter.listings == read
    reconciler.set_desired_policy(DesiredState(policy=table("api")))
    reconciler.set_desired_policy(DesiredState(policy=table("web")))
    assert reconciler.policy_rebuilds == 2  # at start, and the unverified table
    assert not connects(web)
    asker.close()


def _opened(asker: RulesetGeneration) -> RulesetGeneration:
    """The asker with its socket made in the calling thread's namespace."""
    assert asker() is not None
    return asker
