"""wireguard: Flannel's encrypted backend, on the kernel module or on wireguard-go.

As Flannel v0.28 does it, per node: one device ``flannel-wg`` (``flannel-wg-v6``
for IPv6 in separate mode) listening on ``ListenPort`` (51820; ``ListenPortV6``
51821), our lease's network address /32 on it, one route for the whole
``Network`` through it (scope link), and one peer per peer node: its public key,
endpoint ``PublicIP:Port``, its subnets as allowed IPs, the keepalive and the
PSK. WireGuard's allowed IPs then pick the peer of each packet. The lease's
BackendData is Flannel's ``{"PublicKey", "Port"}``; while a peer is still vxlan
(a rollout) it also carries our VTEP's ``{"VNI", "VtepMAC"}`` and the node keeps
that VTEP, as host-gw nodes do, so the pair talks vxlan until both ends run
wireguard (the rule is in :mod:`flannelpy.backend.paths`). flanneld ignores the
extra keys. A pair the rule sends through WireGuard still takes vxlan until our device has
completed a handshake with the peer (:func:`~flannelpy.backend.base.held_on_vxlan`): the
peer may not have seen our lease, and our key, yet. Dual stack, each family does all this
on its own: BackendV6Data carries the IPv6 VTEP's ``{"VNI", "VtepMAC"}`` beside the key,
``flannel-v6.<VNI>`` is kept, and a pair's IPv6 half waits for ``flannel-wg-v6``'s own
handshake. The way back mirrors it: a node
that switched to vxlan or host-gw keeps its device, peers and key (in its lease's
BackendData) while any peer still runs wireguard (:func:`keeping_context`,
:func:`plan_kept`), so no pair is ever left without a path, and its device goes a few
seconds after the last such peer switched; dual stack, ``flannel-wg-v6`` and the key in
BackendV6Data are kept with it.

IPv6-only (``EnableIPv4`` false): ``flannel-wg-v6`` alone, the key and ``ListenPortV6``
in BackendV6Data only, as Flannel.

Dual stack (``EnableIPv6``), ``Mode`` separate as Flannel: a second device
``flannel-wg-v6`` on ``ListenPortV6`` with the same key, one peer per node at
``[PublicIPv6]:Port`` of its BackendV6Data (Flannel's ``{"PublicKey", "Port"}``), its
IPv6 subnets as allowed IPs, our IPv6 lease's network address /128 on it and the
``IPv6Network`` routed through it. The other modes (one device for both families) are
refused with dual stack; the pods' MTU is the smaller of the two devices'.

Options (``Backend`` of net-conf.json, Flannel's names): ``ListenPort``,
``ListenPortV6``, ``PSK`` (base64, as ``wg genpsk``), ``PersistentKeepaliveInterval``
(seconds), ``Mode`` (separate, auto, ipv4, ipv6), ``MTU``; ours:
``Implementation`` (auto: the kernel module when present, else wireguard-go;
kernel; userspace). The overlay MTU is the underlay's minus 60 over IPv4
(IP 20 + UDP 8 + WireGuard header 16 + tag 16) and 80 over IPv6; Flannel
subtracts 80 for both.

Planning is pure: :meth:`WireguardBackend.plan` returns the routes and the devices'
desired state (``DesiredState.wireguard``); the reconciler hands those to the node's
runtime (:mod:`flannelpy.backend.wireguard_runtime`), which starts and updates them. The
node's key comes in the context (``NodeContext.wireguard_identity``), loaded by the agent.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
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

from flannelpy.backend import ipv6
from flannelpy.backend.base import (
    NodeContext,
    PlanMemo,
    held_in_a_family,
    node_needs_vtep,
    plan_peers,
    routable_peers,
)
from flannelpy.backend.paths import (
    Capabilities,
    choose_path,
    own_capabilities,
    peer_capabilities,
)
from flannelpy.backend.vxlan import device_name as vxlan_device_name
from flannelpy.backend.vxlan import vtep_link
from flannelpy.backend.wireguard_config import (
    DEVICE,
    DEVICE_V6,
    WireguardConfig,
    overlay_mtu,
    parse_wireguard_config,
)
from flannelpy.dataplane.state import DesiredState, Route
from flannelpy.dataplane.uapi import WgPeer
from flannelpy.dataplane.wgkeys import is_key
from flannelpy.dataplane.wgspec import WgDeviceSpec
from flannelpy.errors import ConfigError
from flannelpy.subnet.lease import Lease, LeaseAttrs

log = logging.getLogger("flannelpy.backend.wireguard")

NO_GATEWAY = IPv4Address(0)


def lease_public_key(lease: Lease) -> str | None:
    """The peer's WireGuard public key, when its BackendData carries a valid one."""
    key = (lease.attrs.backend_data or {}).get("PublicKey")
    return key if is_key(key) else None


def lease_port(lease: Lease, default: int) -> int:
    """The peer's port; 0 or absent means ours, as Flannel does for older leases."""
    return backend_data_port(lease.attrs.backend_data, default)


def backend_data_port(data: Mapping[str, Any] | None, default: int) -> int:
    """``Port`` of a lease's BackendData or BackendV6Data, else ``default``."""
    port = (data or {}).get("Port")
    if isinstance(port, int) and not isinstance(port, bool) and 0 < port <= 65535:
        return port
    return default


def leases_by_key(
    leases: Sequence[Lease], key_of: Callable[[Lease], str | None], own_key: str | None
) -> dict[str, list[Lease]]:
    """The peers' leases grouped by public key, each group in lease order; leases without
    a key, and our own key, are left out."""
    by_key: dict[str, list[Lease]] = {}
    for lease in sorted(leases, key=lambda lease: lease.order):
        key = key_of(lease)
        if key is not None and key != own_key:
            by_key.setdefault(key, []).append(lease)
    return by_key


def plan_device(
    ctx: NodeContext,
    config: WireguardConfig,
    own: Sequence[Lease],
    wireguard_peers: Sequence[Lease],
    own_public_key: str | None,
    mtu: int,
) -> WgDeviceSpec:
    """The device's desired state (pure): one WireGuard peer per public key, whose
    allowed IPs are all that node's subnets (a node may hold several leases)."""
    own = [lease for lease in own if lease.subnet is not None]  # wireguard is IPv4-only
    usable = [
        lease
        for lease in wireguard_peers
        if lease.subnet is not None and lease.attrs.public_ip is not None
    ]
    peers = set()
    for key, leases in leases_by_key(usable, lease_public_key, own_public_key).items():
        first = leases[0]
        first_ip = first.attrs.public_ip
        assert first_ip is not None  # IPv4-only leases were kept above
        peers.add(
            WgPeer(
                public_key=key,
                endpoint=(first_ip, lease_port(first, config.listen_port)),
                allowed_ips=frozenset(lease.subnet for lease in leases if lease.subnet is not None),
                keepalive=config.keepalive,
                preshared_key=config.psk,
            )
        )
    first_own = min(own, key=lambda lease: lease.order, default=None)
    address = IPv4Interface(f"{first_own.vtep_ip}/32") if first_own else None
    return WgDeviceSpec(
        name=DEVICE,
        listen_port=config.listen_port,
        mtu=mtu,
        address=address,
        peers=frozenset(peers),
    )


def network_route(network: IPv4Network) -> Route:
    """The route for the whole Network through the device, as Flannel adds it."""
    return Route(dst=network, gateway=NO_GATEWAY, ifname=DEVICE)


def network_route_v6(network: IPv6Network) -> Route:
    """The route for the whole IPv6Network through ``flannel-wg-v6`` (Mode separate)."""
    return Route(dst=network, gateway=IPv6Address(0), ifname=DEVICE_V6)


def lease_public_key_v6(lease: Lease) -> str | None:
    """The peer's public key for IPv6: BackendV6Data's (Flannel writes the same key)."""
    key = (lease.attrs.backend_v6_data or {}).get("PublicKey")
    return key if is_key(key) else None


def plan_device_v6(
    config: WireguardConfig,
    own: Sequence[Lease],
    wireguard_peers: Sequence[Lease],
    own_public_key: str | None,
    mtu: int,
) -> WgDeviceSpec:
    """``flannel-wg-v6`` (pure): one peer per IPv6 public key, at ``[PublicIPv6]:Port`` of
    its BackendV6Data, with its IPv6 subnets as allowed IPs; our IPv6 lease's network
    address /128 on it, as Flannel's ``ConfigureV6``."""
    usable = [
        lease
        for lease in wireguard_peers
        if lease.ipv6_subnet is not None and lease.attrs.public_ipv6 is not None
    ]
    peers = set()
    for key, leases in leases_by_key(usable, lease_public_key_v6, own_public_key).items():
        first = leases[0]
        assert first.attrs.public_ipv6 is not None
        port = backend_data_port(first.attrs.backend_v6_data, config.listen_port_v6)
        peers.add(
            WgPeer(
                public_key=key,
                endpoint=(first.attrs.public_ipv6, port),
                allowed_ips=frozenset(
                    lease.ipv6_subnet for lease in leases if lease.ipv6_subnet is not None
                ),
                keepalive=config.keepalive,
                preshared_key=config.psk,
            )
        )
    own6 = sorted(lease.ipv6_subnet for lease in own if lease.ipv6_subnet is not None)
    address = IPv6Interface(f"{own6[0].network_address}/128") if own6 else None
    return WgDeviceSpec(
        name=DEVICE_V6,
        listen_port=config.listen_port_v6,
        mtu=mtu,
        address=address,
        peers=frozenset(peers),
    )


def runs_wireguard(lease: Lease) -> bool:
    """The lease's node runs wireguard and advertises a usable key."""
    return lease.attrs.backend_type.lower() == WireguardBackend.type_name and (
        lease_public_key(lease) is not None
    )


def keeping_context(
    ctx: NodeContext, backend_type: str, peers: Sequence[Lease], device_up: bool
) -> NodeContext:
    """``ctx`` with ``keeps_wireguard`` set when this node, on another backend now, still
    has its WireGuard device (``device_up``: the last plan had it) and a peer still runs
    wireguard: the pair then stays encrypted until that peer switches too, so switching
    back from wireguard node by node never leaves a pair without a path (the peer has
    dropped its VTEP). Dual stack, ``flannel-wg-v6`` is kept with it (:func:`plan_kept`)."""
    keeps = (
        backend_type != WireguardBackend.type_name
        and ctx.public_ip is not None
        and device_up
        and ctx.wireguard_identity is not None
        and any(runs_wireguard(peer) for peer in routable_peers(ctx, [], peers))
    )
    return replace(ctx, keeps_wireguard=keeps) if keeps != ctx.keeps_wireguard else ctx


def kept_device_mtu(ctx: NodeContext, ipv6_device: bool = False) -> int:
    """A kept device's MTU (``flannel-wg``, or ``flannel-wg-v6`` with ``ipv6_device``)."""
    return overlay_mtu(ctx.config.backend.mtu or ctx.underlay.mtu, underlay_is_ipv6=ipv6_device)


def kept_devices_mtu(ctx: NodeContext) -> int:
    """The largest packet that crosses every pair still encrypted: the smallest kept
    device's (dual stack, ``flannel-wg-v6``'s)."""
    return min(kept_device_mtu(ctx), kept_device_mtu(ctx, ipv6_device=ipv6.enabled(ctx)))


def with_kept_key(ctx: NodeContext, attrs: LeaseAttrs) -> LeaseAttrs:
    """Our lease while we keep the device: BackendData carries the key and port too, so
    peers still on wireguard keep the pair encrypted."""
    identity = ctx.wireguard_identity
    if not ctx.keeps_wireguard or identity is None:
        return attrs
    data = dict(attrs.backend_data or {})
    data.update({"PublicKey": identity.public_key, "Port": identity.options.listen_port})
    if not ipv6.enabled(ctx):
        return replace(attrs, backend_data=data)
    data6 = dict(attrs.backend_v6_data or {})
    data6.update({"PublicKey": identity.public_key, "Port": identity.options.listen_port_v6})
    return replace(attrs, backend_data=data, backend_v6_data=data6)


def plan_kept(
    ctx: NodeContext, own: Sequence[Lease], peers: Sequence[Lease], desired: DesiredState
) -> DesiredState:
    """On a node that does not run wireguard: while it keeps the device, the device's
    peers are the wireguard peers (with the options it ran with) and the Network is
    routed through it as under wireguard (the other peers' routes are more specific).
    Once it does not, the device leaves the plan (the planner keeps it a few seconds more,
    so peers that have not seen our new lease yet still get through). Dual stack, the
    same for ``flannel-wg-v6`` and the IPv6Network."""
    identity = ctx.wireguard_identity
    if not ctx.keeps_wireguard or identity is None:
        return desired
    kept_peers = device_peers(ctx, own, peers)
    options, key = identity.options, identity.public_key
    devices = {plan_device(ctx, options, own, kept_peers, key, kept_device_mtu(ctx))}
    routes = set(desired.routes)
    if ctx.config.network is not None:
        routes.add(network_route(ctx.config.network))
    if ipv6.enabled(ctx) and ctx.config.ipv6_network is not None:
        mtu6 = kept_device_mtu(ctx, ipv6_device=True)
        devices.add(plan_device_v6(options, own, kept_peers, key, mtu6))
        routes.add(network_route_v6(ctx.config.ipv6_network))
    return replace(desired, routes=frozenset(routes), wireguard=desired.wireguard | devices)


def own_public_key(ctx: NodeContext) -> str:
    """Our key, which the agent loaded before it planned wireguard."""
    if ctx.wireguard_identity is None:
        raise ConfigError("the WireGuard key is not loaded; the agent must prepare it first")
    return ctx.wireguard_identity.public_key


class WireguardBackend:
    type_name = "wireguard"

    def config(self, ctx: NodeContext) -> WireguardConfig:
        return parse_wireguard_config(ctx.config.backend)

    def mtu(self, ctx: NodeContext) -> int:
        """The pods' MTU: dual stack takes the smaller of the two devices', IPv6-only the
        IPv6 device's."""
        if not ctx.config.enable_ipv4:
            return self.device_mtu_v6(ctx)
        v4 = self.device_mtu(ctx)
        return min(v4, self.device_mtu_v6(ctx)) if ipv6.enabled(ctx) else v4

    def device_mtu(self, ctx: NodeContext) -> int:
        return overlay_mtu(ctx.config.backend.mtu or ctx.underlay.mtu)

    def device_mtu_v6(self, ctx: NodeContext) -> int:
        return overlay_mtu(ctx.config.backend.mtu or ctx.underlay.mtu, underlay_is_ipv6=True)

    def device_names(self, ctx: NodeContext) -> tuple[str, ...]:
        # The transition VTEPs are ours too (WireGuard devices are DesiredState.wireguard).
        vni = ctx.config.backend.vni
        return (vxlan_device_name(vni), ipv6.device_name_v6(vni))

    def lease_attrs(self, ctx: NodeContext, vtep_mac: str | None) -> LeaseAttrs:
        config = self.config(ctx)
        key = own_public_key(ctx)
        data: dict[str, Any] = {"PublicKey": key, "Port": config.listen_port}
        if vtep_mac:
            data.update({"VNI": ctx.config.backend.vni, "VtepMAC": vtep_mac})
        v6 = ipv6.enabled(ctx)
        if v6 and config.mode != "separate":
            raise ConfigError(
                f'net-conf.json: Backend "Mode" "{config.mode}" carries IPv6 inside flannel-wg, '
                'which flannelpy does not do yet; use "separate" (the default) for dual stack'
            )
        # Flannel's BackendV6Data for wireguard: the same key, the IPv6 port; and the
        # IPv6 VTEP while we keep one, as BackendData carries the IPv4 one.
        data6: dict[str, Any] = {"PublicKey": key, "Port": config.listen_port_v6}
        data6.update(ipv6.backend_v6_data(ctx, vtep_mac) or {})
        return LeaseAttrs(
            public_ip=ctx.public_ip,
            backend_type=self.type_name,
            # IPv6-only, Flannel writes BackendV6Data alone.
            backend_data=data if ctx.config.enable_ipv4 else None,
            node_name=ctx.node_name,
            mtu=self.mtu(ctx),
            public_ipv6=ctx.public_ipv6 if v6 else None,
            backend_v6_data=data6 if v6 else None,
        )

    def device_spec(
        self,
        ctx: NodeContext,
        own: Sequence[Lease],
        peers: Sequence[Lease],
        own_public_key: str | None,
    ) -> WgDeviceSpec:
        """The WireGuard device this node should have (pure)."""
        return plan_device(
            ctx,
            self.config(ctx),
            own,
            device_peers(ctx, own, peers),
            own_public_key,
            self.device_mtu(ctx),
        )

    def needs_vtep(self, ctx: NodeContext, peers: Sequence[Lease]) -> bool:
        return node_needs_vtep(ctx, peers)

    def plan(
        self,
        ctx: NodeContext,
        own: Sequence[Lease],
        peers: Sequence[Lease],
        vtep_mac: str | None,
        memo: PlanMemo | None = None,
    ) -> DesiredState:
        config = self.config(ctx)
        link = vtep_link(ctx, vtep_mac) if vtep_mac else None
        link6 = ipv6.vtep6_link(ctx, vtep_mac) if vtep_mac else None
        caps6 = ipv6.own_capabilities_v6(ctx)
        desired = ipv6.merge(
            plan_peers(ctx, own, peers, link, memo),
            ipv6.plan_ipv6(ctx, own, peers, caps6, link6, memo),
        )
        # Pure: the devices are values the reconciler applies. The doctor plans without
        # our key (it compares peers, which never include ourselves).
        key = ctx.wireguard_identity.public_key if ctx.wireguard_identity else None
        devices: set[WgDeviceSpec] = set()
        if ctx.config.enable_ipv4:  # IPv6-only, Flannel creates flannel-wg-v6 alone
            devices.add(self.device_spec(ctx, own, peers, key))
        if ipv6.enabled(ctx):
            devices.add(
                plan_device_v6(
                    config,
                    own,
                    wireguard_peers_v6(ctx, own, peers),
                    key,
                    self.device_mtu_v6(ctx),
                )
            )
        routes = set(desired.routes)
        if ctx.config.network is not None:
            routes.add(network_route(ctx.config.network))
        if ipv6.enabled(ctx) and ctx.config.ipv6_network is not None:
            routes.add(network_route_v6(ctx.config.ipv6_network))
        return replace(desired, routes=frozenset(routes), wireguard=frozenset(devices))


def unencrypted_peers(
    ctx: NodeContext, own: Sequence[Lease], peers: Sequence[Lease], has_vtep: bool = False
) -> int:
    """Peer nodes this wireguard node still reaches in plaintext (vxlan during a rollout,
    or held on vxlan until its handshake, in either family): zero once the switch is
    complete. Counted by node, not by lease."""
    vni = ctx.config.backend.vni if has_vtep else None
    plain = {
        peer.attrs.public_ip
        for peer, path in _paths(ctx, own, peers)
        if path in ("vxlan", "direct") or held_in_a_family(ctx, peer, vni)
    }
    return len(plain)


def wireguard_peers(ctx: NodeContext, own: Sequence[Lease], peers: Sequence[Lease]) -> list[Lease]:
    """The peers the pair rule sends through WireGuard (both ends run it)."""
    return [peer for peer, path in _paths(ctx, own, peers) if path == "wireguard"]


def wireguard_peers_v6(
    ctx: NodeContext, own: Sequence[Lease], peers: Sequence[Lease]
) -> list[Lease]:
    """The IPv6 device's peers. Dual stack: the IPv4 device's (:func:`device_peers`; those
    without a key in BackendV6Data are left out by :func:`plan_device_v6`). IPv6-only: the
    rule applied to the IPv6 capabilities (BackendV6Data's key), on the IPv6 underlay."""
    if ctx.config.enable_ipv4:
        return device_peers(ctx, own, peers)
    caps = ipv6.own_capabilities_v6(replace(ctx, keeps_wireguard=False))
    flanneld_dr = ctx.config.flanneld_backend.direct_routing
    return [
        peer
        for peer in routable_peers(ctx, own, peers)
        if (ip6 := peer.attrs.public_ipv6) is not None
        and choose_path(
            caps, ipv6.peer_capabilities_v6(peer, flanneld_dr), ctx.underlay.on_link(ip6)
        )
        == "wireguard"
    ]


def device_peers(ctx: NodeContext, own: Sequence[Lease], peers: Sequence[Lease]) -> list[Lease]:
    """The IPv4 device's peers: those the pair rule sends through WireGuard, and those
    of ours that still have a device and key although the pair now takes vxlan or a
    direct route (it just switched back from wireguard): until such a peer sees our
    lease change it still sends to us encrypted, and a device without it would drop
    that. What leaves through the device is decided by our routes, and a pair that is
    not wireguard has a more specific route elsewhere."""
    flanneld_dr = ctx.config.flanneld_backend.direct_routing
    return [
        peer
        for peer, path in _paths(ctx, own, peers)
        if path == "wireguard" or peer_capabilities(peer, flanneld_dr).wireguard_key
    ]


def _paths(
    ctx: NodeContext, own: Sequence[Lease], peers: Sequence[Lease]
) -> list[tuple[Lease, object]]:
    # Our VTEP does not change whether a pair is wireguard; for vxlan, assume we have one.
    caps: Capabilities = own_capabilities(ctx.config.backend, None, ctx.keeps_wireguard)
    caps = replace(caps, vni=ctx.config.backend.vni)
    flanneld_dr = ctx.config.flanneld_backend.direct_routing
    return [
        (peer, choose_path(caps, peer_capabilities(peer, flanneld_dr), ctx.underlay.on_link(ip)))
        for peer in routable_peers(ctx, own, peers)
        if (ip := peer.attrs.public_ip) is not None  # IPv6-only peers: backend.ipv6
    ]


def backend_data_problem(data: Mapping[str, Any] | None) -> str | None:
    """Why a wireguard lease's BackendData cannot be used, or None (for validation)."""
    if not isinstance(data, Mapping) or not is_key(data.get("PublicKey")):
        return "its BackendData has no valid WireGuard PublicKey"
    return None
