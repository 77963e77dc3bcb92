"""Heavy clients load only where they are used: `flannelpy --help` and the operator
commands' help never import gRPC or the etcd client, and no command imports the
Kubernetes client before it needs it."""

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
