"""Address pools in etcd (field-notes §3): the store half of :mod:`flannelpy.subnet.pools`.

Layout, beside Flannel's keys (flanneld never reads it)::

    <prefix>/config                          net-conf.json; its Network (and IPv6Network)
                                             are the primary pools
    <prefix>/subnets/10.244.1.0-24           leases (Flannel's)
    <prefix>/flannelpy/pools/10.250.0.0-16   {"Network": "10.250.0.0/16", "SubnetLen": 24,
                                              "Tags": {"flannelpy.io/role": "1"}}
    <prefix>/flannelpy/pools/fd00:250::-48   an IPv6 pool, the same record

The key is the CIDR with ``-`` for ``/``, as in Flannel's lease keys. A primary pool
has no record until it is tagged; its record then only carries tags (its SubnetLen
follows the config). Every edit is a compare-and-swap on the record's mod revision, retried
on a conflict, so two people tagging one pool at once never lose an edit.

Pools are an etcd-mode feature: in Kubernetes mode the controller-manager
allocates each node's podCIDR and no pool applies.

An agent that follows pools lists them with :meth:`PoolStore.list_pools`, then
watches :func:`pools_prefix` and rebuilds the list from its records with
:func:`flannelpy.subnet.pools.records_to_pools` on every change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flannelpy.config.netconf import NetworkConfig
from flannelpy.config.settings import AgentSettings
from flannelpy.errors import ConfigError, KeyExists, StoreError
from flannelpy.store.etcd.kv import KeyValue, Store
from flannelpy.store.etcd.manager import EtcdSubnetManager
from flannelpy.subnet.keys import pool_key, pools_prefix
from flannelpy.subnet.lease import Lease
from flannelpy.subnet.pools import (
    ROLE_EXCLUDED,
    ROLE_KEY,
    ROLE_OPT_IN,
    Pool,
    PoolNetwork,
    check_new_pool,
    check_tag,
    effective_subnet_len,
    parse_pool_key_value,
    pool_record,
    records_to_pools,
)

# Edits ``tags`` in place; returns whether anything changed.
_TagEdit = Callable[[dict[str, str]], bool]

WRITE_RETRIES = 10  # compare-and-swap attempts before an edit gives up
SHOWN_LEASES = 5  # leases named in a refusal; the rest are counted


class PoolRefused(ConfigError):
    """The request conflicts with the pools or leases in the store."""


@dataclass(frozen=True)
class PoolSnapshot:
    """The pools (primary first) and every lease, read at one moment."""

    pools: list[Pool]
    leases: list[Lease]
    ignored: list[str]  # records that could not be read: "KEY: why"


@dataclass(frozen=True)
class PoolEdit:
    pool: Pool  # as stored after the edit
    changed: bool  # False: the pool already looked like that (nothing written)


class PoolStore:
    """Pools over any :class:`~flannelpy.store.etcd.kv.Store` (etcd, or the fake)."""

    def __init__(self, store: Store, prefix: str) -> None:
        self._store = store
        self._prefix = prefix.rstrip("/")
        # The subnet manager reads config and leases exactly as the agent does.
        self._manager = EtcdSubnetManager(store, AgentSettings(etcd_prefix=self._prefix))

    def network_config(self) -> NetworkConfig:
        return self._manager.get_network_config()

    # -- reading -------------------------------------------------------------

    def list_pools(self, config: NetworkConfig) -> list[Pool]:
        """Every readable pool, the primary first, then the others in CIDR order."""
        items, _ = self._store.get_prefix(pools_prefix(self._prefix))
        return records_to_pools(config, items, self._prefix)[0]

    def snapshot(self, config: NetworkConfig) -> PoolSnapshot:
        items, _ = self._store.get_prefix(pools_prefix(self._prefix))
        pools, ignored = records_to_pools(config, items, self._prefix)
        leases, _ = self._manager.list_leases()
        return PoolSnapshot(pools, list(leases.values()), ignored)

    # -- editing -------------------------------------------------------------

    def add(self, config: NetworkConfig, network: PoolNetwork) -> Pool:
        """Create the record of a new, untagged pool (so: no new leases there yet)."""
        check_new_pool(network, config, self.list_pools(config))
        length = effective_subnet_len(Pool(network), config)
        pool = Pool(network, {}, primary=False, subnet_len=length)
        try:
            self._store.create(self._key(network), pool_record(pool, length))
        except KeyExists as e:
            raise PoolRefused(f"{network} is a pool already (someone added it just now)") from e
        return pool

    def tag(self, config: NetworkConfig, network: PoolNetwork, key: str, value: str) -> PoolEdit:
        """Set one tag (§3 keys only), keeping every other tag, even one set concurrently."""
        check_tag(key, value)

        def edit(tags: dict[str, str]) -> bool:
            if tags.get(key) == value:
                return False
            tags[key] = value
            return True

        return self._edit(config, network, edit)

    def untag(self, config: NetworkConfig, network: PoolNetwork, key: str) -> PoolEdit:
        """Drop one tag; a tag that is not there is success with nothing written."""

        def edit(tags: dict[str, str]) -> bool:
            if key not in tags:
                check_tag(key, None)  # say so if the key could never have been set
                return False
            del tags[key]
            return True

        return self._edit(config, network, edit)

    def remove(self, config: NetworkConfig, network: PoolNetwork) -> Pool:
        """Delete a pool's record: never the primary, one in service, or one with leases."""
        if network in (config.network, config.ipv6_network):
            raise PoolRefused(
                f"{network} is a primary pool (from the network config) and cannot be removed; "
                f"to drain it, tag it {ROLE_KEY}={ROLE_EXCLUDED}"
            )
        for _ in range(WRITE_RETRIES):
            kv = self._store.get(self._key(network))
            if kv is None:
                raise self._no_such_pool(network)
            pool = self._read(kv)
            if pool.role == ROLE_OPT_IN:
                # Agents may lease there at any moment: a lease could land between the
                # check below and the delete. Drained (or untagged), nothing new lands.
                raise PoolRefused(
                    f"{network} is in service ({ROLE_KEY}={ROLE_OPT_IN}); tag it "
                    f"{ROLE_KEY}={ROLE_EXCLUDED}, wait for its leases to end, then remove it"
                )
            leases, _ = self._manager.list_leases()
            inside = sorted(
                (
                    net
                    for lease in leases.values()
                    for net in lease.subnets
                    if net.version == network.version and net.overlaps(network)  # type: ignore[arg-type]
                ),
                key=lambda s: int(s.network_address),
            )
            if inside:
                named = ", ".join(str(s) for s in inside[:SHOWN_LEASES])
                extra = len(inside) - SHOWN_LEASES
                more = f" and {extra} more" if extra > 0 else ""
                raise PoolRefused(
                    f"{network} still holds {len(inside)} lease(s) ({named}{more}); tag it "
                    f"{ROLE_KEY}={ROLE_EXCLUDED} and remove it once its pods have ended"
                )
            if self._store.delete_if_mod_revision(kv.key, kv.mod_revision):
                return pool
            # The record changed under us (a tag edit): look again.
        raise self._kept_changing(network)

    # -- helpers -------------------------------------------------------------

    def _key(self, network: PoolNetwork) -> str:
        return pool_key(self._prefix, network)

    def _read(self, kv: KeyValue) -> Pool:
        try:
            return parse_pool_key_value(kv, pools_prefix(self._prefix))
        except ValueError as e:
            raise StoreError(
                f"the pool record at {kv.key} cannot be read ({e}); fix it or delete it "
                f"(etcdctl del {kv.key})"
            ) from e

    def _edit(self, config: NetworkConfig, network: PoolNetwork, edit: _TagEdit) -> PoolEdit:
        primary = network in (config.network, config.ipv6_network)
        key = self._key(network)
        for _ in range(WRITE_RETRIES):
            kv = self._store.get(key)
            if kv is None and not primary:
                raise self._no_such_pool(network)
            stored = self._read(kv) if kv is not None else None
            tags = dict(stored.tags) if stored is not None else {}
            changed = edit(tags)
            if primary:
                pool = Pool(network, tags, True, effective_subnet_len(Pool(network), config))
            else:
                assert stored is not None
                pool = Pool(network, tags, False, stored.subnet_len)
            if not changed:
                return PoolEdit(pool, False)
            value = pool_record(pool, effective_subnet_len(pool, config))
            if kv is None:
                try:
                    self._store.create(key, value)
                except KeyExists:
                    continue  # someone tagged the primary pool first: edit theirs
                return PoolEdit(pool, True)
            if primary and not tags:
                # The primary pool has no record when untagged.
                if self._store.delete_if_mod_revision(key, kv.mod_revision):
                    return PoolEdit(pool, True)
                continue
            if self._store.put_if_mod_revision(key, value, kv.mod_revision) is not None:
                return PoolEdit(pool, True)
        raise self._kept_changing(network)

    @staticmethod
    def _no_such_pool(network: PoolNetwork) -> PoolRefused:
        return PoolRefused(
            f"there is no pool {network}; see the pools with `flannelpy pools list`, or add it "
            f"with `flannelpy pools add {network}`"
        )

    @staticmethod
    def _kept_changing(network: PoolNetwork) -> StoreError:
        return StoreError(
            f"the record of pool {network} kept changing during {WRITE_RETRIES} attempts; "
            "retry once the other edits are done"
        )
