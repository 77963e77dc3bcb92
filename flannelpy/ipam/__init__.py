"""Node IPAM: pod addresses from the node's leases, with cooldown and honest accounting.

``allocator`` is the pure per-lease logic, ``store`` the state directory on disk,
``manager.NodeIpam`` the thread-safe composition the agent's CNI server uses.
"""

from flannelpy.ipam.allocator import Accounting, Allocation, PoolAllocator, exhaustion_message
from flannelpy.ipam.manager import NodeIpam
from flannelpy.ipam.store import IpamStore

__all__ = [
    "Accounting",
    "Allocation",
    "IpamStore",
    "NodeIpam",
    "PoolAllocator",
    "exhaustion_message",
]
