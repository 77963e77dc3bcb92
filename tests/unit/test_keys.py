"""The etcd keyspace (subnet.keys) and the config key's compare-and-swap (store.etcd.config)."""

from __future__ import annotations

from ipaddress import IPv4Network, IPv6Network

import pytest

from flannelpy.errors import ConfigError, StoreError
from flannelpy.store.etcd.config import (
    network_config_of,
    put_network_config,
    read_network_config,
    swap_config,
)
from flannelpy.store.etcd.kv import FakeStore, KeyValue
from flannelpy.subnet import keys

PREFIX = "/coreos.com/network"
NETCONF = '{"Network": "10.244.0.0/16"}'


def test_flannels_keys() -> None:
    assert keys.config_key(PREFIX) == "/coreos.com/network/config"
    assert keys.config_key(PREFIX + "/") == "/coreos.com/network/config"
    assert keys.subnets_prefix(PREFIX) == "/coreos.com/network/subnets/"
    assert (
        keys.lease_key(PREFIX, IPv4Network("10.244.1.0/24"))
        == "/coreos.com/network/subnets/10.244.1.0-24"
    )
    assert (
        keys.lease_key(PREFIX, IPv4Network("10.244.1.0/24"), IPv6Network("fd00:1::/64"))
        == "/coreos.com/network/subnets/10.244.1.0-24&fd00:1::-64"
    )


def test_lease_key_round_trip() -> None:
    v4, v6 = IPv4Network("10.244.1.0/24"), IPv6Network("fd00:1::/64")
    assert keys.key_to_subnet(keys.subnet_to_key(v4)) == (v4, None)
    assert keys.key_to_subnet(keys.subnet_to_key(v4, v6)) == (v4, v6)
    for bad in ("garbage", "10.244.1.0-33", "fd00:1::-64", "10.244.1.1-24"):
        with pytest.raises(ValueError):
            keys.key_to_subnet(bad)


def test_flannelpys_keys_live_under_one_root() -> None:
    root = "/coreos.com/network/flannelpy/"
    assert keys.pools_prefix(PREFIX) == root + "pools/"
    assert keys.pool_key(PREFIX, IPv4Network("10.250.0.0/16")) == root + "pools/10.250.0.0-16"
    assert keys.override_key(PREFIX, "n1") == root + "nodes/n1/override"
    assert keys.status_key(PREFIX, "n1") == root + "nodes/n1/status"
    assert keys.rollout_key(PREFIX) == root + "rollout"
    assert keys.event_key(PREFIX, 17, "n1") == root + "events/17-n1"
    assert keys.event_key(PREFIX, 17, "n1").startswith(keys.events_prefix(PREFIX))


def test_node_of_key() -> None:
    assert keys.node_of_key(PREFIX, keys.status_key(PREFIX, "n1")) == ("n1", "status")
    assert keys.node_of_key(PREFIX, keys.override_key(PREFIX, "n2")) == ("n2", "override")
    nodes = keys.nodes_prefix(PREFIX)
    for other in (
        keys.rollout_key(PREFIX),
        nodes + "n1/other",
        nodes + "n1/status/x",
        nodes + "/status",
    ):
        assert keys.node_of_key(PREFIX, other) is None


# --- the config key -------------------------------------------------------------------


def test_read_network_config_names_the_key_when_missing_or_invalid() -> None:
    store = FakeStore()
    with pytest.raises(ConfigError, match=r"not found in etcd at /coreos\.com/network/config"):
        read_network_config(store, PREFIX)
    store.put(keys.config_key(PREFIX), b"{")
    with pytest.raises(ConfigError, match=r"\(read from etcd key /coreos.com/network/config\)"):
        read_network_config(store, PREFIX)
    put_network_config(store, PREFIX, NETCONF)
    kv, config = read_network_config(store, PREFIX)
    assert kv.value == NETCONF.encode() and str(config.network) == "10.244.0.0/16"
    assert network_config_of(PREFIX, kv) == config


def test_swap_writes_the_edit() -> None:
    store = FakeStore()
    put_network_config(store, PREFIX, NETCONF)
    assert swap_config(store, PREFIX, lambda kv: b'{"Network": "10.9.0.0/16"}', "busy")
    kv = store.get(keys.config_key(PREFIX))
    assert kv is not None and kv.value == b'{"Network": "10.9.0.0/16"}'


def test_swap_with_nothing_to_change_writes_nothing() -> None:
    store = FakeStore()
    put_network_config(store, PREFIX, NETCONF)
    before = store.get(keys.config_key(PREFIX))
    assert not swap_config(store, PREFIX, lambda kv: None, "busy")
    assert store.get(keys.config_key(PREFIX)) == before


def test_swap_creates_a_missing_key_when_the_edit_allows() -> None:
    store = FakeStore()
    seen: list[KeyValue | None] = []

    def edit(kv: KeyValue | None) -> bytes:
        seen.append(kv)
        return NETCONF.encode()

    assert swap_config(store, PREFIX, edit, "busy")
    assert seen == [None]
    kv = store.get(keys.config_key(PREFIX))
    assert kv is not None and kv.value == NETCONF.encode()


def test_a_lost_race_re_reads_and_keeps_the_other_writers_edit() -> None:
    store = FakeStore()
    put_network_config(store, PREFIX, '{"Network": "10.244.0.0/16", "A": 1}')
    calls: list[bytes] = []

    def edit(kv: KeyValue | None) -> bytes:
        assert kv is not None
        calls.append(kv.value)
        if len(calls) == 1:  # someone else writes between our read and our swap
            store.put(keys.config_key(PREFIX), b'{"Network": "10.244.0.0/16", "B": 2}')
        return kv.value[:-1] + b', "Ours": 3}'

    assert swap_config(store, PREFIX, edit, "busy")
    assert calls[1] == b'{"Network": "10.244.0.0/16", "B": 2}'
    kv = store.get(keys.config_key(PREFIX))
    assert kv is not None and kv.value == b'{"Network": "10.244.0.0/16", "B": 2, "Ours": 3}'


def test_swap_keeps_the_keys_etcd_lease() -> None:
    store = FakeStore()
    lease = store.grant_lease(60)
    store.put(keys.config_key(PREFIX), NETCONF.encode(), lease.id)
    assert swap_config(store, PREFIX, lambda kv: b'{"Network": "10.9.0.0/16"}', "busy")
    kv = store.get(keys.config_key(PREFIX))
    assert kv is not None and kv.lease_id == lease.id


def test_swap_gives_up_with_its_sentence_when_every_round_is_lost() -> None:
    store = FakeStore()
    put_network_config(store, PREFIX, NETCONF)
    rounds = 0

    def edit(kv: KeyValue | None) -> bytes:
        nonlocal rounds
        rounds += 1
        other = f'{{"Network": "10.244.0.0/16", "N": {rounds}}}'
        store.put(keys.config_key(PREFIX), other.encode())
        return b'{"Network": "10.9.0.0/16"}'

    with pytest.raises(StoreError, match=r"^the config kept changing; run it again$"):
        swap_config(store, PREFIX, edit, "the config kept changing; run it again", attempts=3)
    assert rounds == 3


def test_an_edit_that_refuses_stops_the_swap() -> None:
    store = FakeStore()

    def edit(kv: KeyValue | None) -> bytes:
        raise ConfigError("no config to edit")

    with pytest.raises(ConfigError, match="no config to edit"):
        swap_config(store, PREFIX, edit, "busy")
    assert store.get(keys.config_key(PREFIX)) is None
