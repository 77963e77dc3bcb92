"""Which subnet a node should lease: Flannel's acquire order, as pure functions.

Given the network config, every lease in the store and what we advertise,
:func:`choose_lease` decides, in this order:

1. a lease whose PublicIP is ours: reuse it if it still fits the config,
   otherwise mark it for deletion (Flannel);
1b. a lease whose NodeName is ours (flannelpy extension): the same node came
   back with a new address; take it over and rewrite it with the new PublicIP,
   so peers stop routing to the old address at once instead of after 24 h.
   Only when ``holder_gone`` proves the old holder has stopped renewing it:
   names default to the host name, and two live nodes with one name would
   otherwise take one lease from each other forever. A live holder is reported
   as ``name_conflict`` and the steps below go on;
2. the previous subnet from subnet.env, if it fits and nobody holds it;
3. a random pick among the first 100 free subnets from SubnetMin (random, so
   nodes starting together rarely race for the same key).

With IPv6 enabled, the IPv6 subnet is chosen on its own, as Flannel does: the
previous one (FLANNEL_IPV6_SUBNET) if it fits and is free, else a random pick
among the first 100 free IPv6 subnets from IPv6SubnetMin. It is not paired with
the IPv4 subnet by index, so leases written by flanneld (which picks both at
random) never make a paired walk collide.

With address pools (field-notes §3, :mod:`flannelpy.subnet.pools`) passed as
``pools=``, steps 1 and 1b accept a lease in any pool, whatever its tags (fail
open: a drained or untagged pool keeps serving what it has); steps 2 and 3 are
:func:`choose_new_subnet`, once per family the config runs: the previous subnet
if its pool may receive new leases, else the family's primary pool first, then
its other pools in CIDR order, each walked as Flannel walks Network. A
dual-stack lease takes its IPv4 subnet from an IPv4 pool and its IPv6 subnet
from an IPv6 pool, each chosen on its own as Flannel chooses them.

The etcd manager does the I/O; this module only decides.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

from flannelpy.config.netconf import NetworkConfig
from flannelpy.errors import PoolExhausted
from flannelpy.subnet.lease import Lease, LeaseAttrs
from flannelpy.subnet.pools import (
    ROLE_EXCLUDED,
    ROLE_KEY,
    ROLE_OPT_IN,
    Pool,
    PoolNetwork,
    eligibility,
    leasable_range,
    network_order,
    primary_pools,
)

FREE_CANDIDATES = 100  # Flannel collects this many free subnets, then picks one at random


@dataclass(frozen=True)
class LeaseChoice:
    """The decision. ``existing`` set: rewrite that lease (same key); else create ``subnet``."""

    subnet: IPv4Network | None  # None IPv6-only
    ipv6_subnet: IPv6Network | None
    reason: str  # "public-ip" | "node-name" | "previous" | "free"
    existing: Lease | None = None
    delete: tuple[Lease, ...] = ()  # our own leases that no longer fit the config
    pool: Pool | None = None  # the pool ``subnet`` lies in (only when pools were given)
    # A lease under our NodeName whose holder still renews it: another live node.
    name_conflict: Lease | None = None


@dataclass(frozen=True)
class PoolChoice:
    """Where a new lease goes: ``subnet`` in ``pool``, ``ipv6_subnet`` in ``ipv6_pool``
    (IPv6-only: ``subnet`` None and ``pool`` the IPv6 one, as in ``ipv6_pool``)."""

    subnet: IPv4Network | None
    ipv6_subnet: IPv6Network | None
    pool: Pool
    ipv6_pool: Pool | None = None


def lease_fits(
    config: NetworkConfig, subnet: IPv4Network | None, ipv6_subnet: IPv6Network | None = None
) -> bool:
    """True if a lease on ``subnet`` (and ``ipv6_subnet``) is one this config could hand out."""
    if not config.enable_ipv4 or config.network is None:
        # IPv6-only: an IPv6 subnet alone (a dual-stack lease no longer fits).
        return (
            subnet is None
            and ipv6_subnet is not None
            and config.enable_ipv6
            and config.ipv6_network is not None
            and _v6_fits(config, ipv6_subnet)
        )
    if subnet is None:
        return False
    if not _in_range(
        subnet, config.network, config.subnet_len, config.subnet_min, config.subnet_max
    ):
        return False
    if not config.enable_ipv6:
        # Flannel drops a dual-stack lease once IPv6 is switched off.
        return ipv6_subnet is None
    if ipv6_subnet is None or config.ipv6_network is None:
        return False
    assert config.ipv6_subnet_len is not None
    assert config.ipv6_subnet_min is not None and config.ipv6_subnet_max is not None
    return _in_range(
        ipv6_subnet,
        config.ipv6_network,
        config.ipv6_subnet_len,
        config.ipv6_subnet_min,
        config.ipv6_subnet_max,
    )


def _in_range(
    subnet: IPv4Network | IPv6Network,
    network: IPv4Network | IPv6Network,
    subnet_len: int,
    low: IPv4Address | IPv6Address,
    high: IPv4Address | IPv6Address,
) -> bool:
    # An ip_network is aligned to its own prefix by construction, so checking the
    # prefix length and the bounds is enough.
    return (
        subnet.version == network.version
        and subnet.prefixlen == subnet_len
        and subnet.subnet_of(network)  # type: ignore[arg-type]
        and low <= subnet.network_address <= high  # type: ignore[operator]
    )


def lease_fits_pools(
    config: NetworkConfig,
    pools: Sequence[Pool],
    subnet: IPv4Network | None,
    ipv6_subnet: IPv6Network | None = None,
) -> Pool | None:
    """The pool a lease on ``subnet`` belongs to (IPv6-only: its IPv6 subnet's), or None
    if the pools could not have leased it (see :func:`lease_pools`)."""
    found = lease_pools(config, pools, subnet, ipv6_subnet)
    return found[0] if found else None


def lease_pools(
    config: NetworkConfig,
    pools: Sequence[Pool],
    subnet: IPv4Network | None,
    ipv6_subnet: IPv6Network | None = None,
) -> tuple[Pool, ...] | None:
    """The pool of each subnet of a lease (IPv4's first), or None if the lease does not
    hold one subnet per family the config runs, each leasable from a pool of its family.

    Tags do not matter here: a lease in a drained or untagged pool still fits (it keeps
    serving until its pods end).
    """
    found = []
    for version, net in ((4, subnet), (6, ipv6_subnet)):
        order = _creation_order(config, pools, version)
        if not order:
            if net is not None:
                return None  # a family the config does not run (Flannel drops such leases)
            continue
        pool = None if net is None else next((p for p in order if _leasable(p, config, net)), None)
        if pool is None:
            return None
        found.append(pool)
    return tuple(found) or None


def _leasable(pool: Pool, config: NetworkConfig, net: PoolNetwork) -> bool:
    """Is ``net`` one of the subnets ``pool`` leases?"""
    if net.version != pool.network.version or not net.subnet_of(pool.network):  # type: ignore[arg-type]
        return False
    span = leasable_range(pool, config)
    offset = int(net.network_address) - int(span.first)
    return net.prefixlen == span.length and offset >= 0 and offset // span.step < span.count


def choose_lease(
    config: NetworkConfig,
    leases: Sequence[Lease],
    attrs: LeaseAttrs,
    previous_subnet: IPv4Network | None,
    rng: random.Random,
    *,
    pools: Sequence[Pool] | None = None,
    cluster: str | None = None,
    holder_gone: Callable[[Lease], bool] = lambda _: False,
    previous_ipv6_subnet: IPv6Network | None = None,
) -> LeaseChoice:
    """Apply the acquire order above. Raises PoolExhausted when no subnet is free.

    ``pools`` None: the config's Network alone, exactly as Flannel. Otherwise the
    store's pools (see the module docstring) as seen by ``cluster`` (None: an agent
    without a cluster name).
    """
    if pools is not None:
        return _choose_lease_in_pools(
            config,
            pools,
            cluster,
            leases,
            attrs,
            previous_subnet,
            rng,
            holder_gone,
            previous_ipv6_subnet,
        )
    reused, delete, conflict = _reuse_own(
        leases,
        attrs,
        lambda lease: (lease_fits(config, lease.subnet, lease.ipv6_subnet), None),
        holder_gone,
    )
    if reused is not None:
        return reused
    fresh = _choose_fresh(config, leases, delete, previous_subnet, rng, previous_ipv6_subnet)
    return replace(fresh, name_conflict=conflict)


def _choose_fresh(
    config: NetworkConfig,
    leases: Sequence[Lease],
    delete: list[Lease],
    previous_subnet: IPv4Network | None,
    rng: random.Random,
    previous_ipv6_subnet: IPv6Network | None = None,
) -> LeaseChoice:
    """Steps 2 and 3 over the config's Network: the previous subnet, else a free one;
    the IPv6 subnet likewise, on its own."""
    held = _Held([lease for lease in leases if all(lease is not d for d in delete)])
    v6 = choose_ipv6_subnet(config, held, previous_ipv6_subnet, rng)
    if not config.enable_ipv4 or config.network is None:
        assert v6 is not None  # netconf: IPv6-only enables IPv6
        reason = "previous" if v6 == previous_ipv6_subnet else "free"
        return LeaseChoice(None, v6, reason, delete=tuple(delete))
    if (
        previous_subnet is not None
        and lease_fits(config, previous_subnet, v6)
        and held.is_free(previous_subnet, None)
    ):
        return LeaseChoice(previous_subnet, v6, "previous", delete=tuple(delete))

    free = []
    for v4 in candidate_subnets(config):
        if held.is_free(v4, None):
            free.append(v4)
            if len(free) >= FREE_CANDIDATES:
                break
    if not free:
        raise PoolExhausted(_exhausted_message(config))
    return LeaseChoice(rng.choice(free), v6, "free", delete=tuple(delete))


def choose_ipv6_subnet(
    config: NetworkConfig,
    held: _Held,
    previous: IPv6Network | None,
    rng: random.Random,
) -> IPv6Network | None:
    """The IPv6 subnet of a new lease (None without IPv6): ``previous`` if it fits the
    config and nobody holds it, else a random one of the first 100 free from
    IPv6SubnetMin (Flannel's independent pick). Raises PoolExhausted when none is free."""
    if not config.enable_ipv6:
        return None
    if previous is not None and _v6_fits(config, previous) and held.is_free(None, previous):
        return previous
    free = []
    for v6 in ipv6_candidates(config):
        if held.is_free(None, v6):
            free.append(v6)
            if len(free) >= FREE_CANDIDATES:
                break
    if not free:
        raise PoolExhausted(
            f"no free IPv6 subnet in {config.ipv6_network}: every /{config.ipv6_subnet_len} "
            f"between {config.ipv6_subnet_min} and {config.ipv6_subnet_max} is leased; free "
            "some leases or enlarge IPv6Network"
        )
    return rng.choice(free)


def _v6_fits(config: NetworkConfig, subnet: IPv6Network) -> bool:
    assert config.ipv6_network is not None and config.ipv6_subnet_len is not None
    assert config.ipv6_subnet_min is not None and config.ipv6_subnet_max is not None
    return _in_range(
        subnet,
        config.ipv6_network,
        config.ipv6_subnet_len,
        config.ipv6_subnet_min,
        config.ipv6_subnet_max,
    )


def _choose_lease_in_pools(
    config: NetworkConfig,
    pools: Sequence[Pool],
    cluster: str | None,
    leases: Sequence[Lease],
    attrs: LeaseAttrs,
    previous_subnet: IPv4Network | None,
    rng: random.Random,
    holder_gone: Callable[[Lease], bool],
    previous_ipv6_subnet: IPv6Network | None = None,
) -> LeaseChoice:
    """choose_lease's order over several pools (same steps, pool-aware fit)."""

    def fit(lease: Lease) -> tuple[bool, Pool | None]:
        pool = lease_fits_pools(config, pools, lease.subnet, lease.ipv6_subnet)
        return pool is not None, pool

    reused, delete, conflict = _reuse_own(leases, attrs, fit, holder_gone)
    if reused is not None:
        return reused
    return replace(
        _choose_fresh_in_pools(
            config, pools, cluster, leases, delete, previous_subnet, rng, previous_ipv6_subnet
        ),
        name_conflict=conflict,
    )


def _choose_fresh_in_pools(
    config: NetworkConfig,
    pools: Sequence[Pool],
    cluster: str | None,
    leases: Sequence[Lease],
    delete: list[Lease],
    previous_subnet: IPv4Network | None,
    rng: random.Random,
    previous_ipv6_subnet: IPv6Network | None = None,
) -> LeaseChoice:
    """Steps 2 and 3 over several pools: per family, the previous subnet if its pool
    takes new leases, else a new subnet."""
    others = [lease for lease in leases if all(lease is not d for d in delete)]
    new = choose_new_subnet(
        config, pools, cluster, others, rng, previous_ipv6_subnet, previous_subnet=previous_subnet
    )
    first: PoolNetwork | None = new.subnet
    previous: PoolNetwork | None = previous_subnet
    if first is None:  # IPv6-only: the lease is known by its IPv6 subnet
        first, previous = new.ipv6_subnet, previous_ipv6_subnet
    reason = "previous" if previous is not None and first == previous else "free"
    return LeaseChoice(new.subnet, new.ipv6_subnet, reason, None, tuple(delete), new.pool)


def choose_new_subnet(
    config: NetworkConfig,
    pools: Sequence[Pool],
    cluster: str | None,
    leases: Sequence[Lease],
    rng: random.Random,
    previous_ipv6_subnet: IPv6Network | None = None,
    *,
    previous_subnet: IPv4Network | None = None,
) -> PoolChoice:
    """The subnets of a NEW lease (field-notes §3): one per family the config runs,
    each chosen among that family's ``pools``.

    Per family, the previous subnet if it is free and its pool takes new leases; else
    only pools where :func:`~flannelpy.subnet.pools.eligibility` allows creating
    leases are walked: the family's primary pool first (from the config if ``pools``
    lacks it), then its others in CIDR order. Within the first pool with room,
    Flannel's rule: collect up to 100 free subnets from its start, pick one at
    random. ``leases`` is every lease in the store; each blocks what it overlaps.
    Raises PoolExhausted naming every pool of the family and why it could not be used.
    """
    held = _Held(leases)
    picked: dict[int, tuple[PoolNetwork, Pool]] = {}
    for version, previous in ((4, previous_subnet), (6, previous_ipv6_subnet)):
        order = _creation_order(config, pools, version)
        if order:
            picked[version] = _pick_in_pools(order, config, cluster, held, rng, previous)
    v6 = picked.get(6)
    first = picked.get(4) or v6
    assert first is not None  # netconf enables a family
    subnet = picked[4][0] if 4 in picked else None
    ipv6_subnet = v6[0] if v6 is not None else None
    assert subnet is None or isinstance(subnet, IPv4Network)
    assert ipv6_subnet is None or isinstance(ipv6_subnet, IPv6Network)
    return PoolChoice(subnet, ipv6_subnet, first[1], v6[1] if v6 is not None else None)


def _pick_in_pools(
    order: Sequence[Pool],
    config: NetworkConfig,
    cluster: str | None,
    held: _Held,
    rng: random.Random,
    previous: PoolNetwork | None,
) -> tuple[PoolNetwork, Pool]:
    """One family's subnet of a new lease, walked over ``order`` (its pools)."""
    if previous is not None and _is_free(held, previous):
        pool = next((p for p in order if _leasable(p, config, previous)), None)
        if pool is not None and eligibility(pool, cluster).create_leases:
            return previous, pool
    refusals = []
    for pool in order:
        if not eligibility(pool, cluster).create_leases:
            refusals.append(_not_eligible(pool, cluster))
            continue
        span = leasable_range(pool, config)
        free = []
        for index in range(span.count):
            candidate = span.subnet(index)
            if _is_free(held, candidate):
                free.append(candidate)
                if len(free) >= FREE_CANDIDATES:
                    break
        if free:
            return rng.choice(free), pool
        if span.count:
            refusals.append(
                f"{pool.network} is full (all {span.count} /{span.length} subnets leased)"
            )
        else:
            refusals.append(f"{pool.network} holds no /{span.length} subnet to lease")
    # Say only what helps: freeing leases matters only if some usable pool is full.
    full = any(" is full " in r for r in refusals)
    remedy = "free some leases, or add" if full else "add"
    family = "IPv6 " if order[0].network.version == 6 else ""
    raise PoolExhausted(
        f"no {family}pool can take a new lease: " + "; ".join(refusals) + f"; {remedy} a "
        f"{family}pool (flannelpy pools add CIDR) and tag it {ROLE_KEY}={ROLE_OPT_IN}"
    )


def _is_free(held: _Held, net: PoolNetwork) -> bool:
    if isinstance(net, IPv4Network):
        return held.is_free(net, None)
    return held.is_free(None, net)


def _creation_order(config: NetworkConfig, pools: Sequence[Pool], version: int) -> list[Pool]:
    """The family's primary pool (from ``pools``, else the config's untagged), then its
    others in CIDR order; empty when the config does not run the family."""
    primary = next((p for p in primary_pools(config) if p.network.version == version), None)
    if primary is None:
        return []
    primary = next((p for p in pools if p.primary and p.network == primary.network), primary)
    others = sorted(
        (p for p in pools if not p.primary and p.network.version == version),
        key=lambda p: network_order(p.network),
    )
    return [primary, *others]


def _not_eligible(pool: Pool, cluster: str | None) -> str:
    """Why ``pool`` takes no new lease, in a few words (eligibility() decided it)."""
    name = "the primary pool " if pool.primary else ""
    if pool.clusters and (cluster is None or cluster not in pool.clusters):
        scope = ", ".join(sorted(pool.clusters))
        whom = f"not {cluster}" if cluster is not None else "and this agent has no cluster name"
        return f"{name}{pool.network} belongs to cluster(s) {scope}, {whom}"
    if pool.role == ROLE_EXCLUDED:
        return f"{name}{pool.network} is tagged {ROLE_KEY}={ROLE_EXCLUDED} (draining)"
    if pool.role is None:
        return f"{pool.network} has no {ROLE_KEY} tag (untagged pools take no new leases)"
    return f"{pool.network} has {ROLE_KEY}={pool.role!r}, which is neither 1 nor 0"


def _reuse_own(
    leases: Sequence[Lease],
    attrs: LeaseAttrs,
    fit: Callable[[Lease], tuple[bool, Pool | None]],
    holder_gone: Callable[[Lease], bool],
) -> tuple[LeaseChoice | None, list[Lease], Lease | None]:
    """Flannel's first two steps, for both choose_lease paths: our lease by public IP,
    then by node name (only from a holder that is gone), kept if ``fit`` accepts it
    (and in the pool it names). Returns the choice, or None and the leases of ours that
    no longer fit (to delete); and a lease under our name whose holder is alive."""
    delete: list[Lease] = []
    mine = _find(leases, lambda lease: same_public_address(lease.attrs, attrs))
    if mine is not None:
        fits, pool = fit(mine)
        if fits:
            reuse = LeaseChoice(mine.subnet, mine.ipv6_subnet, "public-ip", mine, pool=pool)
            return reuse, [], None
        delete.append(mine)
    if attrs.node_name is not None:
        named = _find(
            leases,
            lambda lease: lease.attrs.node_name == attrs.node_name and lease is not mine,
        )
        if named is not None and not holder_gone(named):
            return None, delete, named  # another live node: never ours to take or delete
        if named is not None:
            fits, pool = fit(named)
            if fits:
                choice = LeaseChoice(
                    named.subnet, named.ipv6_subnet, "node-name", named, tuple(delete), pool
                )
                return choice, [], None
            delete.append(named)
    return None, delete, None


def same_public_address(a: LeaseAttrs, b: LeaseAttrs) -> bool:
    """Flannel's "our lease" test, PublicIP; IPv6-only (no PublicIP), PublicIPv6."""
    if a.public_ip is not None or b.public_ip is not None:
        return a.public_ip == b.public_ip
    return a.public_ipv6 is not None and a.public_ipv6 == b.public_ipv6


def _find(leases: Sequence[Lease], match: Callable[[Lease], bool]) -> Lease | None:
    return next((lease for lease in leases if match(lease)), None)


def candidate_subnets(config: NetworkConfig) -> Iterator[IPv4Network]:
    """Every IPv4 subnet the config can lease, from SubnetMin up."""
    assert config.network is not None
    size = 1 << (32 - config.subnet_len)
    addr, last = int(config.subnet_min), int(config.subnet_max)
    while addr <= last:
        yield IPv4Network((addr, config.subnet_len))
        addr += size


def ipv6_candidates(config: NetworkConfig) -> Iterator[IPv6Network]:
    """Every IPv6 subnet the config can lease, from IPv6SubnetMin up."""
    if not config.enable_ipv6:
        return
    assert config.ipv6_subnet_len is not None
    assert config.ipv6_subnet_min is not None and config.ipv6_subnet_max is not None
    size = 1 << (128 - config.ipv6_subnet_len)
    addr, last = int(config.ipv6_subnet_min), int(config.ipv6_subnet_max)
    while addr <= last:
        yield IPv6Network((addr, config.ipv6_subnet_len))
        addr += size


class _Held:
    """The subnets other leases hold, grouped by prefix length for fast lookups."""

    def __init__(self, leases: Sequence[Lease]) -> None:
        self._by_len: dict[tuple[int, int], set[IPv4Network | IPv6Network]] = {}
        for lease in leases:
            for net in (lease.subnet, lease.ipv6_subnet):
                if net is not None:
                    self._by_len.setdefault((net.version, net.prefixlen), set()).add(net)

    def is_free(self, v4: IPv4Network | None, v6: IPv6Network | None) -> bool:
        return (v4 is None or not self._overlaps(v4)) and (v6 is None or not self._overlaps(v6))

    def _overlaps(self, net: IPv4Network | IPv6Network) -> bool:
        # Overlap, not equality: a lease written under another SubnetLen (or by
        # hand) still blocks every subnet it covers. Aligned networks overlap iff
        # the shorter contains the longer, so one lookup per held length suffices.
        for (version, length), held in self._by_len.items():
            if version != net.version:
                continue
            if length <= net.prefixlen:
                if net.supernet(new_prefix=length) in held:
                    return True
            elif any(h.subnet_of(net) for h in held):  # type: ignore[arg-type]
                return True
        return False


def count_candidates(config: NetworkConfig) -> int:
    """How many subnets the IPv4 range holds (for messages)."""
    size = 1 << (32 - config.subnet_len)
    return (int(config.subnet_max) - int(config.subnet_min)) // size + 1


def _exhausted_message(config: NetworkConfig) -> str:
    return (
        f"no free subnet in {config.network}: all {count_candidates(config)} subnets of "
        f"length /{config.subnet_len} between {config.subnet_min} and {config.subnet_max} "
        "are leased; free some leases or enlarge Network"
    )
