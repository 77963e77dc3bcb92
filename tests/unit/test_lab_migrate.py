"""``flannelpy-lab migrate``: its command line, what it refuses before touching a node, and
the hand-over of our allocations to host-local and the flannel CNI plugin (the packets are
in tests/e2e)."""

from __future__ import annotations

import json
import os
from ipaddress import IPv4Network
from pathlib import Path

import pytest
from flannelpy_lab import cli as lab_cli
from flannelpy_lab import flanneld, plan
from flannelpy_lab import state as state_io
from flannelpy_lab.agents import parse_subnet_env
from flannelpy_lab.errors import LabError
from flannelpy_lab.lab import Lab
from flannelpy_lab.migrate import export_allocations, migrate

from flannelpy.ipam import hostlocal
from flannelpy.ipam.manager import NodeIpam


def make_lab(tmp_path: Path) -> Lab:
    state = plan.plan_lab(
        "unit",
        4,
        "vxlan",
        direct_routing=False,
        segments=1,
        network="10.244.0.0/16",
        etcd_prefix="/coreos.com/network",
        subnets=[IPv4Network("100.64.9.0/24")],
        overlay_bridge=False,
        lab_root=str(tmp_path),
        flanneld_nodes=2,
    )
    state_io.save(state)
    return Lab(state)


def test_the_command_line() -> None:
    args = lab_cli.build_parser().parse_args(
        ["migrate", "--name", "demo", "--node", "n3", "--to", "flannelpy"]
    )
    assert (args.lab_command, args.name, args.node, args.to) == (
        "migrate",
        "demo",
        "n3",
        "flannelpy",
    )
    with pytest.raises(SystemExit):
        lab_cli.build_parser().parse_args(["migrate", "--name", "d", "--node", "n3", "--to", "x"])


def test_refusals_name_what_to_fix(tmp_path: Path) -> None:
    lab = make_lab(tmp_path)
    with pytest.raises(LabError, match="runs flanneld already"):
        migrate(lab, "n3", "flanneld")
    with pytest.raises(LabError, match="no node 'n9'"):
        migrate(lab, "n9", "flannelpy")
    with pytest.raises(LabError, match=r"has no subnet\.env"):  # never ready: nothing to hand over
        migrate(lab, "n1", "flanneld")
    assert [n.agent_kind for n in lab.nodes] == ["flannelpy"] * 2 + ["flanneld"] * 2


def test_our_allocations_are_written_for_host_local_and_the_flannel_plugin(
    tmp_path: Path,
) -> None:
    node = make_lab(tmp_path).node("n2")
    with NodeIpam(os.path.join(node.node_dir, "state", "ipam"), fsync=False) as ipam:
        ipam.set_leases([IPv4Network("10.244.55.0/24")])
        ipam.allocate("lab-n2-p1", "eth0")
        ipam.allocate("lab-n2-p2", "eth0")
    # A pod the flannel plugin added itself keeps the config its ADD saved.
    data_dir = Path(flanneld.flannel_data_dir(node))
    data_dir.mkdir(parents=True)
    (data_dir / "lab-n2-p2").write_text("saved by ADD")
    env = parse_subnet_env(
        "FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET=10.244.55.1/24\n"
        "FLANNEL_MTU=1450\nFLANNEL_IPMASQ=true\n"
    )
    assert export_allocations(node, env) == 2
    target = Path(flanneld.host_local_network_dir(node))
    assert (target / "10.244.55.2").read_bytes() == b"lab-n2-p1\r\neth0"
    assert sorted(e.container_id for e in hostlocal.read_dir(str(target))) == [
        "lab-n2-p1",
        "lab-n2-p2",
    ]
    # What the plugin's DEL hands to bridge: host-local over this node's store and subnet.
    saved = json.loads((data_dir / "lab-n2-p1").read_text())
    assert (saved["type"], saved["name"], saved["cniVersion"]) == ("bridge", "cbr0", "0.3.1")
    assert saved["ipam"]["dataDir"] == flanneld.host_local_dir(node)
    assert saved["ipam"]["ranges"] == [[{"subnet": "10.244.55.0/24"}]]
    assert (data_dir / "lab-n2-p2").read_text() == "saved by ADD"
    assert export_allocations(make_lab(tmp_path / "never-ran").node("n2"), env) == 0
