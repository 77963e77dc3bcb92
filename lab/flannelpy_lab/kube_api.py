"""Talking to the lab's API server as cluster admin: the real kubectl, Nodes and Pods as a
kubelet writes them, and Nodes read back without a kubectl process (cheap enough to poll),
with Flannel's annotations read as the lab's lease records."""

from __future__ import annotations

import json
import os
import re
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from typing import Any

from flannelpy_lab import plan
from flannelpy_lab.errors import LabError
from flannelpy_lab.kube_build import bin_dir
from flannelpy_lab.kube_files import admin_kubeconfig, admin_token, api_url, kube_path, record
from flannelpy_lab.state import LabState, NodeInfo

_PROXY_VARS = re.compile(r"(?i)^(https?|all|no)_proxy$")

ANNOTATION_PREFIX = "flannel.alpha.coreos.com/"


def api_json(state: LabState, path: str, timeout: float = 5.0, body: Any = None) -> Any:
    """GET ``path`` from kube-apiserver as cluster admin, or POST ``body`` (JSON) there when
    given (no kubectl process: cheap enough to poll, and no process start in the way of
    a test's timing); LabError when it does not answer or refuses."""
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}),
        urllib.request.HTTPSHandler(
            context=ssl.create_default_context(cafile=kube_path(state, "pki", "ca.crt"))
        ),
    )
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(api_url(state) + path, data=data)
    request.add_header("Authorization", f"Bearer {admin_token(state)}")
    if data is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with opener.open(request, timeout=timeout) as resp:
            return json.load(resp)
    except (urllib.error.URLError, OSError, ValueError) as e:
        verb = "GET" if data is None else "POST"
        raise LabError(
            f"kube-apiserver {verb} {path} failed ({e}); is the control plane "
            "running (`flannelpy-lab status`)?"
        ) from e


def node_lease(node: dict[str, Any]) -> dict[str, Any] | None:
    """A Node as the lab's lease record (``status`` lists these): its podCIDR and Flannel's
    annotations, whoever wrote them; None until it has both."""
    annotations = (node.get("metadata") or {}).get("annotations") or {}
    cidr = (node.get("spec") or {}).get("podCIDR")
    public_ip = annotations.get(ANNOTATION_PREFIX + "public-ip")
    # IPv6-only, Flannel writes the IPv6 annotations alone (and the podCIDR is IPv6).
    public_ipv6 = annotations.get(ANNOTATION_PREFIX + "public-ipv6")
    if not cidr or not (public_ip or public_ipv6):
        return None
    name = (node.get("metadata") or {}).get("name")
    return {
        "key": name,
        "subnet": cidr,
        "public_ip": public_ip,
        "public_ipv6": public_ipv6,
        "backend": annotations.get(ANNOTATION_PREFIX + "backend-type"),
        "node_name": name,
        "error": None,
    }


def node_leases(state: LabState) -> list[dict[str, Any]]:
    items = api_json(state, "/api/v1/nodes").get("items") or []
    return [lease for lease in map(node_lease, items) if lease]


def node_has_lease(state: LabState, node: NodeInfo) -> bool:
    """Has ``node``'s agent published its lease on its Node (a flanneld node's readiness)?"""
    try:
        doc = api_json(state, f"/api/v1/nodes/{node.name}", timeout=2.0)
    except LabError:  # the API briefly unreachable: not ready yet
        return False
    lease = node_lease(doc)
    if lease is None:
        return False
    if plan.ipv6_only(state):
        return lease["public_ipv6"] == plan.ipv6_underlay_ip(node)
    return lease["public_ip"] == str(node.ip)


def node_manifest(name: str, internal_ip: str) -> dict[str, Any]:
    """A Node as a kubelet registers it (status included: create keeps it for Nodes)."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {
                "kubernetes.io/hostname": name,
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
            },
            # A kubelet always sets this one. flanneld v0.28.9 needs some annotation: on a
            # Node with none it panics writing its own (a nil map in AcquireLease).
            "annotations": {"volumes.kubernetes.io/controller-managed-attach-detach": "true"},
        },
        "status": {
            "addresses": [
                {"type": "InternalIP", "address": internal_ip},
                {"type": "Hostname", "address": name},
            ],
            "conditions": [
                {
                    "type": "Ready",
                    "status": "True",
                    "reason": "KubeletReady",
                    "message": "registered by the lab",
                    "lastHeartbeatTime": now,
                    "lastTransitionTime": now,
                }
            ],
        },
    }


def pod_manifest(
    namespace: str,
    name: str,
    node: str,
    labels: dict[str, str],
    ports: dict[str, int] | None = None,
) -> dict[str, Any]:
    """A Pod bound to ``node`` as the lab's NetworkPolicy tests and benches write it: no
    kubelet runs it (the lab's pods are made through the CNI executable), so its status is
    written apart (:func:`pod_running_status`); ``ports``: container port names -> numbers."""
    container: dict[str, Any] = {"name": "c", "image": "none"}
    if ports:
        container["ports"] = [{"name": n, "containerPort": p} for n, p in ports.items()]
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": namespace, "labels": dict(labels)},
        "spec": {
            "nodeName": node,
            "automountServiceAccountToken": False,
            "containers": [container],
        },
    }


def pod_running_status(ip: str) -> dict[str, Any]:
    """The status patch a kubelet writes once a pod runs with one address."""
    return {"status": {"phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}]}}


# -- kubectl, as cluster admin ----------------------------------------------------------


def proxyless_env() -> dict[str, str]:
    # The API server is on the lab's address: a proxy from the environment would not reach it.
    return {k: v for k, v in os.environ.items() if not _PROXY_VARS.match(k)}


def kubectl(
    state: LabState,
    *args: str,
    stdin: str | None = None,
    check: bool = True,
    timeout: float = 30.0,
) -> subprocess.CompletedProcess[str]:
    """The real kubectl as cluster admin; with ``check``, a failure is a LabError."""
    binary = os.path.join(record(state).get("bin_dir") or bin_dir(), "kubectl")
    argv = [binary, "--kubeconfig", admin_kubeconfig(state), *args]
    try:
        proc = subprocess.run(
            argv,
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=proxyless_env(),
            check=False,
        )
    except subprocess.TimeoutExpired as e:
        raise LabError(f"`kubectl {' '.join(args)}` did not finish within {timeout:g} s") from e
    if check and proc.returncode != 0:
        raise LabError(f"`kubectl {' '.join(args)}` failed: {proc.stderr.strip()[-400:]}")
    return proc


def kubectl_json(state: LabState, *args: str) -> Any:
    return json.loads(kubectl(state, *args, "-o", "json").stdout)
