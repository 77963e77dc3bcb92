"""Showing a rollout record (pure): its state, a summary, a row per node, the way back."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from flannelpy.config.netconf import BackendConfig
from flannelpy.control.records import NodeStatus
from flannelpy.rollout.backends import backend_config, backend_name, short
from flannelpy.rollout.flanneld import FlanneldNode, why_cut_off
from flannelpy.rollout.record import TERMINAL, RolloutRecord


def describe_state(record: RolloutRecord) -> str:
    text: str = record.state
    if record.request is not None and record.state not in TERMINAL:
        text += f" ({record.request} requested: after the current step)"
    if record.state == "paused-window" and record.next_window:
        text += f" until {record.next_window}"
    return text


def summary(record: RolloutRecord) -> str:
    """One line on how the rollout ended (or where it stands)."""
    target = backend_name(backend_config(record.target))
    switched = [e.node for e in record.nodes if e.state == "done" and not e.skipped]
    skipped = [e.node for e in record.nodes if e.skipped]
    text = f"rollout {record.id} {describe_state(record)}: {len(switched)} of "
    text += f"{len(record.nodes)} nodes switched to {target}"
    if switched:
        text += f" ({', '.join(switched)})"
    if skipped:
        text += f"; already on it: {', '.join(skipped)}"
    if record.reason:
        text += f"; {record.reason}"
    if record.note:
        text += f"; note: {record.note}"
    return text


@dataclass(frozen=True)
class NodeRow:
    """A line of ``rollout status`` for one node."""

    node: str
    rollout_state: str
    backend: str
    applied_generation: int | None
    ready: bool | None
    blocked: str | None


def status_rows(
    record: RolloutRecord | None,
    statuses: Mapping[str, NodeStatus],
    flanneld: Sequence[FlanneldNode] = (),
    current: BackendConfig | None = None,
) -> list[NodeRow]:
    """A row per node of ours (the rollout's order first), then one per flanneld node
    (``flanneld``, with the config's Backend as ``current``): the rollout never switches
    those, and ``blocked`` says when its target would cut one off."""
    names = list(record.order) if record else []
    names += sorted(set(statuses) - set(names))
    rows = []
    for name in names:
        st = statuses.get(name)
        entry = record.entry(name) if record and name in record.order else None
        rows.append(
            NodeRow(
                node=name,
                rollout_state=(entry.state + (" (skipped)" if entry.skipped else ""))
                if entry
                else "-",
                backend=short(st.backend) if st else "no status",
                applied_generation=st.applied_generation if st else None,
                ready=st.ready if st else None,
                blocked=st.blocked.sentence if st and st.blocked else None,
            )
        )
    active = record is not None and record.state not in TERMINAL and not record.config_written
    target = backend_config(record.target) if record is not None and active else None
    for node in flanneld:
        why = why_cut_off(node, current, target) if target and current else None
        vni = f" (VNI {node.vni})" if node.vni is not None else ""
        rows.append(
            NodeRow(
                node=node.label,
                rollout_state="flanneld (not switched)",
                backend=(node.backend_type or "unknown") + vni,
                applied_generation=None,
                ready=None,
                blocked=f"the target cuts it off: it {why}" if why else None,
            )
        )
    return rows


def how_to_go_back(record: RolloutRecord) -> str | None:
    """For a stopped rollout: which nodes run the target through an override, and the
    command that walks them back to the config's Backend one at a time."""
    switched = [e.node for e in record.nodes if not e.skipped and e.state == "done"]
    if not switched or record.config_written:
        return None
    back = backend_config(record.config_backend or {"Type": "vxlan"})
    command = f"flannelpy rollout start --backend {back.type}"
    if back.type == "vxlan" and back.direct_routing:
        command += " --direct-routing"
    return (
        f"{', '.join(switched)} keep {backend_name(backend_config(record.target))} through "
        f"their overrides; to go back to the config's {backend_name(back)}, run `{command}` "
        "(it walks them back one at a time)"
    )
