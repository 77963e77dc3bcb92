"""What the rollout needs of a store, as a protocol and its values.

The store layer implements it: :mod:`flannelpy.store.rollout_etcd` (etcd mode) and
:mod:`flannelpy.store.rollout_kube` (Kubernetes mode).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from flannelpy.config.netconf import NetworkConfig
from flannelpy.control.records import NodeOverride, NodeStatus
from flannelpy.rollout.record import RolloutRecord
from flannelpy.subnet.lease import Lease


@dataclass(frozen=True)
class ConfigDoc:
    raw: bytes
    mod_revision: int
    config: NetworkConfig


@dataclass(frozen=True)
class NodesSnapshot:
    statuses: dict[str, NodeStatus] = field(default_factory=dict)
    overrides: dict[str, NodeOverride] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)  # key -> why it cannot be read
    present: frozenset[str] | None = None  # the nodes that exist; None: the store cannot tell


class RolloutStorage(Protocol):
    """What the driver and the commands need of a mode's store: etcd's
    ``RolloutStore`` (:mod:`flannelpy.store.rollout_etcd`), or Kubernetes mode's
    (:mod:`flannelpy.store.rollout_kube`)."""

    record_key: str

    def read_config(self) -> ConfigDoc: ...
    def read_nodes(self) -> NodesSnapshot: ...
    def read_leases(self) -> list[Lease]: ...
    def read_record(self) -> tuple[RolloutRecord | None, int]: ...
    def put_record(self, record: RolloutRecord, mod_revision: int) -> int | None: ...
    def write_override(self, node: str, override: NodeOverride) -> None: ...
    def delete_override(self, node: str, generation: int | None = None) -> bool: ...
    def write_config_backend(self, backend: Mapping[str, Any]) -> NetworkConfig: ...

    def cordon(self, node: str, rollout: str) -> bool:
        """Take ``node`` out of scheduling and load balancing while it changes."""
        ...

    def uncordon(self, node: str) -> bool: ...
