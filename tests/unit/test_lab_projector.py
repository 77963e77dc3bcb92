"""The lab's ConfigMap projection: the kubelet's AtomicWriter layout, on a temp dir."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

import pytest
from flannelpy_lab.projector import DATA, current, project


def test_layout_is_the_kubelet_s_and_a_plain_file_is_replaced(tmp_path: Path) -> None:
    (tmp_path / "net-conf.json").write_text("old plain file")
    (tmp_path / "state.json").write_text("{}")  # not projected: left alone
    assert project(str(tmp_path), {"net-conf.json": "v1", "cni-conf.json": "c1"})
    data = tmp_path / DATA
    assert data.is_symlink() and os.readlink(data).startswith("..")
    assert os.readlink(tmp_path / "net-conf.json") == f"{DATA}/net-conf.json"
    assert (tmp_path / "net-conf.json").read_text() == "v1"
    assert (tmp_path / "state.json").read_text() == "{}"
    assert current(str(tmp_path)) == {"net-conf.json": "v1", "cni-conf.json": "c1"}
    assert not project(str(tmp_path), {"net-conf.json": "v1", "cni-conf.json": "c1"})


def test_an_update_swaps_the_version_and_removes_the_old_one(tmp_path: Path) -> None:
    project(str(tmp_path), {"net-conf.json": "v1", "cni-conf.json": "c1"})
    first = os.readlink(tmp_path / DATA)
    assert project(str(tmp_path), {"net-conf.json": "v2"})
    second = os.readlink(tmp_path / DATA)
    assert second != first and not (tmp_path / first).exists()
    assert (tmp_path / "net-conf.json").read_text() == "v2"
    assert not (tmp_path / "cni-conf.json").exists()  # a key the ConfigMap lost
    versions = [
        p.name
        for p in tmp_path.iterdir()
        if p.name.startswith("..") and p.is_dir() and not p.is_symlink()
    ]
    assert versions == [second]


def test_a_reader_never_sees_half_a_file(tmp_path: Path) -> None:
    big = {"a": "x" * 200_000, "b": "y" * 200_000}
    project(str(tmp_path), {"net-conf.json": big["a"]})
    seen: set[str] = set()
    stop = threading.Event()

    def read() -> None:
        while not stop.is_set():
            # FileNotFoundError: resolved to the version just removed; read again.
            with contextlib.suppress(FileNotFoundError):
                seen.add((tmp_path / "net-conf.json").read_text())

    reader = threading.Thread(target=read)
    reader.start()
    try:
        for i in range(40):
            project(str(tmp_path), {"net-conf.json": big["ab"[i % 2]]})
    finally:
        stop.set()
        reader.join()
    assert seen <= set(big.values()), {len(s) for s in seen}


@pytest.mark.parametrize("key", ["..data", "a/b", ""])
def test_keys_a_volume_cannot_hold_are_refused(tmp_path: Path, key: str) -> None:
    with pytest.raises(ValueError, match="no ConfigMap key"):
        project(str(tmp_path), {key: "x"})
