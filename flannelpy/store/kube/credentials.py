"""The credentials a request carries, kept fresh as client-go keeps them.

- A token file (the in-cluster service account's, or a kubeconfig's ``tokenFile``) is
  re-read once a minute: projected service-account tokens rotate, and a pod that kept
  the first one would be refused once it expires.
- An ``exec`` credential plugin (``client.authentication.k8s.io/v1`` or ``v1beta1``
  ExecCredential) is run when a credential is first needed, its answer (a token, or a
  client certificate and key) kept until its ``expirationTimestamp``, and run again
  after the API server answers 401.

Thread-safe: the node watch, the lease renewal and the status writes share one client.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from flannelpy.errors import StoreError
from flannelpy.store.kube.kubeconfig import Access, ExecSpec

TOKEN_REREAD = 60.0  # seconds: client-go's cached token source re-reads this often
EXEC_TIMEOUT = 60.0  # seconds a credential plugin may take
EXPIRY_MARGIN = 10.0  # seconds: a credential this close to its expiry is renewed first


@dataclass(frozen=True)
class ClientCert:
    cert: bytes | None = None  # PEM, or None with a file
    key: bytes | None = None
    cert_file: str | None = None
    key_file: str | None = None


class TokenFile:
    """A bearer token read from a file, re-read every ``reread`` seconds (and at once
    after a 401); the last good read stays in use if a re-read fails."""

    def __init__(
        self,
        path: str,
        monotonic: Callable[[], float] = time.monotonic,
        reread: float = TOKEN_REREAD,
    ) -> None:
        self.path = path
        self._monotonic = monotonic
        self._reread = reread
        self._token: str | None = None
        self._read_at = float("-inf")
        self._lock = threading.Lock()

    def token(self) -> str:
        with self._lock:
            now = self._monotonic()
            if self._token is None or now - self._read_at >= self._reread:
                try:
                    with open(self.path, encoding="utf-8") as f:
                        self._token = f.read().strip()
                    self._read_at = now
                except OSError as e:
                    if self._token is None:
                        raise StoreError(
                            f"kubernetes API credentials: cannot read the token file "
                            f"{self.path} ({e.strerror}); mount the service account token there"
                        ) from e
            return self._token

    def expire(self) -> None:
        with self._lock:
            self._read_at = float("-inf")


def _parse_time(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


class ExecPlugin:
    """A kubeconfig's exec credential plugin: run, its answer cached until it expires."""

    def __init__(
        self,
        spec: ExecSpec,
        clock: Callable[[], float] = time.time,
        run: Callable[..., subprocess.CompletedProcess[str]] = subprocess.run,
    ) -> None:
        self.spec = spec
        self._clock = clock
        self._run = run
        self._lock = threading.Lock()
        self._status: dict[str, Any] | None = None
        self._expires: float | None = None
        self.runs = 0  # how many times the plugin ran

    def _fail(self, problem: str) -> StoreError:
        return StoreError(
            f"kubernetes API credentials: the exec plugin {self.spec.command} {problem}; "
            "fix users[].user.exec in --kubeconfig-file or the plugin"
        )

    def status(self) -> dict[str, Any]:
        """The plugin's ExecCredential status (``token``, or ``clientCertificateData`` and
        ``clientKeyData``), run again when the cached one expired."""
        with self._lock:
            fresh = self._status is not None and (
                self._expires is None or self._clock() < self._expires - EXPIRY_MARGIN
            )
            if not fresh:
                self._status, self._expires = self._exec()
            assert self._status is not None
            return self._status

    def expire(self) -> None:
        with self._lock:
            self._status = None

    def _exec(self) -> tuple[dict[str, Any], float | None]:
        spec = self.spec
        request: dict[str, Any] = {"interactive": False}
        if spec.cluster is not None:
            request["cluster"] = _cluster_info(spec.cluster)
        env = dict(os.environ)
        env.update(spec.env)
        info = {"apiVersion": spec.api_version, "kind": "ExecCredential", "spec": request}
        env["KUBERNETES_EXEC_INFO"] = json.dumps(info)
        self.runs += 1
        try:
            done = self._run(
                [spec.command, *spec.args],
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=EXEC_TIMEOUT,
                check=False,
            )
        except (OSError, subprocess.SubprocessError) as e:
            raise self._fail(f"could not run ({e})") from e
        if done.returncode != 0:
            tail = (done.stderr or "").strip().splitlines()[-1:] or ["no message"]
            raise self._fail(f"exited with status {done.returncode} ({tail[0]})")
        try:
            doc = json.loads(done.stdout)
        except ValueError as e:
            raise self._fail(f"printed no JSON ({e})") from e
        if not isinstance(doc, dict) or doc.get("kind") != "ExecCredential":
            raise self._fail("printed no ExecCredential")
        if doc.get("apiVersion") != spec.api_version:
            raise self._fail(
                f"answered apiVersion {doc.get('apiVersion')!r}, not {spec.api_version!r}"
            )
        status = doc.get("status")
        if not isinstance(status, dict):
            raise self._fail("printed an ExecCredential without status")
        has_cert = bool(status.get("clientCertificateData"))
        if not status.get("token") and not has_cert:
            raise self._fail("gave neither a token nor a client certificate")
        if has_cert != bool(status.get("clientKeyData")):
            raise self._fail("gave a client certificate without its key, or a key alone")
        expires = status.get("expirationTimestamp")
        try:
            expiry = _parse_time(str(expires)) if expires else None
        except ValueError as e:
            raise self._fail(f"gave an expirationTimestamp that is not RFC 3339 ({e})") from e
        return status, expiry


def _cluster_info(cluster: Mapping[str, Any]) -> dict[str, Any]:
    info = {
        "server": cluster.get("server"),
        "tls-server-name": cluster.get("tls-server-name"),
        "insecure-skip-tls-verify": bool(cluster.get("insecure-skip-tls-verify")),
        "certificate-authority-data": cluster.get("certificate-authority-data"),
    }
    return {k: v for k, v in info.items() if v not in (None, "")}


class Credentials:
    """What one Access authenticates with: a header per request, and the client
    certificate the TLS connections present (which an exec plugin may change)."""

    def __init__(
        self,
        access: Access,
        monotonic: Callable[[], float] = time.monotonic,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._static_token = access.token
        self._token_file = TokenFile(access.token_file, monotonic) if access.token_file else None
        self._plugin = ExecPlugin(access.exec, clock) if access.exec else None
        self._cert = ClientCert(
            access.cert_data, access.key_data, access.cert_file, access.key_file
        )

    @property
    def plugin(self) -> ExecPlugin | None:
        return self._plugin

    def authorization(self) -> str | None:
        if self._plugin is not None:
            token = self._plugin.status().get("token")
            if token:
                return f"Bearer {token}"
        if self._token_file is not None:
            return f"Bearer {self._token_file.token()}"
        if self._static_token:
            return f"Bearer {self._static_token}"
        return None

    def client_cert(self) -> ClientCert | None:
        if self._plugin is not None:
            status = self._plugin.status()
            if status.get("clientCertificateData"):
                return ClientCert(
                    str(status["clientCertificateData"]).encode(),
                    str(status["clientKeyData"]).encode(),
                )
        if self._cert.cert or self._cert.cert_file:
            return self._cert
        return None

    def refreshable(self) -> bool:
        """Can a 401 be answered by fetching credentials again?"""
        return self._plugin is not None or self._token_file is not None

    def refresh(self) -> None:
        """After a 401: run the plugin again, re-read the token file."""
        if self._plugin is not None:
            self._plugin.expire()
        if self._token_file is not None:
            self._token_file.expire()
