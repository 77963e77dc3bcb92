"""The disruption policy in the store (etcd mode): write it, and gather what agents report.

The policy is the ``DisruptionPolicy`` key of net-conf.json at ``<prefix>/config``
(see :mod:`flannelpy.control.policy`). :func:`set_policy` rewrites that one key and
nothing else, with a compare-and-swap so an edit made meanwhile by someone else is
never lost. :func:`gather` adds what the agents report: changes blocked on each node
(their ``nodes/<node>/status``) and the last changes forced past the policy
(``events/``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from flannelpy.control.policy import (
    DisruptionPolicy,
    WindowState,
    decide,
    parse_policy,
    window_state,
    with_policy,
)
from flannelpy.errors import ConfigError
from flannelpy.store.etcd.config import swap_config
from flannelpy.store.etcd.kv import KeyValue, Store
from flannelpy.subnet.keys import config_key, events_prefix, node_of_key, nodes_prefix

WRITE_ATTEMPTS = 5  # compare-and-swap rounds before giving up on a busy config key
FORCED_SHOWN = 10  # forced-change records a report keeps, newest last


def _read_config(store: Store, prefix: str) -> KeyValue:
    key = config_key(prefix)
    kv = store.get(key)
    if kv is None:
        raise ConfigError(
            f"network config not found in etcd at {key}; write net-conf.json there first "
            f"(etcdctl put {key} '{{\"Network\": ...}}'), or check --etcd-prefix"
        )
    return kv


def set_policy(store: Store, prefix: str, policy: DisruptionPolicy) -> str:
    """Write ``policy`` into the config key, retrying when someone else wrote it
    meanwhile (their edit is re-read, never overwritten). Returns the key."""
    key = config_key(prefix)

    def edit(kv: KeyValue | None) -> bytes:
        current = kv if kv is not None else _read_config(store, prefix)  # raises when missing
        try:
            return with_policy(current.value, policy).encode()
        except ConfigError as e:
            raise ConfigError(f"{e} (in etcd key {key}; nothing was written)") from e

    swap_config(
        store,
        prefix,
        edit,
        attempts=WRITE_ATTEMPTS,
        gave_up=f"the network config at {key} changed {WRITE_ATTEMPTS} times while the "
        "policy was being written; run the command again",
    )
    return key


@dataclass(frozen=True)
class NodeReport:
    node: str
    blocked: Mapping[str, Any] | None  # the status "Blocked" object, as the agent wrote it
    error: str | None = None  # the status could not be read


@dataclass(frozen=True)
class ForcedRecord:
    key: str
    node: str
    change: str
    reason: str
    by: str
    at: str


@dataclass(frozen=True)
class PolicyReport:
    config_key: str
    policy: DisruptionPolicy
    now: datetime
    state: WindowState | None  # the window's, whatever the mode (None: no window)
    nodes: tuple[NodeReport, ...]
    forced: tuple[ForcedRecord, ...]  # the newest FORCED_SHOWN, oldest first
    forced_total: int

    @property
    def allowed_now(self) -> bool:
        return decide(self.policy, self.now, "any").allowed


def gather(store: Store, prefix: str, now: datetime) -> PolicyReport:
    key = config_key(prefix)
    kv = _read_config(store, prefix)
    try:
        doc = json.loads(kv.value)
    except (ValueError, UnicodeDecodeError) as e:
        raise ConfigError(f"net-conf.json at {key} is not valid JSON ({e}); fix it") from e
    if not isinstance(doc, dict):
        raise ConfigError(f"net-conf.json at {key} is not a JSON object; fix it")
    try:
        policy = parse_policy(doc)
    except ConfigError as e:
        raise ConfigError(f"{e} (read from etcd key {key})") from e
    state = window_state(policy.window, now) if policy.window else None
    statuses, _ = store.get_prefix(nodes_prefix(prefix))
    nodes = []
    for item in statuses:
        where = node_of_key(prefix, item.key)
        if where is not None and where[1] == "status":
            nodes.append(_node_report(where[0], item.value))
    events, _ = store.get_prefix(events_prefix(prefix))
    forced = sorted((_forced(item) for item in events), key=_event_order)
    return PolicyReport(
        config_key=key,
        policy=policy,
        now=now,
        state=state,
        nodes=tuple(sorted(nodes, key=lambda n: n.node)),
        forced=tuple(forced[-FORCED_SHOWN:]),
        forced_total=len(forced),
    )


def _node_report(node: str, value: bytes) -> NodeReport:
    # Only "Blocked" matters here; a status an older or newer agent shaped differently
    # must not hide it, so this reads the one key instead of the whole record.
    try:
        doc = json.loads(value)
    except (ValueError, UnicodeDecodeError):
        return NodeReport(node, None, "its status is not valid JSON")
    if not isinstance(doc, dict):
        return NodeReport(node, None, "its status is not a JSON object")
    blocked = doc.get("Blocked")
    if blocked is not None and not isinstance(blocked, dict):
        return NodeReport(node, None, 'its status "Blocked" is not a JSON object')
    return NodeReport(node, blocked)


def _forced(item: KeyValue) -> ForcedRecord:
    try:
        doc = json.loads(item.value)
    except (ValueError, UnicodeDecodeError):
        doc = None
    if not isinstance(doc, dict):
        doc = {"Change": "(unreadable record)"}
    name = item.key.rsplit("/", 1)[-1]
    return ForcedRecord(
        key=item.key,
        node=str(doc.get("Node") or name.partition("-")[2]),
        change=str(doc.get("Change", "")),
        reason=str(doc.get("Reason", "")),
        by=str(doc.get("By", "")),
        at=str(doc.get("At", "")),
    )


def _event_order(record: ForcedRecord) -> tuple[int, str]:
    # Keys are "<unix-ns>-<node>": order by the number, not the text.
    stamp = record.key.rsplit("/", 1)[-1].partition("-")[0]
    return (int(stamp) if stamp.isdigit() else 0, record.key)
