"""One error hierarchy for the agent.

Every error carries one sentence that names what is wrong and what to fix; the
CLI prints ``str(error)`` and exits with ``exit_code``. Adapters chain the
library error underneath (``raise ... from e``) so logs keep the cause.
This module is a leaf: it imports nothing of flannelpy, so every layer may use it
(an error that carries a layer's own types, e.g. ``ipam.errors.IpamExhausted``,
lives in that layer).
"""

from __future__ import annotations


class FlannelpyError(Exception):
    """Base class: a user-facing sentence plus a process exit code."""

    exit_code = 1


class ConfigError(FlannelpyError):
    """The network config or a flag is invalid. Raised before the host is touched."""

    exit_code = 2


class StoreError(FlannelpyError):
    """The lease store (etcd or the Kubernetes API) failed."""

    exit_code = 3


class StoreUnavailable(StoreError):
    """No endpoint of the store answered."""


class KeyExists(StoreError):
    """A create-if-absent write lost a race: the key exists already."""


class RevisionCompacted(StoreError):
    """A watch asked for a revision the store has compacted away; re-list."""

    def __init__(self, message: str, compacted_revision: int) -> None:
        super().__init__(message)
        self.compacted_revision = compacted_revision


class MalformedWatchEvent(StoreError):
    """A watch delivered an event that is no put or delete of a key under the watched
    prefix: never applied (it must not remove anything); the watcher re-lists."""


class PoolExhausted(StoreError):
    """Every subnet of the network is leased."""

    exit_code = 4


class DataplaneError(FlannelpyError):
    """Programming the kernel failed."""

    exit_code = 5


class InterfaceNotFound(DataplaneError):
    """No interface matches what --iface / --iface-regex / --public-ip ask for."""
