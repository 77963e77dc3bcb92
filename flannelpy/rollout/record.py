"""A rollout's record (pure): what the rollout did so far, node by node.

Kept in the store (:func:`flannelpy.subnet.keys.rollout_key`) so a killed driver
can resume, and only ever replaced by a compare-and-swap.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Literal

from flannelpy.control.records import ForceRecord
from flannelpy.rollout.plan import DEFAULT_STEP_TIMEOUT, RolloutPlan

RecordState = Literal[
    "running",
    "paused",
    "paused-window",
    "rolling-back",
    "failed",
    "aborted",
    "finalizing",
    "done",
]
NodeState = Literal[
    "pending", "applying", "verifying", "done", "rolling-back", "rolled-back", "failed"
]
TERMINAL: frozenset[str] = frozenset({"failed", "aborted", "done"})
IN_FLIGHT: frozenset[str] = frozenset({"applying", "verifying", "rolling-back"})


@dataclass(frozen=True)
class NodeEntry:
    node: str
    state: NodeState = "pending"
    transition: str = ""
    skipped: bool = False  # already ran the target when the rollout started
    previous: Mapping[str, Any] | None = None  # the override this node had (a JSON doc)
    generation: int | None = None  # the override generation we wrote
    applied_at: float | None = None  # the node's AppliedAt for it (the node's clock)
    rollback_generation: int | None = None
    started_at: str | None = None  # ISO, the rollout's wall clock
    finished_at: str | None = None

    def to_doc(self) -> dict[str, Any]:
        return {
            "node": self.node,
            "state": self.state,
            "transition": self.transition,
            "skipped": self.skipped,
            "previous": dict(self.previous) if self.previous is not None else None,
            "generation": self.generation,
            "appliedAt": self.applied_at,
            "rollbackGeneration": self.rollback_generation,
            "startedAt": self.started_at,
            "finishedAt": self.finished_at,
        }

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any]) -> NodeEntry:
        return cls(
            node=str(doc["node"]),
            state=doc.get("state", "pending"),
            transition=str(doc.get("transition", "")),
            skipped=bool(doc.get("skipped")),
            previous=doc.get("previous"),
            generation=doc.get("generation"),
            applied_at=doc.get("appliedAt"),
            rollback_generation=doc.get("rollbackGeneration"),
            started_at=doc.get("startedAt"),
            finished_at=doc.get("finishedAt"),
        )


@dataclass(frozen=True)
class RolloutRecord:
    """One rollout. Keys are lower camel case: agents read ``id`` and ``state`` to decide
    whether an override naming this rollout is vouched for."""

    id: str
    state: RecordState
    target: Mapping[str, Any]  # the Backend document
    config_backend: Mapping[str, Any] | None  # the config's Backend at the start
    nodes: tuple[NodeEntry, ...]
    created_at: str
    updated_at: str
    step_timeout: float = DEFAULT_STEP_TIMEOUT
    reason: str | None = None  # why failed / paused / aborted
    request: Literal["pause", "abort"] | None = None  # honoured after the current step
    next_window: str | None = None  # paused-window: when the next window opens (ISO)
    force: ForceRecord | None = None
    driver: str | None = None  # the driver that may act; another one stops
    config_written: bool = False
    note: str | None = None  # what the final step could not finish
    cordon: bool = True  # cordon each node while it changes (Kubernetes mode)

    @property
    def order(self) -> tuple[str, ...]:
        return tuple(e.node for e in self.nodes)

    def entry(self, node: str) -> NodeEntry:
        return next(e for e in self.nodes if e.node == node)

    def current(self) -> NodeEntry | None:
        """The node a step is in flight for, if any."""
        return next((e for e in self.nodes if e.state in IN_FLIGHT), None)

    def with_entry(self, entry: NodeEntry) -> RolloutRecord:
        return replace(self, nodes=tuple(entry if e.node == entry.node else e for e in self.nodes))

    def to_json(self) -> str:
        return json.dumps(
            {
                "id": self.id,
                "state": self.state,
                "target": dict(self.target),
                "configBackend": dict(self.config_backend) if self.config_backend else None,
                "order": list(self.order),
                "nodes": [e.to_doc() for e in self.nodes],
                "createdAt": self.created_at,
                "updatedAt": self.updated_at,
                "stepTimeout": self.step_timeout,
                "reason": self.reason,
                "request": self.request,
                "nextWindow": self.next_window,
                "force": self.force.to_doc() if self.force else None,
                "driver": self.driver,
                "configWritten": self.config_written,
                "note": self.note,
                "cordon": self.cordon,
            },
            indent=1,
        )

    @classmethod
    def from_json(cls, raw: str | bytes) -> RolloutRecord:
        """Raises ValueError naming what is wrong."""
        try:
            doc = json.loads(raw)
            force = doc.get("force")
            return cls(
                id=str(doc["id"]),
                state=doc["state"],
                target=dict(doc["target"]),
                config_backend=doc.get("configBackend"),
                nodes=tuple(NodeEntry.from_doc(e) for e in doc["nodes"]),
                created_at=str(doc["createdAt"]),
                updated_at=str(doc["updatedAt"]),
                step_timeout=float(doc.get("stepTimeout", DEFAULT_STEP_TIMEOUT)),
                reason=doc.get("reason"),
                request=doc.get("request"),
                next_window=doc.get("nextWindow"),
                force=ForceRecord(str(force["Reason"]), str(force["By"]), str(force["At"]))
                if isinstance(force, dict)
                else None,
                driver=doc.get("driver"),
                config_written=bool(doc.get("configWritten")),
                note=doc.get("note"),
                cordon=bool(doc.get("cordon", True)),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"the rollout record lacks or mangles a field: {e!r}") from e


def new_record(
    plan: RolloutPlan,
    rollout_id: str,
    config_backend: Mapping[str, Any] | None,
    now: datetime,
    step_timeout: float = DEFAULT_STEP_TIMEOUT,
    force: ForceRecord | None = None,
    cordon: bool = True,
) -> RolloutRecord:
    stamp = now.isoformat()
    return RolloutRecord(
        id=rollout_id,
        state="running",
        target=dict(plan.target),
        config_backend=dict(config_backend) if config_backend is not None else None,
        nodes=tuple(
            NodeEntry(
                s.node,
                "done" if s.skip else "pending",
                s.transition,
                skipped=s.skip,
                finished_at=stamp if s.skip else None,
            )
            for s in plan.steps
        ),
        created_at=stamp,
        updated_at=stamp,
        step_timeout=step_timeout,
        force=force,
        cordon=cordon,
    )
