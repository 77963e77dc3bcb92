"""Reaching etcd: the endpoint URLs as given, and the TLS files as one SSL context (read
again when they change). :mod:`.gateway` speaks to one member.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from flannelpy.errors import ConfigError


@dataclass(frozen=True)
class EtcdEndpoint:
    url: str
    host: str
    port: int
    secure: bool
    socket_path: str | None = None  # a unix socket's path, else None


def unix_path(url: str) -> str:
    """etcd's Go client's reading of a ``unix://`` endpoint: ``unix:///run/etcd.sock`` is
    an absolute path, ``unix://etcd.sock`` and ``unix:etcd.sock`` are relative to the
    working directory."""
    if url.startswith("unix:///"):
        return url.removeprefix("unix://")
    return url.removeprefix("unix://").removeprefix("unix:")


def parse_endpoints(urls: Sequence[str]) -> list[EtcdEndpoint]:
    """``http://127.0.0.1:2379`` → host, port, TLS or not; ``unix://path`` → a socket.
    Raises ConfigError."""
    endpoints = []
    for raw in urls:
        url = raw.strip()
        if url.startswith("unix:") and unix_path(url) not in ("", "/"):
            endpoints.append(EtcdEndpoint(url, "", 0, False, unix_path(url)))
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


@dataclass(frozen=True)
class TlsFiles:
    """The TLS files' contents, as read at one moment (a rotation reads them again)."""

    ca: bytes | None
    key: bytes | None
    cert: bytes | None


def read_tls_files(cafile: str | None, keyfile: str | None, certfile: str | None) -> TlsFiles:
    """Raises ConfigError naming the flag whose file cannot be read."""
    return TlsFiles(
        _read(cafile, "--etcd-cafile"),
        _read(keyfile, "--etcd-keyfile"),
        _read(certfile, "--etcd-certfile"),
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
