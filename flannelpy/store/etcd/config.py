"""The network config key (``<prefix>/config``): read, write, compare-and-swap.

Over any :class:`~flannelpy.store.etcd.kv.Store`, so no gRPC import. Every tool
that rewrites part of the config (the disruption policy, a rollout's final
Backend) goes through :func:`swap_config`: it re-reads and re-applies its edit
when someone else wrote the key meanwhile, so another writer's edit is never lost.
"""

from __future__ import annotations

from collections.abc import Callable

from flannelpy.config.netconf import NetworkConfig, parse_network_config
from flannelpy.errors import ConfigError, KeyExists, StoreError
from flannelpy.store.etcd.kv import KeyValue, Store
from flannelpy.subnet.keys import config_key

CONFIG_CAS_ATTEMPTS = 5  # rounds before giving up on a config key that keeps changing


def read_network_config(store: Store, prefix: str) -> tuple[KeyValue, NetworkConfig]:
    """The config key as stored and parsed. Raises ConfigError when missing or invalid."""
    kv = store.get(config_key(prefix))
    config = network_config_of(prefix, kv)
    assert kv is not None  # network_config_of raised otherwise
    return kv, config


def network_config_of(prefix: str, kv: KeyValue | None) -> NetworkConfig:
    """The config key's value (as read: None when absent), parsed; raises ConfigError."""
    key = config_key(prefix)
    if kv is None:
        raise ConfigError(
            f"network config not found in etcd at {key}; write net-conf.json "
            f"there (etcdctl put {key} '{{\"Network\": ...}}')"
        )
    try:
        return parse_network_config(kv.value)
    except ConfigError as e:
        raise ConfigError(f"{e} (read from etcd key {key})") from e


def put_network_config(store: Store, prefix: str, raw_json: str | bytes) -> NetworkConfig:
    """Validate net-conf.json and write it to ``<prefix>/config`` (for the lab and tests)."""
    config = parse_network_config(raw_json)
    data = raw_json.encode() if isinstance(raw_json, str) else raw_json
    store.put(config_key(prefix), data)
    return config


def swap_config(
    store: Store,
    prefix: str,
    edit: Callable[[KeyValue | None], bytes | None],
    gave_up: str,
    attempts: int = CONFIG_CAS_ATTEMPTS,
) -> bool:
    """Replace the config key with ``edit(current)`` only if nobody wrote it in between.

    ``edit`` gets the key as read (None when absent; it may raise, e.g. ConfigError
    for a config that is missing or would become invalid) and returns the new
    bytes, or None when there is nothing to write. A lost race reads again and
    calls ``edit`` again. The key keeps its etcd lease, if it has one. True when
    written, False when ``edit`` returned None; StoreError(``gave_up``) once
    ``attempts`` rounds were all lost.
    """
    key = config_key(prefix)
    for _ in range(attempts):
        current = store.get(key)
        data = edit(current)
        if data is None:
            return False
        if current is None:
            try:
                store.create(key, data)
            except KeyExists:
                continue
            return True
        if store.put_if_mod_revision(key, data, current.mod_revision, current.lease_id):
            return True
    raise StoreError(gave_up)
