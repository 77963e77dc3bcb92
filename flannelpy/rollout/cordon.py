"""Taking a node out of scheduling and load balancing while a rollout changes it (pure).

Kubernetes mode: before a node's override is written the rollout cordons the Node
(``spec.unschedulable``) and labels it ``node.kubernetes.io/exclude-from-external-
load-balancers`` (the service controller then drops it from cloud load balancers);
once the node is verified, or rolled back, it returns both. Only what the rollout set
is undone: a node an operator had cordoned stays cordoned. What it set is written on
the Node itself (:data:`CORDON_ANNOTATION`), so a driver that was killed mid-step,
or another one resuming, undoes exactly that and nothing else.

The patches are JSON merge patches of the Node (``null`` removes a key).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

EXCLUDE_LABEL = "node.kubernetes.io/exclude-from-external-load-balancers"
CORDON_ANNOTATION = "flannelpy.io/rollout-cordon"


@dataclass(frozen=True)
class CordonMark:
    """What a rollout changed on a Node to take it out (so it can put back just that)."""

    rollout: str
    unschedulable: bool  # the rollout set spec.unschedulable
    label: bool  # the rollout added the exclude label

    def to_json(self) -> str:
        return json.dumps(
            {"Rollout": self.rollout, "Unschedulable": self.unschedulable, "Label": self.label},
            separators=(",", ":"),
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, raw: str) -> CordonMark:
        """Raises ValueError (someone else wrote the annotation)."""
        try:
            doc = json.loads(raw)
            return cls(str(doc["Rollout"]), bool(doc["Unschedulable"]), bool(doc["Label"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"annotation {CORDON_ANNOTATION} is not one a rollout wrote "
                f"({e!r}); remove it by hand"
            ) from e


def _meta(node: Mapping[str, Any], key: str) -> Mapping[str, str]:
    found = (node.get("metadata") or {}).get(key)
    return found if isinstance(found, dict) else {}


def is_cordoned(node: Mapping[str, Any]) -> bool:
    """Unschedulable and out of external load balancers, as a rollout leaves it."""
    return bool((node.get("spec") or {}).get("unschedulable")) and EXCLUDE_LABEL in _meta(
        node, "labels"
    )


def mark_of(node: Mapping[str, Any]) -> CordonMark | None:
    raw = _meta(node, "annotations").get(CORDON_ANNOTATION)
    return CordonMark.from_json(raw) if isinstance(raw, str) else None


def cordon_patch(node: Mapping[str, Any], rollout: str) -> dict[str, Any] | None:
    """The patch that cordons ``node`` for ``rollout``; None when a rollout already did
    (the mark is there). Raises ValueError when the mark cannot be read."""
    if mark_of(node) is not None:
        return None
    unschedulable = not (node.get("spec") or {}).get("unschedulable")
    label = EXCLUDE_LABEL not in _meta(node, "labels")
    mark = CordonMark(rollout, unschedulable, label)
    patch: dict[str, Any] = {"metadata": {"annotations": {CORDON_ANNOTATION: mark.to_json()}}}
    if label:
        patch["metadata"]["labels"] = {EXCLUDE_LABEL: "true"}
    if unschedulable:
        patch["spec"] = {"unschedulable": True}
    return patch


def uncordon_patch(node: Mapping[str, Any]) -> dict[str, Any] | None:
    """The patch that undoes what a rollout's cordon set; None when there is no mark.
    Raises ValueError when the mark cannot be read."""
    mark = mark_of(node)
    if mark is None:
        return None
    patch: dict[str, Any] = {"metadata": {"annotations": {CORDON_ANNOTATION: None}}}
    if mark.label:
        patch["metadata"]["labels"] = {EXCLUDE_LABEL: None}
    if mark.unschedulable:
        patch["spec"] = {"unschedulable": None}
    return patch
