"""One error hierarchy for the agent.

Every error carries one sentence that names what is wrong and what to fix; the
CLI prints ``str(error)`` and exits with ``exit_code``. Adapters chain the
library error underneath (``raise ... from e``) so logs keep the cause.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from flannelpy.ipam.allocator import Accounting


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


class PoolExhausted(StoreError):
    """Every subnet of the network is leased."""

    exit_code = 4


class DataplaneError(FlannelpyError):
    """Programming the kernel failed."""

    exit_code = 5


class InterfaceNotFound(DataplaneError):
    """No interface matches what --iface / --iface-regex / --public-ip ask for."""


class IpamExhausted(FlannelpyError):
    """No allocatable lease of this node has an address outside cooldown.

    ``accounting`` holds the per-lease numbers the message was built from, so
    callers (CNI error details, metrics) never re-derive them.
    """

    exit_code = 6

    def __init__(self, message: str, accounting: Sequence[Accounting] = ()) -> None:
        super().__init__(message)
        self.accounting: list[Accounting] = list(accounting)
