"""What etcd mode's store says to one etcd member, whichever way it is reached: etcd v3's
API (``/kv/range``, ``/watch``...) with requests and answers as JSON-shaped dicts, the
protobuf messages' JSON mapping (the one etcd's gateway speaks).

Two transports implement :class:`Member`: :class:`~.gateway.GatewayMember` (HTTP/1.1 to
the JSON gateway every etcd since 3.4 serves; the default) and
:class:`~.grpc_member.GrpcMember` (gRPC, used when the node presents a client
certificate: the gateway reaches etcd with the server's own certificate, so etcd would
neither see the node's certificate name nor, unless the server's certificate also
allows client authentication, accept the gateway at all).
"""

from __future__ import annotations

import base64
import binascii
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

# gRPC status codes by number, as etcd sends them on either transport.
STATUS_NAMES = {
    0: "OK",
    1: "CANCELLED",
    2: "UNKNOWN",
    3: "INVALID_ARGUMENT",
    4: "DEADLINE_EXCEEDED",
    5: "NOT_FOUND",
    6: "ALREADY_EXISTS",
    7: "PERMISSION_DENIED",
    8: "RESOURCE_EXHAUSTED",
    9: "FAILED_PRECONDITION",
    10: "ABORTED",
    11: "OUT_OF_RANGE",
    12: "UNIMPLEMENTED",
    13: "INTERNAL",
    14: "UNAVAILABLE",
    15: "DATA_LOSS",
    16: "UNAUTHENTICATED",
}
CODES = {name: number for number, name in STATUS_NAMES.items()}


class MemberError(Exception):
    """An etcd member's refusal: the gRPC status code and etcd's message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(f"{STATUS_NAMES.get(code, str(code))}: {message}")
        self.code = code
        self.message = message

    @property
    def name(self) -> str:
        return STATUS_NAMES.get(self.code, "UNKNOWN")


def b64(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return base64.b64encode(raw).decode("ascii")


def unb64(field: Any) -> bytes:
    """A bytes field of an answer: base64 in JSON, raw from gRPC; an absent one (proto3
    omits empty fields) is b""."""
    if isinstance(field, bytes):
        return field
    return binascii.a2b_base64(field, strict_mode=True) if field else b""


def number(doc: dict[str, Any], field: str) -> int:
    """An integer field of an answer: 64-bit ones come as strings, absent ones are 0."""
    return int(doc.get(field) or 0)


def prefix_end(prefix: bytes) -> bytes:
    """The end of a prefix range, as etcd's clients compute it: the last byte below 0xff
    plus one, the rest dropped; ``\\0`` (every key) when the prefix is all 0xff."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\0"


class AuthToken:
    """etcd's auth token for a user, taken on first use with ``authenticate`` (which
    answers etcd's AuthenticateResponse) and again after :meth:`forget`; None without
    a user. Thread-safe."""

    def __init__(
        self,
        username: str | None,
        password: str | None,
        authenticate: Callable[[dict[str, Any]], dict[str, Any]],
    ) -> None:
        self._request = {"name": username, "password": password} if username is not None else None
        self._authenticate = authenticate
        self._lock = threading.Lock()
        self._token: str | None = None

    def current(self) -> str | None:
        if self._request is None:
            return None
        with self._lock:
            token = self._token
        if token is None:
            token = str(self._authenticate(self._request).get("token") or "")
            with self._lock:
                self._token = token
        return token

    def set(self, token: str) -> None:
        with self._lock:
            self._token = token

    def forget(self) -> None:
        with self._lock:
            self._token = None


class MessageStream(Protocol):
    """An open streaming call (a watch): its messages as they come, each
    ``{"result": ...}`` or ``{"error": ...}``."""

    def messages(self) -> Iterator[dict[str, Any]]:
        """Raises MemberError, or one of the transport's errors, when the stream breaks."""
        ...

    def without_read_timeout(self) -> None:
        """Once open, the stream may stay quiet for ever (keepalive tells a dead peer)."""
        ...

    def abort(self) -> None:
        """Wake a read blocked on the stream, from any thread."""
        ...

    def close(self) -> None: ...


class Member(Protocol):
    """One etcd member. Thread-safe; authenticates on first use when given a user, and
    again after :meth:`forget_token` (etcd's tokens expire)."""

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        """One request; the answer. Raises MemberError when etcd refused it, or a
        transport error (:data:`UNREACHABLE` of the transport) when nobody answered."""
        ...

    def stream(self, path: str, body: dict[str, Any]) -> MessageStream: ...

    def forget_token(self) -> None: ...

    def close(self) -> None: ...
