"""The etcd endpoints' flag: each a URL or ``unix://PATH``, bare ``host:port`` given the
scheme etcd's Go client would give it."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

from flannelpy.errors import ConfigError


def check_endpoints(urls: tuple[str, ...], source: str) -> tuple[str, ...]:
    """Each endpoint a URL or ``unix://PATH``. A bare ``host:port`` is taken as etcd's Go
    client takes it (the TLS files decide the scheme: see with_schemes)."""
    if not urls:
        raise ConfigError(f"{source} is empty; give etcd URLs like http://127.0.0.1:2379")
    for url in urls:
        if url.startswith("unixs:"):
            raise ConfigError(
                f"{source} entry {url!r} is TLS over a unix socket, which flannelpy does not "
                "speak; give unix://PATH (no TLS) or an https:// URL"
            )
        if url.startswith("unix:"):
            if not url.removeprefix("unix:").strip("/"):
                raise ConfigError(
                    f"{source} entry {url!r} names no socket; write it like "
                    "unix:///run/etcd/etcd.sock"
                )
            continue
        parts = urlsplit(url if "://" in url else f"http://{url}")
        try:
            port = parts.port
        except ValueError:
            port = None
        if (
            parts.scheme not in ("http", "https")
            or not parts.hostname
            or ("://" not in url and port is None)
        ):
            raise ConfigError(
                f"{source} entry {url!r} is not an etcd URL; write it like "
                "http://127.0.0.1:2379, https://etcd-0:2379 or etcd-0:2379"
            )
    return urls


def with_schemes(values: dict[str, Any], default: tuple[str, ...]) -> None:
    """A bare ``host:port`` endpoint gets the scheme etcd's Go client would use: https
    when any TLS file is given, else http."""
    urls = values.get("etcd_endpoints")
    if urls is None:
        urls = default
    tls = any(values.get(name) for name in ("etcd_cafile", "etcd_certfile", "etcd_keyfile"))
    scheme = "https" if tls else "http"
    values["etcd_endpoints"] = tuple(
        u if "://" in u or u.startswith("unix:") else f"{scheme}://{u}" for u in urls
    )
