"""Which address pools a node may use: field-notes §3's tag semantics as one pure function.

A pool is a CIDR in the store with tags. ``flannelpy.io/role`` says what may
happen there:

- ``1``: opt-in. New leases may be created in the pool; existing ones serve.
- ``0``: excluded (drain). No new leases, **and** existing leases stop receiving new
  pod addresses; running pods keep theirs until they end.
- no role tag: creation fails closed (no new leases), reconciliation fails open
  (existing leases keep serving untouched). The primary pool (the config's
  ``Network``) is the exception: it is eligible without a tag, unless tagged ``0``.

``flannelpy.io/cluster/<name>`` restricts a pool to the named cluster(s); a pool
without one is shared by every cluster using the store. A lease with assigned
pod addresses is never released, whatever the tags say.

Both families: a pool is an IPv4 or an IPv6 range; ``IPv6Network`` is the IPv6
primary pool, as ``Network`` is the IPv4 one. Tags apply to the pool, so per family.
A dual-stack lease stays one Flannel key holding an IPv4 subnet from an IPv4 pool and
an IPv6 subnet from an IPv6 pool (so flanneld reads it unchanged): it may be created
only where both pools take new leases, and it serves new pods only while both pools
let it. Draining either family's pool drains the whole lease, so the drained range
empties and the lease can be released (its other half could never let go otherwise).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_network
from typing import TYPE_CHECKING, Any

from flannelpy.config.settings import check_cluster_name
from flannelpy.errors import ConfigError
from flannelpy.subnet.keys import KeyValue, pool_key_network, pools_prefix
from flannelpy.subnet.span import overlaps, span

if TYPE_CHECKING:
    from flannelpy.config.netconf import NetworkConfig
    from flannelpy.subnet.lease import Lease

ROLE_KEY = "flannelpy.io/role"
CLUSTER_KEY_PREFIX = "flannelpy.io/cluster/"
ROLE_OPT_IN = "1"
ROLE_EXCLUDED = "0"

PoolNetwork = IPv4Network | IPv6Network


@dataclass(frozen=True)
class Pool:
    network: PoolNetwork
    tags: Mapping[str, str] = field(default_factory=dict)
    primary: bool = False  # the network config's Network (or IPv6Network)
    # Prefix length of the leases cut from this pool; None: the config's SubnetLen
    # (IPv6SubnetLen for an IPv6 pool; always so for a primary pool).
    subnet_len: int | None = None

    @property
    def role(self) -> str | None:
        return self.tags.get(ROLE_KEY)

    @property
    def clusters(self) -> frozenset[str]:
        return frozenset(
            key[len(CLUSTER_KEY_PREFIX) :]
            for key in self.tags
            if key.startswith(CLUSTER_KEY_PREFIX)
        )


@dataclass(frozen=True)
class Eligibility:
    create_leases: bool  # may a node acquire a new lease in this pool?
    allocate_addresses: bool  # may existing leases here hand out new pod addresses?
    reason: str  # one sentence, for logs, `pools list` and errors


def eligibility(pool: Pool, cluster: str | None) -> Eligibility:
    """What ``cluster`` (None: an agent without --cluster-name) may do with ``pool``."""
    if pool.clusters and (cluster is None or cluster not in pool.clusters):
        # Another cluster's pool: nothing new, but never break what runs (fail open).
        scope = ", ".join(sorted(pool.clusters))
        return Eligibility(False, True, f"{pool.network} belongs to cluster(s) {scope}")
    if pool.role == ROLE_EXCLUDED:
        return Eligibility(
            False, False, f"{pool.network} is tagged {ROLE_KEY}=0: draining, nothing new lands"
        )
    if pool.role == ROLE_OPT_IN:
        return Eligibility(True, True, f"{pool.network} is opted in ({ROLE_KEY}=1)")
    if pool.primary:
        return Eligibility(True, True, f"{pool.network} is the primary pool")
    if pool.role is None:
        return Eligibility(
            False, True, f"{pool.network} has no {ROLE_KEY} tag: no new leases, existing ones serve"
        )
    # An unknown role value is treated as no tag: fail closed for creation, open for the rest.
    return Eligibility(
        False,
        True,
        f"{pool.network} has {ROLE_KEY}={pool.role!r}, which is neither 1 nor 0: no new leases",
    )


def may_release_lease(pool: Pool, cluster: str | None, assigned: int, cooling: int) -> bool:
    """A lease is released only when it may not serve new pods and holds no pod address.

    Cooling addresses count too: releasing them would let another node take the
    subnet and hand an address out again before proxies and peers forgot it.
    """
    if assigned or cooling:
        return False
    return not eligibility(pool, cluster).allocate_addresses


# ---------------------------------------------------------------------------
# Tags: what `flannelpy pools tag` accepts (stored records are read leniently:
# an unknown role value already fails closed in eligibility()).
# ---------------------------------------------------------------------------


def check_tag(key: str, value: str | None) -> None:
    """Refuse a tag §3 does not define. ``value`` None: only the key is checked (untag)."""
    if key == ROLE_KEY:
        if value is not None and value not in (ROLE_OPT_IN, ROLE_EXCLUDED):
            raise ConfigError(
                f"{ROLE_KEY}={value} is not a role; use {ROLE_KEY}=1 (new leases may be "
                f"created) or {ROLE_KEY}=0 (drain: nothing new lands)"
            )
        return
    if key.startswith(CLUSTER_KEY_PREFIX):
        check_cluster_name(key[len(CLUSTER_KEY_PREFIX) :], f"tag {key}: the cluster name")
        return
    raise ConfigError(
        f"{key!r} is not a pool tag; pools take {ROLE_KEY} (1 or 0) and "
        f"{CLUSTER_KEY_PREFIX}<cluster-name>"
    )


def parse_tag(text: str) -> tuple[str, str]:
    """``KEY=VALUE`` → (key, value), checked with :func:`check_tag`."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise ConfigError(f"{text!r} is not KEY=VALUE; write it like {ROLE_KEY}=1")
    check_tag(key, value)
    return key, value


def parse_pool_cidr(text: str) -> PoolNetwork:
    """A pool's CIDR as the user typed it (IPv4 or IPv6); raises ConfigError naming the fix."""
    text = text.strip()
    if "/" not in text:
        raise ConfigError(f"{text!r} is not a CIDR; write it as address/prefix, like 10.250.0.0/16")
    try:
        return ip_network(text, strict=True)
    except ValueError as e:
        try:
            network = ip_network(text, strict=False)
        except ValueError:
            raise ConfigError(
                f"{text!r} is not a CIDR; pools are ranges like 10.250.0.0/16 or fd00:250::/48"
            ) from e
        raise ConfigError(f"{text} has host bits set; write the network address, {network}") from e


# ---------------------------------------------------------------------------
# Records: <prefix>/flannelpy/pools/<10.250.0.0-16> (or <fd00:250::-48>) holds
#   {"Network": "10.250.0.0/16", "SubnetLen": 24, "Tags": {"flannelpy.io/role": "1"}}
# ---------------------------------------------------------------------------


def pool_record(pool: Pool, subnet_len: int) -> bytes:
    """The stored JSON of ``pool`` (``subnet_len``: its own, else the config's)."""
    doc = {
        "Network": str(pool.network),
        "SubnetLen": pool.subnet_len if pool.subnet_len is not None else subnet_len,
        "Tags": dict(sorted(pool.tags.items())),
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def parse_pool_record(value: bytes | str) -> Pool:
    """A stored record → a non-primary Pool; raises ValueError naming what is wrong."""
    try:
        doc: Any = json.loads(value)
    except json.JSONDecodeError as e:
        raise ValueError(f"pool record is not JSON: {e}") from e
    if not isinstance(doc, dict):
        raise ValueError("pool record is not a JSON object")
    try:
        network = ip_network(str(doc.get("Network")), strict=True)
    except ValueError as e:
        raise ValueError(f"pool record has no valid Network: {doc.get('Network')!r}") from e
    length = doc.get("SubnetLen")
    if length is not None and (
        not isinstance(length, int)
        or isinstance(length, bool)
        or not 0 < length <= network.max_prefixlen
    ):
        raise ValueError(f"pool record has an invalid SubnetLen: {length!r}")
    tags = doc.get("Tags") or {}
    if not isinstance(tags, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in tags.items()
    ):
        raise ValueError("pool record Tags is not an object of strings")
    return Pool(network, dict(tags), primary=False, subnet_len=length)


def primary_pools(config: NetworkConfig) -> list[Pool]:
    """The config's own pools, untagged: Network, then IPv6Network (each if enabled)."""
    pools = []
    if config.enable_ipv4 and config.network is not None:
        pools.append(Pool(config.network, {}, primary=True, subnet_len=config.subnet_len))
    if config.enable_ipv6 and config.ipv6_network is not None:
        pools.append(Pool(config.ipv6_network, {}, True, config.ipv6_subnet_len))
    return pools


def assemble_pools(config: NetworkConfig, records: Iterable[Pool]) -> list[Pool]:
    """The pools of a store: the config's Network and IPv6Network first (carrying the
    tags of their records, if they have one), then every other record, IPv4 before
    IPv6, in CIDR order.

    A record for a primary network keeps only its tags: its SubnetLen follows the
    config. A record left from an older Network is an ordinary pool, so leases there
    keep serving and a drain is one ``tag`` away.
    """
    primaries = primary_pools(config)
    if not primaries:
        raise ConfigError("net-conf.json has neither Network nor IPv6Network; set one of them")
    others = []
    for record in records:
        index = next((i for i, p in enumerate(primaries) if p.network == record.network), None)
        if index is None:
            others.append(record)
        else:
            primaries[index] = replace(primaries[index], tags=dict(record.tags))
    return [*primaries, *sorted(others, key=lambda p: network_order(p.network))]


def network_order(network: PoolNetwork) -> tuple[int, int, int]:
    """IPv4 before IPv6, then by address and prefix length."""
    return network.version, int(network.network_address), network.prefixlen


def effective_subnet_len(pool: Pool, config: NetworkConfig) -> int:
    """The prefix length of the leases cut from ``pool``."""
    if pool.network.version == 6:
        configured = config.ipv6_subnet_len
        if pool.primary or pool.subnet_len is None:
            return configured if configured is not None else _DEFAULT_SUBNET_LEN[6]
        return pool.subnet_len
    if pool.primary or pool.subnet_len is None:
        return config.subnet_len or _DEFAULT_SUBNET_LEN[4]
    return pool.subnet_len


# A record without SubnetLen in a config without its family: Flannel's defaults.
_DEFAULT_SUBNET_LEN = {4: 24, 6: 64}


@dataclass(frozen=True)
class LeasableRange:
    """The subnets a pool can lease: ``count`` subnets of ``/length`` from ``first``."""

    first: IPv4Address | IPv6Address
    length: int
    count: int

    @property
    def step(self) -> int:
        return 1 << (self.first.max_prefixlen - self.length)

    def subnet(self, index: int) -> PoolNetwork:
        return ip_network((int(self.first) + index * self.step, self.length))


def leasable_range(pool: Pool, config: NetworkConfig) -> LeasableRange:
    """A primary pool leases SubnetMin..SubnetMax (IPv6SubnetMin..Max); another pool
    every subnet but the first (Flannel's default SubnetMin rule: the first's address
    is the pool's own)."""
    length = effective_subnet_len(pool, config)
    step = 1 << (pool.network.max_prefixlen - length)
    bounds = _primary_bounds(pool, config)
    if bounds is not None:
        low, high = bounds
        return LeasableRange(low, length, (int(high) - int(low)) // step + 1)
    if length < pool.network.prefixlen:
        return LeasableRange(pool.network.network_address, length, 0)
    subnets = 1 << (length - pool.network.prefixlen)
    return LeasableRange(pool.network.network_address + step, length, subnets - 1)


def _primary_bounds(
    pool: Pool, config: NetworkConfig
) -> tuple[IPv4Address, IPv4Address] | tuple[IPv6Address, IPv6Address] | None:
    if not pool.primary:
        return None
    if pool.network.version == 4:
        return config.subnet_min, config.subnet_max
    if config.ipv6_subnet_min is None or config.ipv6_subnet_max is None:
        return None
    return config.ipv6_subnet_min, config.ipv6_subnet_max


def check_new_pool(network: PoolNetwork, config: NetworkConfig, pools: Sequence[Pool]) -> None:
    """Refuse a pool of a family the config does not run, one that overlaps another
    (a primary included) or cannot hold one leasable subnet. ``pools``: what
    :func:`assemble_pools` returned."""
    if not any(p.primary and p.network.version == network.version for p in pools):
        keys = "EnableIPv4 and Network" if network.version == 4 else "EnableIPv6 and IPv6Network"
        raise ConfigError(
            f"{network} is an IPv{network.version} range, but net-conf.json runs no "
            f"IPv{network.version}; set {keys} there first"
        )
    length = effective_subnet_len(Pool(network), config)
    if network.prefixlen >= length:
        name = "SubnetLen" if network.version == 4 else "IPv6SubnetLen"
        raise ConfigError(
            f"{network} is too small for {name} {length}: a pool needs at least two "
            f"/{length} subnets (the first is skipped, as in Flannel); use a "
            f"/{length - 1} or larger"
        )
    own = "the config's Network" if network.version == 4 else "the config's IPv6Network"
    for pool in pools:
        if pool.network == network:
            what = f"the primary pool ({own})" if pool.primary else "a pool already"
            raise ConfigError(f"{network} is {what}; see the pools with `flannelpy pools list`")
        if pool.network.version == network.version and pool.network.overlaps(network):
            what = f"the primary pool ({own})" if pool.primary else "pool"
            raise ConfigError(
                f"{network} overlaps {what} {pool.network}; choose a range that overlaps no pool"
            )


# ---------------------------------------------------------------------------
# Capacity: field-notes §2, plan for twice the expected need.
# ---------------------------------------------------------------------------

WARN_UTILISATION = 0.5  # more than half used: the pool no longer has 2x headroom


@dataclass(frozen=True)
class PoolCapacity:
    pool: Pool
    length: int  # prefix length of the pool's leases
    size: int  # leasable subnets
    taken: int  # of those, how many a lease covers
    leases: int  # lease keys inside the pool (any length)

    @property
    def free(self) -> int:
        return self.size - self.taken

    @property
    def utilisation(self) -> float:
        """Taken / size, 0..1; an empty range counts as full (no room at all)."""
        return self.taken / self.size if self.size else 1.0

    @property
    def warning(self) -> str | None:
        if self.utilisation <= WARN_UTILISATION:
            return None
        return (
            f"{self.pool.network} is {self.utilisation:.0%} used ({self.taken} of "
            f"{self.size} /{self.length} subnets): plan for twice the expected need, so add "
            f"a pool (flannelpy pools add CIDR) and tag it {ROLE_KEY}=1"
        )


def capacity(
    config: NetworkConfig, pools: Sequence[Pool], leases: Sequence[Lease]
) -> list[PoolCapacity]:
    """Per pool: leasable subnets, how many a lease covers, how many lease keys lie in it.

    A lease covers every subnet it overlaps, so one written under another SubnetLen
    (or by hand) counts as what it really blocks.
    """
    return [_pool_capacity(pool, config, leases) for pool in pools]


def _pool_capacity(pool: Pool, config: NetworkConfig, leases: Sequence[Lease]) -> PoolCapacity:
    rng = leasable_range(pool, config)
    start = int(rng.first)
    end = start + rng.count * rng.step - 1  # last address of the last leasable subnet
    spans = []
    inside = 0
    for lease in leases:
        net = lease.subnet if pool.network.version == 4 else lease.ipv6_subnet
        if net is None:
            continue  # no subnet of the pool's family
        if overlaps(net, pool.network):  # on integers: nothing cached on the lease's subnet
            inside += 1
        low, high = span(net)
        if rng.count and low <= end and high >= start:
            first = (max(low, start) - start) // rng.step
            spans.append((first, (min(high, end) - start) // rng.step))
    taken = 0
    reach = -1  # highest index counted so far: merge overlapping spans
    for low_i, high_i in sorted(spans):
        if high_i > reach:
            taken += high_i - max(low_i, reach + 1) + 1
            reach = high_i
    return PoolCapacity(pool, rng.length, rng.count, taken, inside)


def records_to_pools(
    config: NetworkConfig, items: Iterable[KeyValue], prefix: str
) -> tuple[list[Pool], list[str]]:
    """Records under :func:`pools_prefix` → pools (primary first) and the unreadable ones."""
    base = pools_prefix(prefix)
    records = []
    ignored = []
    for kv in items:
        try:
            records.append(parse_pool_key_value(kv, base))
        except ValueError as e:
            ignored.append(f"{kv.key}: {e}")
    return assemble_pools(config, records), ignored


def parse_pool_key_value(kv: KeyValue, base: str) -> Pool:
    """One record under ``base`` (the pools prefix) as a Pool; ValueError says why not."""
    network = pool_key_network(kv.key[len(base) :])
    pool = parse_pool_record(kv.value)
    if pool.network != network:
        raise ValueError(f"the record's Network {pool.network} does not match its key")
    return pool
