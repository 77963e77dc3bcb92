"""Issue 31's dual-stack wireguard rollout on real agents: vxlan -> wireguard -> vxlan on a
3-node dual-stack lab, every ordered pair of pods echoing at 20/s in each family the whole
time, and not one echo lost in either.

Each family is made before broken on its own: a wireguard node keeps ``flannel-v6.1``
beside ``flannel.1`` while a peer is vxlan (BackendV6Data carries its VTEP beside the key),
a pair's IPv6 half leaves vxlan only once ``flannel-wg-v6`` has completed its own
handshake, and on the way back a node keeps ``flannel-wg-v6`` and the key in BackendV6Data
while a peer still runs wireguard. The run is the IPv4 module's
(:func:`~tests.e2e.test_wireguard_rollout.roll_to_wireguard_and_back`), with IPv6 echoes
and both WireGuard ports seen on the underlay.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest
from flannelpy_lab import Lab

# pytestmark: the IPv4 module's marks (a lab, network namespaces, root).
from tests.e2e.test_wireguard_rollout import pytestmark, roll_to_wireguard_and_back
from tests.support.lab_util import running_dual_stack_lab

__all__ = ["pytestmark"]
NODES, PODS_PER_NODE = 3, 2


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    args = ["--probe-interval", "1", "--status-publish-interval", "2"]
    name = f"d{secrets.randbelow(100_000)}"
    with running_dual_stack_lab(NODES, args, PODS_PER_NODE, name=name) as lab:
        yield lab


def test_dual_stack_vxlan_to_wireguard_and_back_loses_no_echo_in_either_family(
    lab: Lab, tmp_path: Path
) -> None:
    assert all(pod.ip6 is not None for pod in lab.pods)
    roll_to_wireguard_and_back(lab, tmp_path, ipv6=True)
