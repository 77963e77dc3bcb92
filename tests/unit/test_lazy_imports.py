"""Heavy clients load only where they are used: `flannelpy --help` and the operator
commands' help never import gRPC or the etcd client; and nothing of flannelpy imports the
kubernetes package, Kubernetes mode included (its client is our own, over urllib3)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("grpc", "pyetcd", "kubernetes")

PROBE = """
import json, sys
from flannelpy.cli import main
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(json.dumps(sorted({m.split(".")[0] for m in sys.modules})))
"""


def _top_level_modules_after(*argv: str) -> set[str]:
    result = subprocess.run(
        [sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    return set(json.loads(result.stdout.splitlines()[-1]))


@pytest.mark.parametrize(
    "argv",
    [
        ("--help",),
        ("agent", "--help"),
        ("doctor", "--help"),
        ("policy", "--help"),
        ("pools", "--help"),
        ("rollout", "--help"),
    ],
)
def test_help_imports_no_store_client(argv: tuple[str, ...]) -> None:
    loaded = _top_level_modules_after(*argv)
    assert not loaded & set(HEAVY), f"flannelpy {' '.join(argv)} imported {loaded & set(HEAVY)}"


# What the agent imports in Kubernetes mode (its start, the node watch, the status Lease,
# Events, NetworkPolicy's watches), and the operator commands that talk to the API server.
KUBE_MODE = (
    "flannelpy.cli",
    "flannelpy.commands.agent",
    "flannelpy.agent.compose",
    "flannelpy.store.open_store",
    "flannelpy.store.node_control",
    "flannelpy.store.kube.manager",
    "flannelpy.store.kube.node_status",
    "flannelpy.store.kube.events",
    "flannelpy.store.kube.policy_watch",
    "flannelpy.store.rollout_kube",
    "flannelpy.commands.netpol",
    "flannelpy.commands.rollout",
    "flannelpy.commands.doctor",
    "flannelpy.commands.pools",
)

KUBE_PROBE = """
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
from flannelpy.config.settings import AgentSettings
from flannelpy.store.open_store import open_store
settings = AgentSettings(kube_subnet_mgr=True, kube_api_url="http://127.0.0.1:9", node_name="n1")
store = open_store(settings)
store.policy_source()  # builds the watches (nothing is requested before they run)
print(json.dumps(sorted(sys.modules)))
"""


def test_kubernetes_mode_never_imports_the_kubernetes_package() -> None:
    result = subprocess.run(
        [sys.executable, "-c", KUBE_PROBE, *KUBE_MODE], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    loaded = set(json.loads(result.stdout.splitlines()[-1]))
    assert set(KUBE_MODE) <= loaded and "flannelpy.store.kube.client" in loaded
    assert "kubernetes" not in loaded, sorted(m for m in loaded if m.startswith("kubernetes"))
