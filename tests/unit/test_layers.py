"""The layer contracts in pyproject.toml hold, and would catch an arrow running back up."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": f"{root}:{root / 'lab'}", "PATH": "/usr/bin:/bin"},
    )


@pytest.fixture
def tree_copy(tmp_path: Path) -> Path:
    """The packages and their contracts, copied where they can be broken on purpose."""
    for package in ("flannelpy", "cni_plugin"):
        shutil.copytree(
            REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__")
        )
    shutil.copytree(
        REPO / "lab" / "flannelpy_lab",
        tmp_path / "lab" / "flannelpy_lab",
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    return tmp_path


def test_the_tree_keeps_every_contract(tree_copy: Path) -> None:
    result = _lint(tree_copy)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "broken" not in result.stdout.lower().split("contracts:")[-1].split("kept")[0]


@pytest.mark.parametrize(
    ("module", "upward_import", "broken"),
    [
        # the data plane reaching up into the agent
        ("flannelpy/dataplane/diff.py", "import flannelpy.agent.node", "layers run downward"),
        # errors must stay a leaf
        ("flannelpy/errors.py", "import flannelpy.config.netconf", "layers run downward"),
        # the product importing the lab
        ("flannelpy/observe/mtu.py", "import flannelpy_lab.plan", "never imports the lab"),
        # the CNI executable importing the product
        ("cni_plugin/client.py", "import flannelpy.errors", "stands alone"),
    ],
)
def test_an_arrow_running_back_up_breaks_a_contract(
    tree_copy: Path, module: str, upward_import: str, broken: str
) -> None:
    path = tree_copy / module
    path.write_text(path.read_text() + f"\n{upward_import}  # deliberately upward\n")
    result = _lint(tree_copy)
    assert result.returncode != 0
    assert f"{broken} BROKEN" in result.stdout, result.stdout
