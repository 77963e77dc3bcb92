"""What every CNI command works on: the node's IPAM, its pod network, the records of
its attachments, the agent's settings, and a lock per attachment.

Requests for one (container ID, ifname) are serialised by a lock per key; different
pods run in parallel (the server gives each request a thread). IPAM and the bridge
lock themselves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from flannelpy.cni.records import RecordStore
from flannelpy.cni.workers import Workers
from flannelpy.dataplane.podnames import IPNetwork
from flannelpy.dataplane.podnet import PodNetwork
from flannelpy.ipam import NodeIpam

Key = tuple[str, str]  # (container_id, ifname): what IPAM and the runtime key on
# Work a command leaves for after its reply (DEL's release); whoever passed the list
# must run every item once the reply is sent, whatever happened to the reply.
Deferred = list[Callable[[], None]]


@dataclass(frozen=True)
class CniSettings:
    """What the agent tells the CNI handler; every field with its unit."""

    mtu_provider: Callable[[], int | None]  # the overlay MTU in bytes; None: not known yet
    ready: Callable[[], bool] = lambda: True  # lease held and data plane programmed
    bridge: str = "cni0"  # the CNI config key "bridge" overrides it
    hairpin: bool = True  # a pod reaches itself through a service IP (hairpin mode on its port)
    default_gateway: bool = True  # default of the config key isDefaultGateway
    # The cluster's networks (one per family), routed via the gateway of their family
    # when isDefaultGateway is false.
    cluster_networks: Callable[[], Sequence[IPNetwork]] = lambda: ()
    cooldown_seconds: float = 30.0  # default of the config key ipCooldownSeconds
    wait_seconds: float = 0.0  # default of the config key ipWaitSeconds


class KeyLocks:
    """One lock per key, created on demand and dropped when nobody holds or waits."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[Hashable, list[Any]] = {}  # key -> [lock, users]

    @contextmanager
    def hold(self, key: Hashable) -> Iterator[None]:
        release = self.acquire(key)
        try:
            yield
        finally:
            release()

    def acquire(self, key: Hashable) -> Callable[[], None]:
        """Take ``key``'s lock; returns what releases it, from any thread, once (a DEL
        hands its lock to the work it finishes after the reply)."""
        with self._guard:
            entry = self._locks.setdefault(key, [threading.Lock(), 0])
            entry[1] += 1
        entry[0].acquire()

        def release() -> None:
            entry[0].release()
            with self._guard:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._locks[key]

        return release

    def held(self, key: Hashable) -> bool:
        """Whether anyone holds or waits for ``key``'s lock."""
        with self._guard:
            return key in self._locks


class CommandContext:
    """The state the command classes share; :class:`flannelpy.cni.handler.CniHandler`
        combines them and sets it. ``settings`` is read on each request, never copied, so that
    replacing it takes effect at once."""

    ipam: NodeIpam
    pods: PodNetwork
    records: RecordStore
    settings: CniSettings
    locks: KeyLocks
    writers: Workers  # the threads that write ADD's record beside its plumbing
