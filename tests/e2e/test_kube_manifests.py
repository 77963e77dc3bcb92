"""manifests/ against the real kube-apiserver (``lab up --kube``): what ``kubectl apply -k``
creates is accepted, the DaemonSet included.

The lab applies every object but the DaemonSet for real (its agents run as lab
processes); here the DaemonSet goes through ``--dry-run=server``, so the API server's
validation, defaulting and admission (PodSecurity among them) see it without a kubelet
to run it. servicemonitor.yaml and prometheusrule.yaml need the Prometheus Operator's
CRDs, which a bare API server does not have (and which are not available offline): they
stay out of kustomization.yaml, and the last test shows why.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import pytest
import yaml
from flannelpy_lab import Lab
from flannelpy_lab import kube as control_plane

from tests.support.lab_util import running_lab

pytestmark = [pytest.mark.lab]

OPERATOR_OBJECTS = ("servicemonitor.yaml", "prometheusrule.yaml")


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    # The control plane alone: no agent is needed to judge the objects.
    with running_lab(1, "vxlan", kube=True, start_agents=False) as lab:
        yield lab


def rendered(lab: Lab) -> list[dict[str, Any]]:
    """The objects of ``kubectl kustomize manifests/`` (the real kubectl's kustomize)."""
    out = lab.kubectl("kustomize", control_plane.manifests_dir()).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def ref(obj: dict[str, Any]) -> tuple[str, str, str]:
    meta = obj["metadata"]
    return obj["kind"], meta.get("namespace", ""), meta["name"]


def test_the_lab_applied_every_object_but_the_daemonset(lab: Lab) -> None:
    objects = rendered(lab)
    kinds = {o["kind"] for o in objects}
    assert {
        "Namespace",
        "ServiceAccount",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
        "ConfigMap",
        "DaemonSet",
    } <= kinds, kinds
    for obj in objects:
        kind, namespace, name = ref(obj)
        where = ["-n", namespace] if namespace else []
        got = lab.kubectl("get", kind, name, *where, "-o", "json", check=False)
        if kind == "DaemonSet":
            assert got.returncode != 0 and "NotFound" in got.stderr, got.stderr
            continue
        assert got.returncode == 0, (kind, name, got.stderr)
        server = json.loads(got.stdout)
        assert server["metadata"]["uid"]
        if kind in ("ClusterRole", "Role"):
            assert server["rules"] == obj["rules"]
    # Applying them again changes nothing (the ConfigMap aside: the lab sets its Network).
    again = [o for o in objects if o["kind"] not in ("DaemonSet", "ConfigMap")]
    out = lab.kubectl(
        "apply", "-f", "-", stdin=json.dumps({"apiVersion": "v1", "kind": "List", "items": again})
    ).stdout
    assert out.count(" unchanged") == len(again), out


def test_server_dry_run_of_kustomization_accepts_every_object_the_daemonset_too(
    lab: Lab,
) -> None:
    proc = lab.kubectl("apply", "--dry-run=server", "-k", control_plane.manifests_dir())
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == len(rendered(lab)), lines
    assert all(line.endswith("(server dry run)") for line in lines), lines
    (ds,) = [line for line in lines if line.startswith("daemonset.apps/")]
    assert ds == "daemonset.apps/kube-flannelpy-ds created (server dry run)", ds
    # No warning from admission (PodSecurity: the Namespace is labelled privileged) or
    # from a deprecated field.
    assert "Warning" not in proc.stderr, proc.stderr
    # A dry run persists nothing.
    got = lab.kubectl(
        "get", "daemonset", "kube-flannelpy-ds", "-n", control_plane.NAMESPACE, check=False
    )
    assert got.returncode != 0 and "NotFound" in got.stderr, got.stderr
    # The server returns the DaemonSet as it would store it: defaulted, and valid.
    (server_ds,) = [
        o
        for o in json.loads(
            lab.kubectl(
                "apply",
                "--dry-run=server",
                "-k",
                control_plane.manifests_dir(),
                "-o",
                "json",
            ).stdout
        )["items"]
        if o["kind"] == "DaemonSet"
    ]
    spec = server_ds["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == control_plane.SERVICE_ACCOUNT
    assert spec["hostNetwork"] is True and spec["dnsPolicy"]  # defaulted by the server
    assert server_ds["spec"]["revisionHistoryLimit"] == 10


def test_server_dry_run_rejects_an_invalid_daemonset(lab: Lab) -> None:
    """The dry run above judges the DaemonSet: a broken one is refused."""
    (ds,) = [o for o in rendered(lab) if o["kind"] == "DaemonSet"]
    ds["spec"]["template"]["spec"]["containers"][0]["name"] = "Not_A_DNS_Label"
    proc = lab.kubectl("apply", "--dry-run=server", "-f", "-", stdin=json.dumps(ds), check=False)
    assert proc.returncode != 0 and "is invalid" in proc.stderr, proc.stderr
    assert "Not_A_DNS_Label" in proc.stderr


@pytest.mark.parametrize("manifest", OPERATOR_OBJECTS)
def test_prometheus_operator_objects_need_its_crds(lab: Lab, manifest: str) -> None:
    """Why servicemonitor.yaml and prometheusrule.yaml stay out of kustomization.yaml:
    a cluster without the Prometheus Operator has no such kinds."""
    path = os.path.join(control_plane.manifests_dir(), manifest)
    with open(os.path.join(control_plane.manifests_dir(), "kustomization.yaml")) as f:
        assert manifest not in f.read().split("resources:", 1)[1]
    proc = lab.kubectl("apply", "--dry-run=server", "-f", path, check=False)
    assert proc.returncode != 0, proc.stdout
    assert "no matches for kind" in proc.stderr and "monitoring.coreos.com/v1" in proc.stderr, (
        proc.stderr
    )
    assert "ensure CRDs are installed first" in proc.stderr, proc.stderr
