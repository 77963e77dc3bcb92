"""The init container installs the CNI conflist whole or not at all (Flannel's
``install-conf``, v0.28.6): run as the manifest runs it, against a scratch directory."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import yaml

from flannelpy.commands.install_cni import DISABLED_SUFFIX, check_conflist, install_conflist
from flannelpy.errors import ConfigError

ROOT = Path(__file__).resolve().parents[2]
MANIFEST = ROOT / "manifests" / "kube-flannelpy.yml"
CONFLIST = (ROOT / "cni_plugin" / "10-flannelpy.conflist").read_bytes()
HOST_DIRS = ("/etc/kube-flannel", "/etc/cni/net.d")


def _init_container(name: str) -> dict[str, Any]:
    (ds,) = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if d["kind"] == "DaemonSet"]
    containers = ds["spec"]["template"]["spec"]["initContainers"]
    (container,) = [c for c in containers if c["name"] == name]
    return container


def _run_install_cni(root: Path) -> subprocess.CompletedProcess[str]:
    """The manifest's ``install-cni`` container, its mounts moved under ``root``."""
    container = _init_container("install-cni")
    argv = [*container["command"], *container.get("args", [])]
    for host_dir in HOST_DIRS:
        argv = [a.replace(host_dir, str(root) + host_dir) for a in argv]
    if argv[0] == "flannelpy":
        argv = [sys.executable, "-m", "flannelpy", *argv[1:]]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    for host_dir in HOST_DIRS:
        (tmp_path / host_dir.lstrip("/")).mkdir(parents=True)
    return tmp_path


def test_the_init_container_installs_the_conflist_and_moves_flannels_aside(root: Path) -> None:
    (root / "etc/kube-flannel/cni-conf.json").write_bytes(CONFLIST)
    flannel = root / "etc/cni/net.d/10-flannel.conflist"
    flannel.write_text('{"name": "cbr0", "cniVersion": "0.3.1", "plugins": [{"type": "flannel"}]}')
    result = _run_install_cni(root)
    assert result.returncode == 0, result.stderr
    net_d = root / "etc/cni/net.d"
    assert (net_d / "10-flannelpy.conflist").read_bytes() == CONFLIST
    assert sorted(p.name for p in net_d.iterdir()) == [
        "10-flannel.conflist" + DISABLED_SUFFIX,  # renaming it back restores Flannel
        "10-flannelpy.conflist",
    ]


@pytest.mark.parametrize(
    "source",
    [
        CONFLIST[: len(CONFLIST) // 2],  # cut short
        b"",  # empty
        b'{"name": "cbr0", "cniVersion": "1.0.0"}',  # a .conf, not a conflist
    ],
    ids=["cut-short", "empty", "no-plugins"],
)
def test_the_init_container_never_installs_what_is_no_conflist(root: Path, source: bytes) -> None:
    # Before, the init container's `cp` installed whatever the ConfigMap held: a kubelet
    # then failed to load the network until someone fixed the file by hand.
    installed = root / "etc/cni/net.d/10-flannelpy.conflist"
    installed.write_bytes(CONFLIST)
    (root / "etc/kube-flannel/cni-conf.json").write_bytes(source)
    result = _run_install_cni(root)
    assert result.returncode != 0
    assert installed.read_bytes() == CONFLIST
    assert [p.name for p in installed.parent.iterdir()] == [installed.name]
    (line,) = result.stderr.strip().splitlines()
    assert "cni-conf.json" in line and "fix" in line


def test_a_reader_never_sees_half_a_conflist(tmp_path: Path) -> None:
    """A runtime reading the conflist while it is replaced sees the old or the new one."""
    versions = [
        json.dumps({"name": "cbr0", "cniVersion": "1.0.0", "plugins": [{"type": t}] * 400})
        for t in ("flannelpy", "other")
    ]
    sources = []
    for i, text in enumerate(versions):
        sources.append(tmp_path / f"src{i}.json")
        sources[-1].write_text(text)
    target = tmp_path / "net.d" / "10-flannelpy.conflist"
    install_conflist(sources[0], target)
    seen: set[str] = set()
    done = threading.Event()

    def read() -> None:
        while not done.is_set():
            seen.add(target.read_text())

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(300):
            install_conflist(sources[i % 2], target)
    finally:
        done.set()
        reader.join(timeout=10)
    assert seen and seen <= set(versions)
    assert [p.name for p in target.parent.iterdir()] == [target.name]  # no temp left


@pytest.mark.parametrize(
    ("doc", "names"),
    [
        ("[]", "a JSON object"),
        ('{"name": "cbr0", "plugins": [{"type": "x"}]}', "'cniVersion'"),
        ('{"cniVersion": "1.0.0", "plugins": [{"type": "x"}]}', "'name'"),
        ('{"cniVersion": "1.0.0", "name": "n", "plugins": []}', "'plugins' list"),
        ('{"cniVersion": "1.0.0", "name": "n", "plugins": [{"mtu": 1}]}', "plugin 0"),
        ('{"cniVersion": "1.0.0", \'name\'', "not valid JSON"),
    ],
)
def test_a_conflist_is_checked_with_one_sentence_naming_what_is_wrong(doc: str, names: str) -> None:
    with pytest.raises(ConfigError, match=r"fix cni-conf\.json in the ConfigMap") as raised:
        check_conflist(doc.encode(), "cni-conf.json")
    assert names in str(raised.value)


def test_an_unreadable_source_names_the_mount(tmp_path: Path) -> None:
    target = tmp_path / "10-flannelpy.conflist"
    with pytest.raises(ConfigError, match="check the ConfigMap is mounted there"):
        install_conflist(tmp_path / "missing.json", target)
    assert not target.exists()
