"""A thin client of the Kubernetes API over urllib3: JSON in, JSON out, watches read
line by line.

Why not the ``kubernetes`` package: importing it costs 46 MiB of memory and a third of a
second of CPU (its ``__init__`` loads every API class and model), and every answer is
read as raw JSON anyway (a list of thousands of Nodes decodes several times faster than
through its models). What this does instead is what that client did for us: one pool of
connections to the server, TCP keepalive at client-go's timings (a watch on a silently
dead connection is noticed in minutes, not at its read timeout), one quick retry of a
pooled connection the server had closed (longer outages are retried by our own backoff,
which logs one line per attempt), a connect and a read timeout on every request, and the
credentials of :mod:`.credentials` (a 401 fetches them again and retries once).

Answers map to our errors in :func:`flannelpy.store.kube.api.api_error`.
"""

from __future__ import annotations

import json
import os
import ssl
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import urllib3

from flannelpy.config.settings import AgentSettings
from flannelpy.errors import ConfigError, StoreUnavailable
from flannelpy.store.http import Stream, error_body, socket_options
from flannelpy.store.kube.api import UNREACHABLE, api_error
from flannelpy.store.kube.credentials import ClientCert, Credentials
from flannelpy.store.kube.kubeconfig import Access, check_url, in_cluster, load_kubeconfig

JSON = "application/json"
MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE = "application/strategic-merge-patch+json"
REQUEST_TIMEOUT = (5.0, 15.0)  # seconds: connect, then each read
POOL_SIZE = 8  # connections kept: a few watches stream while requests come and go
USER_AGENT = "flannelpy"
# client-go's TCP keepalive: probe an idle connection after 30 s, every 15 s, 9 times.
KEEPALIVE = (30, 15, 9)

Query = Mapping[str, str | int | bool | None]


def path(*parts: str) -> str:
    """An API path from its segments, names quoted: ``path("api/v1/nodes", name)``."""
    return "/" + "/".join(p if i == 0 else quote(p, safe="") for i, p in enumerate(parts))


def _query(query: Query | None) -> str:
    if not query:
        return ""
    fields = {
        k: ("true" if v else "false") if isinstance(v, bool) else str(v)
        for k, v in query.items()
        if v is not None
    }
    return "?" + urlencode(fields) if fields else ""


def _socket_options() -> list[tuple[int, int, int]]:
    return socket_options(*KEEPALIVE)


def _load_pem(ctx: ssl.SSLContext, cert: ClientCert) -> None:
    """The client certificate into ``ctx``; PEM held in memory goes through a private
    temporary file (the ssl module loads certificates from files only), removed at once."""
    if cert.cert is None:
        assert cert.cert_file and cert.key_file
        ctx.load_cert_chain(cert.cert_file, cert.key_file)
        return
    assert cert.key is not None
    fd, name = tempfile.mkstemp(prefix="flannelpy-client-", suffix=".pem")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cert.cert.rstrip(b"\n") + b"\n" + cert.key)
        ctx.load_cert_chain(name)
    finally:
        os.unlink(name)


def ssl_context(access: Access, cert: ClientCert | None) -> ssl.SSLContext:
    cadata = access.ca_data.decode("ascii", "replace") if access.ca_data else None
    ctx = ssl.create_default_context(cafile=access.ca_file, cadata=cadata)
    if access.insecure:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    if cert is not None:
        _load_pem(ctx, cert)
    return ctx


@dataclass(frozen=True)
class Answer:
    status: int
    reason: str
    body: bytes


class KubeClient:
    """The Kubernetes API at ``access.server``. Thread-safe."""

    def __init__(self, access: Access, pool_size: int = POOL_SIZE) -> None:
        parts = urlsplit(access.server)
        self.access = access
        self._prefix = parts.path.rstrip("/")
        self._pool_size = pool_size
        self._credentials = Credentials(access)
        self._lock = threading.Lock()
        self._pool: urllib3.HTTPConnectionPool | None = None
        self._pool_cert: ClientCert | None = None
        self._retries = urllib3.Retry(total=1, redirect=False, raise_on_status=False)

    @property
    def credentials(self) -> Credentials:
        return self._credentials

    def _connections(self) -> urllib3.HTTPConnectionPool:
        """The pool, made again when the client certificate changed (a plugin's new one)."""
        https = self.access.server.startswith("https:")
        cert = self._credentials.client_cert() if https else None
        with self._lock:
            if self._pool is not None and cert == self._pool_cert:
                return self._pool
            old, self._pool_cert = self._pool, cert
            kwargs: dict[str, Any] = {
                "maxsize": self._pool_size,
                "block": False,
                "socket_options": _socket_options(),
                "retries": self._retries,
            }
            if https:
                kwargs["ssl_context"] = ssl_context(self.access, cert)
                if self.access.tls_server_name:
                    kwargs["server_hostname"] = self.access.tls_server_name
                if self.access.insecure:
                    kwargs["cert_reqs"] = "CERT_NONE"
                    kwargs["assert_hostname"] = False
            self._pool = urllib3.connection_from_url(self.access.server, **kwargs)
        if old is not None:
            old.close()
        return self._pool

    def _open(
        self,
        method: str,
        url: str,
        body: bytes | None,
        content_type: str | None,
        timeout: tuple[float, float],
        stream: bool,
    ) -> Any:
        """One request, sent again once with fresh credentials after a 401."""
        for attempt in (1, 2):
            headers = {"Accept": JSON, "User-Agent": USER_AGENT}
            authorization = self._credentials.authorization()
            if authorization:
                headers["Authorization"] = authorization
            if content_type:
                headers["Content-Type"] = content_type
            resp = self._connections().urlopen(
                method,
                self._prefix + url,
                body=body,
                headers=headers,
                timeout=urllib3.Timeout(connect=timeout[0], read=timeout[1]),
                preload_content=not stream,
                release_conn=not stream,
                retries=self._retries,
            )
            if resp.status != 401 or attempt == 2 or not self._credentials.refreshable():
                return resp
            if stream:
                resp.drain_conn()
                resp.release_conn()
            self._credentials.refresh()
        raise AssertionError("unreachable")

    def _answer(
        self,
        what: str,
        method: str,
        url: str,
        body: bytes | None = None,
        content_type: str | None = None,
        timeout: tuple[float, float] = REQUEST_TIMEOUT,
    ) -> Answer:
        try:
            resp = self._open(method, url, body, content_type, timeout, stream=False)
        except UNREACHABLE as e:
            raise _unreachable(what, e) from e
        return Answer(resp.status, str(resp.reason or ""), bytes(resp.data or b""))

    def get(
        self,
        what: str,
        url: str,
        query: Query | None = None,
        timeout: tuple[float, float] = REQUEST_TIMEOUT,
    ) -> dict[str, Any]:
        """GET ``url`` and decode its JSON object; raises the mapped StoreError."""
        return _decoded(what, self._answer(what, "GET", url + _query(query), timeout=timeout))

    def send(
        self,
        what: str,
        method: str,
        url: str,
        body: Any,
        content_type: str = JSON,
        timeout: tuple[float, float] = REQUEST_TIMEOUT,
    ) -> dict[str, Any]:
        """POST, PUT or PATCH ``body`` as JSON; the object as the server wrote it."""
        data = json.dumps(body).encode()
        return _decoded(what, self._answer(what, method, url, data, content_type, timeout))

    def watch(self, what: str, url: str, query: Query, timeout: tuple[float, float]) -> Stream:
        """Open a watch (``watch=true`` added); its events are :meth:`Stream.lines`."""
        full = url + _query({**query, "watch": True})
        try:
            resp = self._open("GET", full, None, None, timeout, stream=True)
        except UNREACHABLE as e:
            raise _unreachable(what, e) from e
        if resp.status >= 300:
            raise api_error(what, resp.status, str(resp.reason or ""), error_body(resp))
        return Stream(resp)

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()


def _unreachable(what: str, e: BaseException) -> StoreUnavailable:
    return StoreUnavailable(
        f"kubernetes API {what}: cannot reach the API server ({e}); check "
        "--kube-api-url / --kubeconfig-file and the network"
    )


def _decoded(what: str, answer: Answer) -> dict[str, Any]:
    if answer.status >= 300:
        raise api_error(what, answer.status, answer.reason, answer.body)
    try:
        doc = json.loads(answer.body)
    except ValueError as e:
        raise StoreUnavailable(f"kubernetes API {what}: the answer is not JSON ({e})") from e
    if not isinstance(doc, dict):
        raise StoreUnavailable(f"kubernetes API {what}: the answer is not a JSON object")
    return doc


def client_access(settings: AgentSettings, environ: Mapping[str, str] | None = None) -> Access:
    """Where the API server is, as Flannel finds it: ``--kubeconfig-file`` (with
    ``--kube-api-url`` overriding its server), else ``--kube-api-url`` alone with no
    credentials, else the in-cluster service account. Raises ConfigError."""
    url = check_url(settings.kube_api_url) if settings.kube_api_url is not None else None
    if settings.kubeconfig_file:
        access = load_kubeconfig(settings.kubeconfig_file)
        return access.with_server(url) if url else access
    if url:
        return Access(server=url, origin="--kube-api-url")
    return in_cluster(os.environ if environ is None else environ)


def build_api_client(settings: AgentSettings) -> KubeClient:
    """The client every Kubernetes-mode caller shares. Raises ConfigError."""
    access = client_access(settings)
    static = access.cert_data or access.cert_file
    cert = ClientCert(access.cert_data, access.key_data, access.cert_file, access.key_file)
    try:
        if access.server.startswith("https:"):  # a CA or a certificate missing, or no PEM
            ssl_context(access, cert if static else None)
    except (OSError, ssl.SSLError) as e:
        raise ConfigError(
            f"{access.origin or 'the API server'}: cannot load its TLS certificates ({e}); "
            "point certificate-authority and client-certificate at PEM files"
        ) from e
    return KubeClient(access)
