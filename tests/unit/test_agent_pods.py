"""The agent's CNI side, the pure parts: where a pod without a default route sends
the cluster's traffic."""

from __future__ import annotations

from ipaddress import IPv4Network
from pathlib import Path

from flannelpy.agent.pods import _cluster


def test_the_cluster_network_comes_from_subnet_env(tmp_path: Path) -> None:
    path = tmp_path / "subnet.env"
    assert _cluster(str(path)) == []  # not written yet: the ADD is told to try again
    path.write_text(
        "FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET=10.244.1.1/24\n"
        "FLANNEL_MTU=1450\nFLANNEL_IPMASQ=false\n"
    )
    assert _cluster(str(path)) == [IPv4Network("10.244.0.0/16")]
    path.write_text("FLANNEL_NETWORK=nonsense\n")
    assert _cluster(str(path)) == []
