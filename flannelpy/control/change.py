"""Should a running node take on the config it is now told to run? (pure)

The wanted config is the network config with this node's override (if any) in
place of its Backend. Against what the node runs, a difference is one of:

- nothing that matters here → nothing to do;
- Network, SubnetLen and the like → not applied live (every lease and pod
  address depends on them); the agent says a restart is needed;
- DirectRouting, the policy itself, ... → applied at once;
- disruptive (backend type, VNI, port, MTU, GBP, learning) → applied only when
  forced, vouched for by the active rollout (which checked the policy for this
  step), or allowed by the policy now; otherwise blocked, and the node keeps
  running what it runs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Literal

from flannelpy.config.netconf import NetworkConfig, parse_network_config
from flannelpy.control.node_control import rollout_vouches
from flannelpy.control.policy import ETCD_REMEDY, decide, disruptive_changes, parse_policy
from flannelpy.control.records import ForceRecord, NodeOverride
from flannelpy.errors import ConfigError

Action = Literal["none", "apply", "block", "restart-needed"]


def wanted_config(config_raw: bytes, override: NodeOverride | None) -> NetworkConfig:
    """The network config with the override's Backend in place of the config's."""
    if override is None:
        return parse_network_config(config_raw)
    doc: dict[str, Any] = json.loads(config_raw)
    for key in [k for k in doc if k.lower() == "backend"]:
        del doc[key]
    doc["Backend"] = dict(override.backend)
    try:
        wanted = parse_network_config(json.dumps(doc))
    except ConfigError as e:
        raise ConfigError(f"this node's override: {e}") from e
    # flanneld nodes run the document's own Backend: paths to them follow it.
    return replace(wanted, cluster_backend=parse_network_config(config_raw).backend)


@dataclass(frozen=True)
class ChangeDecision:
    action: Action
    changes: tuple[str, ...] = ()  # the disruptive differences, in words
    sentence: str | None = None  # why blocked / why a restart is needed
    forced: ForceRecord | None = None
    vouched: bool = False  # the active rollout wrote this override


def _live_fields(config: NetworkConfig) -> tuple[object, ...]:
    """What a running node cannot change without re-addressing its leases and pods."""
    return (
        config.network,
        config.subnet_len,
        config.subnet_min,
        config.subnet_max,
        config.enable_ipv4,
        config.enable_ipv6,
        config.ipv6_network,
        config.enable_nftables,
    )


def decide_change(
    running: NetworkConfig,
    running_mtu: int,
    wanted: NetworkConfig,
    wanted_mtu: int,
    override: NodeOverride | None,
    rollout: Any,
    now: datetime,
    remedy: str = ETCD_REMEDY,
) -> ChangeDecision:
    if _live_fields(running) != _live_fields(wanted):
        return ChangeDecision(
            "restart-needed",
            sentence=(
                "the network config changed Network, SubnetLen, SubnetMin/Max, the IP "
                "families or EnableNFTables; those are not applied to a running node: restart "
                "every agent (pods keep their addresses only if their subnets stay inside Network)"
            ),
        )
    changes = tuple(disruptive_changes(running.backend, wanted.backend, running_mtu, wanted_mtu))
    if not changes:
        return ChangeDecision("none" if wanted == running else "apply")
    if override is not None and override.force is not None:
        return ChangeDecision("apply", changes, forced=override.force)
    if override is not None and rollout_vouches(rollout, override.rollout):
        return ChangeDecision("apply", changes, vouched=True)
    policy = parse_policy(wanted.raw)
    decision = decide(policy, now, ", ".join(changes), remedy)
    if decision.allowed:
        return ChangeDecision("apply", changes)
    return ChangeDecision("block", changes, sentence=decision.sentence)
