"""The control plane's files and addresses: where they live under the lab's directory,
the API server's address, and the PKI made at start (a CA, the serving certificate, the
ServiceAccount key, static tokens, client certificates) with the kubeconfigs that use
it. Kept apart from the processes that read them (flannelpy_lab.kube)."""

from __future__ import annotations

import json
import os
import secrets
import subprocess
from ipaddress import IPv4Interface
from typing import Any

from flannelpy_lab.errors import LabError
from flannelpy_lab.state import LabState

STATE_KEY = "kube"  # in LabState.extra: the control plane's record

API_PORT = 6443


SERVICE_CIDR = "10.96.0.0/16"


SERVICE_IP = "10.96.0.1"  # the "kubernetes" Service's ClusterIP: the range's first address


SERVICE_NAMES = (
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)


def kube_dir(state: LabState) -> str:
    return os.path.join(state.lab_dir, "kube")


def kube_path(state: LabState, *parts: str) -> str:
    return os.path.join(kube_dir(state), *parts)


def admin_kubeconfig(state: LabState) -> str:
    return kube_path(state, "admin.kubeconfig")


def agent_kubeconfig(state: LabState) -> str:
    """The kubeconfig every agent gets: the flannelpy ServiceAccount's token."""
    return kube_path(state, "flannelpy.kubeconfig")


def host_ip(state: LabState) -> str:
    return str(IPv4Interface(state.host_address).ip)


def api_url(state: LabState) -> str:
    return f"https://{host_ip(state)}:{API_PORT}"


def admin_token(state: LabState) -> str:
    with open(admin_kubeconfig(state), encoding="utf-8") as f:
        token: str = json.load(f)["users"][0]["user"]["token"]
        return token


# P-256 keys, which every component takes (ES256 ServiceAccount tokens too): an RSA-2048
# key took 0.36 s of CPU here, a P-256 one 0.01 s, and a kubelet lab makes about ten.
EC_KEY = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")


def openssl(*args: str) -> None:
    proc = subprocess.run(["openssl", *args], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise LabError(f"`openssl {args[0]}` failed: {proc.stderr.strip()[-300:]}")


def make_pki(state: LabState) -> None:
    """A CA, kube-apiserver's serving certificate, the ServiceAccount signing key and
    static tokens for the admin and the controller-manager."""
    pki = kube_path(state, "pki")
    os.makedirs(pki, exist_ok=True)
    p = lambda name: os.path.join(pki, name)  # noqa: E731
    openssl(
        "req",
        "-x509",
        *EC_KEY,
        "-days",
        "2",
        "-subj",
        f"/CN=fpl-{state.name}-ca",
        "-keyout",
        p("ca.key"),
        "-out",
        p("ca.crt"),
    )
    with open(p("apiserver.ext"), "w", encoding="utf-8") as f:
        # As a cluster's: also the "kubernetes" Service's address and names, which pods
        # (CoreDNS, the e2e specs' clients) reach it by through kube-proxy.
        names = ",".join(f"DNS:{n}" for n in SERVICE_NAMES)
        f.write(
            f"subjectAltName=IP:{host_ip(state)},IP:127.0.0.1,IP:{SERVICE_IP},"
            f"DNS:localhost,{names}\n"
        )
    signed_cert(state, "apiserver", "/CN=kube-apiserver", p("apiserver.ext"))
    openssl("ecparam", "-genkey", "-name", "prime256v1", "-noout", "-out", p("sa.key"))
    openssl("ec", "-in", p("sa.key"), "-pubout", "-out", p("sa.pub"))
    admin, kcm = secrets.token_hex(16), secrets.token_hex(16)
    with open(p("tokens.csv"), "w", encoding="utf-8") as f:
        f.write(
            f"{admin},fpl-admin,uid-admin,system:masters\n"
            f"{kcm},system:kube-controller-manager,uid-kcm\n"
        )
    os.chmod(p("tokens.csv"), 0o600)
    write_token_kubeconfig(state, admin_kubeconfig(state), api_url(state), admin)
    write_token_kubeconfig(state, kube_path(state, "kcm.kubeconfig"), api_url(state), kcm)
    # kube-apiserver's client certificate to the kubelets (exec, logs, port-forward).
    client_cert(state, "apiserver-kubelet-client", "kube-apiserver-kubelet-client")


def client_cert(state: LabState, name: str, cn: str, org: str | None = None) -> tuple[str, str]:
    """A client certificate signed by the lab's CA (user ``cn``, group ``org``); returns
    the certificate's and the key's paths."""
    return signed_cert(state, name, f"/CN={cn}" + (f"/O={org}" if org else ""))


def signed_cert(
    state: LabState, name: str, subject: str, extfile: str | None = None
) -> tuple[str, str]:
    """A key and a certificate for ``subject`` signed by the lab's CA, as
    ``pki/<name>.key`` and ``.crt`` (``extfile``: its extensions); returns the
    certificate's and the key's paths."""
    p = lambda ext: kube_path(state, "pki", f"{name}.{ext}")  # noqa: E731
    openssl("req", *EC_KEY, "-subj", subject, "-keyout", p("key"), "-out", p("csr"))
    extensions = ("-extfile", extfile) if extfile else ()
    openssl("x509", "-req", "-in", p("csr"), "-CA", kube_path(state, "pki", "ca.crt"),
            "-CAkey", kube_path(state, "pki", "ca.key"), "-CAcreateserial", "-days", "2",
            *extensions, "-out", p("crt"))  # fmt: skip
    return p("crt"), p("key")


def write_token_kubeconfig(state: LabState, path: str, server: str, token: str) -> None:
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "lab",
        "clusters": [
            {
                "name": "lab",
                "cluster": {
                    "server": server,
                    "certificate-authority": kube_path(state, "pki", "ca.crt"),
                },
            }
        ],
        "users": [{"name": "lab", "user": {"token": token}}],
        "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": "lab"}}],
    }
    tmp = path + ".tmp"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
        json.dump(doc, f)
    os.replace(tmp, path)


def cert_kubeconfig(server: str, ca: str, cert: str, key: str) -> dict[str, Any]:
    """A kubeconfig authenticating with a client certificate (kubelets, the scheduler,
    kube-proxy)."""
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "lab",
        "clusters": [{"name": "lab", "cluster": {"server": server, "certificate-authority": ca}}],
        "users": [{"name": "lab", "user": {"client-certificate": cert, "client-key": key}}],
        "contexts": [{"name": "lab", "context": {"cluster": "lab", "user": "lab"}}],
    }


def write_file(path: str, text: str, mode: int = 0o644) -> None:
    """``text`` into ``path`` atomically, its directory made, with ``mode``."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode), "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def record(state: LabState) -> dict[str, Any]:
    doc: dict[str, Any] = state.extra.setdefault(STATE_KEY, {})
    return doc
