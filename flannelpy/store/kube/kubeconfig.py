"""Where the Kubernetes API server is and how to prove who we are, read as Flannel (and
client-go) reads it: a kubeconfig's current context, the in-cluster service account, or
a bare URL.

What a kubeconfig may say, and how it is read:

- the cluster: ``server``, ``certificate-authority`` (a file) or
  ``certificate-authority-data`` (base64 PEM), ``insecure-skip-tls-verify``,
  ``tls-server-name``;
- the user: ``client-certificate``/``client-key`` (files) or ``-data`` (base64 PEM),
  ``token``, ``tokenFile`` (re-read, and it wins over ``token``, as in client-go), or an
  ``exec`` credential plugin (:mod:`.exec_credential`).

Relative paths are relative to the kubeconfig's directory. Anything else that changes
how to connect or authenticate (a legacy ``auth-provider``, a username and password,
impersonation, a proxy) is refused with a ConfigError naming what to use instead: a
credential silently ignored would only surface later as a 401 far from its cause.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from flannelpy.errors import ConfigError

SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
_OTHER = "a token, a client certificate or an exec credential plugin"
# A user's keys that would change who we are, none of them read: what to use instead.
UNSUPPORTED_USER_KEYS = {
    "auth-provider": "an exec credential plugin (users[].user.exec) or a token",
    "username": _OTHER,
    "password": _OTHER,
    "as": "the credentials of that identity itself",
    "as-groups": "the credentials of that identity itself",
}


@dataclass(frozen=True)
class ExecSpec:
    """A kubeconfig's ``users[].user.exec``: the plugin run to get a credential."""

    command: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    api_version: str = "client.authentication.k8s.io/v1"
    cluster: Mapping[str, Any] | None = None  # given to the plugin when provideClusterInfo


@dataclass(frozen=True)
class Access:
    """How to reach and authenticate to one API server (no secret is read here but the
    kubeconfig's own fields: token files and plugins are read when a request needs them)."""

    server: str
    ca_file: str | None = None
    ca_data: bytes | None = None
    insecure: bool = False
    tls_server_name: str | None = None
    cert_file: str | None = None
    key_file: str | None = None
    cert_data: bytes | None = None
    key_data: bytes | None = None
    token: str | None = None
    token_file: str | None = None
    exec: ExecSpec | None = None
    origin: str = field(default="", compare=False)  # for messages: "--kubeconfig-file X"

    def with_server(self, server: str) -> Access:
        return replace(self, server=server)


def check_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(
            f"--kube-api-url {url!r} is not a URL; write it like https://10.96.0.1:443"
        )
    return url.rstrip("/")


def in_cluster(environ: Mapping[str, str], sa_dir: str = SA_DIR) -> Access:
    """The pod's service account, as client-go's rest.InClusterConfig reads it."""
    host = environ.get("KUBERNETES_SERVICE_HOST", "")
    port = environ.get("KUBERNETES_SERVICE_PORT", "")
    token_file, ca_file = os.path.join(sa_dir, "token"), os.path.join(sa_dir, "ca.crt")
    problem = None
    if not host or not port:
        problem = "KUBERNETES_SERVICE_HOST and KUBERNETES_SERVICE_PORT are not set"
    elif not os.path.isfile(token_file):
        problem = f"{token_file} does not exist"
    elif not os.path.isfile(ca_file):
        problem = f"{ca_file} does not exist"
    if problem is not None:
        raise ConfigError(
            f"not running in a pod with a service account ({problem}); give "
            "--kubeconfig-file or --kube-api-url"
        )
    if ":" in host:  # an IPv6 address
        host = f"[{host}]"
    return Access(
        server=f"https://{host}:{port}",
        ca_file=ca_file,
        token_file=token_file,
        origin="the pod's service account",
    )


class _Reader:
    """One kubeconfig's current context; every problem is a ConfigError about ``path``."""

    def __init__(self, path: str, doc: Any) -> None:
        self.path = path
        self.base = os.path.dirname(os.path.abspath(path))
        self.doc = doc

    def fail(self, problem: str, fix: str) -> ConfigError:
        return ConfigError(f"--kubeconfig-file {self.path}: {problem}; {fix}")

    def named(self, kind: str, name: str) -> dict[str, Any]:
        entries = self.doc.get(kind + "s") or []
        for entry in entries if isinstance(entries, list) else []:
            if isinstance(entry, dict) and entry.get("name") == name:
                value = entry.get(kind)
                return value if isinstance(value, dict) else {}
        raise self.fail(
            f"the current context names the {kind} {name!r}, which it does not define",
            f"add it to its {kind}s or switch context (kubectl config use-context)",
        )

    def path_of(self, value: Any, key: str) -> str:
        if not isinstance(value, str) or not value:
            raise self.fail(f"{key} is not a file name", "give the path of the file")
        return value if os.path.isabs(value) else os.path.join(self.base, value)

    def data(self, value: Any, key: str) -> bytes:
        try:
            return base64.b64decode(str(value), validate=True)
        except (binascii.Error, ValueError) as e:
            raise self.fail(f"{key} is not base64 ({e})", "give the PEM base64-encoded") from e

    def access(self) -> Access:
        if not isinstance(self.doc, dict):
            raise self.fail("it is not a kubeconfig (no mapping at the top)", "point it at one")
        current = self.doc.get("current-context")
        if not current:
            raise self.fail(
                "it names no current-context",
                "set one (kubectl config use-context NAME --kubeconfig ...)",
            )
        context = self.named("context", str(current))
        cluster = self.named("cluster", str(context.get("cluster") or ""))
        user = self.named("user", str(context.get("user") or "")) if context.get("user") else {}
        server = cluster.get("server")
        if not isinstance(server, str) or not server:
            raise self.fail(f"the cluster of context {current!r} has no server", "add its URL")
        if cluster.get("proxy-url"):
            raise self.fail(
                "proxy-url is not supported",
                "let the node reach the API server directly and remove proxy-url",
            )
        access = Access(
            server=server.rstrip("/"),
            insecure=bool(cluster.get("insecure-skip-tls-verify")),
            tls_server_name=cluster.get("tls-server-name") or None,
            origin=f"--kubeconfig-file {self.path}",
        )
        if cluster.get("certificate-authority-data"):
            data = self.data(cluster["certificate-authority-data"], "certificate-authority-data")
            access = replace(access, ca_data=data)
        elif cluster.get("certificate-authority"):
            ca = self.path_of(cluster["certificate-authority"], "certificate-authority")
            access = replace(access, ca_file=ca)
        return self.credentials(access, user, cluster)

    def credentials(self, access: Access, user: dict[str, Any], cluster: dict[str, Any]) -> Access:
        for key, instead in UNSUPPORTED_USER_KEYS.items():
            if user.get(key):
                name = user[key].get("name") if key == "auth-provider" else None
                what = f"the auth-provider {name!r}" if name else key
                raise self.fail(
                    f"its user sets {what}, which flannelpy does not support", f"use {instead}"
                )
        if user.get("client-certificate-data"):
            access = replace(
                access,
                cert_data=self.data(user["client-certificate-data"], "client-certificate-data"),
            )
        elif user.get("client-certificate"):
            access = replace(
                access, cert_file=self.path_of(user["client-certificate"], "client-certificate")
            )
        if user.get("client-key-data"):
            access = replace(access, key_data=self.data(user["client-key-data"], "client-key-data"))
        elif user.get("client-key"):
            access = replace(access, key_file=self.path_of(user["client-key"], "client-key"))
        has_cert = access.cert_data or access.cert_file
        has_key = access.key_data or access.key_file
        if bool(has_cert) != bool(has_key):
            raise self.fail(
                "its user has a client certificate without its key, or a key without its "
                "certificate",
                "give both (client-certificate and client-key, or their -data forms)",
            )
        if user.get("tokenFile"):
            access = replace(access, token_file=self.path_of(user["tokenFile"], "tokenFile"))
        if user.get("token"):
            access = replace(access, token=str(user["token"]))
        if user.get("exec"):
            access = replace(access, exec=self.exec_spec(user["exec"], cluster))
        return access

    def exec_spec(self, spec: Any, cluster: dict[str, Any]) -> ExecSpec:
        if not isinstance(spec, dict) or not spec.get("command"):
            raise self.fail("its user's exec has no command", "name the plugin to run")
        version = str(spec.get("apiVersion") or "")
        if version not in (
            "client.authentication.k8s.io/v1",
            "client.authentication.k8s.io/v1beta1",
        ):
            raise self.fail(
                f"its user's exec asks for apiVersion {version!r}",
                "use client.authentication.k8s.io/v1 (or v1beta1)",
            )
        command = str(spec["command"])
        if os.sep in command and not os.path.isabs(command):
            command = os.path.normpath(os.path.join(self.base, command))  # as client-go does
        env = []
        for item in spec.get("env") or []:
            if not isinstance(item, dict) or "name" not in item:
                raise self.fail(
                    "its user's exec env has an entry without a name", "give name and value"
                )
            env.append((str(item["name"]), str(item.get("value", ""))))
        return ExecSpec(
            command=command,
            args=tuple(str(a) for a in spec.get("args") or []),
            env=tuple(env),
            api_version=version,
            cluster=cluster if spec.get("provideClusterInfo") else None,
        )


def load_kubeconfig(path: str) -> Access:
    """The current context of the kubeconfig at ``path``. Raises ConfigError."""
    import yaml  # only here: a DaemonSet in a pod never reads a kubeconfig

    try:
        text = Path(path).read_text(encoding="utf-8")
        doc = yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else " ".join(str(e).split())
        mark = getattr(e, "problem_mark", None)
        if mark is not None:  # one line, not YAML's drawing of where it stopped
            reason = f"{getattr(e, 'problem', None) or 'not YAML'} at line {mark.line + 1}"
        raise ConfigError(
            f"--kubeconfig-file {path}: cannot load it ({reason}); point it at a valid kubeconfig"
        ) from e
    return _Reader(path, doc).access()
