"""The conflist shipped in the repo stays Flannel's shape and valid for our plugin."""

import json
from pathlib import Path

from flannelpy.cni.spec import parse_request

CONFLIST = Path(__file__).resolve().parents[2] / "cni_plugin" / "10-flannelpy.conflist"


def test_repo_conflist_mirrors_flannels_and_parses() -> None:
    doc = json.loads(CONFLIST.read_text())
    assert doc["name"] == "cbr0"
    assert [p["type"] for p in doc["plugins"]] == ["flannelpy", "portmap"]
    assert doc["plugins"][1]["capabilities"] == {"portMappings": True}
    ours = {**doc["plugins"][0], "cniVersion": doc["cniVersion"], "name": doc["name"]}
    env = {
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": "c1",
        "CNI_NETNS": "/run/netns/x",
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/opt/cni/bin",
    }
    request = parse_request(env, json.dumps(ours).encode())
    assert request.network_name == "cbr0" and request.config["ipCooldownSeconds"] == 30
