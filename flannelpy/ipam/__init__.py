"""Node IPAM: pod addresses from the node's leases, with cooldown and honest accounting.

``allocator`` is the pure per-lease logic, ``store`` the state directory on disk,
``manager.NodeIpam`` the thread-safe composition the agent's CNI server uses,
``capacity`` the pure warm-capacity decisions (when to take or give back a lease).
"""

from flannelpy.ipam.allocator import Accounting, Allocation, PoolAllocator, exhaustion_message
from flannelpy.ipam.capacity import CapacityPlan, CapacitySettings, LeaseUsage, plan_capacity
from flannelpy.ipam.manager import NodeIpam
from flannelpy.ipam.store import IpamStore

__all__ = [
    "Accounting",
    "Allocation",
    "CapacityPlan",
    "CapacitySettings",
    "IpamStore",
    "LeaseUsage",
    "NodeIpam",
    "PoolAllocator",
    "exhaustion_message",
    "plan_capacity",
]
