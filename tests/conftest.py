"""Shared pytest fixtures."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest

from tests.support.etcd_server import EtcdServer, TlsFiles

# --- etcd --------------------------------------------------------------------


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


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Any:
    """Keep each phase's report on the test item (``item.rep_call``), so a fixture can
    tell in its teardown whether the test failed (and show the agents' logs)."""
    report = yield
    setattr(item, f"rep_{report.when}", report)
    return report
