"""The agent's CNI socket: requests from the thin executable, a thread each.

A thread per connection, because DEL is kernel-bound (~20 ms to delete a veth,
mostly waiting for RCU) and the runtime fires many at once: a single-threaded
server took 6.7× the reference plugins' wall time for 50 concurrent DELs.
Threads are kept idle for the next connection (:class:`flannelpy.cni.workers.Workers`)
rather than started for each. Whatever the handler needs to serialise (IPAM, the
bridge, one container) it locks itself.

Network namespace: every thread this server starts inherits the namespace of
the thread that called :meth:`CniServer.start` (or enters ``netns`` when one is
given), and the handler programs *that* namespace. The agent process already
runs in the node's namespace, so it starts the server from any of its threads;
tests pass ``netns`` to run a whole server inside a throwaway "node" namespace.
The socket itself is a path in the filesystem, reachable from every namespace.

The accept loop lives as long as the server: a connection that cannot get a
thread (the process is out of them) is served on the accept thread itself, and
any other failure is logged and the loop goes on. It once exited instead and
unlinked the socket, so every later ADD failed with code 11 while DELs leaked.
:meth:`CniServer.alive` tells liveness whether the loop turns and the socket
path is still ours.

Framing is :mod:`flannelpy.cni.wire`. The socket is 0600 in a 0700 directory: only
root (the kubelet, the runtime) may ask for pod networking.

The pod's namespace arrives as a descriptor (SCM_RIGHTS with the request's
first bytes), opened by the executable where CNI_NETNS means something; the
server hands it to the handler, which verifies it is a network namespace, and
closes every descriptor received once the reply is sent, whatever happened.

``after_reply`` (optional) hears each request once its reply has been sent and the
connection closed (or the sending failed), still with its descriptor, on the request's
thread: what the agent does only for itself (opening a pod's counters through its
namespace) or may finish later (a DEL's release) costs the runtime's call nothing.

Each connection has two bounded phases: the whole request must arrive within
``read_timeout`` (a total, so a client trickling a byte at a time is dropped
too), and the reply must be taken within SEND_TIMEOUT_SECONDS. The handler's
own work is bounded by the handler (an IPAM wait is capped).
"""

from __future__ import annotations

import array
import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

from flannelpy.cni import wire
from flannelpy.cni.spec import CniError, Code
from flannelpy.cni.workers import Workers
from flannelpy.dataplane.netns import enter_netns
from flannelpy.errors import DataplaneError

log = logging.getLogger(__name__)


class Handler(Protocol):
    """One request: (exit code, stdout). ``netns_fd`` is CNI_NETNS as the executable
    opened it, passed only when one arrived (a handler that never serves ADD, CHECK
    or DEL may take two arguments); the server closes it after the call."""

    def __call__(
        self, env: dict[str, str], stdin: bytes, netns_fd: int | None = None
    ) -> tuple[int, bytes]: ...


# After the reply: (CNI_* environment, stdin, the namespace's fd or None, exit code, stdout).
AfterReply = Callable[[dict[str, str], bytes, "int | None", int, bytes], None]

ACCEPT_POLL_SECONDS = 0.2  # how often the accept loop looks at its stop flag
ACCEPT_STALE_SECONDS = 30.0  # an accept loop silent this long is stuck (it turns every 0.2 s)
# The whole request, from accept to the client's shutdown: the executables send
# it at once (~1 ms), so 10 s only ever cuts off a stalled or trickling client.
READ_TIMEOUT_SECONDS = 10.0
SEND_TIMEOUT_SECONDS = 10.0  # the reply is a few kB; a client that stops reading is dropped
MAX_FDS = 1  # the namespace of CNI_NETNS; more is refused
BACKLOG = 256  # a 100-pod burst connects at once
ERROR_VERSION = "1.1.0"  # for errors raised before the request's cniVersion is known
STOP_GRACE_SECONDS = 30.0  # in-flight requests finish (a bounded IPAM wait included)


class CniServer:
    def __init__(
        self,
        socket_path: str,
        handler: Handler,
        netns: str | None = None,
        read_timeout: float = READ_TIMEOUT_SECONDS,
        after_reply: AfterReply | None = None,
    ) -> None:
        self.socket_path = socket_path
        self.handler = handler
        self.after_reply = after_reply
        self.netns = netns
        self.read_timeout = read_timeout
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._workers = Workers("cni-conn")
        self._inflight = 0  # connections being served
        self._done = threading.Condition()
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self._socket_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the bound socket
        self._last_turn = 0.0  # time.monotonic() of the accept loop's last turn

    # -- life cycle

    def start(self) -> None:
        """Bind the socket and serve in a background thread; returns once listening."""
        self._stop.clear()
        self._started.clear()
        self._thread = threading.Thread(target=self._run, name="cni-server", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error

    def stop(self, grace: float = STOP_GRACE_SECONDS) -> None:
        """Stop accepting, let in-flight requests finish (bounded), remove the socket."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._done:
            self._done.wait_for(lambda: self._inflight == 0, grace)

    def _run(self) -> None:
        try:
            if self.netns is not None:
                enter_netns(self.netns)
            self._listener = bind_socket(self.socket_path)
            st = os.stat(self.socket_path)
            self._socket_id = (st.st_dev, st.st_ino)
            self._last_turn = time.monotonic()
        except BaseException as e:
            self._start_error = e
            self._started.set()
            return
        self._started.set()
        log.info("CNI server listening socket=%s", self.socket_path)
        try:
            self._accept_loop(self._listener)
        finally:
            self._listener.close()
            self._listener = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_path)

    def alive(self) -> tuple[bool, str]:
        """(True, "ok") while the accept loop turns and the socket path is the one it
        listens on; else why not, for /healthz (a restart rebinds the socket)."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return False, f"the CNI server no longer accepts on {self.socket_path}"
        silent = time.monotonic() - self._last_turn
        if silent > ACCEPT_STALE_SECONDS:
            return False, f"the CNI server's accept loop has not turned for {silent:.0f} s"
        try:
            st = os.stat(self.socket_path)
        except OSError as e:
            return False, f"the CNI socket {self.socket_path} is gone ({e.strerror})"
        if (st.st_dev, st.st_ino) != self._socket_id:
            return False, f"the CNI socket {self.socket_path} was replaced by another"
        return True, "ok"

    def _accept_loop(self, listener: socket.socket) -> None:
        listener.settimeout(ACCEPT_POLL_SECONDS)
        while not self._stop.is_set():
            self._last_turn = time.monotonic()
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError as e:  # EMFILE and the like: wait a turn, then accept again
                log.warning("CNI socket accept failed: %s", e)
                self._stop.wait(ACCEPT_POLL_SECONDS)
                continue
            try:
                self._dispatch(conn)
            except Exception:  # never end the loop: the socket would be gone for good
                log.exception("CNI connection could not be served")
                with contextlib.suppress(OSError):
                    conn.close()

    def _dispatch(self, conn: socket.socket) -> None:
        with self._done:
            self._inflight += 1
        try:
            self._workers.submit(lambda: self._serve(conn))
        except RuntimeError as e:  # "can't start new thread": serve it here, slower but served
            log.warning("no thread for a CNI connection, serving it inline reason=%s", e)
            self._serve(conn)

    # -- one connection

    def _serve(self, conn: socket.socket) -> None:
        fds: list[int] = []
        after: Callable[[], None] | None = None
        try:
            with conn:
                reply, after = self._reply(conn, fds)
                if after is None:  # nothing needs them past the answer: closed before it
                    _close_all(fds)
                try:
                    conn.settimeout(SEND_TIMEOUT_SECONDS)  # sendall's total, not per send
                    conn.sendall(reply)
                except OSError as e:
                    log.warning("could not send the CNI reply: %s", e)
        finally:
            try:
                if after is not None:  # once the connection is closed, whatever happened
                    after()
            finally:
                _close_all(fds)
                with self._done:
                    self._inflight -= 1
                    self._done.notify_all()

    def _reply(
        self, conn: socket.socket, fds: list[int]
    ) -> tuple[bytes, Callable[[], None] | None]:
        """The reply, and what to run once it is sent; ``fds`` gets the descriptors
        received, for the caller to close."""
        try:
            data, received = read_request(conn, timeout=self.read_timeout)
        except (wire.WireError, OSError) as e:
            log.warning("CNI request dropped reason=%s", e)
            err = CniError(Code.IO_FAILURE, f"could not read the request from the CNI plugin: {e}")
            return wire.encode_reply(1, err.to_json(ERROR_VERSION)), None
        fds.extend(received)
        return self._answer(data, received[0] if received else None)

    def _answer(self, data: bytes, netns_fd: int | None) -> tuple[bytes, Callable[[], None] | None]:
        try:
            env, stdin = wire.decode_request(data)
        except wire.WireError as e:
            err = CniError(Code.IO_FAILURE, f"could not read the request from the CNI plugin: {e}")
            return wire.encode_reply(1, err.to_json(ERROR_VERSION)), None
        try:
            if netns_fd is None:
                code, out = self.handler(env, stdin)
            else:
                code, out = self.handler(env, stdin, netns_fd)
        except Exception as e:  # the handler should not raise; never leave the client hanging
            log.exception("CNI handler failed command=%s", env.get("CNI_COMMAND"))
            err = CniError(Code.INTERNAL, f"the flannelpy agent failed unexpectedly: {e}")
            return wire.encode_reply(1, err.to_json(ERROR_VERSION)), None
        hook = self.after_reply
        if hook is None:
            return wire.encode_reply(code, out), None

        def after() -> None:
            try:
                hook(env, stdin, netns_fd, code, out)
            except Exception:  # the reply is out; nothing may end the worker badly
                log.exception("CNI after-reply hook failed command=%s", env.get("CNI_COMMAND"))

        return wire.encode_reply(code, out), after


def _close_all(fds: list[int]) -> None:
    while fds:
        os.close(fds.pop())


_FD_SPACE = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)


def read_request(
    conn: socket.socket,
    limit: int = wire.MAX_REQUEST_BYTES,
    timeout: float = READ_TIMEOUT_SECONDS,
) -> tuple[bytes, list[int]]:
    """Everything until the client shuts down writing, within ``timeout`` seconds in
    all, and the descriptors that came with it (close-on-exec; the caller closes
    them). Raises WireError beyond ``limit`` or MAX_FDS, TimeoutError past the
    deadline, having closed what it received."""
    deadline = time.monotonic() + timeout
    chunks: list[bytes] = []
    fds: list[int] = []
    size = 0
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"the request did not arrive within {timeout:g} s")
            conn.settimeout(left)
            try:
                chunk, ancdata, flags, _ = conn.recvmsg(65536, _FD_SPACE, socket.MSG_CMSG_CLOEXEC)
            except TimeoutError:
                raise TimeoutError(f"the request did not arrive within {timeout:g} s") from None
            for level, kind, payload in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got = array.array("i")
                    got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                    fds.extend(got)
            # The kernel closes what did not fit and says so with MSG_CTRUNC.
            if flags & socket.MSG_CTRUNC or len(fds) > MAX_FDS:
                raise wire.WireError(
                    f"the request carried more than {MAX_FDS} file descriptor; run flannelpy-cni"
                )
            if not chunk:
                return b"".join(chunks), fds
            size += len(chunk)
            if size > limit:
                raise wire.WireError(f"request larger than {limit} bytes")
            chunks.append(chunk)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def bind_socket(path: str) -> socket.socket:
    """A listening unix socket at ``path``: 0600, directory 0700, a stale socket replaced.

    Bound under a temporary name, restricted, then renamed over ``path``, so the
    socket is never reachable with wider permissions and a running client never
    sees the path missing.
    """
    folder = os.path.dirname(path) or "."
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except OSError as e:
        raise DataplaneError(
            f"cannot create the CNI socket directory {folder}: {e.strerror}"
        ) from e
    tmp = f"{path}.{os.getpid()}.tmp"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        sock.bind(tmp)
        os.chmod(tmp, 0o600)
        sock.listen(BACKLOG)
        os.replace(tmp, path)
    except OSError as e:
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise DataplaneError(f"cannot listen on the CNI socket {path}: {e.strerror or e}") from e
    return sock
