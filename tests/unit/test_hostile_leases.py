"""Peer leases are input from other machines: bounded parsing, validation before the
kernel, and two live nodes with one name (issue 12, items 2 and 3)."""

from __future__ import annotations

import contextlib
import json
import random
import threading
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from flannelpy.errors import ConfigError
from flannelpy.store.etcd.kv import FakeStore
from flannelpy.store.etcd.manager import RENEW_GRACE_SECONDS, EtcdSubnetManager
from flannelpy.store.kube.node import annotation_keys, node_to_lease
from flannelpy.subnet.bounded_json import MAX_DEPTH, loads_bounded, nesting_depth
from flannelpy.subnet.keys import lease_key
from flannelpy.subnet.lease import Lease, LeaseAttrs
from flannelpy.subnet.validate import (
    BACKEND_DATA,
    BAD_ADDRESS,
    OUTSIDE_NETWORK,
    OVERLAPS_HOST,
    OVERLAPS_OWN,
    OWN_ADDRESS,
    REASONS,
    UNDECODABLE,
    Bounds,
    check_peer,
    split_peers,
)
from tests.support.agent_fakes import NODE_IP, PREFIX, AgentHarness, FakeClock, agent_settings
from tests.support.fakes import network_config

DEEP = "[" * 3000 + "]" * 3000  # the value that killed every agent of a lab
GOOD_MAC = {"VNI": 1, "VtepMAC": "c6:d2:32:6f:8f:44"}


def peer(subnet: str, ip: str = "192.168.1.20", data: Any = GOOD_MAC) -> Lease:
    attrs = LeaseAttrs(public_ip=IPv4Address(ip), backend_type="vxlan", backend_data=data)
    return Lease(subnet=IPv4Network(subnet), attrs=attrs)


BOUNDS = Bounds(
    networks=(IPv4Network("10.244.0.0/16"), IPv4Network("10.250.0.0/16")),
    own=(IPv4Network("10.244.1.0/24"),),
    host=(IPv4Network("100.64.0.0/24"),),
    public_ip=IPv4Address("100.64.0.11"),
    host_ips=(IPv4Address("100.64.0.11"),),
)


# -- bounded JSON ---------------------------------------------------------------------


def test_a_value_nested_3000_deep_is_refused_with_a_value_error() -> None:
    # Before: json.loads raised RecursionError, which no caller caught.
    with pytest.raises(ValueError, match="nested 3000 deep"):
        LeaseAttrs.from_json(DEEP)
    doc = '{"PublicIP":"192.168.1.5","BackendData":{"x":' + DEEP + "}}"
    with pytest.raises(ValueError, match="nested"):
        LeaseAttrs.from_json(doc)


def test_size_and_depth_bounds() -> None:
    with pytest.raises(ValueError, match="bytes"):
        loads_bounded(b'"' + b"x" * 70_000 + b'"')
    assert loads_bounded("[" * MAX_DEPTH + "]" * MAX_DEPTH) is not None
    assert nesting_depth('{"a": "[[[[{{{{\\"[["}') == 1  # brackets inside strings do not count
    with pytest.raises(ValueError, match="UTF-8"):
        loads_bounded(b"\xff\xfe")


def test_wrong_field_types_never_reach_the_lease() -> None:
    raw = json.dumps(
        {
            "PublicIP": "192.168.1.5",
            "BackendType": 7,
            "PublicIPv6": ["x"],
            "BackendData": {"VNI": "1", "VtepMAC": {"a": 1}},
            "Flannelpy": {"NodeName": 3, "MTU": True},
        }
    )
    attrs = LeaseAttrs.from_json(raw)
    assert (attrs.backend_type, attrs.public_ipv6, attrs.node_name, attrs.mtu) == (
        "",
        None,
        None,
        None,
    )
    with pytest.raises(ValueError, match="PublicIP"):
        LeaseAttrs.from_json('{"PublicIP": ["192.168.1.5"]}')


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)
LEASE_DOC = st.fixed_dictionaries(
    {},
    optional={
        "PublicIP": st.one_of(st.just("192.168.1.5"), st.just("127.0.0.1"), JSON),
        "BackendType": st.one_of(st.just("vxlan"), JSON),
        "BackendData": st.one_of(st.just(GOOD_MAC), JSON),
        "PublicIPv6": JSON,
        "Flannelpy": st.one_of(
            st.fixed_dictionaries(
                {}, optional={"NodeName": JSON, "MTU": JSON, "DirectRouting": JSON}
            ),
            JSON,
        ),
    },
)


@settings(max_examples=300, deadline=None)
@given(doc=LEASE_DOC, subnet=st.integers(0, 2**24 - 1))
def test_any_lease_json_parses_or_is_refused_and_validates_without_raising(
    doc: dict[str, Any], subnet: int
) -> None:
    try:
        attrs = LeaseAttrs.from_json(json.dumps(doc))
    except ValueError:
        return
    lease = Lease(subnet=IPv4Network((subnet << 8, 24)), attrs=attrs)
    why = check_peer(lease, BOUNDS)
    assert why is None or why.reason in REASONS
    assert isinstance(attrs.backend_type, str) and isinstance(attrs.node_name, str | None)
    assert attrs.mtu is None or type(attrs.mtu) is int


@settings(max_examples=100, deadline=None)
@given(raw=st.binary(max_size=200) | st.text(alphabet='[]{}",:0 a\\', max_size=300))
def test_any_bytes_parse_or_raise_value_error(raw: bytes | str) -> None:
    with contextlib.suppress(ValueError):
        LeaseAttrs.from_json(raw)


# -- Kubernetes annotations -----------------------------------------------------------

KEYS = annotation_keys("flannel.alpha.coreos.com")


def node(notes: dict[str, str]) -> dict[str, Any]:
    base = {KEYS.managed: "true", KEYS.public_ip: "192.168.1.7", KEYS.backend_type: "vxlan"}
    return {
        "metadata": {"name": "n7", "annotations": {**base, **notes}},
        "spec": {"podCIDR": "10.244.7.0/24"},
    }


def test_a_superscript_mtu_annotation_is_ignored_not_raised() -> None:
    # Before: "²".isdigit() is True and int("²") raised ValueError out of the watch.
    lease = node_to_lease(node({KEYS.mtu: "²"}), KEYS, network_config())
    assert lease is not None and lease.attrs.mtu is None
    lease = node_to_lease(node({KEYS.mtu: "1450"}), KEYS, network_config())
    assert lease is not None and lease.attrs.mtu == 1450


def test_deep_backend_data_annotation_is_not_a_lease() -> None:
    with pytest.raises(ValueError, match="not a JSON object"):
        node_to_lease(node({KEYS.backend_data: DEEP}), KEYS, network_config())


@settings(max_examples=300, deadline=None)
@given(
    notes=st.dictionaries(
        st.sampled_from(
            [
                KEYS.mtu,
                KEYS.backend_data,
                KEYS.backend_type,
                KEYS.public_ip,
                KEYS.public_ipv6,
                KEYS.backend_v6_data,
                KEYS.public_ip_overwrite,
            ]
        ),
        st.text(max_size=20) | st.sampled_from(["²", "١٥٠٠", "1e3", "-1", DEEP, "{}", "null"]),
    )
)
def test_any_annotations_make_a_lease_or_a_value_error(notes: dict[str, str]) -> None:
    with contextlib.suppress(ValueError):
        node_to_lease(node(notes), KEYS, network_config())


# -- validation -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("lease", "reason"),
    [
        (peer("100.64.0.0/24"), OUTSIDE_NETWORK),  # the lab's underlay, reproduced
        (peer("10.0.0.0/8"), OUTSIDE_NETWORK),
        (peer("10.244.0.0/16"), OVERLAPS_OWN),  # covers our lease
        (peer("10.244.1.0/24"), OVERLAPS_OWN),
        (peer("10.244.2.0/24", ip="127.0.0.1"), BAD_ADDRESS),
        (peer("10.244.2.0/24", ip="224.0.0.1"), BAD_ADDRESS),
        (peer("10.244.2.0/24", ip="0.0.0.0"), BAD_ADDRESS),
        (peer("10.244.2.0/24", ip="169.254.1.1"), BAD_ADDRESS),
        (peer("10.244.2.0/24", ip="10.244.9.9"), BAD_ADDRESS),  # inside the overlay
        (peer("10.244.2.0/24", ip="100.64.0.11"), OWN_ADDRESS),
        (peer("10.244.2.0/24", data={"VNI": "1", "VtepMAC": "c6:d2:32:6f:8f:44"}), BACKEND_DATA),
        (peer("10.244.2.0/24", data={"VNI": 1, "VtepMAC": {"x": 1}}), BACKEND_DATA),
        (peer("10.244.2.0/24", data={"VNI": 1 << 24}), BACKEND_DATA),
        (peer("10.244.2.0/24", data={"VNI": 1, "VtepMAC": "not-a-mac"}), BACKEND_DATA),
    ],
)
def test_hostile_peer_leases_are_rejected(lease: Lease, reason: str) -> None:
    why = check_peer(lease, BOUNDS)
    assert why is not None and why.reason == reason, why


def test_a_lease_over_the_nodes_addresses_is_rejected() -> None:
    bounds = Bounds(
        networks=(IPv4Network("10.0.0.0/8"),),
        own=(),
        public_ip=IPv4Address("10.1.0.5"),
        host=(IPv4Network("10.1.0.0/24"),),
    )
    why = check_peer(peer("10.1.0.0/24"), bounds)
    assert why is not None and why.reason == OVERLAPS_HOST


def test_good_peers_pass_and_split_sorts_them() -> None:
    good = [
        peer("10.244.2.0/24"),
        peer("10.250.3.0/24", data=None),
        peer("10.244.3.0/24", data={"VNI": 1, "VtepMAC": "C6:D2:32:6F:8F:44"}),
    ]
    leases = {x.key: x for x in [*good, peer("100.64.0.0/24")]}
    accepted, rejected = split_peers(leases, [], BOUNDS)
    assert set(accepted) == {x.key for x in good}
    assert list(rejected) == ["100.64.0.0-24"]


# -- in the agent ---------------------------------------------------------------------


def put_raw(h: AgentHarness, key_suffix: str, value: str) -> None:
    h.store.put(f"{PREFIX}/subnets/{key_suffix}", value.encode())


def value(ip: str) -> str:
    return json.dumps({"PublicIP": ip, "BackendType": "vxlan", "BackendData": GOOD_MAC})


def rejected_total(h: AgentHarness, reason: str) -> float:
    got = h.writer.metrics.registry.get_sample_value(
        "flannelpy_rejected_leases_total", {"reason": reason}
    )
    return got or 0.0


def test_the_agent_never_programs_hostile_leases_and_counts_them(tmp_path: Path) -> None:
    h = AgentHarness(tmp_path)
    h.start()
    try:
        put_raw(h, "192.168.1.0-24", value("192.168.1.20"))  # our underlay's subnet
        put_raw(h, "10.244.200.0-24", value("127.0.0.1"))
        put_raw(h, "10.244.201.0-24", DEEP)
        put_raw(h, "10.244.202.0-24", value("192.168.1.21"))  # a good peer
        for _ in range(2):  # twice: logged and counted once
            h.deliver_leases()
        h.reconcile()
        dsts = {str(r.dst) for r in h.kernel.state.routes}
        assert "10.244.202.0/24" in dsts
        assert not dsts & {"192.168.1.0/24", "10.244.200.0/24", "10.244.201.0/24"}
        view = h.writer.view
        assert [(r.key, r.reason) for r in view.rejected] == [
            ("10.244.200.0-24", BAD_ADDRESS),
            ("10.244.201.0-24", UNDECODABLE),
            ("192.168.1.0-24", OUTSIDE_NETWORK),
        ]
        assert view.peers == 1
        for reason in (BAD_ADDRESS, UNDECODABLE, OUTSIDE_NETWORK):
            assert rejected_total(h, reason) == 1.0
        h.store.delete_if_mod_revision(
            f"{PREFIX}/subnets/10.244.201.0-24",
            h.store.get(f"{PREFIX}/subnets/10.244.201.0-24").mod_revision,  # type: ignore[union-attr]
        )
        h.deliver_leases()
        assert [r.key for r in h.writer.view.rejected] == ["10.244.200.0-24", "192.168.1.0-24"]
    finally:
        h.stop()


def test_a_lease_with_our_address_outside_the_network_is_not_adopted(tmp_path: Path) -> None:
    h = AgentHarness(tmp_path / "a")
    put_raw(h, "10.244.5.0-24", value(NODE_IP))  # ours from an earlier run: reused
    put_raw(h, "192.168.1.0-24", value(NODE_IP))  # "ours" too, but our underlay's subnet
    h.start()
    try:
        # Before: adopted as a second lease of ours (and its gateway put on cni0).
        assert h.own_subnets() == [IPv4Network("10.244.5.0/24")]
        assert [(r.key, r.reason) for r in h.writer.view.rejected] == [
            ("192.168.1.0-24", OUTSIDE_NETWORK)
        ]
    finally:
        h.stop()


# -- two nodes, one name --------------------------------------------------------------


def two_managers(tmp_path: Path) -> tuple[EtcdSubnetManager, EtcdSubnetManager, FakeClock]:
    from flannelpy.store.etcd.config import put_network_config

    clock = FakeClock()
    store = FakeStore(clock=clock)
    put_network_config(store, PREFIX, '{"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan"}}')
    s = agent_settings(tmp_path)
    a = EtcdSubnetManager(store, s, clock=clock, rng=random.Random(1))
    b = EtcdSubnetManager(store, s, clock=clock, rng=random.Random(2))
    return a, b, clock


def me(ip: str) -> LeaseAttrs:
    return LeaseAttrs(public_ip=IPv4Address(ip), backend_type="vxlan", node_name="same-host")


def test_a_second_live_node_with_our_name_refuses_to_start(tmp_path: Path) -> None:
    a, b, _ = two_managers(tmp_path)
    held = a.acquire_lease(me("192.168.1.5"), None)
    # Before: b took held's key over by name, then a took it back, forever.
    with pytest.raises(ConfigError, match=r"already used by the live node at 192\.168\.1\.5"):
        b.acquire_lease(me("192.168.1.6"), None)
    leases, _ = a.list_leases()
    assert [(x.subnet, str(x.attrs.public_ip)) for x in leases.values()] == [
        (held.subnet, "192.168.1.5")
    ]
    assert a.renew_lease(held).subnet == held.subnet  # a keeps it


def test_a_node_recreated_with_a_new_address_takes_over_once_the_old_is_gone(
    tmp_path: Path,
) -> None:
    a, b, clock = two_managers(tmp_path)
    held = a.acquire_lease(me("192.168.1.5"), None)
    ttl, margin = 24 * 3600, 60 * 60
    clock.advance(ttl - margin)  # a's renewal is due now ...
    with pytest.raises(ConfigError):
        b.acquire_lease(me("192.168.1.6"), None)  # ... and a may still be retrying it
    clock.advance(RENEW_GRACE_SECONDS + 1)  # a missed it: gone
    took = b.acquire_lease(me("192.168.1.6"), None)
    assert took.subnet == held.subnet


def test_a_lost_lease_with_a_live_namesake_takes_a_fresh_subnet(tmp_path: Path) -> None:
    a, b, _ = two_managers(tmp_path)
    first = b.acquire_lease(
        LeaseAttrs(public_ip=IPv4Address("192.168.1.6"), backend_type="vxlan", node_name="other"),
        None,
    )
    held = a.acquire_lease(me("192.168.1.5"), None)
    # b renamed itself to a's name at runtime, then lost its lease: it re-acquires
    # without taking a's lease (no refusal: it is not b's start any more).
    b.release_lease(first)
    again = b.acquire_lease(me("192.168.1.6"), None)
    assert again.subnet != held.subnet
    kv = a._store.get(lease_key(PREFIX, held.subnet))
    assert kv is not None and json.loads(kv.value)["PublicIP"] == "192.168.1.5"


# -- watch loops never end on an error ------------------------------------------------


class FlakyStore(FakeStore):
    """Raises an error no handler foresaw on the first ``fail`` lists."""

    def __init__(self, fail: int, clock: FakeClock) -> None:
        super().__init__(clock=clock)
        self.fail = fail

    def get_prefix(self, prefix: str) -> tuple[list[Any], int]:
        if self.fail > 0 and "/subnets/" in prefix:
            self.fail -= 1
            raise RecursionError("maximum recursion depth exceeded")
        return super().get_prefix(prefix)


def test_the_lease_watch_survives_an_unexpected_error_and_counts_it(tmp_path: Path) -> None:
    from flannelpy.store.etcd.config import put_network_config

    clock = FakeClock()
    store = FlakyStore(2, clock)
    put_network_config(store, PREFIX, '{"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan"}}')
    restarts: list[str] = []
    stop = threading.Event()
    got: list[int] = []

    def on_leases(leases: Any, revision: int) -> None:
        got.append(revision)
        stop.set()

    manager = EtcdSubnetManager(
        store,
        agent_settings(tmp_path),
        clock=clock,
        sleep=lambda _stop, _s: None,
        on_watch_restart=restarts.append,
    )
    manager.watch_leases(on_leases, stop)  # before: the RecursionError ended the watch
    assert restarts == ["error", "error"] and len(got) == 1


def test_the_callbacks_own_exceptions_still_propagate(tmp_path: Path) -> None:
    from flannelpy.store.etcd.config import put_network_config

    store = FakeStore(clock=FakeClock())
    put_network_config(store, PREFIX, '{"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan"}}')
    manager = EtcdSubnetManager(store, agent_settings(tmp_path))

    def on_leases(leases: Any, revision: int) -> None:
        raise KeyError("the agent's bug")

    with pytest.raises(KeyError, match="the agent's bug"):
        manager.watch_leases(on_leases, threading.Event())
