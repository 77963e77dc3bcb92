"""The netns lab in Kubernetes mode, against the real control plane (``lab up --kube``):
the CNI side of a node with no Python at all.

The Kubernetes-mode behaviours this module ran against the API-server stand-in have moved
to the real kube-apiserver: pods and nodes reaching and a deleted Node's routes leaving
(tests/e2e/test_kube_real.py); a podCIDR change (the Node re-registered as an operator
does it), the API server gone and back under traffic, and an expired watch
(tests/e2e/test_kube_faults.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from ipaddress import IPv4Interface
from pathlib import Path

import pytest
from flannelpy_lab import Lab

from tests.support.lab_util import running_real_kube_lab

pytestmark = [pytest.mark.lab]


@pytest.fixture(scope="module")
def kube_lab() -> Iterator[Lab]:
    with running_real_kube_lab(nodes=1) as lab:
        yield lab


def _python_paths() -> list[str]:
    """Every place a Python interpreter or its library could be found on this host."""
    found = {os.path.realpath(sys.executable), sys.executable}
    for name in ("python3", "python", "python3.11"):
        for directory in ("/usr/bin", "/usr/local/bin", "/bin"):
            candidate = os.path.join(directory, name)
            if os.path.exists(candidate):
                found.add(candidate)
    which = shutil.which("python3")
    if which:
        found.add(which)
    return sorted(found)


def test_static_executable_needs_no_python(kube_lab: Lab) -> None:
    """Run the lab's CNI executable where no Python interpreter can be found or run."""
    lab = kube_lab
    node = lab.node("n1")
    assert lab.state.extra["cni_exec"] == "static"
    binary = os.path.join(lab.state.cni_bin_dir, "flannelpy")
    launcher = os.path.join(lab.state.lab_dir, "python-launcher")
    from cni_plugin.client import write_launcher

    write_launcher(launcher)
    hide = []
    for path in _python_paths():
        hide.append(f"mount --bind /dev/null {path}")
    for directory in (
        "/root/.pyenv",
        "/usr/lib/python3",
        "/usr/lib/python3.11",
        "/usr/local/lib/python3.11",
        str(Path(sys.prefix)),
    ):
        if os.path.isdir(directory):
            hide.append(f"mount -t tmpfs none {directory}")
    conf = json.loads(Path(node.conflist).read_text())
    plugin = {**conf["plugins"][0], "cniVersion": conf["cniVersion"], "name": conf["name"]}
    subprocess.run(["ip", "netns", "add", "fpl-nopy-pod"], check=True)
    try:

        def run(executable: str, command: str) -> subprocess.CompletedProcess[bytes]:
            script = "; ".join([*hide, f"exec ip netns exec {node.namespace} {executable}"])
            env = {
                "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
                "CNI_COMMAND": command,
                "CNI_CONTAINERID": "nopython",
                "CNI_NETNS": "/run/netns/fpl-nopy-pod",
                "CNI_IFNAME": "eth0",
                "CNI_PATH": lab.state.cni_path,
            }
            return subprocess.run(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                input=json.dumps(plugin).encode(),
                env=env,
                capture_output=True,
                timeout=30,
            )

        probe = subprocess.run(
            [
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                "; ".join([*hide, "python3 -c 'print(1)' || exit 42"]),
            ],
            capture_output=True,
            timeout=30,
        )
        assert probe.returncode != 0, "the test failed to hide Python"
        assert run(launcher, "VERSION").returncode != 0  # the Python form cannot run here
        added = run(binary, "ADD")
        assert added.returncode == 0, added.stdout + added.stderr
        address = json.loads(added.stdout)["ips"][0]["address"]
        assert node.overlay_address is not None
        assert IPv4Interface(address).ip in IPv4Interface(node.overlay_address).network
        assert run(binary, "DEL").returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", "fpl-nopy-pod"], check=False)
