"""How Kubernetes mode finds the API server and its credentials: the kubeconfig's current
context (each auth form, files relative to the kubeconfig, data against files, what is
refused), the in-cluster service account and its rotating token, the exec credential
plugin (cached until it expires, run again after a 401), and how answers map to errors."""

from __future__ import annotations

import base64
import json
import os
import re
import stat
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from flannelpy.config.settings import AgentSettings
from flannelpy.errors import ConfigError, RevisionCompacted, StoreError, StoreUnavailable
from flannelpy.store.kube.api import Conflict, Forbidden, NotFound, api_error
from flannelpy.store.kube.client import Answer, _decoded, client_access
from flannelpy.store.kube.credentials import Credentials, ExecPlugin, TokenFile
from flannelpy.store.kube.kubeconfig import Access, ExecSpec, in_cluster, load_kubeconfig

CA_PEM = b"-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n"


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def kubeconfig(
    tmp_path: Path, user: dict[str, Any], cluster: dict[str, Any] | None = None, **top: Any
) -> str:
    doc: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {"name": "c", "cluster": {"server": "https://10.0.0.1:6443/", **(cluster or {})}}
        ],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "ctx", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "ctx",
        **top,
    }
    path = tmp_path / "conf" / "kubeconfig"
    path.parent.mkdir(exist_ok=True)
    path.write_text(yaml.safe_dump(doc))
    return str(path)


# --- the kubeconfig ------------------------------------------------------------------


def test_a_token_and_a_ca_file_relative_to_the_kubeconfig(tmp_path: Path) -> None:
    path = kubeconfig(
        tmp_path,
        {"token": "tok-1"},
        {"certificate-authority": "pki/ca.crt", "tls-server-name": "api.example"},
    )
    access = load_kubeconfig(path)
    assert access.server == "https://10.0.0.1:6443"
    assert access.ca_file == str(tmp_path / "conf" / "pki" / "ca.crt")
    assert access.tls_server_name == "api.example" and not access.insecure
    assert Credentials(access).authorization() == "Bearer tok-1"
    assert Credentials(access).client_cert() is None


def test_client_certificate_files_and_data(tmp_path: Path) -> None:
    files = load_kubeconfig(
        kubeconfig(tmp_path, {"client-certificate": "u.crt", "client-key": "/abs/u.key"})
    )
    assert files.cert_file == str(tmp_path / "conf" / "u.crt") and files.key_file == "/abs/u.key"
    data = load_kubeconfig(
        kubeconfig(
            tmp_path,
            {"client-certificate-data": b64(b"CERT"), "client-key-data": b64(b"KEY")},
            {"certificate-authority-data": b64(CA_PEM), "insecure-skip-tls-verify": True},
        )
    )
    assert (data.cert_data, data.key_data, data.ca_data) == (b"CERT", b"KEY", CA_PEM)
    assert data.insecure and data.cert_file is None and data.ca_file is None
    cert = Credentials(data).client_cert()
    assert cert is not None and (cert.cert, cert.key) == (b"CERT", b"KEY")
    assert Credentials(data).authorization() is None


def test_a_token_file_wins_over_a_token_and_is_read_when_needed(tmp_path: Path) -> None:
    path = kubeconfig(tmp_path, {"token": "static", "tokenFile": "token"})
    access = load_kubeconfig(path)
    assert access.token_file == str(tmp_path / "conf" / "token")
    (tmp_path / "conf" / "token").write_text("from-file\n")
    assert Credentials(access).authorization() == "Bearer from-file"


def test_kube_api_url_overrides_the_server_and_keeps_the_credentials(tmp_path: Path) -> None:
    path = kubeconfig(tmp_path, {"token": "tok-1"})
    settings = AgentSettings(kubeconfig_file=path, kube_api_url="https://192.0.2.7:443/")
    access = client_access(settings)
    assert access.server == "https://192.0.2.7:443" and access.token == "tok-1"
    alone = client_access(AgentSettings(kube_api_url="http://192.0.2.7:8080"))
    assert alone == Access(server="http://192.0.2.7:8080")


@pytest.mark.parametrize(
    ("user", "top", "message"),
    [
        ({"token": "t"}, {"current-context": ""}, r"names no current-context; set one"),
        ({"token": "t"}, {"current-context": "other"}, r"names the context 'other', which it"),
        (
            {"auth-provider": {"name": "gcp", "config": {}}},
            {},
            r"sets the auth-provider 'gcp', which flannelpy does not support; use an exec "
            r"credential plugin",
        ),
        ({"username": "a", "password": "b"}, {}, r"sets username, .* use a token, a client"),
        ({"as": "admin", "token": "t"}, {}, r"sets as, .*; use the credentials of that"),
        ({"client-certificate": "u.crt"}, {}, r"certificate without its key.*; give both"),
        ({"client-key-data": "%%%"}, {}, r"client-key-data is not base64"),
        (
            {"exec": {"command": "x", "apiVersion": "client.authentication.k8s.io/v1alpha1"}},
            {},
            r"asks for apiVersion .*v1alpha1'; use client.authentication.k8s.io/v1",
        ),
    ],
)
def test_what_is_refused_names_the_fix(
    tmp_path: Path, user: dict[str, Any], top: dict[str, Any], message: str
) -> None:
    path = kubeconfig(tmp_path, user, **top)
    with pytest.raises(ConfigError, match=rf"^--kubeconfig-file {re.escape(path)}: .*{message}"):
        load_kubeconfig(path)


def test_a_missing_or_broken_kubeconfig(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"missing: cannot load it \(No such file"):
        load_kubeconfig(str(tmp_path / "missing"))
    (tmp_path / "bad").write_text("clusters: [unclosed")
    broken = r"bad: cannot load it \(expected ',' or ']', but got '<stream end>' at line 1\); "
    with pytest.raises(ConfigError, match=broken + "point it at a valid kubeconfig$"):
        load_kubeconfig(str(tmp_path / "bad"))
    (tmp_path / "list").write_text("- 1\n")
    with pytest.raises(ConfigError, match=r"it is not a kubeconfig"):
        load_kubeconfig(str(tmp_path / "list"))


def test_an_exec_plugin_relative_to_the_kubeconfig(tmp_path: Path) -> None:
    spec = {
        "command": "./bin/cred",
        "args": ["--x"],
        "env": [{"name": "A", "value": "1"}],
        "apiVersion": "client.authentication.k8s.io/v1beta1",
        "provideClusterInfo": True,
    }
    access = load_kubeconfig(kubeconfig(tmp_path, {"exec": spec}))
    assert access.exec is not None
    assert access.exec.command == str(tmp_path / "conf" / "bin" / "cred")
    assert access.exec.args == ("--x",) and access.exec.env == (("A", "1"),)
    assert access.exec.cluster is not None
    on_path = load_kubeconfig(kubeconfig(tmp_path, {"exec": {**spec, "command": "cred"}}))
    assert on_path.exec is not None and on_path.exec.command == "cred"  # looked up on PATH


# --- in the cluster ------------------------------------------------------------------


def test_in_cluster_reads_the_service_account(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("sa-1")
    (tmp_path / "ca.crt").write_bytes(CA_PEM)
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    access = in_cluster(env, str(tmp_path))
    assert access.server == "https://10.96.0.1:443"
    assert access.ca_file == str(tmp_path / "ca.crt")
    assert Credentials(access).authorization() == "Bearer sa-1"
    six = in_cluster({**env, "KUBERNETES_SERVICE_HOST": "fd00::1"}, str(tmp_path))
    assert six.server == "https://[fd00::1]:443"
    (tmp_path / "token").unlink()
    with pytest.raises(ConfigError, match=r"token does not exist\); give --kubeconfig-file"):
        in_cluster(env, str(tmp_path))
    with pytest.raises(ConfigError, match=r"^not running in a pod with a service account"):
        in_cluster({}, str(tmp_path))


def test_the_token_file_is_read_again_every_minute(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("first\n")
    now = [0.0]
    token = TokenFile(str(path), monotonic=lambda: now[0])
    assert token.token() == "first"
    path.write_text("second")  # the kubelet rotated the projected token
    now[0] = 59.0
    assert token.token() == "first"
    now[0] = 60.0
    assert token.token() == "second"
    path.write_text("third")
    token.expire()  # a 401: read it at once
    assert token.token() == "third"
    path.unlink()  # a failed re-read keeps the last good token
    now[0] = 200.0
    assert token.token() == "third"
    with pytest.raises(StoreError, match=r"cannot read the token file .*; mount the service"):
        TokenFile(str(path)).token()


# --- the exec credential plugin ----------------------------------------------------------


PLUGIN = """\
#!{python}
import json, os, sys
count_file = sys.argv[1]
count = int(open(count_file).read()) + 1 if os.path.exists(count_file) else 1
open(count_file, "w").write(str(count))
info = json.loads(os.environ["KUBERNETES_EXEC_INFO"])
status = {{"token": f"tok-{{count}}-{{os.environ['PLUGIN_ENV']}}",
          "expirationTimestamp": os.environ["EXPIRES"]}}
if os.environ.get("CERT"):
    status = {{"clientCertificateData": "CERT", "clientKeyData": "KEY"}}
if os.environ.get("BAD"):
    print(os.environ["BAD"]); sys.exit(int(os.environ.get("CODE", "0")))
print(json.dumps({{"apiVersion": info["apiVersion"], "kind": "ExecCredential",
                   "status": status, "spec_seen": info["spec"]}}))
"""


def plugin(
    tmp_path: Path, version: str = "client.authentication.k8s.io/v1", **env: str
) -> ExecSpec:
    script = tmp_path / "plugin.py"
    script.write_text(PLUGIN.format(python=sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    env = {"PLUGIN_ENV": "e", "EXPIRES": "2030-01-01T00:10:00Z", **env}
    return ExecSpec(
        command=str(script),
        args=(str(tmp_path / "count"),),
        env=tuple(env.items()),
        api_version=version,
    )


def at(text: str) -> float:
    return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()


@pytest.mark.parametrize(
    "version", ["client.authentication.k8s.io/v1", "client.authentication.k8s.io/v1beta1"]
)
def test_the_plugin_token_is_cached_until_it_expires(tmp_path: Path, version: str) -> None:
    now = [at("2030-01-01T00:00:00")]
    creds = Credentials(
        Access(server="https://a", exec=plugin(tmp_path, version)), clock=lambda: now[0]
    )
    assert creds.authorization() == "Bearer tok-1-e"
    now[0] = at("2030-01-01T00:09:00")
    assert creds.authorization() == "Bearer tok-1-e"  # still valid: not run again
    assert creds.plugin is not None and creds.plugin.runs == 1
    now[0] = at("2030-01-01T00:09:55")  # within the margin before its expiry
    assert creds.authorization() == "Bearer tok-2-e"
    assert creds.refreshable()
    creds.refresh()  # after a 401
    assert creds.authorization() == "Bearer tok-3-e"
    assert (tmp_path / "count").read_text() == "3"


def test_the_plugin_can_give_a_client_certificate(tmp_path: Path) -> None:
    creds = Credentials(Access(server="https://a", exec=plugin(tmp_path, CERT="1")))
    cert = creds.client_cert()
    assert cert is not None and (cert.cert, cert.key) == (b"CERT", b"KEY")
    assert creds.authorization() is None


def test_the_plugin_is_told_about_the_request(tmp_path: Path) -> None:
    seen: dict[str, Any] = {}

    def run(argv: list[str], **kwargs: Any) -> Any:
        import subprocess

        seen.update(json.loads(kwargs["env"]["KUBERNETES_EXEC_INFO"]))
        return subprocess.run(argv, **kwargs)

    spec = plugin(tmp_path)
    spec = ExecSpec(spec.command, spec.args, spec.env, spec.api_version, {"server": "https://a"})
    ExecPlugin(spec, run=run).status()
    assert seen["kind"] == "ExecCredential" and seen["spec"]["interactive"] is False
    assert seen["spec"]["cluster"] == {"server": "https://a", "insecure-skip-tls-verify": False}


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"BAD": "oops", "CODE": "3"}, r"exited with status 3"),
        ({"BAD": "not json"}, r"printed no JSON"),
        ({"BAD": '{"kind": "Other"}'}, r"printed no ExecCredential"),
        (
            {"BAD": json.dumps({"kind": "ExecCredential", "apiVersion": "x", "status": {}})},
            r"answered apiVersion 'x'",
        ),
        ({"EXPIRES": "soon"}, r"gave an expirationTimestamp that is not RFC 3339"),
    ],
)
def test_a_failing_plugin_names_what_to_fix(
    tmp_path: Path, env: dict[str, str], message: str
) -> None:
    plug = ExecPlugin(plugin(tmp_path, **env))
    with pytest.raises(StoreError, match=rf"exec plugin .*plugin.py {message}.*; fix users"):
        plug.status()
    missing = ExecPlugin(ExecSpec(command=str(tmp_path / "nothing")))
    with pytest.raises(StoreError, match=r"could not run"):
        missing.status()


# --- answers as errors -------------------------------------------------------------------


def status_body(message: str) -> bytes:
    return json.dumps({"kind": "Status", "message": message}).encode()


def test_answers_map_to_our_errors() -> None:
    gone = api_error("watch nodes", 410, "Gone", status_body("too old resource version"))
    assert isinstance(gone, RevisionCompacted)
    assert str(gone) == "kubernetes API watch nodes: too old resource version (410 Gone); re-list"
    for status in (500, 503, 429):
        assert isinstance(api_error("list nodes", status, "x"), StoreUnavailable)
    unauthorized = api_error("get node n1", 401, "Unauthorized")
    assert type(unauthorized) is StoreError
    assert str(unauthorized) == (
        "kubernetes API get node n1: unauthorized (Unauthorized); check the ServiceAccount "
        "token or --kubeconfig-file"
    )
    forbidden = api_error("patch node n1 status", 403, "Forbidden", status_body("no"))
    assert isinstance(forbidden, Forbidden)
    assert "forbidden (no); the agent's ClusterRole must allow pods: get; nodes: get,list" in str(
        forbidden
    )
    assert "its Role in its own namespace leases.coordination.k8s.io: create,patch" in str(
        forbidden
    )
    missing = api_error("get node n9", 404, "Not Found")
    assert isinstance(missing, NotFound)
    assert str(missing) == "kubernetes API get node n9: not found (Not Found)"
    assert isinstance(api_error("write", 409, "Conflict"), Conflict)
    assert str(api_error("x", 422, "")) == "kubernetes API x failed: HTTP 422 (HTTP 422)"


def test_an_answer_that_is_not_a_json_object_is_a_store_fault() -> None:
    assert _decoded("get node n1", Answer(200, "OK", b'{"a": 1}')) == {"a": 1}
    with pytest.raises(StoreUnavailable, match=r"get node n1: the answer is not JSON"):
        _decoded("get node n1", Answer(200, "OK", b"<html>"))
    with pytest.raises(StoreUnavailable, match=r"the answer is not a JSON object"):
        _decoded("get node n1", Answer(200, "OK", b"[1]"))
    with pytest.raises(NotFound):
        _decoded("get node n1", Answer(404, "Not Found", b"<html>"))


def test_no_credential_file_is_left_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Client certificate data reaches the TLS context through a private temporary file,
    removed at once (the ssl module loads certificates from files only)."""
    import ssl

    from flannelpy.store.kube.client import ssl_context
    from flannelpy.store.kube.credentials import ClientCert

    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)
    with pytest.raises(ssl.SSLError):  # not a real certificate: loading it fails...
        ssl_context(Access(server="https://a"), ClientCert(b"CERT", b"KEY"))
    assert os.listdir(tmp_path) == []  # ...and still nothing stays on disk


class Chunks:
    """A response whose body comes in the given chunks."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    def stream(self, amt: Any = None, decode_content: Any = None) -> Any:
        return iter(self.chunks)


@pytest.mark.parametrize("size", [1, 3, 7, 64, 10_000])
def test_watch_lines_are_the_same_however_the_body_is_cut(size: int) -> None:
    from flannelpy.store.http import Stream

    body = b'{"type": "ADDED"}\n\n{"type": "MODIFIED", "x": "' + b"y" * 300 + b'"}\n{"tail": 1}'
    chunks = [body[i : i + size] for i in range(0, len(body), size)]
    lines = list(Stream(Chunks([b"", *chunks, b""])).lines())
    assert lines == body.split(b"\n")
