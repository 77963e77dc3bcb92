"""The agent's effective settings in its run dir, and ``flannelpy doctor`` reading them:
the agent writes what it resolved (never a secret); the doctor with no flags uses it,
and flags and FLANNELD_* variables still win."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from flannelpy import cli
from flannelpy.config.effective import (
    SETTINGS_FILE,
    read_effective,
    with_agent_defaults,
    write_effective,
)
from flannelpy.config.settings import AgentSettings
from flannelpy.errors import ConfigError
from tests.support.agent_fakes import NODE, AgentHarness


class Gathered(Exception):
    """Raised by the stand-in for gather(): the doctor's settings, without a host."""

    def __init__(self, settings: AgentSettings) -> None:
        super().__init__("gathered")
        self.settings = settings


def doctor_settings(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], environ: dict[str, str]
) -> AgentSettings:
    """What ``flannelpy doctor ARGV`` would look at, with only ``environ`` set."""
    import flannelpy.doctor.gather as gather_module

    def gather(settings: AgentSettings, clock: Any = None) -> Any:
        raise Gathered(settings)

    monkeypatch.setattr(gather_module, "gather", gather)
    for name in [k for k in __import__("os").environ if k.startswith("FLANNELD_")]:
        monkeypatch.delenv(name)
    monkeypatch.delenv("NODE_NAME", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    args = cli.build_parser().parse_args(["doctor", *argv])
    with pytest.raises(Gathered) as caught:
        args.run(args)
    return caught.value.settings


def agent_written(tmp_path: Path, **overrides: Any) -> Path:
    settings = AgentSettings(
        etcd_endpoints=("https://10.0.0.5:2379", "https://10.0.0.6:2379"),
        etcd_prefix="/lab/network",
        etcd_cafile="/etc/flannel/ca.pem",
        etcd_certfile="/etc/flannel/client.pem",
        etcd_keyfile="/etc/flannel/client-key.pem",
        etcd_username="flannel",
        etcd_password="s3cret",
        iface_can_reach="10.0.0.5",
        run_dir=str(tmp_path / "run"),
        state_dir=str(tmp_path / "state"),
        subnet_file=str(tmp_path / "run" / "subnet.env"),
        ip_masq=True,
        **overrides,
    )
    write_effective(settings, "node-7", "eth1")
    return tmp_path / "run"


def test_the_agent_leaves_what_it_resolved_at_start(tmp_path: Path) -> None:
    harness = AgentHarness(tmp_path, etcd_password="s3cret", etcd_username="flannel")
    harness.start()
    try:
        text = (Path(harness.settings.run_dir) / SETTINGS_FILE).read_text()
    finally:
        harness.stop()
    doc = json.loads(text)
    assert doc["node_name"] == NODE
    assert doc["iface"] == [harness.writer.state.ctx.underlay.name]
    assert doc["run_dir"] == harness.settings.run_dir
    assert doc["etcd_prefix"] == harness.settings.etcd_prefix
    assert "s3cret" not in text and "etcd_password" not in doc and "etcd_username" not in doc


def test_the_doctor_with_no_flags_uses_the_agents_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = agent_written(tmp_path)
    s = doctor_settings(monkeypatch, [], {"FLANNELD_RUN_DIR": str(run_dir)})
    assert s.etcd_endpoints == ("https://10.0.0.5:2379", "https://10.0.0.6:2379")
    assert (s.etcd_prefix, s.etcd_cafile, s.etcd_keyfile) == (
        "/lab/network",
        "/etc/flannel/ca.pem",
        "/etc/flannel/client-key.pem",
    )
    assert s.node_name == "node-7", "not the host name"
    assert s.iface == ("eth1",) and s.iface_can_reach is None, "the interface it picked"
    assert s.ip_masq and s.run_dir == str(run_dir)
    assert s.subnet_file == str(run_dir / "subnet.env")
    assert s.etcd_password is None and s.etcd_username is None


def test_flags_and_variables_win_over_the_agents_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = agent_written(tmp_path)
    s = doctor_settings(
        monkeypatch,
        ["--run-dir", str(run_dir), "--etcd-prefix", "/other", "--iface-regex", "^ens"],
        {"FLANNELD_NODE_NAME": "from-env", "FLANNELD_IP_MASQ": ""},
    )
    assert s.etcd_prefix == "/other" and s.node_name == "from-env"
    assert s.iface == () and s.iface_regex == ("^ens",), "a chosen interface replaces its"
    assert s.ip_masq, "an empty variable is unset: the agent's value stays"
    assert s.etcd_endpoints == ("https://10.0.0.5:2379", "https://10.0.0.6:2379")


def test_no_settings_file_means_the_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    s = doctor_settings(monkeypatch, ["--run-dir", str(tmp_path)], {"NODE_NAME": "n"})
    assert s.etcd_endpoints == AgentSettings().etcd_endpoints and s.node_name == "n"
    assert read_effective(str(tmp_path / "absent")) == {}


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        ("[1, 2]", "not a JSON object"),
        ('{"Version": 9}', "Version is 9"),
        ('{"Version": 1, "iface": [3]}', "iface holds a list"),
        ('{"Version": 1, "etcd_prefix": {"a": 1}}', "etcd_prefix is a dict"),
        ("[" * 100_000, "larger than"),
        ("{", "Expecting"),
    ],
)
def test_a_file_that_is_not_ours_is_refused_by_name(
    tmp_path: Path, content: str, reason: str
) -> None:
    (tmp_path / SETTINGS_FILE).write_text(content)
    with pytest.raises(ConfigError, match=f"settings.json is not the agent's.*{reason}"):
        with_agent_defaults(str(tmp_path), {})


def test_a_bad_value_in_the_file_is_named_by_its_variable(tmp_path: Path) -> None:
    from flannelpy.config.settings import settings_from_args

    (tmp_path / SETTINGS_FILE).write_text('{"Version": 1, "etcd_endpoints": ["ftp://x"]}')
    args = cli.build_parser().parse_args(["doctor"])
    with pytest.raises(ConfigError, match="FLANNELD_ETCD_ENDPOINTS"):
        settings_from_args(args, with_agent_defaults(str(tmp_path), {}))
