"""The kubelet lab's cluster DNS (``flannelpy-lab up --kubelet --cluster-dns``): CoreDNS.

CoreDNS is built by ``scripts/build-peers.sh --coredns`` from ``tests/peers/coredns`` (its
own main with only the plugins the Corefile below uses), packed here into a one-layer image
(a static binary needs no base) and run as kubeadm runs it: a Deployment in kube-system
labelled ``k8s-app=kube-dns`` behind the ``kube-dns`` Service at the address every kubelet
gives its pods as their nameserver, with the ``system:coredns`` ClusterRole's permissions
and a Corefile in a ConfigMap. Unlike kubeadm's, the Corefile forwards nothing: a name
outside the cluster's zones is refused, so no query leaves the lab.
"""

from __future__ import annotations

import io
import os
import tarfile
from typing import Any

from flannelpy_lab import images
from flannelpy_lab.flanneld import built_peer

BUILD_ARGS = ("--coredns",)
NAMESPACE = "kube-system"
NAME = "coredns"
LABELS = {"k8s-app": "kube-dns"}  # what the e2e DNS specs select CoreDNS's pods by
SERVICE_IP = "10.96.0.10"  # in the lab's Service range (flannelpy_lab.kube.SERVICE_CIDR)
DOMAIN = "cluster.local"
COREFILE = f""".:53 {{
    errors
    health {{
        lameduck 5s
    }}
    ready
    kubernetes {DOMAIN} in-addr.arpa ip6.arpa {{
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 30
    }}
    prometheus :9153
    cache 30
    reload
    loadbalance
}}
"""


def binary() -> str:
    """The pinned CoreDNS build (built now if missing)."""
    return built_peer("CoreDNS", BUILD_ARGS)


def kubelet_settings() -> dict[str, Any]:
    """What every kubelet's configuration gains: the nameserver and search domain of pods."""
    return {"clusterDNS": [SERVICE_IP], "clusterDomain": DOMAIN}


def image(directory: str, coredns: str) -> images.Image:
    """The CoreDNS image as an archive in ``directory``: /coredns and nothing else."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(coredns, "coredns")
    layer = buf.getvalue()
    ref = f"localhost/flannelpy-coredns:{images.layer_digest(layer)[:12]}"
    path = os.path.join(directory, "coredns.tar")
    with open(path + ".tmp", "wb") as f:
        f.write(images.image_archive(ref, layer, ("/coredns",)))
    os.replace(path + ".tmp", path)
    return images.Image(ref, path)


def manifests(image_ref: str) -> list[dict[str, Any]]:
    """kubeadm's CoreDNS objects, with the lab's Corefile and image."""
    meta = {"name": NAME, "namespace": NAMESPACE}
    rules = [
        {"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"],
         "verbs": ["list", "watch"]},
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
         "verbs": ["list", "watch"]},
    ]  # fmt: skip
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta},
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRole",
            "metadata": {"name": "system:coredns"},
            "rules": rules,
        },
        {
            "apiVersion": "rbac.authorization.k8s.io/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": "system:coredns"},
            "roleRef": {
                "apiGroup": "rbac.authorization.k8s.io",
                "kind": "ClusterRole",
                "name": "system:coredns",
            },
            "subjects": [{"kind": "ServiceAccount", "name": NAME, "namespace": NAMESPACE}],
        },
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta, "data": {"Corefile": COREFILE}},
        _deployment(meta, image_ref),
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "kube-dns", "namespace": NAMESPACE, "labels": LABELS},
            "spec": {
                "selector": LABELS,
                "clusterIP": SERVICE_IP,
                "ports": [
                    {"name": "dns", "port": 53, "protocol": "UDP"},
                    {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
                    {"name": "metrics", "port": 9153, "protocol": "TCP"},
                ],
            },
        },
    ]


def _deployment(meta: dict[str, str], image_ref: str) -> dict[str, Any]:
    container = {
        "name": NAME,
        "image": image_ref,
        "imagePullPolicy": "Never",
        "args": ["-conf", "/etc/coredns/Corefile"],
        "volumeMounts": [{"name": "config", "mountPath": "/etc/coredns", "readOnly": True}],
        "ports": [
            {"name": "dns", "containerPort": 53, "protocol": "UDP"},
            {"name": "dns-tcp", "containerPort": 53, "protocol": "TCP"},
            {"name": "metrics", "containerPort": 9153, "protocol": "TCP"},
        ],
        "securityContext": {
            "allowPrivilegeEscalation": False,
            "capabilities": {"add": ["NET_BIND_SERVICE"], "drop": ["ALL"]},
            "readOnlyRootFilesystem": True,
        },
        "livenessProbe": {"httpGet": {"path": "/health", "port": 8080}, "periodSeconds": 10},
        "readinessProbe": {"httpGet": {"path": "/ready", "port": 8181}, "periodSeconds": 2},
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {**meta, "labels": LABELS},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": LABELS},
            "template": {
                "metadata": {"labels": LABELS},
                "spec": {
                    "serviceAccountName": NAME,
                    "priorityClassName": "system-cluster-critical",
                    "dnsPolicy": "Default",  # CoreDNS itself: not through itself
                    "containers": [container],
                    "volumes": [{"name": "config", "configMap": {"name": NAME}}],
                },
            },
        },
    }
