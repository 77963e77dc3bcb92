"""The lab's real control plane (``flannelpy_lab.kube``): what needs neither root nor the
binaries to run — the missing build, the agents' flags and the Node it registers."""

from __future__ import annotations

import argparse
from ipaddress import IPv4Network
from pathlib import Path

import pytest
from flannelpy_lab import agents, kube_build, plan
from flannelpy_lab import kube as control_plane
from flannelpy_lab.errors import LabError
from flannelpy_lab.lab import Lab

from flannelpy.config.settings import add_agent_arguments, settings_from_args


def test_a_missing_build_fails_naming_the_build_script(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(control_plane.BIN_DIR_ENV, str(tmp_path / "none"))
    with pytest.raises(LabError, match=r"run scripts/build-kube\.sh") as caught:
        Lab.up("unit", 2, kube=True, lab_root=str(tmp_path / "labs"))
    assert "kube-apiserver" in str(caught.value)
    # It failed before anything was claimed or built.
    assert not (tmp_path / "labs").exists()


def test_the_pinned_directory_follows_the_wrapper_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(control_plane.BIN_DIR_ENV, raising=False)
    monkeypatch.setenv(control_plane.PEERS_DIR_ENV, "/nonexistent/peers")
    with pytest.raises(LabError, match=r"/nonexistent/peers/kubernetes-v1\.\d+\.\d+ "):
        control_plane.bin_dir()


def test_agents_get_the_service_account_kubeconfig(tmp_path: Path) -> None:
    state = plan.plan_lab(
        "unit",
        2,
        "vxlan",
        direct_routing=False,
        segments=1,
        network="10.244.0.0/16",
        etcd_prefix="/coreos.com/network",
        subnets=[IPv4Network("100.64.9.0/24")],
        overlay_bridge=False,
        lab_root=str(tmp_path),
    )
    state.extra["kube_api_url"] = control_plane.api_url(state)
    state.extra["kube_kubeconfig"] = control_plane.agent_kubeconfig(state)
    parser = argparse.ArgumentParser()
    add_agent_arguments(parser)
    argv = agents.agent_argv(state, state.nodes[0])
    settings = settings_from_args(parser.parse_args(argv[4:]), {})
    assert settings.kube_subnet_mgr
    assert settings.kubeconfig_file == control_plane.agent_kubeconfig(state)
    assert settings.kube_api_url == f"https://{control_plane.host_ip(state)}:6443"
    assert settings.net_config_path == agents.kube_net_conf_path(state)


def test_the_node_is_registered_as_a_kubelet_would() -> None:
    node = control_plane.node_manifest("n1", "100.64.9.1")
    assert node["metadata"]["labels"]["kubernetes.io/hostname"] == "n1"
    assert {"type": "InternalIP", "address": "100.64.9.1"} in node["status"]["addresses"]
    (ready,) = node["status"]["conditions"]
    assert (ready["type"], ready["status"]) == ("Ready", "True")


def test_down_without_a_state_file_stops_the_control_plane_it_started(tmp_path: Path) -> None:
    """Before, a lab whose state file was gone left kube-apiserver, kube-controller-manager,
    kube-scheduler and the ConfigMap projector running: only processes naming a file by
    --data-dir/--state-dir/... were swept. Stand-ins: Python under those names."""
    import os
    import subprocess
    import sys

    lab_dir = tmp_path / "labs" / "unit"
    (lab_dir / "kube").mkdir(parents=True)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    sleep = "import time; time.sleep(60)"
    started = {}
    for name in ("kube-apiserver", "kube-controller-manager", "kube-scheduler"):
        os.symlink(sys.executable, bin_dir / name)
        arg = f"--kubeconfig={lab_dir}/kube/{name}.kubeconfig"
        started[name] = subprocess.Popen([str(bin_dir / name), "-c", sleep, arg])
    projector = [sys.executable, "-m", "flannelpy_lab.projector", "--dir", str(lab_dir)]
    started["projector"] = subprocess.Popen([sys.executable, "-c", sleep, *projector[1:]])
    # Another lab's and a user's processes, which must live on.
    other = subprocess.Popen(
        [str(bin_dir / "kube-apiserver"), "-c", sleep, f"--tls-cert-file={tmp_path}/other/a"]
    )
    reader = subprocess.Popen([sys.executable, "-c", sleep, f"{lab_dir}/kube/admin.kubeconfig"])
    try:
        control_plane.stop(None, str(lab_dir))
        for name, proc in started.items():
            assert proc.wait(timeout=10) is not None, name
        assert other.poll() is None and reader.poll() is None
    finally:
        for proc in [*started.values(), other, reader]:
            proc.kill()
            proc.wait()


def test_the_pin_is_read_alone_or_in_a_require_block() -> None:
    # go mod tidy writes a block once the wrapper requires a second module directly.
    assert kube_build.required_version("require k8s.io/kubernetes v1.37.2\n") == "v1.37.2"
    assert kube_build.required_version("\tk8s.io/kubernetes v1.37.2\n") == "v1.37.2"
    assert kube_build.required_version("\tk8s.io/kubernetes v1.37.2 // indirect\n") is None
    assert kube_build.required_version("\tk8s.io/kubectl => k8s.io/kubectl v0.37.2\n") is None
    assert kube_build.required_version("\tk8s.io/kubelet v0.37.2\n") is None


def test_an_image_archive_needs_kubelets_and_a_tagged_archive(tmp_path: Path) -> None:
    with pytest.raises(LabError, match="--image-archive needs --kubelet"):
        Lab.up("unit", 2, image_archives=["x.tar"], lab_root=str(tmp_path / "labs"))
    broken = tmp_path / "broken.tar"
    broken.write_bytes(b"not a tar")
    with pytest.raises(LabError, match="is not an image archive"):
        Lab.up("unit", 2, kubelets=True, image_archives=[str(broken)], lab_root=str(tmp_path))
    assert not (tmp_path / "labs").exists()
