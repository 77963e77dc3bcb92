"""CNI_NETNS reaches the agent as an open namespace, whatever the agent's mount namespace.

The runtime's path may mean nothing where the agent runs: containerd with
``netns_mounts_under_state_dir`` bind-mounts namespaces in its own mount
namespace (the agent's view of the path is an empty file), cri-dockerd passes
``/proc/<pid>/ns/net`` of a PID namespace the agent does not share. The real
executables (both) open the path where the runtime runs them and pass the
descriptor; these tests recreate each case with a CNI server in this process
(tests/integration/test_cni_server.py's Node) and check the pod by its packets.
"""

from __future__ import annotations

import array
import json
import os
import select
import shutil
import socket
import stat
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from ipaddress import IPv4Interface
from typing import Any

import pytest

from cni_plugin import client
from flannelpy.cni import CniServer, spec, wire
from tests.integration.test_cni_client import Exes, exes  # noqa: F401  (the fixture)
from tests.integration.test_cni_server import Node, assert_no_state, in_pod, node  # noqa: F401
from tests.support.netns_util import is_root, sh

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(not is_root(), reason="network namespaces need root"),
]

# A shell that runs the executable in a mount namespace of its own, where $NS_PATH
# (an empty file in ours) is the pod's namespace, bind-mounted over a private tmpfs:
# what containerd's netns_mounts_under_state_dir looks like from another container.
HIDDEN = (
    'mount -t tmpfs fpcni "$NS_DIR" && touch "$NS_PATH" && mount --bind "$NS_SOURCE" "$NS_PATH"'
    ' && exec "$CNI_EXE"'
)


@pytest.fixture
def hidden_dir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="fpns-", dir="/tmp")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def cni_env(command: str, cid: str, netns: str, **extra: str) -> dict[str, str]:
    return {
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": cid,
        "CNI_NETNS": netns,
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/opt/cni/bin",
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        **extra,
    }


def run_cni(
    argv: list[str], env: dict[str, str], stdin: bytes
) -> tuple[int, dict[str, Any] | None]:
    proc = subprocess.run(argv, env=env, input=stdin, capture_output=True, timeout=60, check=False)
    assert proc.stderr == b"", proc.stderr
    return proc.returncode, (json.loads(proc.stdout) if proc.stdout else None)


def run_hidden(
    exe: str, command: str, cid: str, source: str, directory: str, stdin: bytes
) -> tuple[int, dict[str, Any] | None]:
    """The executable with CNI_NETNS = a path only its own mount namespace resolves."""
    path = os.path.join(directory, "ns")
    env = cni_env(command, cid, path, NS_DIR=directory, NS_PATH=path, NS_SOURCE=source, CNI_EXE=exe)
    argv = ["unshare", "--mount", "--propagation", "private", "sh", "-c", HIDDEN]
    return run_cni(argv, env, stdin)


def ping_from_node(cni_node: Node, address: str) -> None:
    ip = IPv4Interface(address).ip
    cni_node.ns.exec(f"ping -c 1 -W 2 {ip}")


# --- (a) a namespace the agent's mount namespace cannot see ---------------------------


@pytest.mark.parametrize("kind", ["python", "c"])
def test_a_netns_only_the_runtime_can_see_is_plumbed(
    exes: Exes,  # noqa: F811
    node: Node,  # noqa: F811
    hidden_dir: str,
    kind: str,
) -> None:
    exe = dict(exes.both())[kind]
    pod = node.pod()
    path = os.path.join(hidden_dir, "ns")
    open(path, "w").close()  # what the agent sees there: an empty file, as under containerd
    assert stat.S_ISREG(os.stat(path).st_mode) and os.stat(path).st_size == 0
    stdin = json.dumps(node.config()).encode()

    code, result = run_hidden(exe, "ADD", "hidden", pod, hidden_dir, stdin)
    assert code == 0, result
    assert result is not None and result["interfaces"][1]["sandbox"] == path  # the identity
    address = result["ips"][0]["address"]
    assert address in in_pod(pod, "ip -br addr show eth0").stdout
    ping_from_node(node, address)
    (record,) = node.records.list()
    assert record.netns == path

    assert run_hidden(exe, "CHECK", "hidden", pod, hidden_dir, stdin) == (0, None)
    assert run_hidden(exe, "DEL", "hidden", pod, hidden_dir, stdin) == (0, None)
    assert_no_state(node)
    assert "eth0" not in in_pod(pod, "ip -br link").stdout


def test_gc_at_start_keeps_a_pod_whose_netns_path_the_agent_cannot_see(
    exes: Exes,  # noqa: F811
    node: Node,  # noqa: F811
    hidden_dir: str,
) -> None:
    pod = node.pod()
    stdin = json.dumps(node.config()).encode()
    code, result = run_hidden(exes.c, "ADD", "kept", pod, hidden_dir, stdin)
    assert code == 0 and result is not None
    assert not os.path.exists(os.path.join(hidden_dir, "ns"))  # nothing there for the agent
    assert node.ns.call(node.handler.gc_dead) == []
    assert [r.container_id for r in node.records.list()] == ["kept"]
    ping_from_node(node, result["ips"][0]["address"])
    assert run_hidden(exes.c, "DEL", "kept", pod, hidden_dir, stdin) == (0, None)
    assert_no_state(node)


@pytest.mark.parametrize("netns", ["empty-file", "missing"])
def test_del_succeeds_from_the_record_when_the_namespace_cannot_be_used(
    exes: Exes,  # noqa: F811
    node: Node,  # noqa: F811
    hidden_dir: str,
    netns: str,
) -> None:
    pod = node.pod()
    path = os.path.join(hidden_dir, "ns")
    open(path, "w").close()
    stdin = json.dumps(node.config()).encode()
    for kind, exe in exes.both():
        cid = f"del-{kind}"
        assert run_hidden(exe, "ADD", cid, pod, hidden_dir, stdin)[0] == 0
        if netns == "missing":
            os.unlink(path)
        # Run where the path is the empty file (an fd that is no namespace) or nothing
        # (no fd at all): the veth goes by its host end, from the record.
        assert run_cni([exe], cni_env("DEL", cid, path), stdin) == (0, None)
        assert_no_state(node)
        assert "eth0" not in in_pod(pod, "ip -br link").stdout
        open(path, "w").close()


# --- (b) anything but a network namespace is refused -------------------------------------


@pytest.mark.parametrize("target", ["regular-file", "mount-namespace", "directory", "fifo"])
def test_a_netns_that_is_no_network_namespace_is_refused(
    exes: Exes,  # noqa: F811
    node: Node,  # noqa: F811
    hidden_dir: str,
    target: str,
) -> None:
    path = {
        "regular-file": os.path.join(hidden_dir, "ns"),
        "mount-namespace": "/proc/self/ns/mnt",  # the executable's own, opened by it
        "directory": hidden_dir,
        "fifo": os.path.join(hidden_dir, "fifo"),  # opened without blocking: no hang
    }[target]
    if target == "regular-file":
        open(path, "w").close()
    if target == "fifo":
        os.mkfifo(path)
    stdin = json.dumps(node.config()).encode()
    for command in ("ADD", "CHECK"):
        for kind, exe in exes.both():
            code, err = run_cni([exe], cni_env(command, "c1", path), stdin)
            assert code == 1 and err is not None, (kind, command)
            assert err["code"] == spec.Code.INVALID_ENVIRONMENT, (kind, command, err)
            assert "is not a network namespace" in err["msg"] and path in err["msg"], err
            assert_no_state(node)
    assert "cni0" not in node.links()  # refused before anything was made


def test_an_old_executable_gets_an_error_naming_the_fix(node: Node, hidden_dir: str) -> None:  # noqa: F811
    # No fd (an executable from before): the agent opens the path and finds the
    # empty file its mount namespace shows.
    path = os.path.join(hidden_dir, "ns")
    open(path, "w").close()
    code, err = node.request("ADD", "old", path, pass_fd=False)
    assert code == 1 and err["code"] == spec.Code.INVALID_ENVIRONMENT
    assert "install the current flannelpy-cni" in err["msg"] and path in err["msg"]
    assert_no_state(node)
    # Where the agent does see the namespace, the fallback still plumbs it.
    pod = node.pod()
    code, result = node.request("ADD", "old", pod, pass_fd=False)
    assert code == 0, result
    ping_from_node(node, result["ips"][0]["address"])
    assert node.request("DEL", "old", pod, pass_fd=False) == (0, None)
    assert_no_state(node)


# --- (c) /proc/<pid>/ns/net, as cri-dockerd passes it -----------------------------------

# In a PID namespace of its own (the agent's /proc does not show its processes: the
# same number names another process there), a sleeper holds a fresh network namespace
# and the executable is run with CNI_NETNS=/proc/<its pid>/ns/net, one command a line.
PROC_DRIVER = r"""
unshare --net sleep 600 &
sleeper=$!
# Until the child has unshared, its /proc entry still shows this shell's namespace.
while [ "$(readlink /proc/$sleeper/ns/net)" = "$(readlink /proc/$$/ns/net)" ]; do sleep 0.01; done
echo "pid $sleeper"
while read -r command; do
  CNI_COMMAND=$command CNI_NETNS=/proc/$sleeper/ns/net "$CNI_EXE" <"$CNI_CONF" >"$OUT/$command"
  echo "done $command $?"
done
kill $sleeper
"""


class ProcDriver:
    def __init__(self, exe: str, conf: str, out: str) -> None:
        env = cni_env("", "proc", "", CNI_EXE=exe, CNI_CONF=conf, OUT=out)
        del env["CNI_COMMAND"], env["CNI_NETNS"]
        self.out = out
        self.proc = subprocess.Popen(
            ["unshare", "--pid", "--fork", "--mount-proc", "sh", "-c", PROC_DRIVER],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.pid = int(self._line().split()[1])

    def _line(self) -> str:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], 30)
        assert ready, "the driver did not answer"
        return self.proc.stdout.readline().strip()

    def run(self, command: str) -> tuple[int, dict[str, Any] | None]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        done, name, code = self._line().split()
        assert (done, name) == ("done", command)
        with open(os.path.join(self.out, command), "rb") as f:
            out = f.read()
        return int(code), (json.loads(out) if out else None)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()  # its PID namespace (and the sleeper) goes with it
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


@pytest.mark.parametrize("kind", ["python", "c"])
def test_proc_pid_ns_net_of_another_pid_namespace_works(
    exes: Exes,  # noqa: F811
    node: Node,  # noqa: F811
    hidden_dir: str,
    kind: str,
) -> None:
    conf = os.path.join(hidden_dir, "conf.json")
    with open(conf, "w") as f:
        json.dump(node.config(), f)
    driver = ProcDriver(dict(exes.both())[kind], conf, hidden_dir)
    try:
        # The number means another process here: the path would be the wrong namespace.
        assert driver.pid < 10
        code, result = driver.run("ADD")
        assert code == 0, result
        assert result is not None
        assert result["interfaces"][1]["sandbox"] == f"/proc/{driver.pid}/ns/net"
        ping_from_node(node, result["ips"][0]["address"])
        # Not in the namespace the path names here (that of this PID namespace's process).
        assert result["interfaces"][1]["mac"] not in sh(["ip", "-br", "link"]).stdout
        assert driver.run("CHECK") == (0, None)
        assert driver.run("DEL") == (0, None)
        assert_no_state(node)
    finally:
        driver.close()


# --- (d) malformed stdin ----------------------------------------------------------------


@pytest.mark.parametrize(
    "stdin", [b'{"cniVersion": "1.0.0", "name": ', b"[1, 2]", b"", b"\xff{}", b"null"]
)
def test_stdin_that_is_no_json_object_answers_code_6(
    exes: Exes,  # noqa: F811
    node: Node,  # noqa: F811
    stdin: bytes,
) -> None:
    pod = node.pod()
    for command in ("ADD", "DEL", "CHECK", "GC", "STATUS"):
        for kind, exe in exes.both():
            code, err = run_cni([exe], cni_env(command, "c1", pod), stdin)
            assert code == 1 and err is not None, (kind, command)
            assert err["code"] == spec.Code.DECODE_FAILURE, (kind, command, err)
    # The agent answers the same when it gets such a request another way.
    code, err = node.request("ADD", "c1", pod, stdin=stdin)
    assert code == 1 and err["code"] == spec.Code.DECODE_FAILURE
    assert_no_state(node)


# --- (e) no descriptor leaks ------------------------------------------------------------


def open_fds() -> set[int]:
    return {int(n) for n in os.listdir("/proc/self/fd")}


def send_raw(path: str, data: bytes, fds: list[int]) -> tuple[int, bytes]:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(30)
        sock.connect(path)
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
        sock.sendmsg([data], rights)
        sock.shutdown(socket.SHUT_WR)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return wire.decode_reply(reply)


def test_no_descriptor_leaks(node: Node, hidden_dir: str) -> None:  # noqa: F811
    pod, other = node.pod(), node.pod()
    regular = os.path.join(hidden_dir, "file")
    open(regular, "w").close()
    env = cni_env("ADD", "leak", pod)
    del env["PATH"]
    good = wire.encode_request(env, json.dumps(node.config()).encode())

    def round_of_requests() -> None:
        assert node.add("leak", pod)[0] == 0
        assert node.request("CHECK", "leak", pod)[0] == 0
        assert node.add("leak", pod)[0] == 0  # idempotent, the record answers
        assert node.request("ADD", "bad", regular)[1]["code"] == 4  # no netns
        assert node.request("ADD", "bad", "/proc/self/ns/mnt")[1]["code"] == 4
        assert node.request("ADD", "bad", pod, stdin=b"{")[1]["code"] == 6
        assert node.request("ADD", "old", other, pass_fd=False)[0] == 0
        assert node.delete("old", other, pass_fd=False)[0] == 0
        assert node.request("STATUS", config=node.config(cniVersion="1.1.0")) == (0, None)
        ns_fd = os.open(pod, os.O_RDONLY | os.O_CLOEXEC)
        try:
            # A garbled request and one with two descriptors: refused, both closed.
            assert send_raw(node.socket, b"garbage", [ns_fd])[0] == 1
            assert send_raw(node.socket, good, [ns_fd, ns_fd])[0] == 1
        finally:
            os.close(ns_fd)
        assert node.delete("leak", pod)[0] == 0

    round_of_requests()  # first use: lazy imports, cached sockets, thread pools
    before = open_fds()
    for _ in range(25):
        round_of_requests()
    assert open_fds() == before
    assert_no_state(node)


# --- (f) a stalled client is dropped, the others are served ------------------------------


def _echo(env: dict[str, str], stdin: bytes, netns_fd: int | None = None) -> tuple[int, bytes]:
    return 0, b"fd" if netns_fd is not None else b"no fd"


def test_a_stalled_or_trickling_client_is_dropped_within_the_deadline(hidden_dir: str) -> None:
    path = os.path.join(hidden_dir, "s.sock")
    timeout = 1.0
    before = open_fds()
    server = CniServer(path, _echo, read_timeout=timeout)
    server.start()
    stalled = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    trickler = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        request = wire.encode_request({"CNI_COMMAND": "ADD"}, b"{}")
        started = time.monotonic()
        stalled.connect(path)
        ns_fd = os.open("/proc/self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
        try:  # half a request and a descriptor, then silence
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [ns_fd]).tobytes())]
            stalled.sendmsg([request[:5]], rights)
        finally:
            os.close(ns_fd)
        trickler.connect(path)
        stop = threading.Event()

        def trickle() -> None:  # a byte every 0.2 s: each recv is quick, the total is not
            for byte in (b"F", b"P", b"C", b"N", b"I") * 20:
                if stop.wait(0.2):
                    return
                try:
                    trickler.send(byte)
                except OSError:
                    return

        thread = threading.Thread(target=trickle, daemon=True)
        thread.start()
        # Meanwhile everyone else is served at once.
        for _ in range(5):
            t0 = time.monotonic()
            assert client.forward(path, request) == (0, b"no fd")
            assert time.monotonic() - t0 < 0.5
        for sock in (stalled, trickler):
            sock.settimeout(10)
            code, out = wire.decode_reply(sock.recv(65536))
            dropped_after = time.monotonic() - started
            assert code == 1 and json.loads(out)["code"] == spec.Code.IO_FAILURE
            assert b"did not arrive within 1 s" in out
            assert timeout <= dropped_after < timeout + 1.0, dropped_after
        stop.set()
        thread.join()
    finally:
        stalled.close()
        trickler.close()
        server.stop()
    assert open_fds() == before  # the stalled client's descriptor was closed too


def test_the_client_gives_up_at_its_deadline(hidden_dir: str) -> None:
    # An agent that accepts and never answers: the executable's own deadline ends it.
    path = os.path.join(hidden_dir, "mute.sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(1)
        started = time.monotonic()
        with pytest.raises(client.AgentUnreachable) as info:
            client.forward(path, wire.encode_request({"CNI_COMMAND": "ADD"}, b"{}"), None, 0.5)
        assert 0.5 <= time.monotonic() - started < 1.5
    assert info.value.msg == f"the flannelpy agent did not answer on {path} (timed out after 0.5 s)"


def test_both_executables_give_up_at_the_same_deadline(exes: Exes, hidden_dir: str) -> None:  # noqa: F811
    # 60 s (every command but ADD): the three runs share that wait.
    path = os.path.join(hidden_dir, "mute.sock")
    stdin = json.dumps({"cniVersion": "1.1.0", "name": "n", "type": "t", "agentSocket": path})
    runs = [("python", "GC"), ("c", "GC"), ("c", "DEL")]
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(path)
        listener.listen(8)  # never accepted: connect and send succeed, no reply comes
        started = time.monotonic()
        procs = [
            subprocess.Popen(
                [dict(exes.both())[kind]],
                env=cni_env(command, "c1", ""),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            for kind, command in runs
        ]
        for proc in procs:  # every config delivered first: their deadlines run together
            assert proc.stdin is not None
            proc.stdin.write(stdin.encode())
            proc.stdin.close()
        outs = []
        for proc in procs:
            assert proc.stdout is not None
            outs.append(proc.stdout.read())  # until it exits: small, never fills the pipe
            proc.stdout.close()
            proc.wait(120)
        elapsed = time.monotonic() - started
    assert client.DEADLINE_SECONDS <= elapsed < client.DEADLINE_SECONDS + 10
    msg = f"the flannelpy agent did not answer on {path} (timed out after 60 s)"
    expected = spec.CniError(11, msg, client.DETAILS).to_json("1.1.0")
    assert [(p.returncode, out) for p, out in zip(procs, outs, strict=True)] == [
        (1, expected),
        (1, expected),
        (0, b""),  # DEL succeeds: the agent reconciles when it is back
    ]
