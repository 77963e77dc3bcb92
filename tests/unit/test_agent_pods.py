"""The agent's CNI side: where a pod without a default route sends the cluster's traffic."""

from __future__ import annotations

from dataclasses import replace
from ipaddress import IPv4Network
from pathlib import Path

from flannelpy.agent.pods import PodAttachments
from flannelpy.config.settings import AgentSettings
from flannelpy.observe.metrics import AgentMetrics


def test_the_cluster_network_is_the_configured_network(tmp_path: Path) -> None:
    settings = replace(AgentSettings(), state_dir=str(tmp_path / "state"),
                       run_dir=str(tmp_path / "run"))  # fmt: skip
    network = IPv4Network("10.244.0.0/16")
    pods = PodAttachments(settings, lambda: 1450, lambda: True, AgentMetrics(), network)
    # Known from the start: no file to wait for, so such an ADD never has to retry.
    assert tuple(pods.handler.settings.cluster_networks()) == (network,)
