"""One etcd member over its JSON gateway: etcd v3's own API (the same protobuf messages
as gRPC, ``/v3/kv/range``, ``/v3/watch``...) as JSON over HTTP/1.1, which every etcd
since 3.4 serves on its client URLs (``--enable-grpc-gateway``, on by default).

Why not gRPC by default: importing grpcio and etcd's protobuf messages costs 13 MiB of
memory and a thread pool on every node (README, "Dependencies, and why"), and every call
the agent makes is a unary request or one prefix watch, which HTTP carries as well. What
the gRPC client did is done here: one pool of connections per member, TLS, a token taken
again when etcd forgets it, "requires a leader" on every call and watch, a timeout on
every request, and TCP keepalive so a watch on a silently dead member is noticed in
seconds. A node with a client certificate goes over gRPC (:mod:`.member` says why).

Refusals are :class:`~.member.MemberError` (the gRPC status etcd sent);
:mod:`.rpc_errors` says what each means for the caller.
"""

from __future__ import annotations

import json
import socket
import ssl
from collections.abc import Iterator
from typing import Any

import urllib3

from flannelpy.store.etcd.connection import EtcdEndpoint
from flannelpy.store.etcd.member import CODES, AuthToken, MemberError
from flannelpy.store.http import Stream, error_body, socket_options

API = "/v3"
# gRPC's keepalive as the gRPC client had it (etcd refuses pings more often than every
# 5 s): probe an idle connection after 10 s, give up 5 s later; sent data unacknowledged
# for 15 s also ends the connection.
KEEPALIVE = (10, 5, 1)
USER_TIMEOUT_MS = 15_000
POOL_SIZE = 4  # connections kept per member: a few watches stream while requests go
USER_AGENT = "flannelpy"
# The gateway's HTTP status for a code, read back when an answer carries no JSON.
_HTTP_STATUS_CODES = {400: 3, 401: 16, 403: 7, 404: 5, 409: 10, 412: 9, 429: 8, 500: 2, 501: 12}
_HTTP_STATUS_CODES.update({503: 14, 504: 4})


class _UnixConnection(urllib3.connection.HTTPConnection):
    """An HTTP connection to a unix socket (etcd's ``unix://`` client URLs)."""

    def __init__(self, *args: Any, socket_path: str, **kwargs: Any) -> None:
        self._socket_path = socket_path
        super().__init__(*args, **kwargs)

    def _new_conn(self) -> socket.socket:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        timeout = self.timeout
        if isinstance(timeout, (int, float)):
            sock.settimeout(timeout)
        try:
            sock.connect(self._socket_path)
        except OSError as e:
            sock.close()
            raise urllib3.exceptions.NewConnectionError(self, f"{self._socket_path}: {e}") from e
        return sock


class _UnixPool(urllib3.HTTPConnectionPool):
    ConnectionCls = _UnixConnection


def _pool(
    ep: EtcdEndpoint, context: ssl.SSLContext | None, retries: urllib3.Retry
) -> urllib3.HTTPConnectionPool:
    common: dict[str, Any] = {"maxsize": POOL_SIZE, "block": False, "retries": retries}
    if ep.socket_path is not None:
        return _UnixPool("localhost", socket_path=ep.socket_path, **common)
    common["socket_options"] = socket_options(*KEEPALIVE, USER_TIMEOUT_MS)
    if ep.secure:
        return urllib3.HTTPSConnectionPool(ep.host, ep.port, ssl_context=context, **common)
    return urllib3.HTTPConnectionPool(ep.host, ep.port, **common)


def _error_of(status: int, body: bytes) -> MemberError:
    """The error an answer other than 200 carries: ``{"code": N, "message": ...}`` for a
    request, ``{"error": {"grpc_code": N, "message": ...}}`` inside a stream."""
    try:
        doc = json.loads(body)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
        doc = doc["error"]
    if isinstance(doc, dict):
        code = doc.get("code", doc.get("grpc_code"))
        message = doc.get("message") or doc.get("error")
        if isinstance(code, int) and isinstance(message, str):
            return MemberError(code, message)
    text = body[:200].decode("utf-8", "replace").strip() or f"HTTP {status}"
    if status == 404:
        return MemberError(
            CODES["UNIMPLEMENTED"],
            f"no etcd v3 JSON gateway at {API}/ (HTTP 404: {text}); etcd 3.4 or newer "
            "serves it unless started with --enable-grpc-gateway=false; or start the "
            "agent with --etcd-transport=grpc",
        )
    return MemberError(_HTTP_STATUS_CODES.get(status, CODES["UNKNOWN"]), text)


class _Messages:
    """A streaming answer's messages, one JSON object per line (:class:`~.member.MessageStream`)."""

    def __init__(self, stream: Stream) -> None:
        self._stream = stream

    def messages(self) -> Iterator[dict[str, Any]]:
        for line in self._stream.lines():
            try:
                doc = json.loads(line)
            except ValueError as e:
                raise MemberError(CODES["INTERNAL"], f"a message that is not JSON ({e})") from e
            if not isinstance(doc, dict):
                raise MemberError(CODES["INTERNAL"], "a message that is not a JSON object")
            if "error" in doc:  # the stream's last message: etcd ended it
                raise _error_of(200, line)
            yield doc

    def without_read_timeout(self) -> None:
        self._stream.without_read_timeout()

    def abort(self) -> None:
        self._stream.abort()

    def close(self) -> None:
        self._stream.close()


class GatewayMember:
    """One etcd member's JSON gateway (:class:`~.member.Member`)."""

    def __init__(
        self,
        ep: EtcdEndpoint,
        context: ssl.SSLContext | None,
        timeout: float,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        self.endpoint = ep
        self._timeout = urllib3.Timeout(connect=timeout, read=timeout)
        # One quick retry of a connection that failed to open; never of a sent request.
        retries = urllib3.Retry(total=1, read=0, redirect=False, raise_on_status=False)
        self._pool = _pool(ep, context, retries)
        self.token = AuthToken(
            username, password, lambda body: self._post("/auth/authenticate", body)
        )

    def _headers(self) -> dict[str, str]:
        headers = {
            "Content-Type": "application/json",
            "User-Agent": USER_AGENT,
            # gRPC metadata through the gateway: a member cut off from the leader refuses
            # the call at once ("no leader", UNAVAILABLE: the call fails over) rather than
            # serving a stale read, and cancels open watches instead of serving a frozen
            # world.
            "Grpc-Metadata-Hasleader": "true",
        }
        token = self.token.current()
        if token:
            headers["Authorization"] = token
        return headers

    def forget_token(self) -> None:
        self.token.forget()

    def _post(
        self, path: str, body: dict[str, Any], headers: dict[str, str] | None = None
    ) -> dict[str, Any]:
        resp = self._pool.urlopen(
            "POST",
            API + path,
            body=json.dumps(body).encode(),
            headers=headers or {"Content-Type": "application/json", "User-Agent": USER_AGENT},
            timeout=self._timeout,
        )
        data = bytes(resp.data or b"")
        if resp.status != 200:
            raise _error_of(resp.status, data)
        try:
            doc = json.loads(data)
        except ValueError as e:
            raise MemberError(CODES["INTERNAL"], f"{path}: the answer is not JSON ({e})") from e
        if not isinstance(doc, dict):
            raise MemberError(CODES["INTERNAL"], f"{path}: the answer is not a JSON object")
        return doc

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """POST ``body`` to ``/v3<path>``; the answer's object. Raises MemberError, or
        one of UNREACHABLE when the member does not answer."""
        return self._post(path, body, self._headers())

    def stream(self, path: str, body: dict[str, Any]) -> _Messages:
        """Open a streaming call (a watch); its messages are the stream's lines. The
        response waits no longer than a request for its start; once open, it may stay
        quiet for ever (keepalive watches the connection)."""
        resp = self._pool.urlopen(
            "POST",
            API + path,
            body=json.dumps(body).encode(),
            headers=self._headers(),
            timeout=self._timeout,
            preload_content=False,
            release_conn=False,
        )
        if resp.status != 200:
            raise _error_of(resp.status, error_body(resp))
        return _Messages(Stream(resp))

    def close(self) -> None:
        self._pool.close()
