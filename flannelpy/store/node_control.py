"""The control channel's adapters: what a node is told to run, and what it reports.

etcd mode follows exactly three keys and the pools prefix, each with its own
watch: watching the whole ``flannelpy/`` prefix would deliver every node's status
writes to every node, N² events for nothing. Kubernetes mode reads the mounted
net-conf.json and this Node's override annotation. The protocol and the snapshot
are :mod:`flannelpy.control.node_control`'s.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flannelpy.control.node_control import (
    ACTIVE_ROLLOUT_STATES,
    ControlSnapshot,
    snapshot_of,
)
from flannelpy.control.records import ForceRecord, NodeStatus
from flannelpy.errors import RevisionCompacted, StoreError, StoreUnavailable
from flannelpy.retry import Backoff
from flannelpy.store.etcd.kv import Store
from flannelpy.subnet.keys import (
    KeyValue,
    config_key,
    event_key,
    override_key,
    pools_prefix,
    rollout_key,
    status_key,
)

if TYPE_CHECKING:
    from flannelpy.store.kube.manager import KubeSubnetManager
    from flannelpy.store.kube.node_status import LeasePublisher

OVERRIDE_ANNOTATION = "flannelpy.io/override"  # kept equal to flannelpy.store.kube's
# Kubernetes mode: how long after a rollout's last override change the status record
# follows probe rounds (longer than any step should wait for verification).
ROLLOUT_FOLLOW_SECONDS = 900.0

log = logging.getLogger("flannelpy.control")


class EtcdNodeControl:
    def __init__(self, store: Store, prefix: str, node: str) -> None:
        self._store = store
        self._prefix = prefix
        self._node = node
        self._keys = {
            "config": config_key(prefix),
            "override": override_key(prefix, node),
            "rollout": rollout_key(prefix),
            "pools": pools_prefix(prefix),  # a prefix: every record under it
        }
        self._values: dict[str, bytes | None] = {}
        self._pools: dict[str, KeyValue] = {}
        self._lock = threading.Lock()
        self._rollout_seen: tuple[bytes | None, bool] = (None, False)  # parsed once per value

    def watch(self, on_change: Callable[[ControlSnapshot], None], stop: threading.Event) -> None:
        revisions: dict[str, int] = {}
        backoff = Backoff()
        while not stop.is_set():
            try:
                for name in self._keys:
                    revisions[name] = self._read(name)
                break
            except StoreError as e:
                log.warning("control keys unreadable; retrying error=%s", e)
                stop.wait(backoff.next())
        if stop.is_set():
            return
        on_change(self.snapshot())
        notify = threading.Lock()  # one callback at a time, in event order per key
        threads = [
            threading.Thread(
                target=self._follow,
                args=(name, revisions[name], on_change, notify, stop),
                name=f"control-{name}",
                daemon=True,
            )
            for name in self._keys
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    def _follow(
        self,
        name: str,
        revision: int,
        on_change: Callable[[ControlSnapshot], None],
        notify: threading.Lock,
        stop: threading.Event,
    ) -> None:
        key = self._keys[name]
        backoff = Backoff()
        while not stop.is_set():
            try:
                for batch in self._store.watch_prefix(key, revision + 1, stop):
                    revision = batch.revision
                    changed = False
                    for event in batch.events:
                        if name == "pools":
                            with self._lock:
                                if event.kind == "put":
                                    self._pools[event.key] = KeyValue(
                                        event.key, event.value, event.mod_revision
                                    )
                                else:
                                    self._pools.pop(event.key, None)
                            changed = True
                            continue
                        if event.key != key:
                            continue  # a longer key sharing the prefix
                        with self._lock:
                            self._values[name] = event.value if event.kind == "put" else None
                        changed = True
                    if changed and name == "override":
                        # Each key has a watch of its own, so the config's may lag: a
                        # rollout writes its target config before it removes the
                        # overrides, and the override's removal must never be seen with
                        # the config it replaced (the node would run that a moment).
                        self._read("config")
                    if changed:
                        with notify:
                            on_change(self.snapshot())
                    backoff.reset()
                if stop.is_set():
                    return
                reason: BaseException = StoreUnavailable("the watch stream ended")
            except (RevisionCompacted, StoreUnavailable) as e:
                reason = e
            except Exception as e:  # a dead follower would freeze this input for good
                log.exception("control watch failed; restarting key=%s error=%s", key, e)
                reason = e
            stop.wait(backoff.next())
            try:
                revision = self._read(name)
            except Exception as e:  # retried like the watch itself
                log.warning("control key unreadable; retrying key=%s error=%s", key, e)
                continue
            log.info("control watch restarted key=%s reason=%s", key, reason)
            with notify:
                on_change(self.snapshot())

    def _read(self, name: str) -> int:
        """Read one key into the snapshot; the revision to watch from."""
        key = self._keys[name]
        items, revision = self._store.get_prefix(key)
        with self._lock:
            if name == "pools":
                self._pools = {kv.key: kv for kv in items}
            else:
                self._values[name] = next((kv.value for kv in items if kv.key == key), None)
        return revision

    def snapshot(self) -> ControlSnapshot:
        with self._lock:
            values = dict(self._values)
            pools = tuple(self._pools[k] for k in sorted(self._pools))
        return snapshot_of(
            values.get("config"),
            values.get("override"),
            self._keys["override"],
            values.get("rollout"),
            pools,
        )

    def publish_status(self, status: NodeStatus) -> None:
        self._store.put(status_key(self._prefix, self._node), status.to_json().encode())

    def rollout_in_progress(self) -> bool:
        with self._lock:
            raw = self._values.get("rollout")
        seen, active = self._rollout_seen
        if raw is not seen:
            snap = snapshot_of(None, None, "", raw)
            active = snap.rollout is not None and snap.rollout.get("state") in ACTIVE_ROLLOUT_STATES
            self._rollout_seen = (raw, active)
        return active

    def record_forced(self, node: str, change: str, force: ForceRecord) -> None:
        key = event_key(self._prefix, time.time_ns(), node)
        doc = {
            "Node": node,
            "Change": change,
            "Reason": force.reason,
            "By": force.by,
            "At": force.at,
        }
        self._store.put(key, json.dumps(doc, separators=(",", ":")).encode())

    def record_blocked(self, node: str, change: str, sentence: str) -> None:
        return None  # this node's status record carries it (NodeStatus.blocked)


class KubeNodeControl:
    """Kubernetes mode: the ConfigMap's net-conf.json (the kubelet updates the mounted
    file in place), and this Node's override annotation as the node watch sees it.

    The status record is this node's Lease (:mod:`flannelpy.store.kube.node_status`),
    which no agent watches. The rollout record is not read here: an override a rollout
    wrote is checked against the policy like any other (the rollout checked it too), and
    a rollout is in progress while some Node's override names one and one changed
    in the last :data:`ROLLOUT_FOLLOW_SECONDS` (the node watch shows every Node). A
    blocked change shows in status.json, ``doctor`` and the metric, and both a blocked
    and a forced one leave an Event on the Node (a repeat counts in the same Event's
    series, :mod:`flannelpy.store.kube.events`).
    """

    POLL_SECONDS = 2.0  # the kubelet refreshes ConfigMap volumes every minute or so

    def __init__(
        self, manager: KubeSubnetManager, config_path: str, publisher: LeasePublisher | None = None
    ) -> None:
        self._manager = manager
        self._config_path = config_path
        self._publisher = publisher
        self._config_backend: Mapping[str, Any] | None = None  # as last read from the file
        from flannelpy.store.kube.events import NodeEvents

        self._events = NodeEvents(manager.api_client, lambda: manager.node_name)

    def watch(self, on_change: Callable[[ControlSnapshot], None], stop: threading.Event) -> None:
        # Decide nothing before the node list has shown our Node's override (or that
        # there is none): deciding without it would undo an applied override.
        while not self._manager.own_override_seen.wait(0.2):
            if stop.is_set():
                return
        last: ControlSnapshot | None = None
        while not stop.is_set():
            try:
                raw: bytes | None = Path(self._config_path).read_bytes()
            except OSError:
                raw = None  # mid-update (the kubelet swaps a symlink); read again soon
            snap = snapshot_of(
                raw, self._manager.own_override, f"annotation {OVERRIDE_ANNOTATION}", None
            )
            if raw is not None and snap != last:
                self._config_backend = _backend_of(raw)
                on_change(snap)
                last = snap
            self._events.flush()  # repeats counted since the last series update
            stop.wait(self.POLL_SECONDS)

    def publish_status(self, status: NodeStatus) -> None:
        if self._publisher is not None:
            self._publisher.publish(status.node, status.to_json(), self._config_backend)

    def rollout_in_progress(self) -> bool:
        # A rollout rewrites an override every step: overrides an aborted one left
        # behind stop costing a write per probe round once they stand still.
        idle = time.monotonic() - self._manager.rollout_changed_at
        return bool(self._manager.rollout_overrides) and idle < ROLLOUT_FOLLOW_SECONDS

    def record_forced(self, node: str, change: str, force: ForceRecord) -> None:
        from flannelpy.store.kube.event_series import EventSpec

        self._events.record(
            EventSpec(
                "OverrideForced",
                "ApplyConfigChange",
                f"flannelpy applied a disruptive change ({change}) past the disruption policy: "
                f"{force.reason} (by {force.by} at {force.at})",
            )
        )

    def record_blocked(self, node: str, change: str, sentence: str) -> None:
        from flannelpy.store.kube.event_series import EventSpec

        self._events.record(EventSpec("ConfigChangeBlocked", "BlockConfigChange", sentence))


def _backend_of(raw: bytes) -> Mapping[str, Any] | None:
    """The Backend object of a net-conf.json, if it parses (for the status record)."""
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(doc, dict):
        return None
    backend = next((v for k, v in doc.items() if k.lower() == "backend"), None)
    return backend if isinstance(backend, dict) else None
