"""A live switch away from wireguard keeps the device while a peer still runs wireguard;
a device that leaves the plan stays a grace, unless planned again; the runtime runs
exactly the devices of each pass."""

from __future__ import annotations

from dataclasses import replace
from ipaddress import IPv4Address, IPv4Interface, IPv4Network
from pathlib import Path
from typing import Any

import pytest

from flannelpy.agent.planning import Lingering
from flannelpy.backend.base import NodeContext
from flannelpy.backend.vxlan import VxlanBackend
from flannelpy.backend.wireguard import keeping_context, plan_kept, with_kept_key
from flannelpy.backend.wireguard_config import WireguardConfig, WireguardIdentity
from flannelpy.backend.wireguard_runtime import WireguardRuntime
from flannelpy.dataplane.wgkeys import generate_private_key, public_key
from flannelpy.dataplane.wgspec import WgDeviceSpec
from flannelpy.errors import DataplaneError
from flannelpy.subnet.lease import Lease, LeaseAttrs
from tests.support.fakes import context, lease

SPEC = WgDeviceSpec(
    name="flannel-wg", listen_port=51820, mtu=1440, address=IPv4Interface("10.5.1.0/32")
)


class FakeDevice:
    def __init__(self, name: str) -> None:
        self.name = name
        self.stopped = 0
        self.specs: list[WgDeviceSpec] = []

    def set_desired(self, spec: WgDeviceSpec) -> None:
        self.specs.append(spec)

    def stop(self) -> None:
        self.stopped += 1


def fake_runtime(tmp_path: Path) -> tuple[WireguardRuntime, list[FakeDevice]]:
    made: list[FakeDevice] = []

    def make(name: str, *_: Any) -> FakeDevice:
        made.append(FakeDevice(name))
        return made[-1]

    rt = WireguardRuntime(
        str(tmp_path / "k"), str(tmp_path / "run"), implementation="userspace", make_device=make
    )
    rt.prepare(WireguardConfig())
    return rt, made


def test_the_runtime_runs_exactly_the_planned_devices(tmp_path: Path) -> None:
    rt, made = fake_runtime(tmp_path)
    told: list[frozenset[str]] = []
    rt.on_confirmed = lambda _device, keys: told.append(keys)
    rt.apply([SPEC])
    rt.apply([SPEC])
    (device,) = made  # one device, handed each pass's spec
    assert device.specs == [SPEC, SPEC] and device.stopped == 0
    rt.apply([])
    assert device.stopped == 1 and rt.devices == {}
    assert told == [frozenset()]  # a device made later starts without confirmed peers
    rt.apply([SPEC])
    assert len(made) == 2 and made[1].specs == [SPEC]


def test_a_device_is_not_started_before_the_key_is_loaded(tmp_path: Path) -> None:
    rt = WireguardRuntime(
        str(tmp_path / "k"), str(tmp_path / "run"), make_device=lambda *_: FakeDevice("x")
    )
    with pytest.raises(DataplaneError, match="before the WireGuard key was loaded"):
        rt.apply([SPEC])


# --- the grace: a device that leaves the plan stays a few seconds -------------------------


def test_a_device_that_leaves_the_plan_stays_for_the_grace() -> None:
    lingering: Lingering[WgDeviceSpec] = Lingering(5.0)
    assert lingering.update({"flannel-wg": SPEC}, now=0.0) == {}
    assert lingering.update({}, now=1.0) == {"flannel-wg": SPEC}  # peers may still send
    assert not lingering.over(5.9) and lingering.over(6.0)
    assert lingering.update({}, now=6.0) == {}


def test_planning_it_again_within_the_grace_keeps_it_planned() -> None:
    lingering: Lingering[WgDeviceSpec] = Lingering(5.0)
    lingering.update({"flannel-wg": SPEC}, now=0.0)
    lingering.update({}, now=1.0)
    assert lingering.update({"flannel-wg": SPEC}, now=2.0) == {}  # planned: not lingering
    assert not lingering.over(100.0)


def test_a_grace_under_way_is_not_pushed_back_by_replans() -> None:
    lingering: Lingering[WgDeviceSpec] = Lingering(5.0)
    lingering.update({"flannel-wg": SPEC}, now=0.0)
    lingering.update({}, now=1.0)
    assert lingering.update({}, now=3.0) == {"flannel-wg": SPEC}  # every replan asks again
    assert lingering.over(6.0)  # the first grace holds


# --- switching back from wireguard: the device is kept while a peer runs it ---------------

OWN = Lease(
    IPv4Network("10.244.1.0/24"),
    LeaseAttrs(
        IPv4Address("192.168.1.10"), "vxlan", {"VNI": 1, "VtepMAC": "02:00:00:00:00:01"}, mtu=1450
    ),
)
VXLAN_PEER = lease("10.244.2.0/24", "192.168.1.11", mac="02:00:00:00:00:02")


def wg_peer(pub: str) -> Lease:
    return Lease(
        IPv4Network("10.244.3.0/24"),
        LeaseAttrs(
            IPv4Address("192.168.1.12"), "wireguard", {"PublicKey": pub, "Port": 51999}, mtu=1440
        ),
    )


IDENTITY = WireguardIdentity(public_key(generate_private_key()), WireguardConfig(listen_port=51999))


def vxlan_node() -> NodeContext:
    """A node that ran wireguard on port 51999 and switched to vxlan."""
    return replace(context("vxlan"), wireguard_identity=IDENTITY)


def test_the_device_is_kept_only_while_a_peer_still_runs_wireguard() -> None:
    peer = wg_peer(public_key(generate_private_key()))
    ctx = vxlan_node()
    assert keeping_context(ctx, "vxlan", [VXLAN_PEER, peer], device_up=True).keeps_wireguard
    assert not keeping_context(ctx, "vxlan", [VXLAN_PEER], device_up=True).keeps_wireguard
    assert not keeping_context(ctx, "wireguard", [peer], device_up=True).keeps_wireguard
    # retired: never brought back by a peer
    assert not keeping_context(ctx, "vxlan", [peer], device_up=False).keeps_wireguard


def test_a_kept_device_carries_the_wireguard_peers_and_the_network_route() -> None:
    peer_pub, kept_pub = (public_key(generate_private_key()) for _ in range(2))
    peer = wg_peer(peer_pub)
    # a node that switched back before us, and still keeps its key
    kept = Lease(
        IPv4Network("10.244.5.0/24"),
        LeaseAttrs(
            IPv4Address("192.168.1.15"),
            "vxlan",
            {"VNI": 1, "VtepMAC": "02:00:00:00:00:05", "PublicKey": kept_pub, "Port": 51999},
            mtu=1450,
        ),
    )
    peers = [VXLAN_PEER, peer, kept]
    ctx = keeping_context(vxlan_node(), "vxlan", peers, device_up=True)
    desired = plan_kept(
        ctx, [OWN], peers, VxlanBackend().plan(ctx, [OWN], peers, "02:00:00:00:00:01")
    )
    # the vxlan peers through the VTEP; the wireguard one only through the /16 via flannel-wg
    assert {(r.dst, r.ifname) for r in desired.routes} == {
        (IPv4Network("10.244.2.0/24"), "flannel.1"),
        (IPv4Network("10.244.5.0/24"), "flannel.1"),
        (IPv4Network("10.244.0.0/16"), "flannel-wg"),
    }
    assert not desired.unreachable
    (spec,) = desired.wireguard
    assert spec.listen_port == 51999  # the options it ran with, not the defaults
    # the kept peer stays on the device: it may still send to us encrypted for a moment
    assert {p.public_key for p in spec.peers} == {peer_pub, kept_pub}
    (wg,) = [p for p in spec.peers if p.public_key == peer_pub]
    assert wg.endpoint == (IPv4Address("192.168.1.12"), 51999)
    attrs = with_kept_key(ctx, VxlanBackend().lease_attrs(ctx, "02:00:00:00:00:01"))
    assert attrs.backend_type == "vxlan"
    assert attrs.backend_data == {
        "VNI": 1,
        "VtepMAC": "02:00:00:00:00:01",
        "PublicKey": IDENTITY.public_key,
        "Port": 51999,
    }


def test_once_no_peer_runs_wireguard_the_device_leaves_the_plan_and_the_key_the_lease() -> None:
    ctx = keeping_context(vxlan_node(), "vxlan", [VXLAN_PEER], device_up=True)
    desired = plan_kept(
        ctx, [OWN], [VXLAN_PEER], VxlanBackend().plan(ctx, [OWN], [VXLAN_PEER], "02:00:00:00:00:01")
    )
    assert not desired.wireguard  # the planner keeps it for the grace, then it goes
    assert all(r.ifname != "flannel-wg" for r in desired.routes)
    attrs = with_kept_key(ctx, VxlanBackend().lease_attrs(ctx, "02:00:00:00:00:01"))
    assert "PublicKey" not in (attrs.backend_data or {})


# --- the prober's MTU at a switch back ---------------------------------------------------


def test_the_prober_reads_the_kept_devices_mtu_from_the_switch_back_on(tmp_path: Path) -> None:
    """A node switches back from wireguard to vxlan while a peer still runs wireguard: the
    pair stays on the kept device (MTU 1440), so from the switch on the full-MTU probe is
    that size. Before, the view published at the switch, ahead of the new plan, said 1450
    until the lease was rewritten, and a probe round in between lost its full-MTU echo."""
    from flannelpy.agent.state import NodeState
    from flannelpy.backend.wireguard import kept_device_mtu
    from flannelpy.store.etcd.config import put_network_config
    from tests.support.agent_fakes import PREFIX, net_conf, wireguard_agent

    key = public_key(generate_private_key())
    peer = LeaseAttrs(IPv4Address("192.168.1.11"), "wireguard", {"PublicKey": key}, mtu=1440)
    agent, _ = wireguard_agent(tmp_path, Lease(IPv4Network("10.244.200.0/24"), peer))
    agent.start()
    try:
        agent.deliver_leases()
        agent.reconcile()
        seen: list[int] = []  # what a probe round reads while the switch is applied
        apply = agent.kernel.apply

        def watching_apply(changes: Any) -> Any:
            seen.append(agent.writer.view.probe_mtu)
            return apply(changes)

        agent.kernel.apply = watching_apply  # type: ignore[method-assign]
        put_network_config(agent.store, PREFIX, net_conf({"Type": "vxlan"}))
        agent.deliver_control()
        state: NodeState = agent.writer.state
        assert state.backend.type_name == "vxlan" and state.keeps_wireguard
        kept = kept_device_mtu(state.ctx)
        assert state.mtu == 1450 and kept == 1440
        assert seen and set(seen) == {kept}, seen
        assert agent.writer.view.probe_mtu == kept
    finally:
        agent.stop()
