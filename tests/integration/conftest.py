"""Fixtures of the integration tier: real etcd servers."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence

import pytest

from tests.support.etcd_server import EtcdServer, TlsFiles


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EtcdServer]:
    """One real etcd for the session. Share it through a unique key prefix
    (``etcd_prefix``); tests that stop, restart or compact etcd use ``etcd_factory``."""
    server = EtcdServer()
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture
def etcd_factory() -> Iterator[Callable[..., EtcdServer]]:
    """Start private etcd servers (``etcd_factory()``, ``etcd_factory(tls=...)``,
    ``etcd_factory(extra_args=[...])``); every one started is stopped when the test ends."""
    servers: list[EtcdServer] = []

    def start(tls: TlsFiles | None = None, extra_args: Sequence[str] = ()) -> EtcdServer:
        server = EtcdServer(tls=tls, extra_args=extra_args)
        servers.append(server)
        return server.start()

    try:
        yield start
    finally:
        for server in servers:
            server.stop()


@pytest.fixture
def etcd_prefix() -> str:
    """A Flannel-style key prefix no other test uses."""
    return f"/test-{uuid.uuid4().hex[:12]}/coreos.com/network"
