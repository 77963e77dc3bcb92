"""The wireguard backend's pure parts: config, keys, UAPI text, peer diff, planning, paths."""

from __future__ import annotations

import base64
import json
import os
import stat
import subprocess
from dataclasses import replace
from ipaddress import (
    IPv4Address,
    IPv4Interface,
    IPv4Network,
    IPv6Address,
    IPv6Interface,
    IPv6Network,
)
from typing import Any

import pytest

from flannelpy.backend.base import NodeContext
from flannelpy.backend.paths import choose_path, own_capabilities, peer_capabilities
from flannelpy.backend.registry import get_backend
from flannelpy.backend.wireguard import WireguardBackend, unencrypted_peers
from flannelpy.backend.wireguard_config import WireguardConfig, parse_wireguard_config
from flannelpy.backend.wireguard_runtime import WireguardRuntime
from flannelpy.config.netconf import BackendConfig, parse_network_config
from flannelpy.dataplane.state import DesiredState, Route
from flannelpy.dataplane.uapi import WgDeviceConfig, WgPeer, format_set, parse_get
from flannelpy.dataplane.wgkeys import generate_private_key, load_or_create_key, public_key
from flannelpy.dataplane.wgspec import PeerChanges, WgDeviceSpec, peer_changes
from flannelpy.dataplane.wireguard import KERNEL_FIX, WireguardDevice, choose_implementation
from flannelpy.errors import ConfigError, DataplaneError
from flannelpy.subnet.lease import Lease, LeaseAttrs
from tests.support.fakes import context, lease

KEY_A = "YHl4XgeS8ZbhGdIAhDCzUJIJkuF7IB0Mf8ZpA4tlVmo="  # a private key
KEY_B = generate_private_key()
KEY_C = generate_private_key()
PUB_B, PUB_C = public_key(KEY_B), public_key(KEY_C)
PSK = base64.b64encode(bytes(range(32))).decode()
NET = IPv4Network("10.244.0.0/16")


def backend_of(**options: Any) -> BackendConfig:
    raw = {"Type": "wireguard", **options}
    doc = json.dumps({"Network": "10.244.0.0/16", "Backend": raw})
    return parse_network_config(doc).backend


def wg_lease(
    subnet: str,
    ip: str,
    pub: str | None,
    port: int | None = 51820,
    extra: dict[str, Any] | None = None,
) -> Lease:
    data: dict[str, Any] = {"PublicKey": pub}
    if port is not None:
        data["Port"] = port
    data.update(extra or {})
    return Lease(IPv4Network(subnet), LeaseAttrs(IPv4Address(ip), "wireguard", data, mtu=1440))


def identified(tmp_path: Any, ctx: NodeContext) -> NodeContext:
    """``ctx`` with the node's key loaded, as the agent does before it plans wireguard."""
    rt = WireguardRuntime(
        str(tmp_path / "wireguard.key"), str(tmp_path / "run"), implementation="userspace"
    )
    options = parse_wireguard_config(ctx.config.backend)
    return replace(ctx, wireguard_identity=rt.prepare(options))


def devices(state: DesiredState) -> list[WgDeviceSpec]:
    """The planned WireGuard devices, flannel-wg first."""
    return sorted(state.wireguard, key=lambda spec: spec.name)


# --- config ----------------------------------------------------------------------------


def test_flannel_s_defaults() -> None:
    assert parse_wireguard_config(backend_of()) == WireguardConfig(
        listen_port=51820,
        listen_port_v6=51821,
        psk=None,
        keepalive=0,
        mode="separate",
        implementation="auto",
    )


def test_options_are_read_case_insensitively_as_go_does() -> None:
    config = parse_wireguard_config(
        backend_of(
            listenport=51900,
            PSK=PSK,
            PersistentKeepaliveInterval=25,
            mode="AUTO",
            Implementation="userspace",
        )
    )
    assert (
        config.listen_port,
        config.psk,
        config.keepalive,
        config.mode,
        config.implementation,
    ) == (51900, PSK, 25, "auto", "userspace")


@pytest.mark.parametrize(
    ("options", "words"),
    [
        ({"ListenPort": 0}, 'Backend "ListenPort" must be a whole number in 1..65535'),
        ({"ListenPort": "51820"}, '"ListenPort"'),
        ({"PersistentKeepaliveInterval": -1}, '"PersistentKeepaliveInterval"'),
        ({"PersistentKeepaliveInterval": 2.5}, '"PersistentKeepaliveInterval"'),
        ({"Mode": "both"}, "use one of: separate, auto, ipv4, ipv6"),
        ({"Mode": "ipv6"}, 'use "separate" (the default) or "ipv4"'),
        ({"PSK": "not-a-key"}, "`wg genpsk`"),
        ({"Implementation": "dpdk"}, "use one of: auto, kernel, userspace"),
    ],
)
def test_bad_options_are_refused_in_one_sentence(options: dict[str, Any], words: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_wireguard_config(backend_of(**options))
    assert words in str(exc.value)
    assert str(exc.value).count(". ") == 0


def test_kernel_without_the_module_is_refused_saying_what_to_install() -> None:
    with pytest.raises(ConfigError) as exc:
        choose_implementation("kernel", module=False, userspace_binary="/usr/bin/wireguard-go")
    assert KERNEL_FIX in str(exc.value)
    assert choose_implementation("auto", False, "/usr/bin/wireguard-go") == "userspace"
    assert choose_implementation("auto", True, None) == "kernel"
    assert choose_implementation("userspace", True, "/usr/bin/wireguard-go") == "userspace"
    with pytest.raises(ConfigError, match="apt-get install wireguard-go"):
        choose_implementation("auto", False, None)


# --- keys ------------------------------------------------------------------------------


def test_x25519_matches_rfc_7748() -> None:
    # RFC 7748 section 6.1: Alice's private key and public key.
    alice = bytes.fromhex("77076d0a7318a57d3c16c17251b26645df4c2f87ebc0992ab177fba51db92c2a")
    expected = bytes.fromhex("8520f0098930a754748b7ddcb43ef75a0dbf3a0d26381af4eba4a98eaa9b4e6a")
    assert base64.b64decode(public_key(base64.b64encode(alice).decode())) == expected


def test_public_key_matches_wg_pubkey() -> None:
    out = subprocess.run(
        ["wg", "pubkey"], input=KEY_A + "\n", capture_output=True, text=True, check=True
    )
    assert public_key(KEY_A) == out.stdout.strip()


def test_the_key_is_generated_once_and_kept_0600(tmp_path: Any) -> None:
    path = str(tmp_path / "state" / "wireguard.key")
    first = load_or_create_key(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert load_or_create_key(path) == first
    with open(path, "w") as f:
        f.write("garbage")
    with pytest.raises(ConfigError, match="remove it to have a new one generated"):
        load_or_create_key(path)


# --- UAPI ------------------------------------------------------------------------------


def test_uapi_get_answer_is_parsed() -> None:
    text = "\n".join(
        [
            f"private_key={base64.b64decode(KEY_A).hex()}",
            "listen_port=51820",
            f"public_key={base64.b64decode(PUB_B).hex()}",
            f"preshared_key={'0' * 64}",
            "protocol_version=1",
            "endpoint=100.64.0.2:51820",
            "last_handshake_time_sec=0",
            "tx_bytes=0",
            "persistent_keepalive_interval=25",
            "allowed_ip=10.244.2.0/24",
            "allowed_ip=fd00::/64",
            "errno=0",
            "",
        ]
    )
    got = parse_get(text)
    assert got.private_key == KEY_A and got.listen_port == 51820
    assert got.peers == {
        PUB_B: WgPeer(
            PUB_B,
            (IPv4Address("100.64.0.2"), 51820),
            frozenset({IPv4Network("10.244.2.0/24"), IPv6Network("fd00::/64")}),
            25,
            None,
        )
    }
    with pytest.raises(DataplaneError, match="errno 1"):
        parse_get("errno=1\n\n")


def test_an_ipv6_peer_round_trips_through_the_uapi() -> None:
    """flannel-wg-v6's peers: a bracketed IPv6 endpoint and IPv6 allowed IPs."""
    peer = WgPeer(
        PUB_B,
        (IPv6Address("fd00:64::2"), 51821),
        frozenset({IPv6Network("fd10:244:0:2::/64")}),
        0,
        None,
    )
    request = format_set(None, 51821, [peer]).decode()
    assert "endpoint=[fd00:64::2]:51821\n" in request
    assert "allowed_ip=fd10:244:0:2::/64\n" in request
    answer = request.replace("set=1\n", "").replace("replace_allowed_ips=true\n", "")
    assert parse_get(answer.rstrip("\n") + "\nerrno=0\n\n").peers == {PUB_B: peer}


def test_uapi_set_replaces_each_peer_whole() -> None:
    peer = WgPeer(
        PUB_B, (IPv4Address("100.64.0.2"), 51820), frozenset({IPv4Network("10.244.2.0/24")}), 0, PSK
    )
    text = format_set(KEY_A, 51820, [peer], remove=[PUB_C]).decode()
    lines = text.split("\n")
    assert lines[:3] == [
        "set=1",
        f"private_key={base64.b64decode(KEY_A).hex()}",
        "listen_port=51820",
    ]
    assert lines[3:5] == [f"public_key={base64.b64decode(PUB_C).hex()}", "remove=true"]
    assert "replace_allowed_ips=true" in lines and "allowed_ip=10.244.2.0/24" in lines
    assert f"preshared_key={bytes(range(32)).hex()}" in lines
    assert text.endswith("\n\n")


def test_only_the_difference_is_written() -> None:
    b = WgPeer(PUB_B, (IPv4Address("100.64.0.2"), 51820), frozenset({IPv4Network("10.244.2.0/24")}))
    c = WgPeer(PUB_C, (IPv4Address("100.64.0.3"), 51820), frozenset({IPv4Network("10.244.3.0/24")}))
    spec = WgDeviceSpec("flannel-wg", 51820, 1440, None, frozenset({b, c}))
    same = WgDeviceConfig(KEY_A, 51820, {PUB_B: b, PUB_C: c})
    assert peer_changes(spec, KEY_A, same).empty
    # c removed by hand, b's endpoint changed, a stranger added, the key overwritten
    stranger = WgPeer(PUB_A := public_key(KEY_A), None, frozenset())
    moved = WgPeer(PUB_B, (IPv4Address("100.64.0.9"), 51820), b.allowed_ips)
    changes = peer_changes(
        spec, KEY_A, WgDeviceConfig(KEY_B, 51820, {PUB_B: moved, PUB_A: stranger})
    )
    assert changes.private_key == KEY_A and changes.listen_port is None
    assert changes.remove == (PUB_A,)
    assert set(changes.set) == {b, c}


# --- planning --------------------------------------------------------------------------


def test_lease_carries_flannel_s_backend_data_and_the_mtu(tmp_path: Any) -> None:
    backend = WireguardBackend()
    ctx = identified(tmp_path, context("wireguard"))
    attrs = backend.lease_attrs(ctx, None)
    pub = attrs.backend_data["PublicKey"]  # type: ignore[index]
    assert attrs.backend_type == "wireguard"
    assert attrs.backend_data == {"PublicKey": pub, "Port": 51820}
    assert attrs.mtu == backend.mtu(ctx) == 1440  # IPv4 underlay of 1500 minus 60
    with open(tmp_path / "wireguard.key") as f:
        assert public_key(f.read().strip()) == pub
    # with a VTEP (a peer still vxlan) the VTEP is advertised beside the key
    with_vtep = backend.lease_attrs(ctx, "02:00:00:00:00:01")
    assert with_vtep.backend_data == {
        "PublicKey": pub,
        "Port": 51820,
        "VNI": 1,
        "VtepMAC": "02:00:00:00:00:01",
    }


def test_a_peer_per_node_and_one_route_for_the_network(tmp_path: Any) -> None:
    ctx = context("wireguard")
    backend_config = backend_of(PersistentKeepaliveInterval=25, PSK=PSK)
    ctx = identified(tmp_path, replace(ctx, config=replace(ctx.config, backend=backend_config)))
    own = wg_lease("10.244.1.0/24", "192.168.1.10", None)
    peers = [
        wg_lease("10.244.2.0/24", "192.168.1.11", PUB_B),
        wg_lease("10.244.7.0/24", "192.168.1.11", PUB_B),  # a second lease of that node
        wg_lease("10.244.3.0/24", "192.168.2.12", PUB_C, port=None),  # an older Flannel
        wg_lease("10.244.4.0/24", "192.168.1.14", "bad key"),
    ]
    state = WireguardBackend().plan(ctx, [own], peers, None)
    assert state.routes == {Route(NET, IPv4Address(0), "flannel-wg")}
    assert not state.links and not state.fdb
    (bad,) = state.unreachable
    assert bad.subnet == IPv4Network("10.244.4.0/24") and "PublicKey" in bad.reason
    (spec,) = state.wireguard
    assert (spec.name, spec.listen_port, spec.mtu) == ("flannel-wg", 51820, 1440)
    assert spec.address == IPv4Interface("10.244.1.0/32")
    assert spec.peers == {
        WgPeer(
            PUB_B,
            (IPv4Address("192.168.1.11"), 51820),
            frozenset({IPv4Network("10.244.2.0/24"), IPv4Network("10.244.7.0/24")}),
            25,
            PSK,
        ),
        WgPeer(
            PUB_C,
            (IPv4Address("192.168.2.12"), 51820),
            frozenset({IPv4Network("10.244.3.0/24")}),
            25,
            PSK,
        ),
    }


def test_a_wireguard_node_talks_vxlan_to_a_vxlan_peer_and_never_plain(tmp_path: Any) -> None:
    ctx = identified(tmp_path, context("wireguard"))
    own = wg_lease("10.244.1.0/24", "192.168.1.10", None)
    vxlan_peer = lease("10.244.2.0/24", "192.168.1.11", mac="02:00:00:00:00:02")
    hostgw_peer = lease("10.244.4.0/24", "192.168.1.13", backend="host-gw")
    backend = get_backend("wireguard")
    assert isinstance(backend, WireguardBackend)
    assert backend.needs_vtep(ctx, [vxlan_peer])
    assert not backend.needs_vtep(ctx, [wg_lease("10.244.3.0/24", "192.168.1.12", PUB_B)])
    state = backend.plan(ctx, [own], [vxlan_peer, hostgw_peer], "02:00:00:00:00:01")
    assert (
        Route(IPv4Network("10.244.2.0/24"), IPv4Address("10.244.2.0"), "flannel.1", onlink=True)
        in state.routes
    )
    assert not [r for r in state.routes if r.ifname == "eth0"]  # no plain direct route
    (unreachable,) = state.unreachable
    assert unreachable.subnet == IPv4Network("10.244.4.0/24")
    assert devices(state)[0].peers == frozenset()
    wg_peer = wg_lease("10.244.3.0/24", "192.168.1.12", PUB_B)
    assert unencrypted_peers(ctx, [own], [vxlan_peer, hostgw_peer, wg_peer]) == 1
    assert unencrypted_peers(ctx, [own], [wg_peer]) == 0


def test_a_vxlan_node_reaches_a_wireguard_peer_through_its_vtep_only() -> None:
    vx = own_capabilities(BackendConfig(type="vxlan"), "02:00:00:00:00:01")
    with_vtep = peer_capabilities(
        wg_lease(
            "10.244.3.0/24", "192.168.1.12", PUB_B, extra={"VNI": 1, "VtepMAC": "02:00:00:00:00:03"}
        )
    )
    without = peer_capabilities(wg_lease("10.244.3.0/24", "192.168.1.12", PUB_B))
    assert choose_path(vx, with_vtep, on_link=True) == "vxlan"
    assert not isinstance(choose_path(vx, without, on_link=True), str)
    dr = own_capabilities(BackendConfig(type="vxlan", direct_routing=True), "02:00:00:00:00:01")
    assert choose_path(dr, with_vtep, on_link=True) == "vxlan"  # DirectRouting yields
    wg = own_capabilities(BackendConfig(type="wireguard"), None)
    assert choose_path(wg, without, on_link=False) == "wireguard"


class FakeLink:
    def __init__(self) -> None:
        self.ensured: list[WgDeviceSpec] = []

    def exists(self, name: str) -> bool:
        return True

    def ensure(self, spec: WgDeviceSpec, create_kind: str | None) -> None:
        self.ensured.append(spec)

    def delete(self, name: str) -> None:
        pass


class FakeDevice:
    """Applies PeerChanges as a device would, and records each write."""

    def __init__(self) -> None:
        self.config = WgDeviceConfig(None, 0, {})
        self.writes: list[PeerChanges] = []

    def get(self) -> WgDeviceConfig:
        return self.config

    def set(self, changes: PeerChanges) -> None:
        self.writes.append(changes)
        peers = {k: v for k, v in self.config.peers.items() if k not in changes.remove}
        peers.update({p.public_key: p for p in changes.set})
        self.config = WgDeviceConfig(
            changes.private_key or self.config.private_key,
            changes.listen_port or self.config.listen_port,
            peers,
        )


def test_the_device_is_repaired_and_a_new_one_handshakes_at_once() -> None:
    b = WgPeer(PUB_B, (IPv4Address("100.64.0.2"), 51820), frozenset({IPv4Network("10.244.2.0/24")}))
    spec = WgDeviceSpec("flannel-wg", 51820, 1440, None, frozenset({b}))
    link, fake = FakeLink(), FakeDevice()
    repairs: list[tuple[str, int]] = []
    device = WireguardDevice(
        "flannel-wg",
        KEY_A,
        "kernel",
        "/nonexistent",
        link=link,
        on_repair=lambda kind, n: repairs.append((kind, n)),
    )
    device.configurator = fake
    device._spec = spec  # as set_desired stores it, without the loop thread
    device.reconcile_once()
    assert fake.config == WgDeviceConfig(KEY_A, 51820, {PUB_B: b})
    # a fresh device: keepalive switched on (one keepalive, a handshake now) and back off
    assert [w.set[0].keepalive for w in fake.writes[1:]] == [1, 0]
    assert link.ensured == [spec]
    # a peer removed by hand comes back, and is asked for a handshake (it may have
    # dropped ours meanwhile)
    fake.config = WgDeviceConfig(KEY_A, 51820, {})
    fake.writes.clear()
    device.reconcile_once()
    assert [w.set[0].keepalive for w in fake.writes] == [0, 1, 0]
    # a peer changed by hand (endpoint) is rewritten alone, no handshake forced
    fake.config = WgDeviceConfig(KEY_A, 51820, {PUB_B: replace(b, endpoint=None)})
    fake.writes.clear()
    device.reconcile_once()
    assert [w.set for w in fake.writes] == [(b,)]
    assert ("peers_set", 1) in repairs
    assert device.reconcile_once() == PeerChanges(
        counts={"peers_removed": 0, "peers_set": 0, "key": 0, "port": 0}
    )


# --- dual stack: flannel-wg-v6 (Mode separate) ----------------------------------------


def test_dual_stack_plans_the_ipv6_device_its_route_and_flannels_backend_v6_data(
    tmp_path: Any,
) -> None:
    from tests.unit.test_dual_stack_node import ctx as dual_ctx

    node = identified(tmp_path, dual_ctx("wireguard"))
    backend = WireguardBackend()
    attrs = backend.lease_attrs(node, None)
    assert attrs.public_ipv6 == IPv6Address("fd00:64::10")
    assert node.wireguard_identity is not None
    key = node.wireguard_identity.public_key
    assert attrs.backend_v6_data == {"PublicKey": key, "Port": 51821}
    assert attrs.mtu == 1500 - 80  # the pods' MTU: the smaller family's
    own = Lease(
        subnet=IPv4Network("10.244.1.0/24"), ipv6_subnet=IPv6Network("fc00:0:0:1::/64"), attrs=attrs
    )
    peer = Lease(
        subnet=IPv4Network("10.244.2.0/24"),
        ipv6_subnet=IPv6Network("fc00:0:0:2::/64"),
        attrs=LeaseAttrs(
            public_ip=IPv4Address("192.168.1.12"),
            backend_type="wireguard",
            backend_data={"PublicKey": PUB_B, "Port": 51820},
            public_ipv6=IPv6Address("fd00:64::12"),
            backend_v6_data={"PublicKey": PUB_B, "Port": 0},  # 0: ours, as Flannel reads it
        ),
    )
    desired = backend.plan(node, [own], [peer], None)
    v4, v6 = devices(desired)
    assert (v4.name, v4.listen_port, v4.mtu) == ("flannel-wg", 51820, 1440)
    assert (v6.name, v6.listen_port, v6.mtu) == ("flannel-wg-v6", 51821, 1420)
    assert v6.address == IPv6Interface("fc00:0:0:1::/128")
    assert v6.peers == {
        WgPeer(
            PUB_B, (IPv6Address("fd00:64::12"), 51821), frozenset({IPv6Network("fc00:0:0:2::/64")})
        )
    }
    assert (
        Route(dst=IPv6Network("fc00::/48"), gateway=IPv6Address(0), ifname="flannel-wg-v6")
        in desired.routes
    )


def test_dual_stack_with_one_device_for_both_families_is_refused(tmp_path: Any) -> None:
    from tests.unit.test_dual_stack_node import ctx as dual_ctx

    node = identified(tmp_path, dual_ctx("wireguard", Mode="auto"))
    with pytest.raises(ConfigError, match='use "separate"'):
        WireguardBackend().lease_attrs(node, None)


# --- IPv6-only (EnableIPv4 false): flannel-wg-v6 alone -------------------------------


def ipv6_only_ctx() -> Any:
    from flannelpy.backend.base import NodeContext
    from flannelpy.dataplane.state import UnderlayInterface

    config = parse_network_config(
        json.dumps(
            {
                "EnableIPv4": False,
                "EnableIPv6": True,
                "IPv6Network": "fc00::/48",
                "Backend": {"Type": "wireguard"},
            }
        )
    )
    under = UnderlayInterface(
        name="eth0",
        index=2,
        ip=None,
        networks=(),
        mtu=1500,
        ip6=IPv6Address("fd00:64::10"),
        networks6=(IPv6Network("fd00:64::/64"),),
    )
    return NodeContext(
        config=config,
        underlay=under,
        public_ip=None,
        node_name="n1",
        public_ipv6=IPv6Address("fd00:64::10"),
    )


def v6_lease(n: int, ip6: str, backend: str, v6_data: dict[str, Any] | None) -> Lease:
    return Lease(
        subnet=None,
        ipv6_subnet=IPv6Network(f"fc00:0:0:{n:x}::/64"),
        attrs=LeaseAttrs(
            public_ip=None,
            backend_type=backend,
            backend_data=None,
            public_ipv6=IPv6Address(ip6),
            backend_v6_data=v6_data,
            mtu=1420,
        ),
    )


def test_ipv6_only_runs_flannel_wg_v6_alone_with_flannels_backend_v6_data(tmp_path: Any) -> None:
    """As Flannel's Mode separate with EnableIPv4 false: no flannel-wg, the key and the
    IPv6 port in BackendV6Data only, and the pods' MTU that of the IPv6 device (−80)."""
    node = identified(tmp_path, ipv6_only_ctx())
    backend = WireguardBackend()
    attrs = backend.lease_attrs(node, None)
    assert attrs.public_ip is None and attrs.backend_data is None
    assert node.wireguard_identity is not None
    key = node.wireguard_identity.public_key
    assert attrs.backend_v6_data == {"PublicKey": key, "Port": 51821}
    assert attrs.mtu == backend.mtu(node) == 1500 - 80
    own = Lease(subnet=None, ipv6_subnet=IPv6Network("fc00:0:0:1::/64"), attrs=attrs)
    peers = [
        v6_lease(2, "fd00:64::12", "wireguard", {"PublicKey": PUB_B, "Port": 51821}),
        v6_lease(3, "fd00:64::13", "wireguard", {"PublicKey": "not a key"}),
        v6_lease(4, "fd00:64::14", "vxlan", {"VNI": 1, "VtepMAC": "02:00:00:00:00:04"}),
    ]
    desired = backend.plan(node, [own], peers, None)
    (spec,) = desired.wireguard  # flannel-wg-v6 only
    assert (spec.name, spec.listen_port, spec.mtu) == ("flannel-wg-v6", 51821, 1420)
    assert spec.address == IPv6Interface("fc00:0:0:1::/128")
    assert spec.peers == {
        WgPeer(
            PUB_B, (IPv6Address("fd00:64::12"), 51821), frozenset({IPv6Network("fc00:0:0:2::/64")})
        )
    }
    assert desired.routes == {
        Route(dst=IPv6Network("fc00::/48"), gateway=IPv6Address(0), ifname="flannel-wg-v6")
    }
    assert not desired.links  # and never a plain route to the vxlan peer
