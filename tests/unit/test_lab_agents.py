"""Per-node agent flags and source trees in the lab, and its settings as FLANNELD_*
variables for ``flannelpy-lab run|env`` (no namespaces, no root)."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from ipaddress import IPv4Network
from pathlib import Path

import pytest
from flannelpy_lab import agents, environ, plan
from flannelpy_lab import cli as lab_cli
from flannelpy_lab import state as state_io
from flannelpy_lab.errors import LabError
from flannelpy_lab.lab import Lab

import flannelpy
from flannelpy.config.settings import add_agent_arguments, settings_from_args
from flannelpy.errors import ConfigError

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(flannelpy.__file__)))


def planned(tmp_path: Path, nodes: int = 3, flanneld_nodes: int = 0) -> state_io.LabState:
    return plan.plan_lab(
        "unit",
        nodes,
        "vxlan",
        direct_routing=False,
        segments=1,
        network="10.244.0.0/16",
        etcd_prefix="/coreos.com/network",
        subnets=[IPv4Network("100.64.9.0/24")],
        overlay_bridge=False,
        lab_root=str(tmp_path),
        flanneld_nodes=flanneld_nodes,
    )


def make_lab(tmp_path: Path) -> Lab:
    state = planned(tmp_path)
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
    # Recorded in state.json, so another process (flannelpy-lab run) sees the same argv.
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
        out = subprocess.run(
            [sys.executable, "-m", "flannelpy"],
            env=env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout.strip()

    env = agents.agent_env(agents.agent_source(lab.state, lab.node("n3")))
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tree)
    assert imported(env) == str(tree / "flannelpy" / "__main__.py")

    lab.set_node_agent_source("n3", None)
    assert agents.agent_source(lab.state, lab.node("n3")) is None
    default = agents.agent_env(None)
    assert default["PYTHONPATH"].split(os.pathsep)[0] == REPO_ROOT
    assert default.get("PYTHONSAFEPATH") == os.environ.get("PYTHONSAFEPATH")


# --- flannelpy-lab run and env: the lab's settings as FLANNELD_* variables -------------------


def test_a_nodes_variables_mean_what_its_agent_flags_mean(tmp_path: Path) -> None:
    lab = make_lab(tmp_path)
    lab.set_node_agent_args("n2", ["--cluster-name", "a", "--iface", "eth9"])
    node = lab.node("n2")
    env = environ.node_environ(lab.state, node)
    argv = agents.agent_argv(lab.state, node)
    parser = argparse.ArgumentParser(add_help=False)
    add_agent_arguments(parser)
    flags = parser.parse_args(argv[argv.index("agent") + 1 :])
    assert settings_from_args(argparse.Namespace(), env) == settings_from_args(flags, {})
    assert env["NODE_NAME"] == "n2" and env["FLANNELD_RUN_DIR"] == node.run_dir
    assert env["FLANNELD_IFACE"] == f"{node.underlay_iface},eth9"
    assert env["FLANNELD_ETCD_ENDPOINTS"] == lab.state.etcd_endpoint


def test_flags_that_no_variable_can_hold_are_refused(tmp_path: Path) -> None:
    lab = make_lab(tmp_path)
    lab.set_node_agent_args("n1", ["--iface-regex", "^eth", "--iface-regex", "^ens"])
    with pytest.raises(LabError, match="cannot all be written as FLANNELD_"):
        environ.node_environ(lab.state, lab.node("n1"))


def test_the_lab_brings_its_own_etcd(tmp_path: Path) -> None:
    state = make_lab(tmp_path).state
    with pytest.raises(ConfigError, match="leave out --etcd-endpoints, --etcd-prefix"):
        environ.command_argv(
            "unit",
            None,
            [
                "flannelpy",
                "pools",
                "list",
                "--etcd-prefix=/x",
                "--etcd-endpoints",
                "http://127.0.0.1:1",
            ],
        )
    argv = environ.command_argv("unit", state.node("n1"), ["flannelpy", "doctor"])
    assert argv == [
        "ip",
        "netns",
        "exec",
        state.node("n1").namespace,
        sys.executable,
        "-m",
        "flannelpy",
        "doctor",
    ]


def test_run_hands_the_command_the_labs_store_and_nothing_of_ours(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    lab = make_lab(tmp_path)
    load = Lab.load
    monkeypatch.setattr(Lab, "load", lambda name: load(name, str(tmp_path)))
    monkeypatch.setenv("FLANNELD_KUBE_SUBNET_MGR", "true")
    show = 'echo "$FLANNELD_ETCD_ENDPOINTS $FLANNELD_ETCD_PREFIX ${FLANNELD_KUBE_SUBNET_MGR-}"'
    assert lab_cli.main(["run", "unit", "--", "sh", "-c", show + "; exit 3"]) == 3
    state = lab.state
    assert capfd.readouterr().out == f"{state.etcd_endpoint} {state.etcd_prefix} \n"

    assert lab_cli.main(["env", "unit"]) == 0
    out = capfd.readouterr().out
    assert out == (
        f"export FLANNELD_ETCD_ENDPOINTS={state.etcd_endpoint}\n"
        f"export FLANNELD_ETCD_PREFIX={state.etcd_prefix}\n"
    )
    assert lab_cli.main(["env", "unit", "--node", "n9"]) == 1
    assert "lab unit has no node 'n9'" in capfd.readouterr().err


def test_a_flanneld_that_lost_the_lease_race_is_told_from_other_exits(tmp_path: Path) -> None:
    ours, theirs = planned(tmp_path, nodes=2, flanneld_nodes=1).nodes
    assert theirs.runs_flanneld and not ours.runs_flanneld
    log = Path(theirs.agent_log)
    log.parent.mkdir(parents=True, exist_ok=True)
    assert not agents.lost_lease_race(theirs)  # no log yet
    race = f"E1207 main.go:384] Error registering network: {agents.FLANNELD_LEASE_RACE}\n"
    log.write_text(f"--- lab: flanneld starting at T\n{race}")
    assert agents.lost_lease_race(theirs)
    # Only the latest start counts: a restart that failed otherwise is not the race.
    log.write_text(f"--- lab: flanneld starting at T\n{race}--- lab: flanneld starting at U\n"
                   "E1207 main.go:384] failed to find interface\n")  # fmt: skip
    assert not agents.lost_lease_race(theirs)
    # Our agent never is.
    Path(ours.agent_log).parent.mkdir(parents=True, exist_ok=True)
    Path(ours.agent_log).write_text(f"--- lab: flannelpy starting at T\n{race}")
    assert not agents.lost_lease_race(ours)
