"""The rollout's reads and writes in etcd, over any Store.

Keys (see :mod:`flannelpy.subnet.keys`): the network config, every node's
status and override, the rollout record and the events of forced changes. The
record is only ever replaced with a compare-and-swap on its mod revision, so a
``pause`` or ``abort`` written meanwhile, or a second driver, is never
overwritten: the loser re-reads and decides again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flannelpy.config.netconf import NetworkConfig
from flannelpy.control.records import NodeOverride, NodeStatus
from flannelpy.errors import KeyExists, StoreError
from flannelpy.rollout.backends import rewrite_backend
from flannelpy.rollout.record import RolloutRecord
from flannelpy.rollout.storage import ConfigDoc, NodesSnapshot
from flannelpy.store.etcd.config import network_config_of, read_network_config, swap_config
from flannelpy.store.etcd.kv import Store
from flannelpy.subnet.keys import (
    KeyValue,
    config_key,
    key_to_subnet,
    node_of_key,
    nodes_prefix,
    override_key,
    rollout_key,
    subnets_prefix,
)
from flannelpy.subnet.lease import Lease, LeaseAttrs

CAS_RETRIES = 5  # an override written by someone else meanwhile: read again


class RolloutStore:
    def __init__(self, store: Store, prefix: str) -> None:
        self.store = store
        self.prefix = prefix.rstrip("/")
        self.config_key = config_key(self.prefix)
        self.record_key = rollout_key(self.prefix)

    # -- reading ---------------------------------------------------------------

    def read_config(self) -> ConfigDoc:
        kv, config = read_network_config(self.store, self.prefix)
        return ConfigDoc(kv.value, kv.mod_revision, config)

    def read_nodes(self) -> NodesSnapshot:
        items, _ = self.store.get_prefix(nodes_prefix(self.prefix))
        snap = NodesSnapshot()
        for kv in items:
            found = node_of_key(self.prefix, kv.key)
            if found is None:
                continue
            node, kind = found
            try:
                if kind == "status":
                    snap.statuses[node] = NodeStatus.from_json(kv.value)
                else:
                    snap.overrides[node] = NodeOverride.from_json(kv.value)
            except ValueError as e:
                snap.errors[kv.key] = str(e)
        return snap

    def read_leases(self) -> list[Lease]:
        """Every lease under ``<prefix>/subnets/`` that parses (the agents report the rest)."""
        base = subnets_prefix(self.prefix)
        items, _ = self.store.get_prefix(base)
        leases = []
        for kv in items:
            try:
                subnet, ipv6_subnet = key_to_subnet(kv.key[len(base) :])
                attrs = LeaseAttrs.from_json(kv.value)
            except ValueError:
                continue
            leases.append(
                Lease(subnet, attrs, None, ipv6_subnet, kv.mod_revision, kv.lease_id or None)
            )
        return leases

    def read_record(self) -> tuple[RolloutRecord | None, int]:
        """The record and its mod revision; (None, 0) when there is none."""
        kv = self.store.get(self.record_key)
        if kv is None:
            return None, 0
        try:
            return RolloutRecord.from_json(kv.value), kv.mod_revision
        except ValueError as e:
            raise StoreError(
                f"{e} (etcd key {self.record_key}); if no rollout is running, delete the key"
            ) from e

    # -- the record --------------------------------------------------------------

    def put_record(self, record: RolloutRecord, mod_revision: int) -> int | None:
        """Write the record if it still has ``mod_revision`` (0: if there is none); the new
        revision, or None when someone else wrote it first."""
        data = record.to_json().encode()
        if mod_revision == 0:
            try:
                return self.store.create(self.record_key, data)
            except KeyExists:
                return None
        return self.store.put_if_mod_revision(self.record_key, data, mod_revision)

    # -- overrides and events -------------------------------------------------------

    def write_override(self, node: str, override: NodeOverride) -> None:
        self.store.put(override_key(self.prefix, node), override.to_json().encode())

    def delete_override(self, node: str, generation: int | None = None) -> bool:
        """Remove ``node``'s override (only while it has ``generation``, when given);
        False when there is none to remove."""
        key = override_key(self.prefix, node)
        for _ in range(CAS_RETRIES):
            kv = self.store.get(key)
            if kv is None:
                return False
            if generation is not None:
                try:
                    if NodeOverride.from_json(kv.value).generation != generation:
                        return False
                except ValueError:
                    return False
            if self.store.delete_if_mod_revision(key, kv.mod_revision):
                return True
        raise StoreError(f"{key} kept changing while being deleted; run the command again")

    # -- the config --------------------------------------------------------------------

    def write_config_backend(self, backend: Mapping[str, Any]) -> NetworkConfig:
        """Put ``backend`` into ``<prefix>/config`` in place of its Backend, every other key
        kept as written; validated as a whole, then compare-and-swapped."""
        written: list[NetworkConfig] = []

        def edit(kv: KeyValue | None) -> bytes | None:
            written.clear()
            network_config_of(self.prefix, kv)  # raises when missing or invalid
            assert kv is not None
            data, config, changed = rewrite_backend(kv.value, backend)
            written.append(config)
            return data.encode() if changed else None  # None: already there (a resumed step)

        swap_config(
            self.store,
            self.prefix,
            edit,
            gave_up=f"{self.config_key} kept changing while the rollout wrote its Backend; "
            "run flannelpy rollout resume",
        )
        return written[0]

    # -- the cordon ----------------------------------------------------------------------

    def cordon(self, node: str, rollout: str) -> bool:
        return False  # etcd mode knows no scheduler: nothing to cordon

    def uncordon(self, node: str) -> bool:
        return False
