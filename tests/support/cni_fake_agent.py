"""A stand-in flannelpy agent for testing the CNI executables.

Speaks cni_plugin/wire.py on a unix socket, records every request (the raw
bytes and their decoded form) and answers each with a canned reply, a raw
byte string (to play a broken agent), or a handler.

    with FakeAgent(path, reply=(0, b'{"cniVersion": "1.1.0"}')) as agent:
        run the executable ...
        assert agent.requests[0].env["CNI_COMMAND"] == "ADD"
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from flannelpy.cni import spec, wire

Handler = Callable[[dict[str, str], bytes], tuple[int, bytes]]


@dataclass(frozen=True)
class Recorded:
    raw: bytes
    env: dict[str, str]
    stdin: bytes


def validating_handler(env: dict[str, str], stdin: bytes) -> tuple[int, bytes]:
    """Answer as the real agent does for bad input: spec.parse_request, CniError JSON."""
    try:
        request = spec.parse_request(env, stdin)
    except spec.CniError as e:
        return 1, e.to_json(spec.reply_version(stdin))
    if request.command == "ADD":
        result = spec.Result(
            request.cni_version,
            (spec.Interface(request.ifname, "0a:58:0a:f4:01:05", request.netns),),
            (spec.IPConfig("10.244.1.5/24", "10.244.1.1", 0),),
        )
        return 0, spec.render_result(result, request.cni_version)
    if request.command == "VERSION":
        return 0, spec.version_reply(request.cni_version)
    return 0, b""


class FakeAgent:
    """Listens on ``socket_path`` from start() to stop(); one connection at a time."""

    def __init__(
        self, socket_path: str, reply: tuple[int, bytes] | bytes | Handler = (0, b"")
    ) -> None:
        self.socket_path = socket_path
        self.reply = reply
        self._lock = threading.Lock()
        self._requests: list[Recorded] = []
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._thread: threading.Thread | None = None

    @property
    def requests(self) -> list[Recorded]:
        with self._lock:
            return list(self._requests)

    def clear(self) -> None:
        with self._lock:
            self._requests.clear()

    def start(self) -> FakeAgent:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.socket_path)
        listener.listen(64)
        listener.settimeout(0.05)  # so stop() is noticed promptly
        self._listener = listener
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
        if self._listener:
            self._listener.close()
        if os.path.exists(self.socket_path):
            os.unlink(self.socket_path)

    def __enter__(self) -> FakeAgent:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def _serve(self) -> None:
        assert self._listener is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(10)
                with contextlib.suppress(OSError):  # the client went away: nothing to answer
                    self._handle(conn)

    def _handle(self, conn: socket.socket) -> None:
        chunks: list[bytes] = []
        size = 0
        while size <= wire.MAX_REQUEST_BYTES:
            chunk = conn.recv(1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        raw = b"".join(chunks)
        answer: tuple[int, bytes] | None = None
        try:
            env, stdin = wire.decode_request(raw)
        except wire.WireError as e:
            env, stdin = {}, b""
            answer = (1, spec.CniError(spec.Code.INTERNAL, str(e)).to_json(spec.LATEST_VERSION))
        with self._lock:
            self._requests.append(Recorded(raw, env, stdin))
        if isinstance(self.reply, bytes):
            conn.sendall(self.reply)
            return
        if answer is None:
            answer = self.reply(env, stdin) if callable(self.reply) else self.reply
        conn.sendall(wire.encode_reply(*answer))
