"""The netns lab: a cluster of network namespaces, etcd and agents on one host.

Used by ``flannelpy lab up|status|down`` and by the end-to-end tests, through
the same :class:`Lab` API. See design.md, "The netns lab".

Names are imported lazily: ``flannelpy`` builds its whole CLI parser at start,
and the agent should not pay for the etcd/gRPC import of the lab.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flannelpy.lab.errors import LabError
    from flannelpy.lab.lab import Lab, down, down_all, list_labs
    from flannelpy.lab.state import LabState, NodeInfo

__all__ = ["Lab", "LabError", "LabState", "NodeInfo", "down", "down_all", "list_labs"]

_HOMES = {
    "Lab": "flannelpy.lab.lab",
    "down": "flannelpy.lab.lab",
    "down_all": "flannelpy.lab.lab",
    "list_labs": "flannelpy.lab.lab",
    "LabError": "flannelpy.lab.errors",
    "LabState": "flannelpy.lab.state",
    "NodeInfo": "flannelpy.lab.state",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
