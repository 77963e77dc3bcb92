"""The configuration documents of a kubelet lab (pure): containerd's config.toml, the
KubeletConfiguration, the lab's kustomization of ``manifests/`` and the test Deployment.

Separate from the processes that read them (``flannelpy_lab.kubelet``) so that they can
be built and checked without a lab; the CRI tests use ``containerd_config`` alone.
"""

from __future__ import annotations

import json
import os
from typing import Any

from flannelpy_lab import images
from flannelpy_lab import kube as control_plane
from flannelpy_lab.kubelet_state import DAEMONSET, WORKLOAD


def containerd_config(
    base: str, cni_bin_dir: str = "/opt/cni/bin", cni_conf_dir: str = "/etc/cni/net.d"
) -> str:
    """containerd's config.toml with all its state under ``base``. The CNI directories
    are paths in the node's mount namespace (the defaults are what the DaemonSet
    installs into); the CRI tests, which run without one, point them at theirs."""

    def path(*parts: str) -> str:
        return json.dumps(os.path.join(base, *parts))  # a JSON string is a TOML basic string

    cri = '[plugins."io.containerd.grpc.v1.cri"'
    return f"""\
version = 2
root = {path("root")}
state = {path("state")}
disabled_plugins = ["io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
                    "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
                    "io.containerd.tracing.processor.v1.otlp"]

[grpc]
  address = {path("containerd.sock")}

[plugins."io.containerd.internal.v1.opt"]
  path = {path("opt")}

{cri}]
  sandbox_image = {json.dumps(images.PAUSE_IMAGE)}
  netns_mounts_under_state_dir = true
  disable_apparmor = true
  restrict_oom_score_adj = true
  enable_selinux = false
  disable_tcp_service = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

{cri}.containerd]
  snapshotter = "overlayfs"
  default_runtime_name = "runc"

{cri}.containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"

{cri}.containerd.runtimes.runc.options]
  SystemdCgroup = false

{cri}.cni]
  bin_dir = {json.dumps(cni_bin_dir)}
  conf_dir = {json.dumps(cni_conf_dir)}
  max_conf_num = 1
"""


def kubelet_config(
    node_ip: str,
    socket_path: str,
    ca_file: str,
    cgroup_root: str,
) -> dict[str, Any]:
    return {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": node_ip,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzBindAddress": "127.0.0.1",
        "healthzPort": 10248,
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": ca_file},
        },
        "authorization": {"mode": "Webhook"},
        "containerRuntimeEndpoint": f"unix://{socket_path}",
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": cgroup_root,
        "cgroupsPerQOS": True,
        "failCgroupV1": False,
        "failSwapOn": False,
        # Root here lacks CAP_SYS_RESOURCE: the kubelet cannot lower its own score.
        "oomScoreAdj": 0,
        # A pod's own ephemeral-storage limit is enforced (its writable layer and logs are
        # measured, as the Services spec on evicted pods needs), but no node-level disk
        # eviction: the lab's nodes share the host's one filesystem.
        "localStorageCapacityIsolation": True,
        "evictionHard": {"memory.available": "100Mi"},
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "registerNode": True,
        "rotateCertificates": False,
        "resolvConf": "/etc/resolv.conf",
        "staticPodPath": "",
        "podLogsDir": "/var/log/pods",
        "maxPods": 110,
        "nodeStatusUpdateFrequency": "4s",
        "syncFrequency": "10s",
    }


def kustomization(
    manifests: str,
    image_ref: str,
    api_host: str,
    api_port: int,
    iface: str,
    components: list[str] | None = None,
) -> str:
    """The lab's overlay of ``manifests/``: the image, and the agent's way to the API
    server without kube-proxy; nothing else changes but the ``components`` added."""
    name, _, tag = image_ref.rpartition(":")
    patch = {
        "apiVersion": "apps/v1",
        "kind": "DaemonSet",
        "metadata": {"name": DAEMONSET, "namespace": control_plane.NAMESPACE},
        "spec": {
            "template": {
                "spec": {
                    "containers": [
                        {
                            "name": "kube-flannelpy",
                            "env": [
                                {"name": "KUBERNETES_SERVICE_HOST", "value": api_host},
                                {"name": "KUBERNETES_SERVICE_PORT", "value": str(api_port)},
                                {"name": "FLANNELD_IFACE", "value": iface},
                            ],
                        }
                    ]
                }
            }
        },
    }
    doc = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [manifests],
        "images": [{"name": "flannelpy", "newName": name, "newTag": tag}],
        "patches": [{"patch": json.dumps(patch)}],
        **({"components": components} if components else {}),
    }
    return json.dumps(doc, indent=1)


def workload(replicas: int) -> dict[str, Any]:
    """The test Deployment: busybox pods spread one per node by the scheduler."""
    labels = {"app": WORKLOAD}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": WORKLOAD, "namespace": "default"},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "topologySpreadConstraints": [
                        {
                            "maxSkew": 1,
                            "topologyKey": "kubernetes.io/hostname",
                            "whenUnsatisfiable": "DoNotSchedule",
                            # A cordoned or tainted node is no domain to spread over.
                            "nodeTaintsPolicy": "Honor",
                            "labelSelector": {"matchLabels": labels},
                        }
                    ],
                    "terminationGracePeriodSeconds": 1,
                    "containers": [
                        {
                            "name": "main",
                            "image": images.BUSYBOX_IMAGE,
                            "imagePullPolicy": "Never",
                            "command": ["/bin/sleep", "2147483647"],
                        }
                    ],
                },
            },
        },
    }
