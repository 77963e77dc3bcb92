"""The HTTP server cannot starve the node: bounded connections, timeouts, and a CNI
server that keeps accepting whatever happens to the rest of the process.

Real sockets on 127.0.0.1 (HTTP) and a real CNI server in a throwaway node
namespace (see test_cni_server). The flood test raises this process's
RLIMIT_NOFILE to its hard limit for the 10,000 client sockets, and restores it.
"""

from __future__ import annotations

import errno
import http.client
import os
import resource
import socket
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest

from cni_plugin import client
from flannelpy.cni import wire
from flannelpy.cni.server import CniServer
from flannelpy.observe.health import HealthServer, Heartbeats
from flannelpy.observe.metrics import AgentMetrics
from tests.integration.test_cni_server import SUBNET, make_node, pod_ip
from tests.support.netns_util import is_root

FLOOD = 10_000
ADDS = 50


def get(port: int, path: str) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read().decode()
    finally:
        conn.close()


@contextmanager
def health(**kw: object) -> Iterator[HealthServer]:
    server = HealthServer(
        "127.0.0.1:0",
        AgentMetrics().registry,
        ready=lambda: (True, "ok"),
        live=lambda: (True, "ok"),
        **kw,  # type: ignore[arg-type]
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def closed_by_peer(sock: socket.socket, within: float) -> bool:
    """Whether the server closes ``sock`` (EOF or reset) within ``within`` seconds."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


# --- the HTTP server's bounds --------------------------------------------------------


def test_connections_beyond_the_bound_are_refused_and_idle_ones_time_out() -> None:
    with health(max_connections=4, timeout=1.0) as server:
        port = server.address[1]
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(4)]
        try:
            time.sleep(0.3)  # all four accepted and waiting for a request line
            extra = socket.create_connection(("127.0.0.1", port))
            with extra:
                assert closed_by_peer(extra, 0.5), "a fifth connection was not refused"
            assert server.refused >= 1
            # The idle ones are dropped after the timeout, and the slots serve again.
            assert all(closed_by_peer(s, 3.0) for s in idle)
            assert get(port, "/healthz") == (200, "ok\n")
        finally:
            for s in idle:
                s.close()


def test_a_kept_alive_connection_that_goes_quiet_is_closed() -> None:
    with health(timeout=0.5) as server:
        conn = http.client.HTTPConnection("127.0.0.1", server.address[1], timeout=5)
        conn.request("GET", "/healthz")
        assert conn.getresponse().read() == b"ok\n"
        assert conn.sock is not None and closed_by_peer(conn.sock, 3.0)
        conn.close()


def test_metrics_are_served_only_where_asked() -> None:
    with health(serve_metrics=False) as server:
        status, body = get(server.address[1], "/metrics")
        assert status == 404 and "--metrics-addr" in body
        assert get(server.address[1], "/healthz") == (200, "ok\n")
    with health() as server:
        assert get(server.address[1], "/metrics")[0] == 200


def test_liveness_covers_added_checks() -> None:
    beats = Heartbeats()
    state = {"ok": True}
    beats.add_check("cni-server", lambda: (state["ok"], "the CNI server no longer accepts"))
    assert beats.live() == (True, "ok")
    state["ok"] = False
    assert beats.live() == (False, "cni-server: the CNI server no longer accepts")
    beats.add_check("broken", lambda: 1 / 0)  # type: ignore[arg-type, return-value]
    state["ok"] = True
    ok, reason = beats.live()
    assert not ok and reason.startswith("broken: check failed")


# --- the CNI server never stops accepting -------------------------------------------


def _echo(env: dict[str, str], stdin: bytes) -> tuple[int, bytes]:
    return 0, stdin


def ask(path: str, body: bytes = b"{}") -> tuple[int, bytes]:
    return client.forward(path, wire.encode_request({"CNI_COMMAND": "VERSION"}, body))


def test_the_accept_loop_survives_a_worker_that_cannot_start(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = os.path.join(str(tmp_path), "cni.sock")
    server = CniServer(path, _echo)
    server.start()
    try:
        real_start = threading.Thread.start

        def no_threads(self: threading.Thread) -> None:
            if self.name == "cni-conn":
                raise RuntimeError("can't start new thread")
            real_start(self)

        monkeypatch.setattr(threading.Thread, "start", no_threads)
        assert [ask(path, b'{"n": %d}' % i) for i in range(3)] == [
            (0, b'{"n": %d}' % i) for i in range(3)
        ]
        monkeypatch.undo()
        assert os.path.exists(path) and server.alive() == (True, "ok")
        assert ask(path) == (0, b"{}")
    finally:
        server.stop()
    assert server.alive()[0] is False and not os.path.exists(path)


def test_alive_notices_a_socket_that_is_gone_or_replaced(tmp_path: object) -> None:
    path = os.path.join(str(tmp_path), "cni.sock")
    server = CniServer(path, _echo)
    server.start()
    try:
        os.unlink(path)
        ok, reason = server.alive()
        assert not ok and "is gone" in reason
        other = socket.socket(socket.AF_UNIX)
        other.bind(path)
        try:
            ok, reason = server.alive()
            assert not ok and "replaced" in reason
        finally:
            other.close()
    finally:
        server.stop()


# --- 10,000 connections held open, 50 ADDs ------------------------------------------


@contextmanager
def raised_nofile(wanted: int) -> Iterator[None]:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < wanted:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} is below {wanted}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def flood(port: int, count: int) -> list[socket.socket]:
    """``count`` non-blocking connection attempts to 127.0.0.1:``port``, left open."""
    socks = []
    for _ in range(count):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        rc = s.connect_ex(("127.0.0.1", port))
        assert rc in (0, errno.EINPROGRESS), os.strerror(rc)
        socks.append(s)
    return socks


@pytest.mark.netns
@pytest.mark.skipif(not is_root(), reason="network namespaces need root")
def test_ten_thousand_connections_to_healthz_do_not_stop_cni_adds() -> None:
    beats = Heartbeats()
    with raised_nofile(FLOOD + 2_000), make_node() as node:
        server = HealthServer(
            "127.0.0.1:0", AgentMetrics().registry, ready=lambda: (True, "ok"), live=beats.live
        )
        server.start()
        held: list[socket.socket] = []
        try:
            threads_before = threading.active_count()
            held = flood(server.address[1], FLOOD)
            time.sleep(1.0)  # let the server accept what the backlog holds
            # The HTTP side holds at most its bound of threads, whatever is connected.
            assert threading.active_count() - threads_before <= 40
            pods = [node.pod(f"f{i}") for i in range(ADDS)]
            with ThreadPoolExecutor(max_workers=10) as pool:
                results = list(pool.map(lambda i: node.add(f"flood{i}", pods[i]), range(ADDS)))
            failed = [r for c, r in results if c]
            assert failed == [], failed[:3]
            assert len({pod_ip(r) for _, r in results}) == ADDS
            assert all(pod_ip(r) in SUBNET for _, r in results)
            assert server.refused > 0  # the flood met the bound
        finally:
            for s in held:
                s.close()
            server.stop()
