"""wireguard-go, run as the agent runs it, serves its socket in the agent's run dir and
creates nothing in the host's /run (an empty /run/wireguard used to outlive it)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.support.netns_util import is_root, temp_netns

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(not is_root(), reason="network namespaces need root"),
    pytest.mark.skipif(shutil.which("wireguard-go") is None, reason="needs wireguard-go"),
]

# Runs inside the node's namespace, whose mount namespace is its own (ip netns exec): /run
# there is an empty tmpfs, so other agents or labs on this host change nothing it sees.
PROBE = """
import json, os, subprocess, sys
subprocess.run(["mount", "-n", "-t", "tmpfs", "probe-run", "/run"], check=True)
before = sorted(os.listdir("/run"))
from flannelpy.dataplane.wgnetlink import PyrouteLink
from flannelpy.dataplane.wireguard import UserspaceProcess
from flannelpy.dataplane.uapi import uapi_get
process = UserspaceProcess("wgprobe0", sys.argv[1])
link = PyrouteLink()
process.start(link)
try:
    seen = {
        "before": before,
        "run": sorted(os.listdir("/run")),
        "served": uapi_get(process.socket_path) is not None,
        "device": link.exists("wgprobe0"),
    }
finally:
    process.stop()
seen["after"] = sorted(os.listdir("/run"))
print(json.dumps(seen))
"""


def test_wireguard_go_creates_nothing_in_the_hosts_run(tmp_path: Path) -> None:
    socket_dir = tmp_path / "wireguard"
    with temp_netns("wgo") as ns:
        result = ns.exec([sys.executable, "-c", PROBE, str(socket_dir)], check=False)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.splitlines()[-1])
    # The device is up and its socket answers at <run-dir>/wireguard/<dev>.sock ...
    assert seen["device"] and seen["served"]
    # ... and /run stayed as it was while it ran and after (before: "wireguard" in both).
    assert seen["before"] == seen["run"] == seen["after"] == []
