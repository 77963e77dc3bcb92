"""What a lab agent has provably done: its status file's event counts and its log.

Each agent's ``<run dir>/status.json`` carries ``"events": {kind: n}``, the events of
each kind its single writer has finished handling (``leases``, ``lease_lost``,
``control``: config, override and pool records, ``probe``, ``capacity``: IPAM running
low, ``tick``: the timers, the capacity round among them), and ``capacity_checks``,
the capacity rounds begun. A test that asserts that nothing happened (no lease in a
pool, a blocked change not applied) first waits until the agent has handled the input:

    before = quiet_count(node, "control")        # an input the test makes: count first
    ...write the change...
    wait_until_processed(node, "control", after=before)
    wait_for_capacity_round([node])              # a timer's work: mark after the change
    assert ...nothing changed...

The status file is rewritten every couple of seconds, so a count read from it may
lag; the marks allow for that (see there). The counts start at 0 with each agent
process: after a restart pass ``since`` so that the last run's file does not count.
"""

from __future__ import annotations

import json
import os
import time
from functools import partial
from pathlib import Path
from typing import Any, Protocol

from tests.support.waiting import wait_until

EVENT_KINDS = ("leases", "lease_lost", "control", "probe", "capacity", "tick", "handshake")
CAPACITY_CHECKS = "capacity_checks"  # not an event kind: status.json's count of rounds
FIREWALL_RESYNCS = "firewall_resyncs"  # nor this: the firewall resyncs finished


class AgentNode(Protocol):
    """A lab node as these helpers need it (``flannelpy_lab``'s node records fit)."""

    @property
    def name(self) -> str: ...

    @property
    def run_dir(self) -> str: ...

    @property
    def agent_log(self) -> str: ...


def status_path(node: AgentNode) -> Path:
    return Path(node.run_dir) / "status.json"


def read_status(node: AgentNode) -> dict[str, Any]:
    """``node``'s status.json, or {} while there is none yet (the agent writes it atomically)."""
    try:
        doc: dict[str, Any] = json.loads(status_path(node).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    return doc


def processed(status: dict[str, Any], kind: str) -> int:
    """Events of ``kind`` handled according to ``status`` (0 before the first);
    ``capacity_checks`` for the capacity rounds begun, ``firewall_resyncs`` for the
    firewall resyncs finished."""
    if kind in (CAPACITY_CHECKS, FIREWALL_RESYNCS):
        return int(status[kind])
    assert kind in EVENT_KINDS, f"unknown event kind {kind!r}; use one of {EVENT_KINDS}"
    events = status.get("events")
    assert isinstance(events, dict), f"status.json has no 'events' counts: {sorted(status)}"
    return int(events.get(kind, 0))


def _status_since(node: AgentNode, since: float | None) -> dict[str, Any] | None:
    """status.json if it was written after ``since`` (any, with None), else None."""
    try:
        if since is not None and os.stat(status_path(node)).st_mtime <= since:
            return None
    except FileNotFoundError:
        return None
    return read_status(node) or None


def fresh_status(node: AgentNode, timeout: float = 15.0) -> dict[str, Any]:
    """``node``'s status.json as written after this call began."""
    since = time.time()
    return wait_until(
        lambda: _status_since(node, since), timeout, f"a status.json of {node.name} newer than now"
    )


def processed_mark(node: AgentNode, kind: str) -> int:
    """A count of ``kind`` past which every event was taken up after this call.

    Call it after writing the change. It reads a status.json written after the call,
    whose count includes every event finished before the change, and adds one for
    an event that may have been in hand then, working from the state before it.
    Capacity rounds are counted as they begin: those beyond the file's count began
    after the call.
    """
    count = processed(fresh_status(node), kind)
    return count if kind == CAPACITY_CHECKS else count + 1


def wait_until_processed(
    node: AgentNode, kind: str, after: int, timeout: float = 30.0, since: float | None = None
) -> dict[str, Any]:
    """Wait until ``node``'s agent has handled more than ``after`` events of ``kind``
    (in a status.json written after ``since``, if given); return that status.json."""

    def beyond() -> dict[str, Any] | None:
        status = _status_since(node, since)
        return status if status and processed(status, kind) > after else None

    return wait_until(beyond, timeout, f"{node.name}'s agent handling {kind} number {after + 1}")


def quiet_count(node: AgentNode, kind: str) -> int:
    """The count of ``kind`` before a change only the test makes (pool records, the
    config), taken while no such change is in flight: the change is handled once the
    count passes it (one event per write the agent's watch delivers)."""
    return processed(fresh_status(node), kind)


def wait_for_reconcile_passes(
    nodes: list[AgentNode], passes: int = 2, timeout: float = 30.0
) -> None:
    """Wait until each node's agent has ended ``passes`` reconcile passes one after another
    from this call on (status.json's ``last_reconcile``: the wall-clock end of the latest
    pass). Passes run one at a time, so with 2 at least one whole pass began after the
    call: what a node would repair or change, it has by then."""

    def ended_after(node: AgentNode, mark: float) -> bool:
        done = read_status(node).get("last_reconcile")
        return isinstance(done, (int, float)) and done > mark

    for _ in range(passes):
        mark = time.time()
        for node in nodes:
            wait_until(
                partial(ended_after, node, mark),
                timeout,
                f"a reconcile pass of {node.name} ending after {mark:.1f}",
            )


def wait_for_capacity_round(nodes: list[AgentNode], timeout: float = 30.0) -> None:
    """Wait until every node's agent has done a whole capacity round begun after this
    call, where it would add or release a lease seeing every change handled before."""
    marks = {node.name: processed_mark(node, CAPACITY_CHECKS) for node in nodes}
    for node in nodes:
        begun = wait_until_processed(node, CAPACITY_CHECKS, after=marks[node.name], timeout=timeout)
        # The round may still have been running when that file was written; the writer
        # finishes it before the next event, so two more ticks mean it is done.
        wait_until_processed(node, "tick", after=processed(begun, "tick") + 1, timeout=timeout)


def agent_log(node: AgentNode) -> str:
    return Path(node.agent_log).read_text(encoding="utf-8", errors="replace")


def wait_for_log_lines(
    nodes: list[AgentNode],
    text: str,
    before: dict[str, int],
    more: int = 1,
    timeout: float = 30.0,
) -> None:
    """Wait until every node's agent log holds ``more`` lines containing ``text`` beyond
    the ``before`` counts (from :func:`log_counts`)."""
    for node in nodes:
        wanted = before.get(node.name, 0) + more

        def logged(node: AgentNode = node, wanted: int = wanted) -> bool:
            return agent_log(node).count(text) >= wanted

        wait_until(logged, timeout, f"{node.name}'s agent logging {text!r} {more} more time(s)")


def log_counts(nodes: list[AgentNode], text: str) -> dict[str, int]:
    """How often each node's agent log holds ``text`` now."""
    return {node.name: agent_log(node).count(text) for node in nodes}
