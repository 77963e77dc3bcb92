"""IPAM's own error: it carries the allocator's numbers, so it lives beside them
(``flannelpy.errors`` is a leaf and imports nothing of flannelpy)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from flannelpy.errors import FlannelpyError

if TYPE_CHECKING:
    from flannelpy.ipam.allocator import Accounting


class IpamExhausted(FlannelpyError):
    """No allocatable lease of this node has an address outside cooldown.

    ``accounting`` holds the per-lease numbers the message was built from, so
    callers (CNI error details, metrics) never re-derive them.
    """

    exit_code = 6

    def __init__(self, message: str, accounting: Sequence[Accounting] = ()) -> None:
        super().__init__(message)
        self.accounting: list[Accounting] = list(accounting)
