"""Per-node agent flags and source trees in the lab (no namespaces, no root)."""

from __future__ import annotations

import os
import subprocess
import sys
from ipaddress import IPv4Network
from pathlib import Path

import pytest
from flannelpy_lab import agents, plan
from flannelpy_lab import state as state_io
from flannelpy_lab.errors import LabError
from flannelpy_lab.lab import Lab

import flannelpy

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(flannelpy.__file__)))


def make_lab(tmp_path: Path) -> Lab:
    state = plan.plan_lab(
        "unit", 3, "vxlan", direct_routing=False, segments=1, network="10.244.0.0/16",
        etcd_prefix="/coreos.com/network", subnets=[IPv4Network("100.64.9.0/24")],
        overlay_bridge=False, lab_root=str(tmp_path),
    )  # fmt: skip
    state_io.save(state)
    return Lab(state)


def fake_tree(root: Path) -> Path:
    """A source root whose ``flannelpy`` says where it was imported from."""
    package = root / "flannelpy"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "__main__.py").write_text("print(__file__)\n")
    return root


def test_node_flags_follow_the_lab_wide_ones_on_that_node_only(tmp_path: Path) -> None:
    lab = make_lab(tmp_path)
    lab.set_agent_args(["--resync-interval", "5"])
    lab.set_node_agent_args("n2", ["--cluster-name", "a"])
    argv = {n.name: agents.agent_argv(lab.state, n) for n in lab.nodes}
    assert argv["n2"][-4:] == ["--resync-interval", "5", "--cluster-name", "a"]
    assert argv["n1"][-2:] == argv["n3"][-2:] == ["--resync-interval", "5"]
    # Recorded in state.json, so another process (a --lab command) sees the same argv.
    reloaded = state_io.load(lab.state.lab_dir)
    assert reloaded is not None
    assert agents.agent_argv(reloaded, reloaded.node("n2")) == argv["n2"]
    lab.set_node_agent_args("n2", [])
    assert agents.agent_argv(lab.state, lab.node("n2")) == argv["n2"][:-2]


def test_an_unknown_node_is_refused(tmp_path: Path) -> None:
    lab = make_lab(tmp_path)
    with pytest.raises(LabError, match="no node 'n9'"):
        lab.set_node_agent_args("n9", ["--cluster-name", "a"])
    with pytest.raises(LabError, match="no node 'n9'"):
        lab.set_node_agent_source("n9", str(tmp_path))


def test_a_directory_without_flannelpy_is_refused(tmp_path: Path) -> None:
    lab = make_lab(tmp_path)
    with pytest.raises(LabError, match="holds no flannelpy package"):
        lab.set_node_agent_source("n1", str(tmp_path))
    assert agents.agent_source(lab.state, lab.node("n1")) is None


def test_a_node_runs_its_own_tree_even_from_a_checkout_of_this_one(tmp_path: Path) -> None:
    """``-m`` puts the working directory first on sys.path: started from the repository
    root, the agent would import this flannelpy instead of the tree asked for."""
    tree = fake_tree(tmp_path / "previous")
    lab = make_lab(tmp_path)
    lab.set_node_agent_source("n3", str(tree))
    assert agents.agent_source(lab.state, lab.node("n3")) == str(tree)
    assert agents.agent_source(lab.state, lab.node("n1")) is None

    def imported(env: dict[str, str]) -> str:
        out = subprocess.run([sys.executable, "-m", "flannelpy"], env=env, cwd=REPO_ROOT,
                             capture_output=True, text=True, timeout=30)  # fmt: skip
        return out.stdout.strip()

    env = agents.agent_env(agents.agent_source(lab.state, lab.node("n3")))
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tree)
    assert imported(env) == str(tree / "flannelpy" / "__main__.py")

    lab.set_node_agent_source("n3", None)
    assert agents.agent_source(lab.state, lab.node("n3")) is None
    default = agents.agent_env(None)
    assert default["PYTHONPATH"].split(os.pathsep)[0] == REPO_ROOT
    assert default.get("PYTHONSAFEPATH") == os.environ.get("PYTHONSAFEPATH")
