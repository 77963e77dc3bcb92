"""The kubelet lab's cluster DNS (``flannelpy_lab.dns``): the objects CoreDNS runs as, the
kubelet settings that point pods at it, and its one-layer image."""

from __future__ import annotations

import json
import tarfile
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

import pytest
from flannelpy_lab import dns
from flannelpy_lab import kube as control_plane
from flannelpy_lab.errors import LabError
from flannelpy_lab.lab import Lab


def test_the_dns_service_sits_in_the_service_range_the_kubelets_name() -> None:
    assert IPv4Address(dns.SERVICE_IP) in IPv4Network(control_plane.SERVICE_CIDR)
    assert dns.kubelet_settings() == {
        "clusterDNS": [dns.SERVICE_IP],
        "clusterDomain": "cluster.local",
    }
    by_kind = {o["kind"]: o for o in dns.manifests("localhost/flannelpy-coredns:x")}
    service = by_kind["Service"]
    assert (service["metadata"]["name"], service["spec"]["clusterIP"]) == (
        "kube-dns",
        dns.SERVICE_IP,
    )
    ports = {(p["port"], p["protocol"]) for p in service["spec"]["ports"]}
    assert {(53, "UDP"), (53, "TCP")} <= ports
    # The e2e DNS specs find CoreDNS's pods by this label.
    template = by_kind["Deployment"]["spec"]["template"]
    assert template["metadata"]["labels"] == {"k8s-app": "kube-dns"}
    assert service["spec"]["selector"] == {"k8s-app": "kube-dns"}


def test_coredns_may_read_what_its_kubernetes_plugin_watches_and_forwards_nothing() -> None:
    by_kind = {o["kind"]: o for o in dns.manifests("img")}
    granted = {
        (group, resource)
        for rule in by_kind["ClusterRole"]["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        if {"list", "watch"} <= set(rule["verbs"])
    }
    assert {("", "services"), ("", "namespaces"), ("discovery.k8s.io", "endpointslices")} <= granted
    binding = by_kind["ClusterRoleBinding"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "coredns", "namespace": "kube-system"}
    ]
    corefile = by_kind["ConfigMap"]["data"]["Corefile"]
    assert "kubernetes cluster.local" in corefile
    assert "forward" not in corefile  # no query leaves the lab


def test_the_image_holds_the_binary_as_its_entrypoint(tmp_path: Path) -> None:
    binary = tmp_path / "coredns"
    binary.write_bytes(b"\x7fELF stand-in")
    binary.chmod(0o755)
    image = dns.image(str(tmp_path), str(binary))
    assert image.ref.startswith("localhost/flannelpy-coredns:")
    with tarfile.open(image.archive) as archive:
        (manifest,) = json.load(archive.extractfile("manifest.json"))  # type: ignore[arg-type]
        assert manifest["RepoTags"] == [image.ref]
        config = json.load(archive.extractfile(manifest["Config"]))  # type: ignore[arg-type]
        assert config["config"]["Entrypoint"] == ["/coredns"]
        layer = archive.extractfile(manifest["Layers"][0])
        assert layer is not None
        with tarfile.open(fileobj=layer) as files:
            assert files.getnames() == ["coredns"]
            assert files.getmember("coredns").mode & 0o111


def test_cluster_dns_and_host_routes_need_kubelets(tmp_path: Path) -> None:
    for option in ("cluster_dns", "host_pod_routes"):
        with pytest.raises(LabError, match="need --kubelet"):
            Lab.up("unit", 2, lab_root=str(tmp_path / "labs"), **{option: True})
    assert not (tmp_path / "labs").exists()
