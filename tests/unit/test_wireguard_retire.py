"""A live switch away from wireguard keeps the device while a peer still runs wireguard,
then retires it after a grace, unless used again."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv4Interface, IPv4Network
from pathlib import Path
from typing import Any

import pytest

from flannelpy.backend import wireguard_runtime
from flannelpy.backend.vxlan import VxlanBackend
from flannelpy.backend.wireguard import keeping_context, plan_kept, with_kept_key
from flannelpy.backend.wireguard_config import WireguardConfig
from flannelpy.backend.wireguard_runtime import WireguardRuntime
from flannelpy.dataplane.wgkeys import generate_private_key, public_key
from flannelpy.dataplane.wireguard import WgDeviceSpec
from flannelpy.subnet.lease import Lease, LeaseAttrs
from tests.support.fakes import context, lease

SPEC = WgDeviceSpec(name="flannel-wg", listen_port=51820, mtu=1440,
                    address=IPv4Interface("10.5.1.0/32"))  # fmt: skip


class FakeDevice:
    name = "flannel-wg"

    def __init__(self) -> None:
        self.stopped = 0
        self.specs: list[WgDeviceSpec] = []

    def set_desired(self, spec: WgDeviceSpec) -> None:
        self.specs.append(spec)

    def stop(self) -> None:
        self.stopped += 1


def started(tmp_path: Path) -> tuple[WireguardRuntime, FakeDevice]:
    device = FakeDevice()
    rt = WireguardRuntime(str(tmp_path / "k"), str(tmp_path / "run"), sink=device)
    rt.device = device
    rt.set_desired(SPEC)
    return rt, device


def test_the_device_is_stopped_and_forgotten_after_the_grace(tmp_path: Path) -> None:
    rt, device = started(tmp_path)
    timer = rt.retire(after=0.01)
    assert timer is not None
    assert device.stopped == 0  # not at once: peers still on wireguard send through it
    timer.join(2)
    assert device.stopped == 1 and rt.device is None


def test_planning_wireguard_again_within_the_grace_keeps_the_device(tmp_path: Path) -> None:
    rt, device = started(tmp_path)
    timer = rt.retire(after=0.05)
    assert timer is not None
    rt.set_desired(SPEC)  # switched back before the grace ended
    timer.join(2)
    assert device.stopped == 0 and rt.device is device and device.specs == [SPEC, SPEC]


def test_a_runtime_that_never_started_a_device_has_nothing_to_retire(tmp_path: Path) -> None:
    rt = WireguardRuntime(str(tmp_path / "k"), str(tmp_path / "run"), sink=FakeDevice())
    assert rt.retire(after=0.0) is None


def test_a_pending_retire_is_not_pushed_back(tmp_path: Path) -> None:
    rt, device = started(tmp_path)
    timer = rt.retire(after=0.05)
    assert timer is not None
    assert rt.retire(after=10.0) is None  # every replan asks again; the first grace holds
    timer.join(2)
    assert device.stopped == 1 and not rt.running


# --- switching back from wireguard: the device is kept while a peer runs it ---------------

OWN = Lease(IPv4Network("10.244.1.0/24"), LeaseAttrs(IPv4Address("192.168.1.10"), "vxlan",
            {"VNI": 1, "VtepMAC": "02:00:00:00:00:01"}, mtu=1450))  # fmt: skip
VXLAN_PEER = lease("10.244.2.0/24", "192.168.1.11", mac="02:00:00:00:00:02")


def wg_peer(pub: str) -> Lease:
    return Lease(
        IPv4Network("10.244.3.0/24"),
        LeaseAttrs(
            IPv4Address("192.168.1.12"), "wireguard", {"PublicKey": pub, "Port": 51999}, mtu=1440
        ),
    )


def prepared(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[WireguardRuntime, Any]:
    """The node's runtime after it ran wireguard on port 51999, its device still up."""
    rt, device = started(tmp_path)
    rt.implementation = "userspace"
    rt.prepare(WireguardConfig(listen_port=51999))
    monkeypatch.setattr(wireguard_runtime, "_runtime", rt)
    return rt, device


def test_the_device_is_kept_only_while_a_peer_still_runs_wireguard(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt, _ = prepared(tmp_path, monkeypatch)
    peer = wg_peer(public_key(generate_private_key()))
    ctx = context("vxlan")
    assert keeping_context(ctx, "vxlan", [VXLAN_PEER, peer]).keeps_wireguard
    assert not keeping_context(ctx, "vxlan", [VXLAN_PEER]).keeps_wireguard
    assert not keeping_context(ctx, "wireguard", [peer]).keeps_wireguard  # runs it
    rt.device = None  # retired: never brought back by a peer
    assert not keeping_context(ctx, "vxlan", [peer]).keeps_wireguard


def test_a_kept_device_carries_the_wireguard_peers_and_the_network_route(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt, device = prepared(tmp_path, monkeypatch)
    peer_pub, kept_pub = (public_key(generate_private_key()) for _ in range(2))
    peer = wg_peer(peer_pub)
    # a node that switched back before us, and still keeps its key
    kept = Lease(IPv4Network("10.244.5.0/24"), LeaseAttrs(
        IPv4Address("192.168.1.15"), "vxlan",
        {"VNI": 1, "VtepMAC": "02:00:00:00:00:05", "PublicKey": kept_pub, "Port": 51999},
        mtu=1450))  # fmt: skip
    peers = [VXLAN_PEER, peer, kept]
    ctx = keeping_context(context("vxlan"), "vxlan", peers)
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
    spec = device.specs[-1]
    assert spec.listen_port == 51999  # the options it ran with, not the defaults
    # the kept peer stays on the device: it may still send to us encrypted for a moment
    assert {p.public_key for p in spec.peers} == {peer_pub, kept_pub}
    (wg,) = [p for p in spec.peers if p.public_key == peer_pub]
    assert wg.endpoint == (IPv4Address("192.168.1.12"), 51999)
    attrs = with_kept_key(ctx, VxlanBackend().lease_attrs(ctx, "02:00:00:00:00:01"))
    assert attrs.backend_type == "vxlan"
    assert attrs.backend_data == {"VNI": 1, "VtepMAC": "02:00:00:00:00:01",
                                  "PublicKey": rt.public_key, "Port": 51999}  # fmt: skip


def test_once_no_peer_runs_wireguard_the_device_retires_and_the_key_is_not_advertised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rt, _ = prepared(tmp_path, monkeypatch)
    retired: list[bool] = []
    monkeypatch.setattr(rt, "retire", lambda after=0.0: retired.append(True))
    ctx = keeping_context(context("vxlan"), "vxlan", [VXLAN_PEER])
    desired = plan_kept(
        ctx, [OWN], [VXLAN_PEER], VxlanBackend().plan(ctx, [OWN], [VXLAN_PEER], "02:00:00:00:00:01")
    )
    assert retired == [True]
    assert all(r.ifname != "flannel-wg" for r in desired.routes)
    attrs = with_kept_key(ctx, VxlanBackend().lease_attrs(ctx, "02:00:00:00:00:01"))
    assert "PublicKey" not in (attrs.backend_data or {})
