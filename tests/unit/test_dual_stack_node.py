"""Dual stack, the node side: lease JSON and keys, peer validation, the IPv6 plan, MTU."""

from __future__ import annotations

import json
from dataclasses import replace
from ipaddress import (
    IPv4Address,
    IPv4Interface,
    IPv4Network,
    IPv6Address,
    IPv6Interface,
    IPv6Network,
)

import pytest

from flannelpy.backend.base import NodeContext
from flannelpy.backend.registry import get_backend
from flannelpy.config.netconf import parse_network_config
from flannelpy.dataplane.state import Address, FdbEntry, Neighbour, Route, UnderlayInterface
from flannelpy.dataplane.underlay import Interface, choose_underlay
from flannelpy.errors import ConfigError
from flannelpy.store.kube import node as kn
from flannelpy.subnet.keys import key_to_subnet, subnet_to_key
from flannelpy.subnet.lease import Lease, LeaseAttrs
from flannelpy.subnet.validate import (
    BACKEND_DATA,
    BAD_ADDRESS,
    OUTSIDE_NETWORK,
    OVERLAPS_OWN,
    Bounds,
    check_peer,
)

MAC = "02:00:00:00:00:01"
MAC6 = "06:00:00:00:00:01"  # flannel-v6.1's: its own, as each of flanneld's devices has
PEER_MAC = "02:00:00:00:00:02"


def dual_config(backend: str = "vxlan", **options: object) -> object:
    return parse_network_config(
        json.dumps(
            {
                "Network": "10.244.0.0/16",
                "EnableIPv6": True,
                "IPv6Network": "fc00::/48",
                "Backend": {"Type": backend, **options},
            }
        )
    )


def ctx(backend: str = "vxlan", mtu: int = 1500, **options: object) -> NodeContext:
    config = dual_config(backend, **options)
    under = UnderlayInterface(
        name="eth0",
        index=2,
        ip=IPv4Address("192.168.1.10"),
        networks=(IPv4Network("192.168.1.0/24"),),
        mtu=mtu,
        ip6=IPv6Address("fd00:64::10"),
        networks6=(IPv6Network("fd00:64::/64"),),
    )
    return NodeContext(
        config=config,  # type: ignore[arg-type]
        underlay=under,
        public_ip=IPv4Address("192.168.1.10"),
        node_name="n1",
        public_ipv6=IPv6Address("fd00:64::10"),
    )


def dual_lease(
    n: int,
    ip6: str | None,
    mac: str | None = PEER_MAC,
    backend: str = "vxlan",
    direct: bool = False,
) -> Lease:
    data = {"VNI": 1, "VtepMAC": mac} if backend == "vxlan" and mac else None
    return Lease(
        subnet=IPv4Network(f"10.244.{n}.0/24"),
        ipv6_subnet=IPv6Network(f"fc00:0:0:{n:x}::/64"),
        attrs=LeaseAttrs(
            public_ip=IPv4Address(f"192.168.{1 if ip6 and 'fd00:64:' in ip6 else 2}.{n}"),
            backend_type=backend,
            backend_data=data,
            public_ipv6=IPv6Address(ip6) if ip6 else None,
            backend_v6_data=data,
            mtu=1430,
            direct_routing=True if direct else None,
        ),
    )


OWN = replace(dual_lease(1, "fd00:64::10", mac=MAC))


# --- lease keys and JSON, as Flannel writes them -------------------------------------------


def test_dual_lease_key_is_flannels() -> None:
    key = subnet_to_key(IPv4Network("10.244.1.0/24"), IPv6Network("fc00:0:0:1::/64"))
    assert key == "10.244.1.0-24&fc00:0:0:1::-64"
    assert key_to_subnet(key) == (IPv4Network("10.244.1.0/24"), IPv6Network("fc00:0:0:1::/64"))


def test_lease_json_carries_public_ipv6_and_backend_v6_data_round_trip() -> None:
    attrs = get_backend("vxlan").lease_attrs(ctx(), MAC)
    doc = json.loads(attrs.to_json())
    assert doc["PublicIPv6"] == "fd00:64::10"
    assert doc["BackendV6Data"] == {"VNI": 1, "VtepMAC": MAC6}
    assert doc["BackendData"] == {"VNI": 1, "VtepMAC": MAC}
    assert LeaseAttrs.from_json(attrs.to_json()) == attrs


def test_flanneld_dual_stack_lease_value_parses() -> None:
    # What flanneld v0.28 writes for a dual-stack vxlan node.
    raw = (
        '{"PublicIP":"192.168.64.3","PublicIPv6":"fd00:64::3","BackendType":"vxlan",'
        '"BackendData":{"VNI":1,"VtepMAC":"c6:d2:32:6f:8f:44"},'
        '"BackendV6Data":{"VNI":1,"VtepMAC":"6a:1f:00:11:22:33"}}'
    )
    attrs = LeaseAttrs.from_json(raw)
    assert attrs.public_ipv6 == IPv6Address("fd00:64::3")
    assert attrs.vtep_mac_v6 == "6a:1f:00:11:22:33"


@pytest.mark.parametrize("value", ['"not-an-ip"', '"10.0.0.1"', '"' + "1" * 80 + '"'])
def test_a_bogus_public_ipv6_makes_the_lease_undecodable(value: str) -> None:
    raw = '{"PublicIP":"192.168.64.3","BackendType":"vxlan","PublicIPv6":' + value + "}"
    with pytest.raises(ValueError, match="PublicIPv6"):
        LeaseAttrs.from_json(raw)


def test_null_public_ipv6_is_no_ipv6() -> None:
    raw = '{"PublicIP":"192.168.64.3","PublicIPv6":null,"BackendType":"host-gw"}'
    assert LeaseAttrs.from_json(raw).public_ipv6 is None


# --- hostile IPv6 halves of peer leases ----------------------------------------------------


def bounds() -> Bounds:
    return Bounds(
        networks=(IPv4Network("10.244.0.0/16"),),
        own=(IPv4Network("10.244.1.0/24"),),
        host=(IPv4Network("192.168.1.0/24"),),
        public_ip=IPv4Address("192.168.1.10"),
        ipv6_networks=(IPv6Network("fc00::/48"),),
        own6=(IPv6Network("fc00:0:0:1::/64"),),
        host6=(IPv6Network("fd00:64::/64"),),
        host_ips6=(IPv6Address("fd00:64::10"),),
    )


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"ipv6_subnet": IPv6Network("fd99::/64")}, OUTSIDE_NETWORK),
        ({"ipv6_subnet": IPv6Network("fc00:0:0:1::/64")}, OVERLAPS_OWN),
        ({"public_ipv6": IPv6Address("fe80::1")}, BAD_ADDRESS),
        ({"public_ipv6": IPv6Address("::1")}, BAD_ADDRESS),
        ({"public_ipv6": IPv6Address("ff02::1")}, BAD_ADDRESS),
        ({"public_ipv6": IPv6Address("fc00:0:0:5::1")}, BAD_ADDRESS),  # inside IPv6Network
        ({"backend_v6_data": {"VNI": 1, "VtepMAC": "zz"}}, BACKEND_DATA),
    ],
)
def test_hostile_ipv6_halves_are_rejected(change: dict[str, object], reason: str) -> None:
    peer = dual_lease(5, "fd00:64::5")
    if "ipv6_subnet" in change:
        peer = replace(peer, ipv6_subnet=change["ipv6_subnet"])  # type: ignore[arg-type]
    else:
        peer = replace(peer, attrs=replace(peer.attrs, **change))  # type: ignore[arg-type]
    why = check_peer(peer, bounds())
    assert why is not None and why.reason == reason, why


def test_a_sound_dual_stack_peer_is_accepted() -> None:
    assert check_peer(dual_lease(5, "fd00:64::5"), bounds()) is None


# --- the IPv6 plan ---------------------------------------------------------------------------


def test_vxlan_dual_stack_programs_flannel_v6_with_flannels_recipe() -> None:
    peer = dual_lease(5, "fd00:99::5")  # not on our IPv6 segment: encapsulated
    state = get_backend("vxlan").plan(ctx(), [OWN], [peer], MAC)
    v6 = next(link for link in state.links if link.name == "flannel-v6.1")
    assert (v6.local_ip, v6.mtu, v6.vni, v6.port) == (IPv6Address("fd00:64::10"), 1430, 1, 8472)
    v4 = next(link for link in state.links if link.name == "flannel.1")
    assert v4.mtu == 1450
    # Each device its own MAC, as flanneld's (before: flannel-v6.1 took flannel.1's).
    assert (v4.mac, v6.mac) == (MAC, MAC6)
    assert Address("flannel-v6.1", IPv6Interface("fc00:0:0:1::/128")) in state.addresses
    assert Address("flannel.1", IPv4Interface("10.244.1.0/32")) in state.addresses
    assert Neighbour("flannel-v6.1", IPv6Address("fc00:0:0:5::"), PEER_MAC) in state.neighbours
    assert FdbEntry("flannel-v6.1", PEER_MAC, IPv6Address("fd00:99::5")) in state.fdb
    assert (
        Route(
            IPv6Network("fc00:0:0:5::/64"), IPv6Address("fc00:0:0:5::"), "flannel-v6.1", onlink=True
        )
        in state.routes
    )
    assert {"flannel.1", "flannel-v6.1"} <= state.owned_devices


def test_dual_stack_overlay_mtu_is_the_ipv6_underlays() -> None:
    # VXLAN over IPv6 costs 70 bytes; one MTU serves both families of a pod.
    assert get_backend("vxlan").mtu(ctx()) == 1430
    assert get_backend("vxlan").mtu(ctx(mtu=9000)) == 8930
    assert get_backend("host-gw").mtu(ctx("host-gw")) == 1500


def test_host_gw_dual_stack_routes_each_family_via_the_peer() -> None:
    peer = dual_lease(5, "fd00:64::5", backend="host-gw", mac=None)
    peer = replace(peer, attrs=replace(peer.attrs, public_ip=IPv4Address("192.168.1.5")))
    state = get_backend("host-gw").plan(ctx("host-gw"), [OWN], [peer], None)
    assert state.routes == {
        Route(IPv4Network("10.244.5.0/24"), IPv4Address("192.168.1.5"), "eth0"),
        Route(IPv6Network("fc00:0:0:5::/64"), IPv6Address("fd00:64::5"), "eth0"),
    }
    assert not state.links


def test_direct_routing_is_per_family() -> None:
    # On our IPv4 segment but not our IPv6 one: direct in IPv4, encapsulated in IPv6.
    peer = dual_lease(5, "fd00:99::5")
    peer = replace(peer, attrs=replace(peer.attrs, public_ip=IPv4Address("192.168.1.5")))
    state = get_backend("vxlan").plan(ctx(DirectRouting=True), [OWN], [peer], MAC)
    routes = {(r.dst, r.ifname) for r in state.routes}
    assert (IPv4Network("10.244.5.0/24"), "eth0") in routes
    assert (IPv6Network("fc00:0:0:5::/64"), "flannel-v6.1") in routes


def test_ipv4_only_peer_in_a_dual_stack_cluster_gets_no_ipv6_entries() -> None:
    peer = replace(dual_lease(5, None), ipv6_subnet=None)
    state = get_backend("vxlan").plan(ctx(), [OWN], [peer], MAC)
    assert all(r.dst.version == 4 for r in state.routes)


# --- interface auto-detection and Kubernetes annotations -----------------------------------


def test_underlay_takes_the_interfaces_global_ipv6_address() -> None:
    eth0 = Interface(
        "eth0",
        2,
        1500,
        (IPv4Interface("192.168.1.10/24"),),
        (IPv6Interface("fe80::1/64"), IPv6Interface("fd00:64::10/64")),
    )
    chosen = choose_underlay([eth0], default_oif=2)
    assert chosen.ip6 == IPv6Address("fd00:64::10")
    assert chosen.networks6 == (IPv6Network("fd00:64::/64"),)
    assert chosen.on_link(IPv6Address("fd00:64::99"))
    assert not chosen.on_link(IPv6Address("fe80::99"))


KEYS = kn.annotation_keys("flannel.alpha.coreos.com")


def node(**annotations: str) -> dict[str, object]:
    return {
        "metadata": {"name": "n2", "annotations": {KEYS.managed: "true", **annotations}},
        "spec": {"podCIDRs": ["10.244.2.0/24", "fc00:0:0:2::/64"]},
    }


def test_kube_node_per_family_lease_and_overwrite() -> None:
    config = dual_config()
    peer = kn.node_to_lease(
        node(
            **{
                KEYS.public_ip: "192.168.1.2",
                KEYS.backend_type: "vxlan",
                KEYS.backend_data: '{"VNI":1,"VtepMAC":"02:00:00:00:00:02"}',
                KEYS.public_ipv6: "fd00:64::2",
                KEYS.public_ipv6_overwrite: "fd00:64::22",
                KEYS.backend_v6_data: '{"VNI":1,"VtepMAC":"02:00:00:00:00:02"}',
            }
        ),
        KEYS,
        config,  # type: ignore[arg-type]
    )
    assert peer is not None
    assert peer.ipv6_subnet == IPv6Network("fc00:0:0:2::/64")
    assert peer.attrs.public_ipv6 == IPv6Address("fd00:64::22")
    assert peer.attrs.vtep_mac_v6 == "02:00:00:00:00:02"
    with pytest.raises(kn.NotALease, match="public-ipv6"):
        kn.node_to_lease(
            node(**{KEYS.public_ip: "192.168.1.2", KEYS.public_ipv6: "nope"}),
            KEYS,
            config,  # type: ignore[arg-type]
        )


def test_kube_writes_public_ipv6_and_backend_v6_data() -> None:
    attrs = get_backend("vxlan").lease_attrs(ctx(), MAC)
    me = node(**{KEYS.node_public_ipv6: "fd00:64::77", KEYS.public_ipv6_overwrite: "fd00:64::88"})
    assert kn.node_public_ipv6(me, KEYS) == IPv6Address("fd00:64::77")
    advertised = kn.advertised_attrs(attrs, me, KEYS)
    wanted = kn.desired_annotations(advertised, KEYS)
    assert wanted[KEYS.public_ipv6] == "fd00:64::88"
    assert json.loads(wanted[KEYS.backend_v6_data]) == {"VNI": 1, "VtepMAC": MAC6}
    assert json.loads(wanted[KEYS.backend_data]) == {"VNI": 1, "VtepMAC": MAC}


def test_kube_dual_stack_waits_for_both_pod_cidrs() -> None:
    config = dual_config()
    only_v4 = {"metadata": {"name": "n1"}, "spec": {"podCIDRs": ["10.244.2.0/24"]}}
    assert kn.own_subnets(only_v4, config) is None  # type: ignore[arg-type]
    both = {"metadata": {"name": "n1"}, "spec": {"podCIDRs": ["10.244.2.0/24", "fc00:0:0:2::/64"]}}
    assert kn.own_subnets(both, config) == (  # type: ignore[arg-type]
        IPv4Network("10.244.2.0/24"),
        IPv6Network("fc00:0:0:2::/64"),
    )


def test_kube_ipv6_only_reads_and_writes_the_ipv6_half_alone() -> None:
    config = parse_network_config(
        json.dumps(
            {
                "EnableIPv4": False,
                "EnableIPv6": True,
                "IPv6Network": "fc00::/48",
                "Backend": {"Type": "vxlan"},
            }
        )
    )
    v6_node = {"metadata": {"name": "n1"}, "spec": {"podCIDRs": ["fc00:0:0:2::/64"]}}
    assert kn.own_subnets(v6_node, config) == (None, IPv6Network("fc00:0:0:2::/64"))
    assert kn.own_subnets({"metadata": {"name": "n1"}, "spec": {}}, config) is None
    outside = {"metadata": {"name": "n1"}, "spec": {"podCIDRs": ["fd99::/64"]}}
    with pytest.raises(ConfigError, match="outside IPv6Network"):
        kn.own_subnets(outside, config)
    # A flanneld peer IPv6-only: no public-ip, no backend-data.
    peer = kn.node_to_lease(
        {
            "metadata": {
                "name": "n2",
                "annotations": {
                    KEYS.managed: "true",
                    KEYS.backend_type: "vxlan",
                    KEYS.public_ipv6: "fd00:64::2",
                    KEYS.backend_v6_data: '{"VNI":1,"VtepMAC":"02:00:00:00:00:02"}',
                },
            },
            "spec": {"podCIDRs": ["fc00:0:0:3::/64"]},
        },
        KEYS,
        config,  # type: ignore[arg-type]
    )
    assert peer is not None and peer.subnet is None
    assert peer.ipv6_subnet == IPv6Network("fc00:0:0:3::/64")
    assert peer.attrs.public_ip is None and peer.attrs.public_ipv6 == IPv6Address("fd00:64::2")
    with pytest.raises(kn.NotALease, match="public-ipv6"):
        kn.node_to_lease(
            {
                "metadata": {"name": "n2", "annotations": {KEYS.managed: "true"}},
                "spec": {"podCIDRs": ["fc00:0:0:3::/64"]},
            },
            KEYS,
            config,  # type: ignore[arg-type]
        )
    # What we write: the IPv6 annotations, and no IPv4 ones, as flanneld.
    attrs = LeaseAttrs(
        public_ip=None,
        backend_type="vxlan",
        backend_data=None,
        public_ipv6=IPv6Address("fd00:64::1"),
        backend_v6_data={"VNI": 1, "VtepMAC": MAC},
        mtu=1430,
    )
    wanted = kn.desired_annotations(attrs, KEYS)
    assert KEYS.public_ip not in wanted and KEYS.backend_data not in wanted
    assert wanted[KEYS.public_ipv6] == "fd00:64::1"


# --- ip6tables ------------------------------------------------------------------------------


def test_ip6tables_rules_are_flannels_with_ff00_multicast() -> None:
    from flannelpy.dataplane.firewall import forward_rules, masq_rules

    net, sub = IPv6Network("fc00::/48"), IPv6Network("fc00:0:0:1::/64")
    lines = [r.line for r in masq_rules(net, [sub], random_fully=True)]
    comment = '-m comment --comment "flanneld masq"'
    assert lines == [
        f"-A POSTROUTING {comment} -j FLANNEL-POSTRTG",
        f"-A FLANNEL-POSTRTG -m mark --mark 0x4000/0x4000 {comment} -j RETURN",
        f"-A FLANNEL-POSTRTG -s {sub} -d {net} {comment} -j RETURN",
        f"-A FLANNEL-POSTRTG -s {net} -d {sub} {comment} -j RETURN",
        f"-A FLANNEL-POSTRTG ! -s {net} -d {sub} {comment} -j RETURN",
        f"-A FLANNEL-POSTRTG -s {net} ! -d ff00::/8 {comment} -j MASQUERADE --random-fully",
        f"-A FLANNEL-POSTRTG ! -s {net} -d {net} {comment} -j MASQUERADE --random-fully",
    ]
    assert [r.line for r in forward_rules(net)][1:] == [
        f'-A FLANNEL-FWD -s {net} -m comment --comment "flanneld forward" -j ACCEPT',
        f'-A FLANNEL-FWD -d {net} -m comment --comment "flanneld forward" -j ACCEPT',
    ]


# --- etcd: acquire, a flanneld lease beside ours, restart keeps both subnets ---------------


def test_etcd_dual_stack_acquire_and_restart_keep_both_subnets(tmp_path: object) -> None:
    import random
    from pathlib import Path

    from flannelpy.store.etcd.config import put_network_config
    from flannelpy.store.etcd.kv import FakeStore
    from flannelpy.store.etcd.manager import EtcdSubnetManager
    from flannelpy.subnet.keys import lease_key
    from flannelpy.subnet.subnet_env import SubnetEnv, read_previous_subnets, write_subnet_env
    from tests.support.agent_fakes import PREFIX, agent_settings

    store = FakeStore()
    put_network_config(
        store,
        PREFIX,
        json.dumps(
            {
                "Network": "10.244.0.0/16",
                "EnableIPv6": True,
                "IPv6Network": "fc00::/48",
                "Backend": {"Type": "vxlan"},
            }
        ),
    )
    # A flanneld node's dual lease, exactly as it writes it.
    flanneld_key = lease_key(PREFIX, IPv4Network("10.244.9.0/24"), IPv6Network("fc00:0:0:1::/64"))
    assert flanneld_key.endswith("/subnets/10.244.9.0-24&fc00:0:0:1::-64")
    store.create(
        flanneld_key,
        b'{"PublicIP":"192.168.1.9","PublicIPv6":"fd00:64::9",'
        b'"BackendType":"vxlan","BackendData":{"VNI":1,"VtepMAC":"02:00:00:00:00:09"},'
        b'"BackendV6Data":{"VNI":1,"VtepMAC":"02:00:00:00:00:09"}}',
        0,
    )
    settings = agent_settings(Path(str(tmp_path)))
    attrs = get_backend("vxlan").lease_attrs(ctx(), MAC)
    first = EtcdSubnetManager(store, settings, rng=random.Random(3)).acquire_lease(attrs, None)
    assert first.ipv6_subnet is not None and first.ipv6_subnet != IPv6Network("fc00:0:0:1::/64")
    leases, _ = EtcdSubnetManager(store, settings).list_leases()
    assert leases[first.key].attrs.public_ipv6 == IPv6Address("fd00:64::10")
    peer = leases["10.244.9.0-24&fc00:0:0:1::-64"]
    assert peer.attrs.vtep_mac_v6 == "02:00:00:00:00:09"

    # The node's key vanished (a wiped store, an expired lease): subnet.env brings both back.
    env_path = str(Path(str(tmp_path)) / "subnet.env")
    write_subnet_env(
        env_path,
        SubnetEnv.for_lease(
            IPv4Network("10.244.0.0/16"),
            first.subnet,
            1430,
            True,
            IPv6Network("fc00::/48"),
            first.ipv6_subnet,
        ),
    )
    assert store.delete_if_mod_revision(
        lease_key(PREFIX, first.subnet, first.ipv6_subnet), first.revision
    )
    v4, v6 = read_previous_subnets(env_path)
    other = replace(attrs, public_ip=IPv4Address("192.168.1.77"))  # a new address, same node
    again = EtcdSubnetManager(store, settings, rng=random.Random(99)).acquire_lease(
        other, v4, previous_ipv6_subnet=v6
    )
    assert (again.subnet, again.ipv6_subnet) == (first.subnet, first.ipv6_subnet)


def test_lab_ip_family_dual_plans_a_ula_underlay_and_the_ipv6_keys() -> None:
    from flannelpy_lab import plan

    assert plan.ip_family_net_conf("ipv4") == {}
    assert plan.ip_family_net_conf("dual") == {"EnableIPv6": True, "IPv6Network": "fd10:244::/56"}
    assert plan.ip_family_net_conf("ipv6") == {
        "EnableIPv4": False,
        "EnableIPv6": True,
        "IPv6Network": "fd10:244::/56",
    }
    with pytest.raises(ConfigError, match="is unknown"):
        plan.ip_family_net_conf("ipv5")
    state = plan.plan_lab(
        "ds",
        3,
        "vxlan",
        direct_routing=False,
        segments=1,
        network="10.244.0.0/16",
        etcd_prefix="/coreos.com/network",
        subnets=[IPv4Network("100.64.7.0/24")],
        overlay_bridge=True,
    )
    assert not plan.ipv6_enabled(state)
    state.extra["net_conf_extra"] = plan.ip_family_net_conf("dual")
    assert plan.ipv6_enabled(state)
    # fd00:64:<segment>::<host>/64: a ULA, unique per node, on the lab switch only.
    assert [plan.ipv6_underlay_address(n) for n in state.nodes] == [
        "fd00:64:1::1/64",
        "fd00:64:1::2/64",
        "fd00:64:1::3/64",
    ]
    assert IPv6Network("fd00:64:1::/64").is_private


def test_two_nodes_creating_dual_keys_with_one_ipv4_subnet_at_once_end_with_two(
    tmp_path: object,
) -> None:
    """Seen in the lab under load: two nodes started together chose the same IPv4 subnet
    with different IPv6 ones; their keys differ, so both creates succeeded and two nodes
    held one subnet. The later one must give it up and choose again."""
    import random
    from pathlib import Path

    from flannelpy.store.etcd.config import put_network_config
    from flannelpy.store.etcd.kv import FakeStore
    from flannelpy.store.etcd.manager import EtcdSubnetManager
    from flannelpy.subnet.keys import lease_key
    from tests.support.agent_fakes import PREFIX, agent_settings

    other_value = (
        b'{"PublicIP":"192.168.1.9","PublicIPv6":"fd00:64::9","BackendType":"vxlan",'
        b'"BackendData":{"VNI":1,"VtepMAC":"02:00:00:00:00:09"},'
        b'"BackendV6Data":{"VNI":1,"VtepMAC":"02:00:00:00:00:09"}}'
    )
    taken: list[str] = []

    class RacingStore(FakeStore):
        """Another node creates a key with our IPv4 subnet just before our first create."""

        def create(self, key: str, value: bytes, lease_id: int = 0) -> int:
            if not taken:
                v4 = key.rsplit("/", 1)[1].split("&")[0]
                theirs = f"{PREFIX}/subnets/{v4}&fc00:0:0:ff::-64"
                taken.append(theirs)
                super().create(theirs, other_value, 0)
            return super().create(key, value, lease_id)

    store = RacingStore()
    put_network_config(
        store,
        PREFIX,
        json.dumps(
            {
                "Network": "10.244.0.0/16",
                "EnableIPv6": True,
                "IPv6Network": "fc00::/48",
                "Backend": {"Type": "vxlan"},
            }
        ),
    )
    settings = agent_settings(Path(str(tmp_path)))
    attrs = get_backend("vxlan").lease_attrs(ctx(), MAC)
    ours = EtcdSubnetManager(store, settings, rng=random.Random(3)).acquire_lease(attrs, None)
    leases, _ = EtcdSubnetManager(store, settings).list_leases()
    theirs = leases[taken[0].rsplit("/", 1)[1]]
    assert ours.subnet != theirs.subnet and ours.ipv6_subnet != theirs.ipv6_subnet
    # Our first key was deleted again: the store holds the other node's and our second.
    assert sorted(leases) == sorted({theirs.key, ours.key})
    assert store.get(lease_key(PREFIX, ours.subnet, ours.ipv6_subnet)) is not None
