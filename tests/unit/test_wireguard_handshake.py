"""Make before break, to wireguard: a pair moves from vxlan to the tunnel only once our
device has completed a handshake with the peer.

Until then the peer may not know our key (it has not seen our new lease) and drops what we
encrypt, so the pair stays on vxlan while both ends have a VTEP, and both keep it. What
the device observes (WireGuard's last handshake) reaches the writer as an event; the
planner reads it from the node context like any other input.
"""

from __future__ import annotations

import base64
from dataclasses import replace
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path
from typing import Any

import pytest

from flannelpy.backend.base import NodeContext
from flannelpy.backend.wireguard import WireguardBackend, unencrypted_peers
from flannelpy.backend.wireguard_config import WireguardConfig, WireguardIdentity
from flannelpy.dataplane.state import DesiredState, FdbEntry, Neighbour, Route
from flannelpy.dataplane.uapi import WgDeviceConfig, WgPeer, parse_get
from flannelpy.dataplane.wgkeys import generate_private_key, public_key
from flannelpy.dataplane.wgspec import WgDeviceSpec, confirmed_peers
from flannelpy.dataplane.wireguard import WireguardDevice
from flannelpy.subnet.lease import Lease, LeaseAttrs
from tests.support.agent_fakes import AgentHarness, wireguard_agent
from tests.support.fakes import context

KEY_A = generate_private_key()
PUB_B, PUB_C = public_key(generate_private_key()), public_key(generate_private_key())
OUR_MAC, PEER_MAC = "02:00:00:00:00:01", "02:00:00:00:00:02"
PEER_SUBNET = IPv4Network("10.244.2.0/24")
OWN = Lease(IPv4Network("10.244.1.0/24"), LeaseAttrs(IPv4Address("192.168.1.10"), "wireguard"))
VXLAN_ROUTE = Route(PEER_SUBNET, IPv4Address("10.244.2.0"), "flannel.1", onlink=True)


def wg_peer(
    pub: str, subnet: str = "10.244.2.0/24", ip: str = "192.168.1.11", vtep: bool = True
) -> Lease:
    """A wireguard peer's lease; with ``vtep`` it still keeps its VTEP (a rollout)."""
    data: dict[str, Any] = {"PublicKey": pub, "Port": 51820}
    if vtep:
        data.update({"VNI": 1, "VtepMAC": PEER_MAC})
    return Lease(IPv4Network(subnet), LeaseAttrs(IPv4Address(ip), "wireguard", data, mtu=1440))


IDENTITY = WireguardIdentity(public_key(KEY_A), WireguardConfig())


def planned(
    confirmed: frozenset[str] | None, peers: list[Lease], vtep_mac: str | None = OUR_MAC
) -> tuple[DesiredState, NodeContext]:
    ctx = replace(context("wireguard"), wireguard_confirmed=confirmed, wireguard_identity=IDENTITY)
    return WireguardBackend().plan(ctx, [OWN], peers, vtep_mac), ctx


# --- what the device observes --------------------------------------------------------


def test_the_uapi_answer_says_which_peers_have_completed_a_handshake() -> None:
    def peer(pub: str, seconds: int) -> list[str]:
        return [
            f"public_key={base64.b64decode(pub).hex()}",
            f"last_handshake_time_sec={seconds}",
            "last_handshake_time_nsec=0",
            "allowed_ip=10.244.2.0/24",
        ]

    got = parse_get(
        "\n".join(
            ["listen_port=51820", *peer(PUB_B, 1765000000), *peer(PUB_C, 0), "errno=0", "", ""]
        )
    )
    assert got.handshaken == frozenset({PUB_B})
    assert set(got.peers) == {PUB_B, PUB_C}


def spec_of(*pubs: str) -> WgDeviceSpec:
    return WgDeviceSpec(
        "flannel-wg",
        51820,
        1440,
        None,
        frozenset(
            WgPeer(pub, (IPv4Address("192.168.1.11"), 51820), frozenset({PEER_SUBNET}))
            for pub in pubs
        ),
    )


def test_a_confirmed_peer_stays_confirmed_until_it_leaves_the_plan() -> None:
    seen = WgDeviceConfig(None, 51820, {}, frozenset({PUB_B}))
    forgot = WgDeviceConfig(None, 51820, {})  # a restarted wireguard-go knows no handshake
    first = confirmed_peers(spec_of(PUB_B, PUB_C), frozenset(), seen)
    assert first == frozenset({PUB_B})
    assert confirmed_peers(spec_of(PUB_B, PUB_C), first, forgot) == frozenset({PUB_B})
    assert confirmed_peers(spec_of(PUB_C), first, forgot) == frozenset()


class FakeConfigurator:
    def __init__(self, handshaken: frozenset[str] = frozenset()) -> None:
        self.handshaken = handshaken
        self.peers: dict[str, WgPeer] = {}
        self.key: str | None = None

    def get(self) -> WgDeviceConfig:
        return WgDeviceConfig(self.key, 51820, dict(self.peers), self.handshaken)

    def set(self, changes: Any) -> None:
        self.key = changes.private_key or self.key
        self.peers = {k: v for k, v in self.peers.items() if k not in changes.remove}
        self.peers.update({p.public_key: p for p in changes.set})


class NoLink:
    def exists(self, name: str) -> bool:
        return True

    def ensure(self, spec: WgDeviceSpec, create_kind: str | None) -> None:
        pass

    def delete(self, name: str) -> None:
        pass


def test_the_device_says_when_its_confirmed_peers_change_and_only_then() -> None:
    told: list[frozenset[str]] = []
    device = WireguardDevice(
        "flannel-wg",
        KEY_A,
        "kernel",
        "/nonexistent",
        link=NoLink(),
        on_confirmed=lambda _name, keys: told.append(keys),
    )
    fake = FakeConfigurator()
    device.configurator = fake
    device._spec = spec_of(PUB_B, PUB_C)  # as set_desired stores it, without the loop thread
    device.reconcile_once()
    assert told == []  # no handshake yet: nothing to say
    fake.handshaken = frozenset({PUB_B})
    device.reconcile_once()
    device.reconcile_once()
    assert told == [frozenset({PUB_B})]
    device._spec = spec_of(PUB_C)  # the peer left
    device.reconcile_once()
    assert told[-1] == frozenset()


# --- what the planner makes of it ----------------------------------------------------


def test_an_unconfirmed_pair_stays_on_vxlan_while_both_ends_have_a_vtep() -> None:
    state, ctx = planned(frozenset(), [wg_peer(PUB_B)])
    assert VXLAN_ROUTE in state.routes
    assert Neighbour("flannel.1", IPv4Address("10.244.2.0"), PEER_MAC) in state.neighbours
    assert FdbEntry("flannel.1", PEER_MAC, IPv4Address("192.168.1.11")) in state.fdb
    # The device has the peer all the same: that is how the handshake happens.
    (device,) = state.wireguard
    assert {p.public_key for p in device.peers} == {PUB_B}
    backend = WireguardBackend()
    assert backend.needs_vtep(ctx, [wg_peer(PUB_B)])
    assert unencrypted_peers(ctx, [OWN], [wg_peer(PUB_B)], has_vtep=True) == 1


def test_a_confirmed_pair_goes_through_the_tunnel_and_the_vtep_may_go() -> None:
    confirmed = frozenset({PUB_B})
    state, ctx = planned(confirmed, [wg_peer(PUB_B)])
    assert not [r for r in state.routes if r.dst == PEER_SUBNET]  # the Network route carries it
    assert not state.neighbours and not state.fdb
    assert not WireguardBackend().needs_vtep(ctx, [wg_peer(PUB_B)])
    assert unencrypted_peers(ctx, [OWN], [wg_peer(PUB_B)], has_vtep=True) == 0


@pytest.mark.parametrize(
    ("confirmed", "peer", "vtep_mac"),
    [
        (frozenset(), wg_peer(PUB_B, vtep=False), OUR_MAC),  # the peer has no VTEP left
        (frozenset(), wg_peer(PUB_B), None),  # we have none: a cluster started on wireguard
        (None, wg_peer(PUB_B), OUR_MAC),  # handshakes unknown (the doctor): not held
    ],
)
def test_without_a_vxlan_path_to_fall_back_on_the_pair_is_not_held(
    tmp_path: Path, confirmed: frozenset[str] | None, peer: Lease, vtep_mac: str | None
) -> None:
    state, _ = planned(confirmed, [peer], vtep_mac)
    assert not [r for r in state.routes if r.dst == PEER_SUBNET]
    assert not state.unreachable


# --- through the writer ----------------------------------------------------------------


def test_the_writer_moves_a_pair_to_the_tunnel_when_the_device_confirms_it(
    tmp_path: Path,
) -> None:
    peer = wg_peer(PUB_B, subnet="10.244.200.0/24")
    agent, rt = wireguard_agent(tmp_path, peer)
    agent.start()
    try:
        agent.deliver_leases()
        agent.reconcile()
        route = Route(peer.subnet, IPv4Address("10.244.200.0"), "flannel.1", onlink=True)
        assert route in agent.kernel.state.routes
        assert "VtepMAC" in (own_lease(agent).backend_data or {})

        assert rt.on_confirmed is not None  # the agent listens to its devices
        # flannel-wg-v6's handshake confirms the IPv6 half only: IPv4 stays on vxlan.
        rt.on_confirmed("flannel-wg-v6", frozenset({PUB_B}))
        assert agent.drain() == 1
        ctx = agent.writer.state.ctx
        assert (ctx.wireguard_confirmed, ctx.wireguard_confirmed_v6) == (set(), {PUB_B})
        agent.reconcile()
        assert route in agent.kernel.state.routes
        # what flannel-wg's loop says after a handshake
        rt.on_confirmed("flannel-wg", frozenset({PUB_B}))
        assert agent.drain() == 1
        agent.reconcile()
        assert not [r for r in agent.kernel.state.routes if r.dst == peer.subnet]
        assert "VtepMAC" not in (own_lease(agent).backend_data or {})  # the VTEP may go
        assert agent.writer.counts.events()["handshake"] == 2
    finally:
        agent.stop()


def own_lease(agent: AgentHarness) -> LeaseAttrs:
    leases, _ = agent.manager.list_leases()
    (subnet,) = agent.own_subnets()
    return next(x.attrs for x in leases.values() if x.subnet == subnet)
