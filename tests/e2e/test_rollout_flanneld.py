"""``flannelpy rollout plan`` in a lab with real flanneld nodes.

flanneld reads no override and ignores every lease of another BackendType, so moving
the nodes of ours to host-gw would cut them off from the flanneld nodes. On a 4-node
vxlan lab (n1, n2 ours; n3, n4 the pinned upstream flanneld, ``scripts/build-peers.sh``)
the plan must refuse, naming the flanneld nodes by subnet and address, and change
nothing; a target that keeps what flanneld runs (the config's vxlan) is planned around.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from flannelpy_lab import Lab

from flannelpy.store.etcd.client import EtcdStore
from flannelpy.store.rollout_etcd import RolloutStore
from flannelpy.subnet.lease import EXTENSION_KEY
from tests.support.lab_util import lab_run_argv, running_mixed_lab, wait_until

pytestmark = [
    pytest.mark.lab,
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to build the netns lab"),
]

REPO = Path(__file__).resolve().parents[2]
OURS, THEIRS = ("n1", "n2"), ("n3", "n4")


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with running_mixed_lab("vxlan") as lab:
        yield lab


@pytest.fixture()
def store(lab: Lab) -> Iterator[RolloutStore]:
    etcd = EtcdStore([lab.etcd_endpoint])
    try:
        rs = RolloutStore(etcd, lab.state.etcd_prefix)
        # Every node holds its lease and both of ours published a status.
        wait_until(
            lambda: len(rs.read_leases()) == 4 and set(rs.read_nodes().statuses) == set(OURS),
            30,
            what="4 leases and the statuses of n1, n2",
        )
        yield rs
    finally:
        etcd.close()


def plan(lab: Lab, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        lab_run_argv(lab.name, "rollout", "plan", *args),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def flanneld_names(lab: Lab, rs: RolloutStore) -> list[str]:
    """``subnet (address)`` of each flanneld node, from its own lease, in subnet order
    (numeric, as the plan lists them: 10.244.7.0/24 before 10.244.62.0/24)."""
    theirs = {str(n.ip) for n in lab.nodes if n.name in THEIRS}
    leases = [ls for ls in rs.read_leases() if str(ls.attrs.public_ip) in theirs]
    assert len(leases) == 2 and all(ls.attrs.mtu is None for ls in leases), leases
    leases.sort(key=lambda ls: ls.subnet)
    return [f"{ls.subnet} ({ls.attrs.public_ip})" for ls in leases]


def test_plan_to_host_gw_refuses_naming_the_flanneld_nodes(lab: Lab, store: RolloutStore) -> None:
    raw = [kv.value for kv in store.store.get_prefix(f"{lab.state.etcd_prefix}/subnets/")[0]]
    assert sum(EXTENSION_KEY.encode() in v for v in raw) == 2, raw  # only ours carry it
    names = flanneld_names(lab, store)
    proc = plan(lab, "--backend", "host-gw")
    text = f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert proc.returncode == 2, text
    (refusal,) = [line for line in proc.stderr.splitlines() if "flanneld node" in line]
    assert refusal.startswith(
        f"flannelpy rollout: flanneld node(s) {names[0]}, which runs vxlan, {names[1]}, which "
        "runs vxlan cannot follow a rollout to host-gw"
    ), text
    assert "migrate them to flannelpy first, or change the Backend in net-conf.json" in refusal
    # Only our nodes are in the order, and the plan changed nothing.
    assert "  1. n1: " in proc.stdout and "  2. n2: " in proc.stdout
    assert "  3. " not in proc.stdout, text
    assert store.read_record() == (None, 0)
    assert store.read_nodes().overrides == {}


def test_plan_goes_around_flanneld_only_when_the_target_keeps_what_they_run(
    lab: Lab, store: RolloutStore
) -> None:
    names = flanneld_names(lab, store)
    # The config's own vxlan: nothing flanneld runs or sees changes.
    proc = plan(lab, "--backend", "vxlan")
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}"
    assert (
        f"flanneld nodes (not switched; they keep the network config's Backend): {', '.join(names)}"
    ) in proc.stdout.splitlines()
    # DirectRouting: flanneld keeps the config's until it restarts; the ends would differ.
    proc = plan(lab, "--backend", "vxlan", "--direct-routing")
    assert proc.returncode == 2, f"{proc.stdout}\n{proc.stderr}"
    assert f"flanneld node(s) {names[0]}, which runs DirectRouting off until it restarts" in (
        proc.stderr
    )
