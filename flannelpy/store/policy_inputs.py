"""What NetworkPolicy enforcement reads from the cluster: policies, pods and namespaces.

The watches (Kubernetes mode: :mod:`flannelpy.store.kube.policy_watch`) parse every
object as it arrives into the compiler's frozen values (:mod:`flannelpy.netpol.model`)
and keep only those, in a :class:`PolicyCache`: memory holds one small value per
object, never the API's JSON. An object the compiler cannot represent is refused: its
reason is logged once per object and reason and counted, nothing of it is enforced,
and an edit the agent cannot represent keeps the last version it accepted (so an
edit never turns into a wider rule than the one enforced before it). The agent takes
whole :class:`PolicySnapshot` values; ``synced`` says every kind has been listed whole
since the start, before which the agent keeps the kernel's table as it is.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from flannelpy.netpol.model import (
    Namespace,
    Pod,
    Policy,
    PolicyRefused,
    parse_namespace,
    parse_pod,
    parse_policy,
)

log = logging.getLogger("flannelpy.store.policy")

POLICIES = "networkpolicy"
PODS = "pod"
NAMESPACES = "namespace"
KINDS = (POLICIES, PODS, NAMESPACES)
MAX_SAID = 10_000  # refusals remembered as said; beyond, the memory starts over

Value = Policy | Pod | Namespace
_PARSERS: dict[str, Callable[[Any], Value]] = {
    POLICIES: parse_policy,
    PODS: parse_pod,
    NAMESPACES: parse_namespace,
}


@dataclass(frozen=True)
class PolicySnapshot:
    """Every accepted object now, and whether each kind has been listed whole yet."""

    policies: tuple[Policy, ...] = ()
    pods: tuple[Pod, ...] = ()
    namespaces: tuple[Namespace, ...] = ()
    synced: bool = False
    refused: tuple[str, ...] = ()  # one sentence per object refused now


class PolicySource(Protocol):
    """Where the agent gets its policy inputs (the store's; fakes in tests)."""

    def snapshot(self) -> PolicySnapshot: ...

    def watch(self, on_change: Callable[[], None], stop: threading.Event) -> None:
        """Block until ``stop``: keep the inputs current, calling ``on_change()`` (on the
        watch's thread) after each change; raises only on a bug."""
        ...


def object_key(kind: str, obj: Any) -> str | None:
    """``namespace/name`` (a Namespace: its name) of a raw object, None when unreadable."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
        return None
    if kind == NAMESPACES:
        return str(meta["name"])
    return f"{meta.get('namespace')}/{meta['name']}"


class PolicyCache:
    """The parsed objects of every kind, fed by watch threads, read whole by the agent.
    ``on_refused(kind)`` counts a refusal (once per object and reason)."""

    def __init__(self, on_refused: Callable[[str], None] | None = None) -> None:
        self._lock = threading.Lock()
        self._objects: dict[str, dict[str, Value]] = {k: {} for k in KINDS}
        self._refused: dict[str, dict[str, str]] = {k: {} for k in KINDS}
        self._listed: set[str] = set()
        self._said: set[tuple[str, str]] = set()
        self._on_refused = on_refused

    def replace_all(self, kind: str, objects: Iterable[Any]) -> None:
        """A whole list of ``kind``: what it lacks is gone; refused ones keep their last
        accepted version, if this cache had one."""
        old = self._objects[kind]
        fresh: dict[str, Value] = {}
        refused: dict[str, str] = {}
        for obj in objects:
            key, value, reason = self._parse(kind, obj)
            if key is None:
                continue
            if reason is not None:
                refused[key] = reason
                if key in old:
                    fresh[key] = old[key]
            elif value is not None:
                fresh[key] = value
        with self._lock:
            self._objects[kind] = fresh
            self._refused[kind] = refused
            self._listed.add(kind)

    def put(self, kind: str, obj: Any) -> bool:
        """An added or modified object; whether what is enforced, or what the agent
        reports refused, may change (a new snapshot is then due)."""
        key, value, reason = self._parse(kind, obj)
        if key is None:
            return False
        with self._lock:
            if reason is not None:  # the last accepted version stays
                said_before = self._refused[kind].get(key)
                self._refused[kind][key] = reason
                return said_before != reason
            was_refused = self._refused[kind].pop(key, None) is not None
            before = self._objects[kind].get(key)
            if value is None:  # a pod that holds no address any more
                self._objects[kind].pop(key, None)
            else:
                self._objects[kind][key] = value
            return before != value or was_refused

    def delete(self, kind: str, obj: Any) -> bool:
        key = object_key(kind, obj)
        if key is None:
            return False
        with self._lock:
            was_refused = self._refused[kind].pop(key, None) is not None
            return self._objects[kind].pop(key, None) is not None or was_refused

    def snapshot(self) -> PolicySnapshot:
        with self._lock:
            objects = {kind: tuple(self._objects[kind].values()) for kind in KINDS}
            refused = tuple(r for kind in KINDS for r in self._refused[kind].values())
            synced = self._listed.issuperset(KINDS)
        return PolicySnapshot(
            policies=objects[POLICIES],  # type: ignore[arg-type]
            pods=objects[PODS],  # type: ignore[arg-type]
            namespaces=objects[NAMESPACES],  # type: ignore[arg-type]
            synced=synced,
            refused=tuple(sorted(refused)),
        )

    def counts(self) -> Mapping[str, int]:
        with self._lock:
            return {kind: len(self._objects[kind]) for kind in KINDS}

    def _parse(self, kind: str, obj: Any) -> tuple[str | None, Value | None, str | None]:
        """(key, value, refusal): value None for a pod that stands for no address."""
        key = object_key(kind, obj)
        try:
            value = _PARSERS[kind](obj)
        except PolicyRefused as e:
            self._refuse(kind, key, str(e))
            return key, None, str(e)
        if isinstance(value, Pod) and (not value.ips or value.host_network):
            return value.key, None, None  # neither selected nor a peer: not kept
        key = value.key if isinstance(value, Policy | Pod) else value.name
        return key, value, None

    def _refuse(self, kind: str, key: str | None, reason: str) -> None:
        said = (kind, reason)
        with self._lock:
            if said in self._said:
                return
            if len(self._said) >= MAX_SAID:
                self._said.clear()
            self._said.add(said)
        log.warning("policy input refused; its last accepted version, if any, stays: %s", reason)
        if self._on_refused is not None:
            self._on_refused(kind)
