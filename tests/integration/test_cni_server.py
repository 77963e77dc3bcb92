"""The agent's CNI server end to end: real IPAM, real kernel, namespaces we create.

Layout of every test: a throwaway "node" namespace where the server's threads
run (``CniServer(netns=...)``: the bridge and host veth ends live there, as
they would in the node's namespace in production), and one throwaway
namespace per pod. Requests go through the thin executable's own ``forward``
(the bytes the real executable sends) and once through the executable itself.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Interface, IPv4Network, IPv6Network
from pathlib import Path
from typing import Any

import pytest

from cni_plugin import client
from flannelpy.cni import CniHandler, CniServer, CniSettings, PodNetwork, RecordStore, wire
from flannelpy.dataplane.podnames import host_veth_name
from flannelpy.errors import DataplaneError
from flannelpy.ipam import NodeIpam
from tests.support.netns_util import Netns, add_netns, is_root, sh, temp_netns, unique_name
from tests.support.waiting import wait_until

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(not is_root(), reason="network namespaces need root"),
]

SUBNET = IPv4Network("10.244.1.0/24")
GATEWAY = IPv4Address("10.244.1.1")
MTU = 1400
NETWORK = "fpnet"
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Node:
    """A CNI server in its own "node" namespace, with the parts it was built from."""

    ns: Netns
    socket: str
    ipam: NodeIpam
    records: RecordStore
    pods: PodNetwork
    handler: CniHandler
    state: dict[str, Any] = field(default_factory=lambda: {"ready": True})
    stack: ExitStack = field(default_factory=ExitStack)

    def config(self, **extra: Any) -> dict[str, Any]:
        doc = {
            "cniVersion": "1.0.0",
            "name": NETWORK,
            "type": "flannelpy",
            "agentSocket": self.socket,
        }
        doc.update(extra)
        return doc

    def request(
        self,
        command: str,
        container_id: str = "",
        netns: str = "",
        ifname: str = "eth0",
        config: dict[str, Any] | None = None,
        stdin: bytes | None = None,
        env: dict[str, str] | None = None,
        pass_fd: bool = True,
    ) -> tuple[int, Any]:
        """One CNI call as the executable makes it (CNI_NETNS opened and passed for ADD,
        CHECK and DEL unless not ``pass_fd``); (exit code, parsed stdout or None)."""
        full_env = {
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": container_id,
            "CNI_NETNS": netns,
            "CNI_IFNAME": ifname,
            "CNI_PATH": "/opt/cni/bin",
        }
        full_env.update(env or {})
        body = stdin if stdin is not None else json.dumps(config or self.config()).encode()
        fd = client.open_netns(os.fsencode(full_env["CNI_NETNS"])) if pass_fd else None
        if full_env["CNI_COMMAND"] not in ("ADD", "CHECK", "DEL") and fd is not None:
            os.close(fd)
            fd = None
        try:
            code, out = client.forward(self.socket, wire.encode_request(full_env, body), fd)
        finally:
            if fd is not None:
                os.close(fd)
        return code, (json.loads(out) if out else None)

    def add(self, cid: str, pod: str, **kw: Any) -> tuple[int, Any]:
        return self.request("ADD", cid, pod, **kw)

    def delete(self, cid: str, pod: str = "", **kw: Any) -> tuple[int, Any]:
        return self.request("DEL", cid, pod, **kw)

    def pod(self, prefix: str = "p") -> str:
        """A new pod namespace (deleted at the end of the test); returns its path."""
        name = unique_name(f"fpc{prefix}", max_len=40)
        add_netns(name)
        self.stack.callback(sh, ["ip", "netns", "del", name], False)
        return f"/run/netns/{name}"

    def links(self) -> dict[str, dict[str, Any]]:
        """The node namespace's links by name (``ip -d -j link``)."""
        out = self.ns.exec("ip -d -j link show").stdout
        return {link["ifname"]: link for link in json.loads(out)}

    def veths(self) -> list[str]:
        return [n for n in self.links() if n.startswith("veth")]


@contextmanager
def make_node(*subnets: IPv4Network | IPv6Network, **settings: Any) -> Iterator[Node]:
    """A node namespace serving CNI on a socket; leases ``subnets`` (default ``SUBNET``)."""
    state_dir = tempfile.mkdtemp(prefix="fpcni")  # short: a socket path must fit 108 bytes
    try:
        with temp_netns("cn") as ns:
            ipam = NodeIpam(os.path.join(state_dir, "ipam"))
            ipam.set_leases(list(subnets) or [SUBNET])
            records = RecordStore(os.path.join(state_dir, "records"))
            pods = PodNetwork()
            state = {"ready": True}
            cni_settings = CniSettings(
                mtu_provider=lambda: MTU, ready=lambda: bool(state["ready"]), **settings
            )
            handler = CniHandler(ipam, pods, records, cni_settings)
            sock = os.path.join(state_dir, "run", "cni.sock")
            server = CniServer(sock, handler.handle, netns=ns.name)
            node = Node(ns, sock, ipam, records, pods, handler, state)
            server.start()
            try:
                with node.stack:
                    yield node
            finally:
                server.stop()
                ipam.close()
    finally:
        shutil.rmtree(state_dir, ignore_errors=True)


@pytest.fixture
def node() -> Iterator[Node]:
    with make_node() as n:
        yield n


def in_pod(pod: str, cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return sh(["ip", "netns", "exec", os.path.basename(pod), *cmd.split()], check=check)


def pod_ip(result: dict[str, Any]) -> IPv4Address:
    return IPv4Interface(result["ips"][0]["address"]).ip


def assert_no_state(node: Node, cid: str = "") -> None:
    """Nothing of a refused or undone ADD is left: no veth, no allocation, no record."""
    assert node.veths() == []
    allocations = node.ipam.allocations()
    assert [a for a in allocations if not cid or a.container_id == cid] == []
    assert node.records.list() == []


# --- ADD ----------------------------------------------------------------------------


def test_two_pods_get_addresses_and_reach_each_other_at_the_mtu(node: Node) -> None:
    p1, p2 = node.pod(), node.pod()
    code1, r1 = node.add("c1", p1)
    code2, r2 = node.add("c2", p2)
    assert (code1, code2) == (0, 0), (r1, r2)
    ip1, ip2 = pod_ip(r1), pod_ip(r2)
    assert ip1 != ip2 and ip1 in SUBNET and ip2 in SUBNET and GATEWAY not in (ip1, ip2)

    host, pod_if = r1["interfaces"]
    assert host["name"] == host_veth_name(p1, "c1", "eth0") and "sandbox" not in host
    assert pod_if == {"name": "eth0", "mac": pod_if["mac"], "sandbox": p1}
    assert r1["ips"] == [{"interface": 1, "address": f"{ip1}/24", "gateway": str(GATEWAY)}]
    assert r1["routes"] == [{"dst": "0.0.0.0/0", "gw": str(GATEWAY)}]
    assert r1["cniVersion"] == "1.0.0"

    links = node.links()
    assert links["cni0"]["mtu"] == MTU and "UP" in links["cni0"]["flags"]
    veth = links[host["name"]]
    assert veth["master"] == "cni0" and veth["mtu"] == MTU
    assert veth["address"] == host["mac"]
    assert veth["linkinfo"]["info_slave_data"]["hairpin"] is True
    addrs = json.loads(node.ns.exec("ip -j -4 addr show dev cni0").stdout)[0]["addr_info"]
    assert [(a["local"], a["prefixlen"]) for a in addrs] == [(str(GATEWAY), 24)]

    eth0 = json.loads(in_pod(p1, "ip -j -d addr show dev eth0").stdout)[0]
    assert eth0["mtu"] == MTU and eth0["address"] == pod_if["mac"]
    assert "default via 10.244.1.1 dev eth0" in in_pod(p1, "ip route").stdout

    in_pod(p1, f"ping -c 1 -W 2 {ip2}")
    in_pod(p2, f"ping -c 1 -W 2 {GATEWAY}")
    # DF at exactly the MTU passes; one byte more is refused locally (no -q: see design.md).
    in_pod(p1, f"ping -c 1 -W 2 -M do -s {MTU - 28} {ip2}")
    too_big = in_pod(p1, f"ping -c 1 -W 2 -M do -s {MTU - 27} {ip2}", check=False)
    assert too_big.returncode != 0 and "message too long" in too_big.stderr + too_big.stdout


def test_add_again_returns_the_same_result_in_the_requested_version(node: Node) -> None:
    pod = node.pod()
    code, first = node.add("c1", pod)
    assert code == 0
    again = node.add("c1", pod)
    assert again == (0, first)
    code, legacy = node.add("c1", pod, config=node.config(cniVersion="0.3.1"))
    assert code == 0 and legacy["cniVersion"] == "0.3.1"
    assert legacy["ips"] == [{"version": "4", **first["ips"][0]}]
    assert len(node.veths()) == 1 and len(node.ipam.allocations()) == 1


def test_add_after_the_pod_interface_vanished_rebuilds_it_with_the_same_address(
    node: Node,
) -> None:
    pod = node.pod()
    _, first = node.add("c1", pod)
    node.ns.ip(f"link del {first['interfaces'][0]['name']}")
    code, second = node.add("c1", pod)
    assert code == 0 and pod_ip(second) == pod_ip(first)
    in_pod(pod, f"ping -c 1 -W 2 {GATEWAY}")


def test_the_real_executable_drives_the_server(node: Node) -> None:
    pod = node.pod()
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": "exe1",
        "CNI_NETNS": pod,
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/opt/cni/bin",
    }
    run = subprocess.run(
        [sys.executable, "-I", "-S", str(REPO / "cni_plugin" / "client.py")],
        input=json.dumps(node.config()).encode(),
        env=env,
        capture_output=True,
        timeout=30,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert pod_ip(json.loads(run.stdout)) in SUBNET
    run = subprocess.run(
        [sys.executable, "-I", "-S", str(REPO / "cni_plugin" / "client.py")],
        input=json.dumps(node.config()).encode(),
        env={**env, "CNI_COMMAND": "DEL"},
        capture_output=True,
        timeout=30,
    )
    assert (run.returncode, run.stdout) == (0, b"")
    assert_no_state(node)


# --- DEL ----------------------------------------------------------------------------


def test_del_removes_everything_and_is_idempotent(node: Node) -> None:
    pod = node.pod()
    _, result = node.add("c1", pod)
    assert node.delete("c1", pod) == (0, None)
    assert node.veths() == []
    assert "eth0" not in in_pod(pod, "ip -br link").stdout
    assert node.ipam.find("c1", "eth0") is None and node.records.list() == []
    assert node.delete("c1", pod) == (0, None)
    assert node.delete("c1") == (0, None)  # CNI_NETNS is optional on DEL
    assert pod_ip(result) not in {a.ip for a in node.ipam.allocations()}


def test_del_after_the_namespace_is_gone_still_releases(node: Node) -> None:
    pod = node.pod()
    node.add("c1", pod)
    sh(["ip", "netns", "del", os.path.basename(pod)])
    assert node.delete("c1", pod) == (0, None)
    assert_no_state(node)


def test_del_without_a_record_releases_and_deletes_the_interface(node: Node) -> None:
    pod = node.pod()
    node.add("c1", pod)
    for record in node.records.list():
        node.records.delete(record.network, record.container_id, record.ifname)
    assert node.delete("c1", pod) == (0, None)
    assert_no_state(node)
    assert "eth0" not in in_pod(pod, "ip -br link").stdout


def test_released_address_cools_down_and_exhaustion_says_so() -> None:
    # A /29 has 5 pod addresses (.2-.6): fill it, free one, and the next ADD must
    # still fail, because a cooling address is not free.
    with make_node(IPv4Network("10.244.9.0/29")) as node:
        pods = [node.pod() for _ in range(6)]
        got = [node.add(f"c{i}", pods[i]) for i in range(5)]
        assert [code for code, _ in got] == [0] * 5
        freed = pod_ip(got[0][1])
        assert node.delete("c0", pods[0]) == (0, None)
        code, err = node.add("c5", pods[5])
        assert code == 1 and err["code"] == 100
        assert err["msg"].startswith("no free address in 10.244.9.0/29: 4 assigned, 1 cooling down")
        assert node.veths() and len(node.veths()) == 4  # the refused ADD left nothing
        assert node.records.read(NETWORK, "c5", "eth0") is None
        # A network configured without cooldown may take it at once.
        code, result = node.add("c5", pods[5], config=node.config(ipCooldownSeconds=0))
        assert code == 0 and pod_ip(result) == freed


# --- CHECK, STATUS, GC -----------------------------------------------------------------


def test_check_passes_then_reports_what_broke(node: Node) -> None:
    pod = node.pod()
    _, result = node.add("c1", pod)
    assert node.request("CHECK", "c1", pod) == (0, None)
    in_pod(pod, "ip addr flush dev eth0")
    code, err = node.request("CHECK", "c1", pod)
    assert code == 1 and err["code"] == 999
    assert f"lacks address {result['ips'][0]['address']}" in err["msg"]
    assert "default route" in err["msg"]  # it went with the address
    code, err = node.request("CHECK", "nope", pod)
    assert code == 1 and err["code"] == 3
    code, err = node.request("CHECK", "c1", pod, config=node.config(cniVersion="0.3.1"))
    assert code == 1 and err["code"] == 1


def test_status_follows_readiness_and_add_waits_for_it(node: Node) -> None:
    config = node.config(cniVersion="1.1.0")
    assert node.request("STATUS", config=config) == (0, None)
    node.state["ready"] = False
    code, err = node.request("STATUS", config=config)
    assert code == 1 and err["code"] == 50
    code, err = node.add("c1", node.pod())
    assert code == 1 and err["code"] == 11
    assert_no_state(node)


def test_gc_drops_attachments_the_runtime_no_longer_lists(node: Node) -> None:
    keep_pod, drop_pod = node.pod(), node.pod()
    node.add("keep", keep_pod)
    _, dropped = node.add("drop", drop_pod)
    valid = [{"containerID": "keep", "ifname": "eth0"}]
    config = node.config(cniVersion="1.1.0", **{"cni.dev/valid-attachments": valid})
    assert node.request("GC", config=config) == (0, None)
    assert [r.container_id for r in node.records.list()] == ["keep"]
    assert [a.container_id for a in node.ipam.allocations()] == ["keep"]
    assert dropped["interfaces"][0]["name"] not in node.links()
    assert node.request("CHECK", "keep", keep_pod) == (0, None)


def test_gc_dead_releases_pods_whose_namespace_is_gone(node: Node) -> None:
    alive, dead = node.pod(), node.pod()
    node.add("alive", alive)
    node.add("dead", dead)
    sh(["ip", "netns", "del", os.path.basename(dead)])
    # gc_dead judges a pod by its host veth (the agent need not see CNI_NETNS paths);
    # the kernel removes it with the namespace, asynchronously.
    deadline = time.monotonic() + 10
    while len(node.veths()) > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    # An address no record explains: an ADD that died between IPAM and the record.
    node.ipam.allocate("crashed", "eth0")
    released = node.ns.call(node.handler.gc_dead)
    assert sorted(released) == [("crashed", "eth0"), ("dead", "eth0")]
    assert [a.container_id for a in node.ipam.allocations()] == ["alive"]
    assert [r.container_id for r in node.records.list()] == ["alive"]
    assert len(node.veths()) == 1


# --- failures leave nothing behind ----------------------------------------------------


@pytest.mark.parametrize(
    ("target", "method", "code"),
    [
        ("pods", "_configure_pod_side", 999),  # veth made, pod side fails
        ("pods", "_create_veth", 999),  # address allocated, veth fails
        ("records", "stage", 5),  # everything done, the record cannot be written
        ("records", "publish", 5),  # its content written, it cannot be put in place
    ],
)
def test_a_failure_half_way_undoes_every_step(
    node: Node, monkeypatch: pytest.MonkeyPatch, target: str, method: str, code: int
) -> None:
    def fail(*args: object, **kwargs: object) -> None:
        if target == "records":
            raise OSError(28, "No space left on device")
        raise DataplaneError(f"injected failure in {method}")

    monkeypatch.setattr(getattr(node, target), method, fail)
    pod = node.pod()
    status, err = node.add("c1", pod)
    assert status == 1 and err["code"] == code, err
    assert_no_state(node)
    assert "eth0" not in in_pod(pod, "ip -br link").stdout
    monkeypatch.undo()
    assert node.add("c1", pod)[0] == 0  # and a retry works


def bad_requests(node: Node, pod: str) -> list[tuple[str, dict[str, Any], int]]:
    """(what, request kwargs, expected code) for input that must change nothing."""
    good = node.config()
    return [
        ("malformed JSON", {"stdin": b'{"cniVersion": "1.0.0", '}, 6),
        ("not an object", {"stdin": b"[1, 2]"}, 6),  # skel's code: it cannot decode one
        ("no name", {"config": {k: v for k, v in good.items() if k != "name"}}, 7),
        ("old cniVersion", {"config": {**good, "cniVersion": "0.2.0"}}, 1),
        ("ifname with /", {"ifname": "eth0/x"}, 4),
        ("ifname too long", {"ifname": "e" * 16}, 4),
        ("container ../", {"container_id": "../../etc"}, 4),
        ("network ../", {"config": {**good, "name": "../../etc"}}, 7),
        ("netns missing", {"netns": pod + "-missing"}, 4),
        ("no command", {"env": {"CNI_COMMAND": ""}}, 4),
        ("unknown command", {"env": {"CNI_COMMAND": "ATTACH"}}, 4),
        ("no ifname", {"ifname": ""}, 4),
        ("bad cooldown", {"config": {**good, "ipCooldownSeconds": -1}}, 7),
        ("bad bridge", {"config": {**good, "bridge": "a/b"}}, 7),
    ]


def test_bad_input_gets_a_spec_error_and_changes_nothing(node: Node) -> None:
    pod = node.pod()
    for what, kwargs, expected in bad_requests(node, pod):
        args = {"container_id": "c1", "netns": pod, **kwargs}
        command = args.pop("command", "ADD")
        code, err = node.request(command, **args)
        assert code == 1, what
        assert err["code"] == expected, (what, err)
        assert set(err) >= {"cniVersion", "code", "msg"} and err["msg"], what
        assert_no_state(node)
    assert "cni0" not in node.links()  # not even the bridge
    assert "eth0" not in in_pod(pod, "ip -br link").stdout


def test_a_garbled_request_gets_an_error_reply(node: Node) -> None:
    code, out = client.forward(node.socket, b"GET / HTTP/1.0\r\n\r\n")
    assert code == 1 and json.loads(out)["code"] == 5


# --- the socket ---------------------------------------------------------------------


def test_socket_is_root_only_and_replaces_a_stale_one() -> None:
    folder = tempfile.mkdtemp(prefix="fpcnis")
    try:
        path = os.path.join(folder, "sub", "cni.sock")
        os.makedirs(os.path.dirname(path))
        Path(path).write_text("stale")
        server = CniServer(path, lambda env, stdin: (0, b"ok:" + env["CNI_COMMAND"].encode()))
        server.start()
        try:
            assert os.stat(path).st_mode & 0o777 == 0o600
            assert client.forward(path, wire.encode_request({"CNI_COMMAND": "X"}, b"")) == (
                0,
                b"ok:X",
            )
        finally:
            server.stop()
        assert not os.path.exists(path)
        fresh = os.path.join(folder, "new", "cni.sock")
        server = CniServer(fresh, lambda env, stdin: (0, b""))
        server.start()
        server.stop()
        assert os.stat(os.path.dirname(fresh)).st_mode & 0o777 == 0o700
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_a_handler_that_raises_still_answers_999() -> None:
    folder = tempfile.mkdtemp(prefix="fpcnis")

    def broken(env: dict[str, str], stdin: bytes) -> tuple[int, bytes]:
        raise RuntimeError("boom")

    try:
        path = os.path.join(folder, "cni.sock")
        server = CniServer(path, broken)
        server.start()
        try:
            code, out = client.forward(path, wire.encode_request({"CNI_COMMAND": "ADD"}, b"{}"))
        finally:
            server.stop()
        assert code == 1 and json.loads(out)["code"] == 999 and "boom" in json.loads(out)["msg"]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_after_reply_runs_once_the_client_has_its_answer_with_the_fd_still_open() -> None:
    """The hook (the agent's pod listeners) costs the runtime's call nothing: the client
    has read its reply before the hook ends, and the hook still sees the namespace."""
    folder = tempfile.mkdtemp(prefix="fpcnis")
    answered = threading.Event()
    heard: list[tuple[str, int, bytes, bool, bool]] = []

    def hook(env: dict[str, str], stdin: bytes, fd: int | None, code: int, out: bytes) -> None:
        client_had_it = answered.wait(10)
        assert fd is not None
        ns_type = fcntl.ioctl(fd, 0xB703)  # NS_GET_NSTYPE: still an open namespace
        heard.append((env["CNI_COMMAND"], code, out, client_had_it, ns_type == 0x40000000))

    try:
        path = os.path.join(folder, "cni.sock")
        server = CniServer(path, lambda env, stdin, fd=None: (0, b"ok"), after_reply=hook)
        server.start()
        try:
            fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                request = wire.encode_request({"CNI_COMMAND": "ADD"}, b"{}")
                assert client.forward(path, request, fd) == (0, b"ok")
            finally:
                os.close(fd)
            answered.set()
            wait_until(lambda: heard, 10, "the after-reply hook")
        finally:
            server.stop()
        assert heard == [("ADD", 0, b"ok", True, True)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_requests_are_served_concurrently() -> None:
    """Ten requests that each block until all ten are in: only a threaded server passes."""
    folder = tempfile.mkdtemp(prefix="fpcnis")
    barrier = threading.Barrier(10, timeout=10)

    def waits(env: dict[str, str], stdin: bytes) -> tuple[int, bytes]:
        barrier.wait()
        return 0, b""

    try:
        path = os.path.join(folder, "cni.sock")
        server = CniServer(path, waits)
        server.start()
        try:
            with ThreadPoolExecutor(10) as pool:
                codes = list(
                    pool.map(
                        lambda _: client.forward(path, wire.encode_request({}, b""))[0], range(10)
                    )
                )
        finally:
            server.stop()
        assert codes == [0] * 10
    finally:
        shutil.rmtree(folder, ignore_errors=True)


# --- many pods at once ------------------------------------------------------------------


def timed(fn: Callable[[], tuple[int, Any]]) -> tuple[int, Any, float]:
    start = time.perf_counter()
    code, out = fn()
    return code, out, time.perf_counter() - start


def test_fifty_concurrent_adds_then_fifty_concurrent_dels(node: Node) -> None:
    pods = [node.pod() for _ in range(50)]
    with ThreadPoolExecutor(50) as pool:
        adds = list(pool.map(lambda i: timed(lambda: node.add(f"c{i}", pods[i])), range(50)))
    assert [code for code, _, _ in adds] == [0] * 50, [out for c, out, _ in adds if c]
    ips = {pod_ip(out) for _, out, _ in adds}
    assert len(ips) == 50
    assert len(node.veths()) == 50 and len(node.records.list()) == 50
    in_pod(pods[0], f"ping -c 1 -W 2 {pod_ip(adds[49][1])}")
    with ThreadPoolExecutor(50) as pool:
        dels = list(pool.map(lambda i: timed(lambda: node.delete(f"c{i}", pods[i])), range(50)))
    assert [code for code, _, _ in dels] == [0] * 50
    assert_no_state(node)
    print(
        f"\n50 concurrent: ADD median {statistics.median(t for *_, t in adds) * 1e3:.1f} ms,"
        f" DEL median {statistics.median(t for *_, t in dels) * 1e3:.1f} ms"
    )


def test_sequential_latency(node: Node) -> None:
    """Not a benchmark (bench/ is): prints medians so a regression is visible in -s runs."""
    pods = [node.pod() for _ in range(20)]
    node.add("warm", node.pod())
    adds = [timed(functools.partial(node.add, f"s{i}", pods[i]))[2] for i in range(20)]
    dels = [timed(functools.partial(node.delete, f"s{i}", pods[i]))[2] for i in range(20)]
    print(
        f"\nsequential: ADD median {statistics.median(adds) * 1e3:.2f} ms,"
        f" DEL median {statistics.median(dels) * 1e3:.2f} ms"
    )
    assert len(node.records.list()) == 1
