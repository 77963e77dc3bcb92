"""Several leases per node: pools, which leases serve, IPAM in step, warm capacity.

A lease serves (gets new pod addresses) per its pools' tags (a dual-stack lease
only while both its pools let it); IPAM and the pod bridge always know the current
leases. Warm capacity adds a lease before the
node runs dry and releases a drained or surplus one once IPAM holds nothing
in it (IPAM first, so no ADD can land on a lease being released).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from ipaddress import IPv4Interface, IPv4Network, IPv6Interface, IPv6Network

from flannelpy.agent.events import EventCounts
from flannelpy.agent.leases import OwnLeases
from flannelpy.agent.state import Clocks, NodeState, SayOnce
from flannelpy.cni.pods import PodSide
from flannelpy.errors import ConfigError, PoolExhausted, StoreError
from flannelpy.ipam.capacity import IPNetwork, LeaseUsage, plan_capacity, update_empty_since
from flannelpy.observe.metrics import AgentMetrics
from flannelpy.subnet.choose import lease_pools
from flannelpy.subnet.lease import Lease
from flannelpy.subnet.manager import SubnetManager
from flannelpy.subnet.pools import capacity as pool_capacity
from flannelpy.subnet.pools import eligibility

log = logging.getLogger("flannelpy.agent.capacity")

CAPACITY_TICK = 5.0  # seconds: drained leases empty and hold-downs end without an event


class Capacity:
    def __init__(
        self,
        state: NodeState,
        leases: OwnLeases,
        manager: SubnetManager,
        pods: PodSide,
        metrics: AgentMetrics,
        counts: EventCounts,
        say_once: SayOnce,
        *,
        cluster: str | None,
        several_leases_per_node: bool,
        on_low_free: Callable[[int], None],
        clocks: Clocks,
    ) -> None:
        self.state = state
        self.leases = leases
        self.manager = manager
        self.pods = pods
        self.metrics = metrics
        self.counts = counts
        self.say_once = say_once
        self.cluster = cluster
        self.several_leases_per_node = several_leases_per_node
        self.on_low_free = on_low_free  # runs in a CNI request's thread: only enqueues
        self.clocks = clocks
        self._empty_since: dict[IPNetwork, float] = {}
        self._low_free_watched: int | None = None  # the MinFreeAddresses IPAM watches for
        self._ipam_view: tuple[tuple[IPv4Network | IPv6Network, ...], ...] = ()
        self._v6_view: tuple[IPv6Network | None, ...] = ()
        # What the pool metrics were last computed from: the config, the pools and the
        # lease list objects (a new snapshot is a new dict), so a tick without a change
        # does not walk every lease of the cluster again (9 ms at 1,000 peers).
        self._pool_inputs: tuple[object, list[object], object] | None = None

    def serves(self, lease: Lease) -> bool:
        """May new pods get addresses here? Per the tags of the lease's pools, one per
        family (field notes §3): a drain of either drains the lease; a lease in no
        known pool keeps serving (reconciliation fails open)."""
        s = self.state
        pools = lease_pools(s.config, s.pools, lease.subnet, lease.ipv6_subnet) or ()
        return all(eligibility(pool, self.cluster).allocate_addresses for pool in pools)

    def sync_ipam(self, again: bool = False) -> None:
        """Hand IPAM and the bridge the current leases and which of them serve
        (``again``: even if unchanged, e.g. for the bridge's new MTU)."""
        if again:
            self._ipam_view = ()
        own = self.state.own
        # Each lease by its IPv4 subnet (an IPv6-only one by its IPv6 subnet).
        subnets = [lease.primary_subnet for lease in own]
        serving = [lease.primary_subnet for lease in own if self.serves(lease)]
        view = (tuple(subnets), tuple(serving))
        if view == self._ipam_view and not self._v6_changed(own):
            return
        first_serving_before = self._ipam_view[1][:1] if self._ipam_view else ()
        # Dual stack: each lease's IPv6 subnet follows its IPv4 one (one allocator each).
        self.pods.use_leases(_with_v6(own, subnets), _with_v6(own, serving))
        self._ipam_view = view
        self._v6_view = tuple(lease.ipv6_subnet for lease in own)
        self.metrics.lease_counts(len(serving), len(subnets) - len(serving))
        self.metrics.lease_limit(self.state.capacity.max_leases_per_node)
        if self.state.subnet_env_written and tuple(serving[:1]) != first_serving_before:
            self.state.subnet_env_due = True

    def _v6_changed(self, own: list[Lease]) -> bool:
        return tuple(lease.ipv6_subnet for lease in own) != self._v6_view

    def watch_low_free(self) -> None:
        """Have IPAM call for capacity below the current MinFreeAddresses (once per value)."""
        threshold = self.state.capacity.min_free_addresses
        if threshold != self._low_free_watched:
            self.pods.ipam.set_low_free_watch(threshold, self.on_low_free)
            self._low_free_watched = threshold

    def manage(self) -> None:
        """Add a lease before the node runs dry, release what is drained or surplus."""
        self.counts.capacity_checked()
        self.state.capacity_due = False
        self.sync_ipam()
        self.watch_low_free()  # settings that changed live apply here
        if not self.several_leases_per_node:
            return  # the controller-manager owns pod CIDRs: one lease, its podCIDR
        usage = self._usage()
        now = self.clocks.wall()
        self._empty_since = update_empty_since(usage, self._empty_since, now)
        plan = plan_capacity(usage, self.state.capacity, now, self._empty_since)
        if plan.acquire:
            self._add_lease(plan.reason)
        for subnet in plan.release:
            self._release_lease(subnet, plan.reason)
        self._pool_metrics()

    def _usage(self) -> list[LeaseUsage]:
        """IPAM's usage per subnet, each marked with its lease (by its first subnet), so
        a dual-stack lease is planned as one."""
        owner = {net: lease.primary_subnet for lease in self.state.own for net in lease.subnets}
        return [replace(u, lease=owner.get(u.subnet)) for u in self.pods.ipam.usage()]

    def _add_lease(self, reason: str) -> None:
        attrs = self.leases.attrs()
        try:
            lease = self.manager.create_lease(attrs, self.state.pools, self.cluster)
        except (PoolExhausted, ConfigError) as e:
            self.say_once(f"capacity:{e}", "cannot add a lease: %s", e)
            return
        except StoreError as e:
            log.warning("adding a lease failed, retrying: %s", e)
            self.state.capacity_due = True
            return
        self.leases.add(lease)
        log.info(
            "lease added subnet=%s reason=%r ipv6_subnet=%s",
            lease.subnet,
            reason,
            lease.ipv6_subnet,
        )
        self.sync_ipam()
        self.state.replan_due = True  # routes and the firewall's ranges

    def _release_lease(self, key: IPNetwork, reason: str) -> None:
        lease = next((x for x in self.state.own if x.primary_subnet == key), None)
        if lease is None or not self.pods.ipam.remove_lease_if_empty(key):
            return  # a pod landed meanwhile: it stays
        # IPAM first (no ADD can land now), then the bridge, then peers learn it is gone.
        self._remove_gateway(key, lease)
        for other in lease.subnets:
            if other != key and self.pods.ipam.remove_lease_if_empty(other):
                self._remove_gateway(other, lease)
        try:
            self.manager.release_lease(lease)
        except StoreError as e:
            log.warning("releasing a lease failed; it expires by itself subnet=%s error=%s", key, e)
        for net in lease.subnets:
            self._empty_since.pop(net, None)
        self.leases.forget(lease)
        self.state.capacity_due = self.state.replan_due = True
        self.sync_ipam()
        log.info(
            "lease released subnet=%s reason=%r ipv6_subnet=%s", key, reason, lease.ipv6_subnet
        )

    def _remove_gateway(self, subnet: IPNetwork, lease: Lease) -> None:
        if isinstance(subnet, IPv4Network):
            self.pods.remove_gateway(IPv4Interface(f"{lease.gateway}/{subnet.prefixlen}"))
        else:
            self.pods.remove_gateway(IPv6Interface(f"{lease.gateway6}/{subnet.prefixlen}"))

    def _pool_metrics(self) -> None:
        s = self.state
        last = self._pool_inputs
        if last is not None and last[0] is s.config and last[2] is s.leases and last[1] == s.pools:
            return
        self._pool_inputs = (s.config, list(s.pools), s.leases)
        self.metrics.pool_utilisation(
            {
                c.pool.network: c.utilisation
                for c in pool_capacity(s.config, s.pools, list(s.leases.values()))
            }
        )


def _with_v6(
    own: list[Lease], subnets: list[IPv4Network | IPv6Network]
) -> list[IPv4Network | IPv6Network]:
    """``subnets`` (by lease, in order) each followed by its lease's IPv6 subnet, if any
    (an IPv6-only lease's is the subnet itself)."""
    v6_of: dict[IPv4Network | IPv6Network, IPv6Network | None] = {
        lease.subnet: lease.ipv6_subnet for lease in own if lease.subnet is not None
    }
    out: list[IPv4Network | IPv6Network] = []
    for net in subnets:
        out.append(net)
        v6 = v6_of.get(net)
        if v6 is not None:
            out.append(v6)
    return out
