"""The agent's control channel: what it is told to run, and what it reports back.

Inputs, followed live: the network config, this node's override and the rollout
record (an override written by a rollout is trusted only while that rollout is
active). Outputs: this node's status record and records of forced changes. See
:mod:`flannelpy.control.records` for the formats
and :mod:`flannelpy.subnet.keys` for the keys.

The store layer implements it (:mod:`flannelpy.store.node_control`) for etcd and for
the Kubernetes API.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from flannelpy.control.records import ForceRecord, NodeOverride, NodeStatus
from flannelpy.subnet.keys import KeyValue


@dataclass(frozen=True)
class ControlSnapshot:
    """The latest of every input; ``None`` where the key does not exist."""

    config: bytes | None
    override: NodeOverride | None
    override_error: str | None  # the override key holds something we cannot read
    rollout: Mapping[str, Any] | None
    pools: tuple[KeyValue, ...] = ()  # the address pool records (etcd mode)


class NodeControl(Protocol):
    def watch(self, on_change: Callable[[ControlSnapshot], None], stop: threading.Event) -> None:
        """Call ``on_change`` with a full snapshot now and after every change, until stop."""
        ...

    def publish_status(self, status: NodeStatus) -> None: ...

    def rollout_in_progress(self) -> bool:
        """True while a rollout is active: its steps wait for fresh status records."""
        ...

    def record_forced(self, node: str, change: str, force: ForceRecord) -> None: ...

    def record_blocked(self, node: str, change: str, sentence: str) -> None:
        """A disruptive change this node has started to hold back (raises StoreError)."""
        ...


ACTIVE_ROLLOUT_STATES = ("running", "rolling-back", "finalizing")


def rollout_vouches(rollout: Mapping[str, Any] | None, rollout_id: str | None) -> bool:
    """True when ``rollout_id`` names the active rollout: it checked the policy for the
    step it is taking, so the node may apply the override without checking again."""
    if rollout is None or not rollout_id:
        return False
    return rollout.get("id") == rollout_id and rollout.get("state") in ACTIVE_ROLLOUT_STATES


def snapshot_of(
    config: bytes | None,
    override_raw: str | bytes | None,
    override_where: str,
    rollout_raw: bytes | None,
    pools: tuple[KeyValue, ...] = (),
) -> ControlSnapshot:
    """A snapshot from raw values; an override or rollout record that does not parse
    becomes ``override_error`` / no rollout, never an exception."""
    override, override_error = None, None
    if override_raw:
        try:
            override = NodeOverride.from_json(override_raw)
        except ValueError as e:
            override_error = f"{override_where}: {e}"
    rollout = None
    if rollout_raw:
        try:
            doc = json.loads(rollout_raw)
            rollout = doc if isinstance(doc, dict) else None
        except ValueError:
            rollout = None
    return ControlSnapshot(config, override, override_error, rollout, pools)
