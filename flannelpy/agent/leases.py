"""Our own leases: acquire, adopt, recover what was lost, renew, rewrite attributes.

A node holds an ordered set of leases, oldest first: the one acquired at start
(Flannel's order), then those added for warm capacity or a new pool. Only the
writer calls these methods; they change ``NodeState.own`` and report what the
writer must follow up (a new plan, firewall rules, subnet.env).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from ipaddress import IPv4Network, IPv6Network

from flannelpy.agent.state import Clocks, NodeState
from flannelpy.agent.vtep import VtepMac
from flannelpy.backend.base import is_own_address
from flannelpy.backend.wireguard import keeping_context, with_kept_key
from flannelpy.errors import StoreError
from flannelpy.observe.metrics import AgentMetrics
from flannelpy.subnet.choose import same_public_address
from flannelpy.subnet.lease import Lease, LeaseAttrs
from flannelpy.subnet.manager import SubnetManager
from flannelpy.subnet.pools import Pool
from flannelpy.subnet.validate import Bounds, check_own

log = logging.getLogger("flannelpy.agent.leases")

RENEW_RETRY_SECONDS = 60.0  # Flannel's retry interval for a failed renewal


@dataclass(frozen=True)
class Recovery:
    """What recovering lost leases changed."""

    first_moved_from: IPv4Network | None = None  # the first lease came back elsewhere
    forgotten: tuple[Lease, ...] = ()  # leases another node took
    changed: bool = False  # anything in the own set changed


@dataclass
class OwnLeases:
    state: NodeState
    manager: SubnetManager
    vtep: VtepMac
    metrics: AgentMetrics
    cluster: str | None
    renew_margin_seconds: float
    clocks: Clocks = field(default_factory=Clocks)
    _retry_at: dict[str, float] = field(default_factory=dict)
    # The attrs a rewrite is still trying to advertise. A rewrite whose reply was lost
    # may have reached the store; until one is confirmed, renewals carry these, or a
    # renewal of the old version would write the old backend back.
    _pending_attrs: LeaseAttrs | None = None

    def attrs(self) -> LeaseAttrs:
        """What our leases advertise now (backend, VTEP)."""
        s = self.state
        peers = s.peers()
        mac = self.vtep.if_needed(s.backend, s.ctx, peers)
        s.vtep_advertised = mac is not None
        ctx = keeping_context(s.ctx, s.backend.type_name, peers, s.wireguard_device_up)
        s.keeps_wireguard = ctx.keeps_wireguard
        return with_kept_key(ctx, s.backend.lease_attrs(ctx, mac))

    def pools_for_leasing(self) -> list[Pool] | None:
        """The pools to lease from; None (the config's networks alone, Flannel's way)
        while no pool beyond the primary ones exists and they are untagged."""
        pools = self.state.pools
        if all(pool.primary and not pool.tags for pool in pools):
            return None
        return pools

    def acquire(
        self, previous: IPv4Network | None, previous_v6: IPv6Network | None = None
    ) -> Lease:
        attrs = self.attrs()
        lease = self.manager.acquire_lease(
            attrs,
            previous,
            self.pools_for_leasing(),
            self.cluster,
            previous_ipv6_subnet=previous_v6,
        )
        self.metrics.lease(lease.primary_subnet, lease.expiration)
        log.info(
            "lease acquired subnet=%s ipv6_subnet=%s public_ip=%s public_ipv6=%s backend=%s",
            lease.subnet,
            lease.ipv6_subnet,
            attrs.public_ip,
            attrs.public_ipv6,
            attrs.backend_type,
        )
        return lease

    def take_snapshot(self, leases: Mapping[str, Lease]) -> bool:
        """Store the lease list (a dict is taken as it is: the writer's events own theirs);
        True if a lease of ours is missing or taken over."""
        self.state.leases = leases if isinstance(leases, dict) else dict(leases)
        lost = False
        for lease in self.state.own:
            current = leases.get(lease.key)
            if current is None or not same_public_address(current.attrs, lease.attrs):
                lost = True
        return lost

    def is_ours(self, lease: Lease) -> bool:
        """A lease advertising our address under our name (or no name): ours from an
        earlier run, e.g. a second lease the node held before a restart."""
        ctx = self.state.ctx
        return is_own_address(ctx, lease) and lease.attrs.node_name in (
            None,
            ctx.node_name,
        )

    def adopt(self, bounds: Bounds) -> list[Lease]:
        """After the first snapshot: take back every other lease that is ours. Its pods
        keep their addresses (IPAM state is on disk); an empty one is released later.
        A lease carrying our address is still input: one outside the networks, on the
        node's own subnets, or with a malformed VTEP is never adopted."""
        s = self.state
        own_keys = {lease.key for lease in s.own}
        found = []
        for key, lease in s.leases.items():
            if key in own_keys or not self.is_ours(lease):
                continue
            why = check_own(lease, bounds)
            if why is not None:
                log.warning(
                    "not adopting a lease with this node's address key=%s reason=%s: %s",
                    key,
                    why.reason,
                    why.detail,
                )
                continue
            found.append(lease)
        found.sort(key=lambda x: x.order)
        s.own.extend(found)
        for lease in found:
            self.metrics.lease(lease.primary_subnet, lease.expiration)
            log.info("kept a lease this node already held subnet=%s", lease.subnet)
        return found

    def recover_lost(self) -> Recovery:
        """Our lease keys vanished (deleted by hand, expired while the store was away)
        or were taken over: re-create what is still free, else let go. Raises
        StoreError when the first lease cannot be re-acquired (the writer retries)."""
        current = dict(self.state.leases)
        moved_from: IPv4Network | None = None
        forgotten: list[Lease] = []
        changed = False
        for index, lease in enumerate(list(self.state.own)):
            now = current.get(lease.key)
            if now is not None and now.attrs.public_ip == lease.attrs.public_ip:
                continue
            changed = True
            if index == 0:
                log.warning(
                    "own lease disappeared from the store; re-acquiring subnet=%s", lease.subnet
                )
                new = self.acquire(lease.subnet)
                self.state.own = [new, *(x for x in self.state.own[1:] if x.key != new.key)]
                if new.subnet != lease.subnet:
                    log.warning("lease changed old=%s new=%s", lease.subnet, new.subnet)
                    self.metrics.drop_lease(lease.primary_subnet)
                    moved_from = lease.subnet
                continue
            log.warning("own lease disappeared from the store; re-creating subnet=%s", lease.subnet)
            try:
                renewed = self.manager.renew_lease(lease)
            except StoreError as e:
                log.error(
                    "lease lost to another node; pods on it lose connectivity subnet=%s error=%s",
                    lease.subnet,
                    e,
                )
                self.forget(lease)
                forgotten.append(lease)
                continue
            self.replace(renewed)
        return Recovery(moved_from, tuple(forgotten), changed)

    def add(self, lease: Lease) -> None:
        self.state.own.append(lease)
        self.metrics.lease(lease.primary_subnet, lease.expiration)

    def replace(self, renewed: Lease) -> None:
        self.state.own = [renewed if x.key == renewed.key else x for x in self.state.own]
        self.metrics.lease(renewed.primary_subnet, renewed.expiration)

    def forget(self, lease: Lease) -> None:
        self.state.own = [x for x in self.state.own if x.key != lease.key]
        self.metrics.drop_lease(lease.primary_subnet)

    def renew_due(self) -> None:
        """Renew every lease whose renewal is due, always the current version (the
        writer may have rewritten its attrs), retrying a failed one a minute later."""
        now = self.clocks.wall()
        for lease in list(self.state.own):
            if now < self._due(lease, now):
                continue
            if self._pending_attrs is not None:
                lease = replace(lease, attrs=self._pending_attrs)
            try:
                renewed = self.manager.renew_lease(lease)
            except StoreError as e:
                self.metrics.renewal("failure")
                self._retry_at[lease.key] = now + RENEW_RETRY_SECONDS
                log.warning(
                    "lease renewal failed, retrying in %ss subnet=%s: %s",
                    RENEW_RETRY_SECONDS,
                    lease.subnet,
                    e,
                )
                continue
            self._retry_at.pop(lease.key, None)
            self.metrics.renewal("success")
            if any(x.key == renewed.key for x in self.state.own):
                self.replace(renewed)
            log.info("lease renewed subnet=%s expires=%s", renewed.subnet, renewed.expiration)

    def _due(self, lease: Lease, now: float) -> float:
        margin = self.renew_margin_seconds
        expiration = lease.expiration or (now + RENEW_RETRY_SECONDS + margin)
        return max(expiration - margin, self._retry_at.get(lease.key, 0.0))

    def rewrite_attrs(self) -> bool:
        """Advertise what we now are (backend, VTEP) on every lease; peers follow it.
        False when the store refused (the writer retries)."""
        attrs = self.attrs()
        self._pending_attrs = attrs
        for lease in list(self.state.own):
            if lease.attrs == attrs:
                continue
            try:
                renewed = self.manager.renew_lease(replace(lease, attrs=attrs))
            except StoreError as e:
                log.warning("could not update our lease, retrying: %s", e)
                return False
            self.replace(renewed)
            log.info(
                "lease updated subnet=%s backend=%s vtep=%s",
                renewed.subnet,
                attrs.backend_type,
                attrs.vtep_mac is not None,
            )
        self._pending_attrs = None
        return True
