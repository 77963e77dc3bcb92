"""What the store layer's two HTTP clients share (the Kubernetes API's,
:mod:`flannelpy.store.kube.client`, and etcd's JSON gateway's,
:mod:`flannelpy.store.etcd.gateway`): TCP keepalive on every connection, and an open
stream read line by line that another thread can wake.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
from collections.abc import Iterator
from typing import Any

import urllib3

# Raised by urllib3 and the socket layer when a server cannot be reached or the
# connection broke.
UNREACHABLE = (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError)


def socket_options(
    idle: int, interval: int, count: int, user_timeout_ms: int | None = None
) -> list[tuple[int, int, int]]:
    """urllib3's defaults plus TCP keepalive (probe an idle connection after ``idle`` s,
    every ``interval`` s, ``count`` times) and, if given, TCP_USER_TIMEOUT (how long sent
    data may stay unacknowledged): a silently dead peer is noticed on a quiet stream."""
    options = [*urllib3.connection.HTTPConnection.default_socket_options]
    options.append((socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1))
    tcp = [("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", interval), ("TCP_KEEPCNT", count)]
    if user_timeout_ms is not None:
        tcp.append(("TCP_USER_TIMEOUT", user_timeout_ms))
    for name, value in tcp:
        if hasattr(socket, name):
            options.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    return options


def error_body(resp: Any) -> bytes:
    """What a streaming request's refusal says (read whole; the connection is given up)."""
    try:
        return bytes(resp.read() or b"")
    except UNREACHABLE:
        return b""
    finally:
        resp.release_conn()


class Stream:
    """An open streaming answer: its lines as they come. :meth:`abort` (from another
    thread) wakes a read blocked on a quiet stream; :meth:`close` gives the connection up
    (a stream cut short leaves unread data, so it is never reused)."""

    def __init__(self, resp: Any) -> None:
        self._resp = resp

    @property
    def connection(self) -> Any:
        return getattr(self._resp, "connection", None)

    def lines(self) -> Iterator[bytes]:
        """The stream's lines, without their newline, as the chunks bring them (both
        servers send one message per chunk; a line cut across chunks is joined)."""
        partial = bytearray()  # a line begun in an earlier chunk
        for chunk in self._resp.stream(amt=None, decode_content=False):
            start = 0
            if partial:
                end = chunk.find(b"\n")
                if end == -1:
                    partial += chunk
                    continue
                partial += chunk[:end]
                yield bytes(partial)
                partial.clear()
                start = end + 1
            while (end := chunk.find(b"\n", start)) != -1:
                yield chunk[start:end]
                start = end + 1
            partial += chunk[start:]
        if partial:
            yield bytes(partial)

    def without_read_timeout(self) -> None:
        """Let a stream that opened within its request's timeout stay quiet for ever;
        keepalive is what then tells a dead peer."""
        sock = getattr(self.connection, "sock", None)
        if sock is not None:
            sock.settimeout(None)

    def abort(self) -> None:
        sock = getattr(self.connection, "sock", None)
        if sock is not None:
            with contextlib.suppress(OSError):  # already closed
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._resp.close()
        self._resp.release_conn()
