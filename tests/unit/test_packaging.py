"""The wheel the DaemonSet image installs holds the product and nothing else: the lab is
a development tool of its own (lab/), never shipped to nodes."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_the_agent_and_the_cni_executable_but_not_the_lab(
    tmp_path: Path,
) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (wheel,) = tmp_path.glob("flannelpy-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    assert {"flannelpy", "cni_plugin"} <= top
    assert not any(name.startswith(("flannelpy_lab", "lab/", "tests/")) for name in names), top
    assert "flannelpy/agent/node.py" in names
    assert "flannelpy/cli.py" in names
