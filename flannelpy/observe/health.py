"""One small HTTP server for Prometheus and the kubelet: /metrics, /healthz, /readyz.

- ``/healthz`` (liveness): the process is alive *and its loops turn*. Each
  loop beats a :class:`Heartbeats` entry; one that stopped beating for longer
  than its allowed age makes the agent not live, and the kubelet restarts it.
  Flannel's /healthz answers 200 whatever its loops do; ours does not.
- ``/readyz`` (readiness): this node can carry pod traffic: lease held,
  subnet.env written, the last reconcile converged, firewall rules in place.
  :func:`readiness` computes it from those facts. It is about the node's own
  state only: a peer without a path (its lease asks for what we cannot do) is
  the peer's problem, shown by metrics, status.json and the doctor; counting it
  here would hold every node of a DaemonSet rollout not ready over one bad peer.

Both answer 200 ``ok`` or 503 with the reason, one line. The server is the
standard library's threading HTTP server in a daemon thread; a scrape or a
probe never waits for another.

The port is reachable from the node's network (hostNetwork), so whatever
connects is bounded: at most MAX_CONNECTIONS are served at once, each with a
socket timeout; one more is closed at once, and the rest wait in the listen
backlog without costing a thread. A thread per idle connection, unbounded,
once exhausted the process's threads and with them the CNI server's workers.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry

from flannelpy.dataplane.reconciler import ReconcileResult
from flannelpy.errors import ConfigError
from flannelpy.observe.exposition import TextRenderer

log = logging.getLogger("flannelpy.observe.health")

Check = Callable[[], tuple[bool, str]]

STOP_TIMEOUT = 5.0  # seconds to wait for the serving thread on stop()
MAX_CONNECTIONS = 32  # served at once; a probe and a scrape need one or two
CONNECTION_TIMEOUT = 5.0  # seconds a connection may stay silent (idle keep-alive included)


def split_host_port(addr: str) -> tuple[str, int]:
    """``"127.0.0.1:9403"`` / ``"[::1]:9403"`` → (host, port). Raises ConfigError."""
    host, sep, port_text = addr.strip().rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port_text.isdigit() or int(port_text) > 65535:
        raise ConfigError(
            f"listen address {addr!r} is not HOST:PORT; write it like 127.0.0.1:9403 or [::1]:9403"
        )
    return host, int(port_text)


class Heartbeats:
    """Last beat per named loop; live while every registered loop beat recently enough.

    A loop registers with its allowed age (a few times its period: a loop that
    waits up to ``resync_interval`` between passes gets, say, 3x that) and
    calls :meth:`beat` once per turn. ``clock`` is monotonic seconds.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._max_age: dict[str, float] = {}
        self._last: dict[str, float] = {}
        self._checks: dict[str, Check] = {}

    def add_check(self, name: str, check: Check) -> None:
        """Also require ``check()`` to pass: for a part that does not loop on a period
        (the CNI server's accept loop) but can die. A check that raises fails."""
        with self._lock:
            self._checks[name] = check

    def register(self, name: str, max_age: float) -> None:
        """Start watching ``name``; it counts as having just beaten."""
        if max_age <= 0:
            raise ValueError(f"heartbeat {name!r}: max_age must be positive, not {max_age}")
        with self._lock:
            self._max_age[name] = max_age
            self._last[name] = self._clock()

    def unregister(self, name: str) -> None:
        """Stop watching ``name`` (its loop ended on purpose)."""
        with self._lock:
            self._max_age.pop(name, None)
            self._last.pop(name, None)

    def beat(self, name: str) -> None:
        """``name`` completed a turn. Raises KeyError for a name never registered."""
        with self._lock:
            if name not in self._max_age:
                raise KeyError(f"heartbeat {name!r} was never registered")
            self._last[name] = self._clock()

    def ages(self) -> dict[str, float]:
        """Seconds since each registered loop's last beat."""
        now = self._clock()
        with self._lock:
            return {name: now - last for name, last in self._last.items()}

    def live(self) -> tuple[bool, str]:
        """(True, "ok"), or (False, which loops are stuck and for how long)."""
        now = self._clock()
        with self._lock:
            stuck = [
                f"{name} last beat {now - self._last[name]:.0f} s ago (allowed {limit:g} s)"
                for name, limit in sorted(self._max_age.items())
                if now - self._last[name] > limit
            ]
        if stuck:
            return False, "loop stuck: " + "; ".join(stuck)
        with self._lock:
            checks = sorted(self._checks.items())
        for name, check in checks:
            try:
                ok, reason = check()
            except Exception as e:
                ok, reason = False, f"check failed: {e}"
            if not ok:
                return False, f"{name}: {reason}"
        return True, "ok"


def readiness(
    *,
    lease_held: bool,
    subnet_env_written: bool,
    last_reconcile: ReconcileResult | None,
    rules_in_place: bool = True,
) -> tuple[bool, str]:
    """Whether the node can carry pod traffic, and if not the first reason why."""
    if not lease_held:
        return False, "no subnet lease held yet: the store may be unreachable"
    if last_reconcile is None:
        return False, "the data plane has not been programmed yet"
    if not last_reconcile.converged:
        first = last_reconcile.failures[0]
        more = len(last_reconcile.failures) - 1
        extra = f" (and {more} more)" if more else ""
        return False, f"the reconciler cannot converge: {first}{extra}"
    if not rules_in_place:
        return False, "firewall rules are not in place"
    if not subnet_env_written:
        return False, "subnet.env is not written yet"
    return True, "ok"


class _Server(ThreadingHTTPServer):
    daemon_threads = True  # a stuck client must never block stop()
    request_queue_size = 64

    def __init__(self, *args: Any, max_connections: int = MAX_CONNECTIONS, **kw: Any) -> None:
        self.slots = threading.BoundedSemaphore(max_connections)
        self.refused = 0  # connections closed at once because every slot was taken
        super().__init__(*args, **kw)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.refused += 1
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread (the process is out of them): drop this one
            self.slots.release()
            self.shutdown_request(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class _Server6(_Server):
    address_family = socket.AF_INET6


class HealthServer:
    """``/metrics`` from ``registry``, ``/healthz`` from ``live``, ``/readyz`` from ``ready``."""

    def __init__(
        self,
        addr: str,
        registry: CollectorRegistry,
        ready: Check,
        live: Check,
        serve_metrics: bool = True,
        max_connections: int = MAX_CONNECTIONS,
        timeout: float = CONNECTION_TIMEOUT,
    ) -> None:
        self._host, self._port = split_host_port(addr)
        self._registry = registry
        self._renderer = TextRenderer(registry)
        self._ready = ready
        self._live = live
        self._serve_metrics_here = serve_metrics
        self._max_connections = max_connections
        self._timeout = timeout
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def refused(self) -> int:
        """Connections closed unserved because MAX_CONNECTIONS were being served."""
        return self._server.refused if self._server is not None else 0

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) actually bound: the port is known after start() when given as 0."""
        if self._server is None:
            return self._host, self._port
        return self._host, int(self._server.server_address[1])

    def start(self) -> None:
        """Bind and serve in a daemon thread. Raises ConfigError when the address is taken."""
        if self._server is not None:
            return
        server_class = _Server6 if ":" in self._host else _Server
        try:
            server = server_class(
                (self._host, self._port),
                self._handler_class(),
                max_connections=self._max_connections,
            )
        except OSError as e:
            raise ConfigError(
                f"cannot listen on {self._host}:{self._port} for /metrics and health "
                f"({e.strerror}); free the port or change --metrics-addr"
            ) from e
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.2},
            name="health-http",
            daemon=True,
        )
        self._thread.start()
        log.info("serving metrics and health address=%s:%d", *self.address)

    def stop(self) -> None:
        server, thread = self._server, self._thread
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join(STOP_TIMEOUT)
        self._server = self._thread = None

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            server_version = "flannelpy"
            protocol_version = "HTTP/1.1"  # keep-alive for Prometheus' repeated scrapes
            # Headers and body leave in two writes; with Nagle on, the body waits for
            # the client's delayed ACK of the headers (40 ms) on a kept-alive connection.
            disable_nagle_algorithm = True
            timeout = owner._timeout  # StreamRequestHandler sets it on the socket

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics" and owner._serve_metrics_here:
                    owner._serve_metrics(self)
                elif path == "/metrics":
                    _reply(self, 404, b"not found: /metrics is served on --metrics-addr\n")
                elif path == "/healthz":
                    owner._serve_check(self, owner._live)
                elif path == "/readyz":
                    owner._serve_check(self, owner._ready)
                else:
                    _reply(self, 404, b"not found: use /metrics, /healthz or /readyz\n")

            def log_message(self, format: str, *args: object) -> None:
                log.debug("http " + format, *args)

        return Handler

    def _serve_metrics(self, handler: BaseHTTPRequestHandler) -> None:
        try:
            body = self._renderer.render()
        except Exception as e:  # report, but keep serving health checks
            log.warning("metrics scrape failed error=%s", e)
            _reply(handler, 500, f"metrics scrape failed: {e}\n".encode())
            return
        # Text format 0.0.4: what every Prometheus version reads (our names are all
        # legacy-valid, so the 1.0.0 format would add nothing).
        _reply(handler, 200, body, CONTENT_TYPE_PLAIN_0_0_4)

    @staticmethod
    def _serve_check(handler: BaseHTTPRequestHandler, check: Check) -> None:
        try:
            ok, reason = check()
        except Exception as e:  # a broken check is a failing check, with its reason
            ok, reason = False, f"check failed: {e}"
        _reply(handler, 200 if ok else 503, f"{'ok' if ok else reason}\n".encode())


def _reply(
    handler: BaseHTTPRequestHandler,
    status: int,
    body: bytes,
    content_type: str = "text/plain; charset=utf-8",
) -> None:
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)
