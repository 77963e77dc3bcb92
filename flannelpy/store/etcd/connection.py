"""Reaching one etcd member: the endpoint URLs, the TLS files, the gRPC channel options,
and the pyetcd client every call goes through (one that requires a leader).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import grpc
import pyetcd
from pyetcd import etcdrpc
from pyetcd.watch import Watcher

from flannelpy.errors import ConfigError

# gRPC channel options: reconnect soon after etcd comes back (the default backoff
# grows to 120 s), and detect a silently dead peer on long-lived watch streams.
# etcd refuses keepalive pings more often than every 5 s, hence 10 s.
GRPC_OPTIONS = [
    # etcd is always reached directly: an HTTP proxy set in the environment (for image
    # pulls, say) must not carry lease traffic, nor take lab traffic off the machine.
    ("grpc.enable_http_proxy", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]

# Every call carries etcd's "hasleader" metadata: a member cut off from the leader
# then refuses it at once with "no leader" (UNAVAILABLE, so the call fails over),
# rather than holding a read until the request timeout, and cancels open watches
# instead of serving a frozen world; the watch then moves to another endpoint.
_REQUIRE_LEADER = (("hasleader", "true"),)


class LeaderClient(pyetcd.MultiEndpointEtcd3Client):  # type: ignore[misc]
    """pyetcd's client, whose calls and watches all require a leader.

    pyetcd passes ``self.metadata`` with every call and sets it to the auth token
    after authenticating; the property keeps the leader requirement beside it.
    """

    _base_metadata: tuple[tuple[str, str], ...] = ()

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self._base_metadata + _REQUIRE_LEADER

    @metadata.setter
    def metadata(self, value: Sequence[tuple[str, str]] | None) -> None:
        self._base_metadata = tuple(value or ())

    def get_watcher(self) -> Watcher:
        return Watcher(
            etcdrpc.WatchStub(self.channel),
            timeout=self.timeout,
            call_credentials=self.call_credentials,
            metadata=self.metadata,
        )


class _SocketEndpoint(pyetcd.Endpoint):  # type: ignore[misc]
    """pyetcd's endpoint on a gRPC target of its own: a unix socket (pyetcd dials
    host:port only)."""

    def __init__(self, target: str, opts: Sequence[tuple[str, Any]]) -> None:
        self._target = target
        super().__init__(target, 0, secure=False, time_retry=0, opts=opts)
        self.netloc = target

    def _mkchannel(self, opts: Sequence[tuple[str, Any]]) -> grpc.Channel:
        return grpc.insecure_channel(self._target, options=opts)


@dataclass(frozen=True)
class EtcdEndpoint:
    url: str
    host: str
    port: int
    secure: bool
    socket_target: str | None = None  # a unix socket's gRPC target, else None


def unix_target(url: str) -> str:
    """etcd's Go client's reading of a ``unix://`` endpoint, as a gRPC target:
    ``unix:///run/etcd.sock`` is an absolute path, ``unix://etcd.sock`` and
    ``unix:etcd.sock`` are relative to the working directory."""
    if url.startswith("unix:///"):
        return url
    return "unix:" + url.removeprefix("unix://").removeprefix("unix:")


def parse_endpoints(urls: Sequence[str]) -> list[EtcdEndpoint]:
    """``http://127.0.0.1:2379`` → host, port, TLS or not; ``unix://path`` → a socket.
    Raises ConfigError."""
    endpoints = []
    for raw in urls:
        url = raw.strip()
        if url.startswith("unix:") and unix_target(url) not in ("unix:", "unix:///"):
            endpoints.append(EtcdEndpoint(url, "", 0, False, unix_target(url)))
            continue
        parts = urlsplit(url if "://" in url else f"http://{url}")
        try:
            port = parts.port or 2379
        except ValueError:
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port <= 0:
            raise ConfigError(
                f"--etcd-endpoints: {raw!r} is not an etcd URL; write it like "
                "http://127.0.0.1:2379 or https://etcd.example:2379"
            )
        endpoints.append(EtcdEndpoint(url, parts.hostname, port, parts.scheme == "https"))
    if not endpoints:
        raise ConfigError("--etcd-endpoints is empty; give at least one etcd URL")
    return endpoints


def open_client(
    ep: EtcdEndpoint,
    credentials: grpc.ChannelCredentials | None,
    timeout: float,
    username: str | None,
    password: str | None,
) -> LeaderClient:
    """A client of the member at ``ep``; with a user, this authenticates (one request)."""
    # time_retry=0: never let pyetcd park an endpoint as failed; we pick endpoints.
    if ep.socket_target is not None:
        endpoint = _SocketEndpoint(ep.socket_target, GRPC_OPTIONS)
    else:
        endpoint = pyetcd.Endpoint(
            ep.host,
            ep.port,
            secure=ep.secure,
            creds=credentials if ep.secure else None,
            time_retry=0,
            opts=GRPC_OPTIONS,
        )
    try:
        client = LeaderClient(
            endpoints=[endpoint], timeout=timeout, user=username, password=password
        )
    except BaseException:
        endpoint.close()
        raise
    if not ep.secure:
        # gRPC refuses call credentials on a plaintext channel; the token also
        # travels as metadata, which is all etcd reads.
        client.call_credentials = None
    return client


def load_credentials(
    cafile: str | None, keyfile: str | None, certfile: str | None
) -> grpc.ChannelCredentials:
    """The TLS files as gRPC channel credentials. Raises ConfigError."""
    return grpc.ssl_channel_credentials(
        root_certificates=_read(cafile, "--etcd-cafile"),
        private_key=_read(keyfile, "--etcd-keyfile"),
        certificate_chain=_read(certfile, "--etcd-certfile"),
    )


def _read(path: str | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"{flag}: cannot read {path}: {e.strerror}; fix the path") from e


def stat_files(paths: Sequence[str | None]) -> tuple[tuple[int, int] | None, ...]:
    """Each file's (mtime_ns, size), None where absent: what tells a rotation."""
    return tuple(_signature(path) for path in paths)


def _signature(path: str | None) -> tuple[int, int] | None:
    try:
        st = os.stat(path) if path is not None else None
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size) if st is not None else None
