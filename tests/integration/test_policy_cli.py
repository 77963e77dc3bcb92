"""`flannelpy policy show | set` against a real etcd.

`set` must rewrite only the DisruptionPolicy key (other keys keep their spelling,
values and order), survive a concurrent edit without losing it, and refuse a bad
window or a config that is wrong elsewhere with exit code 2 and one sentence,
leaving the key untouched. `show` must report the policy, the window at a given
time, each node's blocked change and the last forced changes, as text and JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from flannelpy_lab import Lab
from flannelpy_lab import state as lab_state
from flannelpy_lab.cli import main as lab_main

from flannelpy.cli import main
from flannelpy.control.policy import DisruptionPolicy, parse_policy
from flannelpy.errors import StoreError
from flannelpy.store import policy_records as policy_store
from flannelpy.store.etcd.client import EtcdStore
from flannelpy.store.etcd.kv import KeyValue
from tests.support.etcd_server import EtcdServer, free_port
from tests.support.lab_util import lab_run_args

CONFIG = (
    '{"network": "10.244.0.0/16", "SubnetLen": 24, '
    '"Backend": {"Type": "vxlan", "VNI": 4, "DirectRouting": true, "Custom": [1, 2.5]}, '
    '"Unrelated": {"keep": "me", "n": null}}'
)
WINDOW_ARGS = [
    "--days",
    "Sat,Sun",
    "--start",
    "02:00",
    "--duration",
    "4h",
    "--utc-offset",
    "+02:00",
]


@pytest.fixture(autouse=True)
def no_flanneld_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The command reads FLANNELD_* like the agent: keep the runner's out of it."""
    for name in list(os.environ):
        if name.startswith("FLANNELD_"):
            monkeypatch.delenv(name)


@pytest.fixture
def store(etcd_server: EtcdServer) -> Iterator[EtcdStore]:
    s = EtcdStore([etcd_server.endpoint])
    try:
        yield s
    finally:
        s.close()


def flags(etcd_server: EtcdServer, prefix: str) -> list[str]:
    return ["--etcd-endpoints", etcd_server.endpoint, "--etcd-prefix", prefix]


def policy(
    capsys: pytest.CaptureFixture[str], etcd_server: EtcdServer, prefix: str, *argv: str
) -> tuple[int, str, str]:
    code = main(["policy", *argv, *flags(etcd_server, prefix)])
    out, err = capsys.readouterr()
    return code, out, err


def config_doc(store: EtcdStore, prefix: str) -> dict[str, Any]:
    kv = store.get(f"{prefix}/config")
    assert kv is not None
    doc = json.loads(kv.value)
    assert isinstance(doc, dict)
    return doc


def without_policy(doc: dict[str, Any]) -> list[tuple[str, Any]]:
    return [(k, v) for k, v in doc.items() if k.lower() != "disruptionpolicy"]


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (["Block"], "Block"),
        (["allow"], "Allow"),
        (
            ["AllowDuringMaintenanceWindow", *WINDOW_ARGS],
            "AllowDuringMaintenanceWindow: Sat,Sun 02:00 for 4h (UTC+02:00)",
        ),
    ],
)
def test_set_writes_the_mode_and_keeps_every_other_key(
    capsys: pytest.CaptureFixture[str],
    etcd_server: EtcdServer,
    etcd_prefix: str,
    store: EtcdStore,
    argv: list[str],
    line: str,
) -> None:
    store.put(f"{etcd_prefix}/config", CONFIG.encode())
    code, out, err = policy(capsys, etcd_server, etcd_prefix, "set", *argv)
    assert (code, err) == (0, "")
    assert out.startswith(f"DisruptionPolicy set to {line} in {etcd_prefix}/config\n")
    doc = config_doc(store, etcd_prefix)
    assert without_policy(doc) == list(json.loads(CONFIG).items())  # values, spelling, order
    assert format_of(parse_policy(doc)) == line
    # And show reads back what set wrote.
    code, out, _ = policy(capsys, etcd_server, etcd_prefix, "show", "--json")
    assert code == 0
    assert json.loads(out)["summary"] == line


def format_of(p: DisruptionPolicy) -> str:
    from flannelpy.control.policy import format_policy

    return format_policy(p)


def test_set_reuses_the_existing_spelling_of_the_key(
    capsys: pytest.CaptureFixture[str],
    etcd_server: EtcdServer,
    etcd_prefix: str,
    store: EtcdStore,
) -> None:
    raw = '{\n  "disruptionpolicy": {"mode": "block"},\n  "Network": "10.244.0.0/16"\n}\n'
    store.put(f"{etcd_prefix}/config", raw.encode())
    code, _, err = policy(capsys, etcd_server, etcd_prefix, "set", "Allow")
    assert (code, err) == (0, "")
    kv = store.get(f"{etcd_prefix}/config")
    assert kv is not None
    text = kv.value.decode()
    assert text.startswith('{\n  "disruptionpolicy": {')  # same key, still indented
    assert json.loads(text) == {"disruptionpolicy": {"Mode": "Allow"}, "Network": "10.244.0.0/16"}


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (
            [
                "AllowDuringMaintenanceWindow",
                "--days",
                "Sat",
                "--start",
                "02:00",
                "--duration",
                "8d",
            ],
            "--duration '8d' is not a duration",
        ),
        (
            [
                "AllowDuringMaintenanceWindow",
                "--days",
                "Mon-Sun",
                "--start",
                "02:00",
                "--duration",
                "24h",
            ],
            "the window is always open",
        ),
        (["AllowDuringMaintenanceWindow", "--days", "Sat"], "needs --start and --duration"),
        (["Block", "--days", "Sat"], "--days applies only to AllowDuringMaintenanceWindow"),
        (["Sometimes"], "'Sometimes' is not a policy mode"),
    ],
)
def test_set_refuses_a_bad_policy_with_exit_code_2_and_writes_nothing(
    etcd_server: EtcdServer, etcd_prefix: str, store: EtcdStore, argv: list[str], needle: str
) -> None:
    store.put(f"{etcd_prefix}/config", CONFIG.encode())
    before = store.get(f"{etcd_prefix}/config")
    # A real process: the user sees one sentence on stderr, never a traceback.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flannelpy",
            "policy",
            "set",
            *argv,
            *flags(etcd_server, etcd_prefix),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env={k: v for k, v in os.environ.items() if not k.startswith("FLANNELD_")},
    )
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    assert proc.stderr.startswith("flannelpy: ") and proc.stderr.count("\n") == 1
    assert needle in proc.stderr
    assert store.get(f"{etcd_prefix}/config") == before


def test_set_refuses_a_config_that_is_wrong_elsewhere(
    capsys: pytest.CaptureFixture[str],
    etcd_server: EtcdServer,
    etcd_prefix: str,
    store: EtcdStore,
) -> None:
    store.put(f"{etcd_prefix}/config", b'{"Backend": {"Type": "vxlan"}}')
    before = store.get(f"{etcd_prefix}/config")
    code, out, err = policy(capsys, etcd_server, etcd_prefix, "set", "Block")
    assert (code, out) == (2, "")
    assert '"Network" is required' in err and "nothing was written" in err
    assert store.get(f"{etcd_prefix}/config") == before


def test_missing_config_is_one_sentence_with_exit_code_2(
    capsys: pytest.CaptureFixture[str], etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    for verb in (["show"], ["set", "Block"]):
        code, out, err = policy(capsys, etcd_server, etcd_prefix, *verb)
        assert (code, out) == (2, "")
        assert err == (
            f"flannelpy: network config not found in etcd at {etcd_prefix}/config; write "
            f"net-conf.json there first (etcdctl put {etcd_prefix}/config "
            "'{\"Network\": ...}'), or check --etcd-prefix\n"
        )


class EditsBeforeWriting:
    """The real store, with someone else's edit landing between our read and write."""

    def __init__(self, store: EtcdStore, edits: int) -> None:
        self.store = store
        self.edits = edits
        self.attempts = 0

    def get(self, key: str) -> KeyValue | None:
        return self.store.get(key)

    def put_if_mod_revision(
        self, key: str, value: bytes, mod_revision: int, lease_id: int = 0
    ) -> int | None:
        self.attempts += 1
        if self.edits:
            self.edits -= 1
            current = self.store.get(key)
            assert current is not None
            doc = json.loads(current.value)
            doc[f"Edit{self.attempts}"] = self.attempts
            self.store.put(key, json.dumps(doc).encode())
        return self.store.put_if_mod_revision(key, value, mod_revision, lease_id)


def test_set_keeps_an_edit_made_while_it_writes(etcd_prefix: str, store: EtcdStore) -> None:
    store.put(f"{etcd_prefix}/config", CONFIG.encode())
    racing = EditsBeforeWriting(store, edits=2)
    policy_store.set_policy(racing, etcd_prefix, DisruptionPolicy("Block"))  # type: ignore[arg-type]
    assert racing.attempts == 3
    doc = config_doc(store, etcd_prefix)
    assert doc["DisruptionPolicy"] == {"Mode": "Block"}
    assert doc["Edit1"] == 1 and doc["Edit2"] == 2  # neither edit was lost
    assert doc["Unrelated"] == {"keep": "me", "n": None}


def test_set_gives_up_on_a_key_that_never_stops_changing(
    etcd_prefix: str, store: EtcdStore
) -> None:
    store.put(f"{etcd_prefix}/config", CONFIG.encode())
    racing = EditsBeforeWriting(store, edits=100)
    with pytest.raises(StoreError, match="changed 5 times"):
        policy_store.set_policy(racing, etcd_prefix, DisruptionPolicy("Block"))  # type: ignore[arg-type]
    assert "DisruptionPolicy" not in config_doc(store, etcd_prefix)


def put_json(store: EtcdStore, key: str, doc: Any) -> None:
    store.put(key, json.dumps(doc).encode())


def seed_nodes_and_events(store: EtcdStore, prefix: str) -> None:
    root = f"{prefix}/flannelpy"
    put_json(store, f"{root}/nodes/n1/status", {"Node": "n1", "Ready": True, "Blocked": None})
    put_json(
        store,
        f"{root}/nodes/n2/status",
        {
            "Node": "n2",
            "Ready": True,
            "Blocked": {
                "Generation": 3,
                "Change": "backend vxlan -> host-gw",
                "Sentence": "disruptive change (backend vxlan -> host-gw) blocked by ...",
                "Since": 1_765_000_000.0,
            },
        },
    )
    store.put(f"{root}/nodes/n3/status", b"{not json")
    put_json(store, f"{root}/nodes/n1/override", {"Backend": {"Type": "host-gw"}})
    # 12 forced changes; key order as text differs from time order (9... < 10...).
    for i in range(12):
        stamp = 9_000_000_000 * 10**8 + i if i < 2 else 10**19 + i
        put_json(
            store,
            f"{root}/events/{stamp}-n{i % 3 + 1}",
            {
                "Node": f"n{i % 3 + 1}",
                "Change": f"MTU 1450 -> {1400 + i}",
                "Reason": f"incident {i}",
                "By": "root@host",
                "At": f"t{i:02d}",
            },
        )


def test_show_reports_the_window_blocked_nodes_and_forced_changes(
    capsys: pytest.CaptureFixture[str],
    etcd_server: EtcdServer,
    etcd_prefix: str,
    store: EtcdStore,
) -> None:
    store.put(f"{etcd_prefix}/config", CONFIG.encode())
    assert (
        policy(
            capsys, etcd_server, etcd_prefix, "set", "AllowDuringMaintenanceWindow", *WINDOW_ARGS
        )[0]
        == 0
    )
    seed_nodes_and_events(store, etcd_prefix)

    # Outside the window (Friday 23:00 UTC = Saturday 01:00 at +02:00), as text.
    code, out, err = policy(
        capsys, etcd_server, etcd_prefix, "show", "--at", "2026-12-04T23:00:00+00:00"
    )
    assert (code, err) == (0, "")
    lines = out.splitlines()
    assert lines[0] == (
        "policy: AllowDuringMaintenanceWindow: Sat,Sun 02:00 for 4h (UTC+02:00) "
        f"(etcd key {etcd_prefix}/config)"
    )
    assert lines[1] == (
        "at 2026-12-04T23:00:00+00:00: outside the window, disruptive changes wait; "
        "the next window starts 2026-12-05T02:00:00+02:00"
    )
    assert lines[2] == "blocked changes (1 of 3 nodes):"
    assert lines[3].startswith(
        "  n2: backend vxlan -> host-gw (override generation 3), since 2025-12-06T05:46:40+00:00"
    )
    assert lines[4] == "  n3: its status is not valid JSON"
    assert lines[5] == "forced changes (last 10 of 12):"
    assert lines[6] == '  t02 n3: MTU 1450 -> 1402 by root@host: "incident 2"'
    assert lines[15] == '  t11 n3: MTU 1450 -> 1411 by root@host: "incident 11"'
    assert len(lines) == 16

    # Inside the window, as JSON.
    code, out, err = policy(
        capsys, etcd_server, etcd_prefix, "show", "--json", "--at", "2026-12-06T05:00+02:00"
    )
    assert (code, err) == (0, "")
    report = json.loads(out)
    assert report["policy"]["Window"]["Days"] == ["Sat", "Sun"]
    assert report["allowed_now"] is True
    assert report["window"] == {
        "inside": True,
        "current_end": "2026-12-06T06:00:00+02:00",
        "next_start": "2026-12-12T02:00:00+02:00",
    }
    assert [n["node"] for n in report["nodes"]] == ["n1", "n2", "n3"]
    assert report["nodes"][0]["blocked"] is None and report["nodes"][0]["error"] is None
    assert report["nodes"][1]["blocked"]["generation"] == 3
    assert report["nodes"][1]["blocked"]["change"] == "backend vxlan -> host-gw"
    assert report["nodes"][2]["error"] == "its status is not valid JSON"
    assert [f["reason"] for f in report["forced"]] == [f"incident {i}" for i in range(2, 12)]
    assert report["forced_total"] == 12


@pytest.mark.parametrize(
    ("argv", "summary", "allowed", "second_line"),
    [
        ([], "Allow", True, "disruptive changes proceed"),
        (["set", "Block"], "Block", False, "disruptive changes are blocked"),
    ],
)
def test_show_allow_and_block_now(
    capsys: pytest.CaptureFixture[str],
    etcd_server: EtcdServer,
    etcd_prefix: str,
    store: EtcdStore,
    argv: list[str],
    summary: str,
    allowed: bool,
    second_line: str,
) -> None:
    store.put(f"{etcd_prefix}/config", CONFIG.encode())
    if argv:
        assert policy(capsys, etcd_server, etcd_prefix, *argv)[0] == 0
    before = datetime.now(UTC)
    code, out, _ = policy(capsys, etcd_server, etcd_prefix, "show", "--json")
    report = json.loads(out)
    assert (code, report["summary"], report["allowed_now"]) == (0, summary, allowed)
    assert report["window"] is None and report["nodes"] == [] and report["forced"] == []
    assert abs(datetime.fromisoformat(report["at"]) - before) < timedelta(seconds=30)
    code, out, _ = policy(capsys, etcd_server, etcd_prefix, "show")
    assert out.splitlines()[0] == f"policy: {summary} (etcd key {etcd_prefix}/config)"
    assert second_line in out.splitlines()[1]
    assert "blocked changes: none (0 nodes report a status)" in out


def test_show_names_a_bad_policy_in_the_store(
    capsys: pytest.CaptureFixture[str],
    etcd_server: EtcdServer,
    etcd_prefix: str,
    store: EtcdStore,
) -> None:
    store.put(
        f"{etcd_prefix}/config",
        b'{"Network": "10.244.0.0/16", "DisruptionPolicy": {"Mode": "Never"}}',
    )
    code, out, err = policy(capsys, etcd_server, etcd_prefix, "show")
    assert (code, out) == (2, "")
    assert '"Mode" "Never" is not a mode' in err and f"etcd key {etcd_prefix}/config" in err
    # set repairs it, and only it.
    assert policy(capsys, etcd_server, etcd_prefix, "set", "Allow")[0] == 0
    assert config_doc(store, etcd_prefix)["DisruptionPolicy"] == {"Mode": "Allow"}


def test_show_bad_at_is_a_config_error(
    capsys: pytest.CaptureFixture[str], etcd_server: EtcdServer, etcd_prefix: str
) -> None:
    code, _, err = policy(capsys, etcd_server, etcd_prefix, "show", "--at", "2026-12-05 03:00")
    assert code == 2 and "--at '2026-12-05 03:00' is not a time with an offset" in err


def test_unreachable_etcd_is_one_sentence_with_exit_code_3(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["policy", "show", "--etcd-endpoints", f"http://127.0.0.1:{free_port()}"])
    out, err = capsys.readouterr()
    assert (code, out) == (3, "")
    assert err.startswith("flannelpy: ") and err.count("\n") == 1


def test_kubernetes_mode_is_refused_with_where_to_edit(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLANNELD_KUBE_SUBNET_MGR", "true")
    code = main(["policy", "show"])
    _, err = capsys.readouterr()
    assert code == 2 and "ConfigMap's net-conf.json" in err


def test_lab_takes_the_labs_etcd_and_prefix(
    capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    etcd_server: EtcdServer,
    etcd_prefix: str,
    store: EtcdStore,
) -> None:
    # A saved lab state (no namespaces: only its etcd endpoint and prefix are read).
    lab_dir = tmp_path / "plab"
    lab_state.save(
        lab_state.LabState(
            name="plab",
            backend="vxlan",
            direct_routing=False,
            network="10.244.0.0/16",
            etcd_prefix=etcd_prefix,
            lab_dir=str(lab_dir),
            segments=[],
            router_namespace=None,
            host_link="none",
            host_address="100.64.0.254/24",
            host_routes=[],
            etcd_endpoint=etcd_server.endpoint,
            etcd_data_dir=str(tmp_path / "etcd"),
            etcd_log=str(tmp_path / "etcd.log"),
            overlay_bridge=False,
            nodes=[],
        )
    )
    load = Lab.load
    monkeypatch.setattr(Lab, "load", lambda name: load(name, str(tmp_path)))
    store.put(f"{etcd_prefix}/config", CONFIG.encode())

    # The command runs as a child of the lab's: capfd sees its output.
    assert lab_main(lab_run_args("plab", "policy", "set", "Block")) == 0
    assert config_doc(store, etcd_prefix)["DisruptionPolicy"] == {"Mode": "Block"}
    capfd.readouterr()
    assert lab_main(lab_run_args("plab", "policy", "show")) == 0
    assert capfd.readouterr().out.startswith(f"policy: Block (etcd key {etcd_prefix}/config)")

    code = lab_main(lab_run_args("plab", "policy", "show", "--etcd-prefix", "/other"))
    assert code == 2 and "leave out --etcd-prefix" in capfd.readouterr().err
    code = lab_main(lab_run_args("nolab", "policy", "show"))
    assert code == 1 and "there is no lab 'nolab'" in capfd.readouterr().err
