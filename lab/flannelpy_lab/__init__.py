"""The netns lab: a cluster of network namespaces, etcd and agents on one host.

Used by ``flannelpy-lab up|status|pod|down|run|env`` and by the end-to-end tests,
through the same :class:`Lab` API. It is not part of the product: flannelpy never
imports it, and the image does not ship it.

Names are imported lazily: ``flannelpy-lab --help`` and the parser should not pay
for the etcd/gRPC import of the lab.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flannelpy_lab.errors import LabError
    from flannelpy_lab.lab import Lab, down, down_all, list_labs
    from flannelpy_lab.state import LabState, NodeInfo

__all__ = ["Lab", "LabError", "LabState", "NodeInfo", "down", "down_all", "list_labs"]

_HOMES = {
    "Lab": "flannelpy_lab.lab",
    "down": "flannelpy_lab.lab",
    "down_all": "flannelpy_lab.lab",
    "list_labs": "flannelpy_lab.lab",
    "LabError": "flannelpy_lab.errors",
    "LabState": "flannelpy_lab.state",
    "NodeInfo": "flannelpy_lab.state",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
