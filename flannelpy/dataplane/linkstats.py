"""Link statistics by interface role: one netlink dump of every link, summed per role.

Labels stay low-cardinality: metrics report interface *roles*, not interfaces
(every pod veth is summed into ``role="pods"``). Summed counters stay
monotonic: when a link disappears (a pod deleted) its last counts are kept in
the role's total, so Prometheus never sees the sum fall and mistake it for a
counter reset. What a link counted between the last scrape and its deletion is
lost; that is the price of never storing per-pod series.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from flannelpy.dataplane import nlbatch, rtnl
from flannelpy.dataplane.rtnl import LinkStats, LinkStatsRow

# Interface roles (label ``role``) and what each one is.
ROLE_VXLAN = "vxlan"  # the backend's vxlan devices (flannel.<VNI>)
ROLE_BRIDGE = "bridge"  # the CNI bridge (cni0) itself
ROLE_UNDERLAY = "underlay"  # the interface that carries overlay traffic between nodes
ROLE_PODS = "pods"  # every veth port of the CNI bridge, summed
ROLES = (ROLE_VXLAN, ROLE_BRIDGE, ROLE_UNDERLAY, ROLE_PODS)


@dataclass(frozen=True)
class RoleStats:
    """One interface role at one instant: how many links, how many up, summed counters."""

    role: str
    interfaces: int
    up: int
    counters: LinkStats


def _add(a: LinkStats, b: LinkStats) -> LinkStats:
    return LinkStats(*(x + y for x, y in zip(a, b, strict=True)))


def _is_up(flags: int) -> bool:
    want = rtnl.IFF_UP | rtnl.IFF_LOWER_UP
    return flags & want == want


def classify_links(
    rows: Iterable[LinkStatsRow],
    underlay: str | None,
    bridge: str = "cni0",
    vxlan_prefix: str = "flannel",
) -> dict[str, list[LinkStatsRow]]:
    """Group links by role: vxlan devices named ``<vxlan_prefix>*`` (flannel.1,
    flannel-v6.1), the bridge, the underlay, and the bridge's veth ports."""
    rows = list(rows)
    roles: dict[str, list[LinkStatsRow]] = {role: [] for role in ROLES}
    bridge_index = next((r.ifindex for r in rows if r.name == bridge), 0)
    for row in rows:
        if row.name == bridge:
            roles[ROLE_BRIDGE].append(row)
        elif underlay is not None and row.name == underlay:
            roles[ROLE_UNDERLAY].append(row)
        elif row.kind == "vxlan" and row.name.startswith(vxlan_prefix):
            roles[ROLE_VXLAN].append(row)
        elif bridge_index and row.master == bridge_index and row.kind == "veth":
            roles[ROLE_PODS].append(row)
    return roles


class RoleTotals:
    """Monotonic per-role sums of link counters across links coming and going.

    Keyed by ifindex: a link that vanished, or whose counters went down (its
    index reused by a new link), leaves its last counts in a retired total.
    """

    def __init__(self) -> None:
        self._seen: dict[str, dict[int, LinkStats]] = {role: {} for role in ROLES}
        self._retired: dict[str, LinkStats] = {role: LinkStats() for role in ROLES}

    def update(self, by_role: Mapping[str, Sequence[LinkStatsRow]]) -> list[RoleStats]:
        return [self._update_role(role, by_role.get(role, ())) for role in ROLES]

    def _update_role(self, role: str, rows: Sequence[LinkStatsRow]) -> RoleStats:
        seen = self._seen[role]
        retired = self._retired[role]
        current: dict[int, LinkStats] = {}
        total = LinkStats()
        for row in rows:
            before = seen.pop(row.ifindex, None)
            if before is not None and any(n < o for n, o in zip(row.stats, before, strict=True)):
                retired = _add(retired, before)
            current[row.ifindex] = row.stats
            total = _add(total, row.stats)
        for gone in seen.values():
            retired = _add(retired, gone)
        self._seen[role] = current
        self._retired[role] = retired
        up = sum(1 for row in rows if _is_up(row.flags))
        return RoleStats(role, len(rows), up, _add(retired, total))


class NetlinkLinkStats:
    """The real link provider: one netlink dump of every link per scrape.

    The socket is opened here, so it reads the network namespace of the thread
    that constructs the provider (the agent's), whichever thread scrapes later.
    ``underlay`` may be set later, when the agent has chosen its interface.
    """

    def __init__(
        self, underlay: str | None = None, bridge: str = "cni0", vxlan_prefix: str = "flannel"
    ) -> None:
        self.underlay = underlay
        self.bridge = bridge
        self.vxlan_prefix = vxlan_prefix
        self._sock = nlbatch.NetlinkSocket(rcvbuf=1024 * 1024)
        self._lock = threading.Lock()  # one socket, possibly concurrent scrapes
        self._totals = RoleTotals()

    def __call__(self) -> list[RoleStats]:
        with self._lock:
            rows = nlbatch.dump_link_stats(self._sock)
            roles = classify_links(rows, self.underlay, self.bridge, self.vxlan_prefix)
            return self._totals.update(roles)

    def close(self) -> None:
        self._sock.close()
