"""etcd reached over a unix socket, as etcd's Go client (and so flanneld) reaches it.

etcd 3.4 listens on ``unix://NAME`` only in its host:port form, as a socket file of
that name in its working directory; the tests run it in a temporary directory and
reach the socket both by its absolute path and, from the same directory, by name.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from flannelpy.cli import build_parser
from flannelpy.config.settings import go_style_argv, settings_from_args
from flannelpy.store.etcd.client import EtcdStore, connect_etcd
from tests.support.etcd_server import EtcdServer

SOCKET = "localhost:2379"  # a file name: etcd 3.4 wants host:port even for unix://


@pytest.fixture
def socket_etcd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A real etcd serving on tcp (for its health check) and on tmp_path/SOCKET; the
    test runs in tmp_path, as etcd does."""
    monkeypatch.chdir(tmp_path)
    server = EtcdServer()
    server.extra_args = ("--listen-client-urls", f"{server.endpoint},unix://{SOCKET}")
    try:
        server.start()
        socket_path = tmp_path / SOCKET
        assert socket_path.is_socket()
        yield socket_path
    finally:
        server.stop()


def test_agent_flags_with_a_unix_endpoint_reach_etcd(socket_etcd: Path) -> None:
    """Before: --etcd-endpoints unix://... was refused at start."""
    ns = build_parser().parse_args(
        ["agent", *go_style_argv([f"-etcd-endpoints=unix://{socket_etcd}"])]
    )
    settings = settings_from_args(ns, {"NODE_NAME": "n1"})
    store = connect_etcd(settings, timeout=2.0)
    try:
        revision = store.put("/unix/a", b"one")
        got = store.get("/unix/a")
        assert got is not None and (got.value, got.mod_revision) == (b"one", revision)
        lease = store.grant_lease(30)
        store.put("/unix/leased", b"x", lease.id)
        assert store.lease_remaining(lease.id) is not None
        stop = threading.Event()
        watch = store.watch_prefix("/unix/", revision + 1, stop)
        try:
            batch = next(iter(watch))
            assert [e.key for e in batch.events] == ["/unix/leased"]
        finally:
            stop.set()
            watch.cancel()
    finally:
        store.close()


def test_a_relative_unix_endpoint_is_taken_from_the_working_directory(
    socket_etcd: Path,
) -> None:
    assert Path(os.getcwd()) == socket_etcd.parent
    for endpoint in (f"unix://{SOCKET}", f"unix:{SOCKET}"):
        store = EtcdStore([endpoint], timeout=2.0)
        try:
            store.put("/unix/rel", endpoint.encode())
            got = store.get("/unix/rel")
            assert got is not None and got.value == endpoint.encode()
            assert store.endpoints == [endpoint]
        finally:
            store.close()
