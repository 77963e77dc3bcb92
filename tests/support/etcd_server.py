"""Start a throw-away etcd on 127.0.0.1 for tests and the lab.

Each server gets free random ports and its own temporary data directory, so
parallel runs never share state. ``start_etcd`` works outside pytest;
``tests/conftest.py`` wraps it in fixtures. ``stop`` is idempotent and removes
the data directory; ``kill`` + ``start`` restart a server on the same ports and
data, which is how the tests simulate an etcd outage.
"""

from __future__ import annotations

import os
import shutil
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

ETCD_BINARY = shutil.which("etcd") or "etcd"
START_TIMEOUT = 15.0  # seconds for a single-member etcd to become healthy


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for an https etcd: the CA, the server pair and a client pair."""

    ca: str
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str


def free_port() -> int:
    """A TCP port free right now on 127.0.0.1 (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EtcdServer:
    """One single-member etcd process with its ports and data directory."""

    def __init__(self, tls: TlsFiles | None = None, extra_args: Sequence[str] = ()) -> None:
        self.tls = tls
        self.extra_args = tuple(extra_args)
        self.client_port = free_port()
        self.peer_port = free_port()
        while self.peer_port == self.client_port:
            self.peer_port = free_port()
        self.data_dir = tempfile.mkdtemp(prefix="flannelpy-etcd-")
        self.name = f"test{os.getpid()}"
        self._proc: subprocess.Popen[bytes] | None = None
        self._log_path = Path(self.data_dir) / "etcd.log"

    @property
    def scheme(self) -> str:
        return "https" if self.tls else "http"

    @property
    def endpoint(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.client_port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def _argv(self) -> list[str]:
        peer = f"http://127.0.0.1:{self.peer_port}"
        argv = [
            ETCD_BINARY,
            "--name", self.name,
            "--data-dir", str(Path(self.data_dir) / "data"),
            "--listen-client-urls", self.endpoint,
            "--advertise-client-urls", self.endpoint,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"{self.name}={peer}",
            "--initial-cluster-state", "new",
            # A fast election makes start-up and restart take ~0.2 s instead of ~1 s.
            "--heartbeat-interval", "10",
            "--election-timeout", "100",
            "--logger", "zap",
            "--log-level", "error",
        ]  # fmt: skip
        if self.tls:
            argv += [
                "--cert-file", self.tls.server_cert,
                "--key-file", self.tls.server_key,
                "--trusted-ca-file", self.tls.ca,
                "--client-cert-auth",
            ]  # fmt: skip
        return argv + list(self.extra_args)

    def start(self) -> EtcdServer:
        """Start (or restart after ``kill``) and wait until etcd answers /health."""
        if self.running:
            return self
        log = open(self._log_path, "ab")  # noqa: SIM115 - handed to the child, closed below
        try:
            self._proc = subprocess.Popen(
                self._argv(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        finally:
            log.close()
        try:
            self._wait_healthy()
        except Exception:
            self.stop()
            raise
        return self

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"etcd exited at start-up: {self.log_tail()}")
            if self._health_ok():
                return
            time.sleep(0.05)
        raise RuntimeError(f"etcd did not become healthy in {START_TIMEOUT} s: {self.log_tail()}")

    def _health_ok(self) -> bool:
        context = None
        if self.tls:
            context = ssl.create_default_context(cafile=self.tls.ca)
            context.load_cert_chain(self.tls.client_cert, self.tls.client_key)
        try:
            with urllib.request.urlopen(
                f"{self.endpoint}/health", timeout=0.5, context=context
            ) as resp:
                return b'"health":"true"' in resp.read()
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL etcd, keeping its data and ports for a later ``start``."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait(timeout=10)
            self._proc = None

    def stop(self) -> None:
        """Stop etcd and delete its data directory. Safe to call twice."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=5)
        self._proc = None
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self._log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return " | ".join(text.strip().splitlines()[-lines:])


def start_etcd(tls: TlsFiles | None = None, extra_args: Sequence[str] = ()) -> EtcdServer:
    """Start a fresh etcd; the caller must call ``stop()``."""
    return EtcdServer(tls=tls, extra_args=extra_args).start()


@contextmanager
def running_etcd(
    tls: TlsFiles | None = None, extra_args: Sequence[str] = ()
) -> Iterator[EtcdServer]:
    """``with running_etcd() as etcd: ... etcd.endpoint ...`` — stopped on exit."""
    server = EtcdServer(tls=tls, extra_args=extra_args)
    try:
        yield server.start()
    finally:
        server.stop()


def make_tls_files(directory: str) -> TlsFiles:
    """Create a CA, a server pair for 127.0.0.1 and a client pair with openssl."""
    d = Path(directory)

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    ec_key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run(
        "req",
        "-x509",
        *ec_key,
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "1",
        "-subj",
        "/CN=flannelpy-test-ca",
    )
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        (d / f"{name}.ext").write_text(ext + "\n")
        run(
            "req",
            *ec_key,
            "-keyout",
            f"{name}.key",
            "-out",
            f"{name}.csr",
            "-subj",
            f"/CN=flannelpy-{name}",
        )
        run(
            "x509",
            "-req",
            "-in",
            f"{name}.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            f"{name}.pem",
            "-days",
            "1",
            "-extfile",
            f"{name}.ext",
        )
    return TlsFiles(
        ca=str(d / "ca.pem"),
        server_cert=str(d / "server.pem"),
        server_key=str(d / "server.key"),
        client_cert=str(d / "client.pem"),
        client_key=str(d / "client.key"),
    )
