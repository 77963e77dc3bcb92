"""The kernel's WireGuard module through pyroute2: the device link and its generic netlink
family (``wg`` over netlink). The userspace implementation speaks the UAPI instead
(:mod:`flannelpy.dataplane.uapi`); :mod:`flannelpy.dataplane.wireguard` chooses.
"""

from __future__ import annotations

import base64
import contextlib
from typing import Any

from flannelpy.dataplane.uapi import WgDeviceConfig, WgPeer
from flannelpy.dataplane.wgspec import PeerChanges, WgDeviceSpec
from flannelpy.errors import DataplaneError


class PyrouteLink:
    def exists(self, name: str) -> bool:
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            return bool(ipr.link_lookup(ifname=name))

    def ensure(self, spec: WgDeviceSpec, create_kind: str | None) -> None:
        from pyroute2 import IPRoute
        from pyroute2.netlink.exceptions import NetlinkError

        try:
            with IPRoute() as ipr:
                found = ipr.link_lookup(ifname=spec.name)
                if not found and create_kind is not None:
                    ipr.link("add", ifname=spec.name, kind=create_kind)
                    found = ipr.link_lookup(ifname=spec.name)
                if not found:
                    raise DataplaneError(f"the WireGuard device {spec.name} does not exist")
                index = found[0]
                link = ipr.link("get", index=index)[0]
                if link.get_attr("IFLA_MTU") != spec.mtu:
                    ipr.link("set", index=index, mtu=spec.mtu)
                if spec.address is not None:
                    family = 10 if spec.address.version == 6 else 2  # AF_INET6, AF_INET
                    have = {  # not the link-local one: scope 0 (global)
                        (a.get_attr("IFA_ADDRESS"), a["prefixlen"])
                        for a in ipr.get_addr(index=index, family=family)
                        if a["scope"] == 0
                    }
                    want = (str(spec.address.ip), spec.address.network.prefixlen)
                    for addr, plen in have - {want}:
                        ipr.addr("del", index=index, address=addr, prefixlen=plen)
                    if want not in have:
                        ipr.addr("replace", index=index, address=want[0], prefixlen=want[1])
                if not link["flags"] & 1:  # IFF_UP
                    ipr.link("set", index=index, state="up")
        except NetlinkError as e:
            raise DataplaneError(f"could not set up {spec.name}: {e}") from e

    def delete(self, name: str) -> None:
        from pyroute2 import IPRoute
        from pyroute2.netlink.exceptions import NetlinkError

        with IPRoute() as ipr, contextlib.suppress(NetlinkError):
            ipr.link("del", ifname=name)


class KernelConfigurator:
    """pyroute2's generic netlink WireGuard family (the kernel module)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def get(self) -> WgDeviceConfig:
        from pyroute2 import WireGuard

        peers: dict[str, WgPeer] = {}
        handshaken: set[str] = set()
        private_key: str | None = None
        port = 0
        with WireGuard() as wg:
            for msg in wg.info(self.name):
                raw_key = msg.get_attr("WGDEVICE_A_PRIVATE_KEY")
                if raw_key:
                    private_key = _b64(raw_key)
                port = msg.get_attr("WGDEVICE_A_LISTEN_PORT") or port
                for p in msg.get_attr("WGDEVICE_A_PEERS") or []:
                    peer = _kernel_peer(p)
                    if peer is not None:
                        peers[peer.public_key] = peer
                        if _kernel_handshake_seconds(p):
                            handshaken.add(peer.public_key)
        return WgDeviceConfig(
            private_key=private_key, listen_port=port, peers=peers, handshaken=frozenset(handshaken)
        )

    def set(self, changes: PeerChanges) -> None:
        from pyroute2 import WireGuard
        from pyroute2.netlink.exceptions import NetlinkError

        try:
            with WireGuard() as wg:
                if changes.private_key is not None or changes.listen_port is not None:
                    args: dict[str, Any] = {}
                    if changes.private_key is not None:
                        args["private_key"] = changes.private_key
                    if changes.listen_port is not None:
                        args["listen_port"] = changes.listen_port
                    wg.set(self.name, **args)
                for key in changes.remove:
                    wg.set(self.name, peer={"public_key": key, "remove": True})
                for peer in changes.set:
                    spec: dict[str, Any] = {
                        "public_key": peer.public_key,
                        "allowed_ips": sorted(str(n) for n in peer.allowed_ips),
                        "persistent_keepalive": peer.keepalive,
                    }
                    if peer.endpoint is not None:
                        spec["endpoint_addr"] = str(peer.endpoint[0])
                        spec["endpoint_port"] = peer.endpoint[1]
                    if peer.preshared_key:
                        spec["preshared_key"] = peer.preshared_key
                    wg.set(self.name, peer=spec)
        except NetlinkError as e:
            raise DataplaneError(f"could not configure {self.name}: {e}") from e


def _kernel_handshake_seconds(msg: Any) -> int:
    """WGPEER_A_LAST_HANDSHAKE_TIME's seconds (pyroute2 decodes a timespec); 0: never."""
    value = msg.get_attr("WGPEER_A_LAST_HANDSHAKE_TIME")
    try:
        return int(value["tv_sec"]) if value is not None else 0
    except (KeyError, TypeError, ValueError):
        return 0


def _b64(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _kernel_peer(msg: Any) -> WgPeer | None:
    from ipaddress import ip_address, ip_network

    key = msg.get_attr("WGPEER_A_PUBLIC_KEY")
    if not key:
        return None
    allowed = set()
    for a in msg.get_attr("WGPEER_A_ALLOWEDIPS") or []:
        allowed.add(ip_network(a.get_attr("WGALLOWEDIP_A_IPADDR") or "0.0.0.0/0", strict=False))
    endpoint = msg.get_attr("WGPEER_A_ENDPOINT")
    ep = None
    if isinstance(endpoint, dict) and endpoint.get("family") in (2, 10):
        ep = (ip_address(endpoint["addr"]), int(endpoint["port"]))
    psk = msg.get_attr("WGPEER_A_PRESHARED_KEY")
    psk_s = _b64(psk) if psk else None
    if psk_s is not None and base64.b64decode(psk_s) == bytes(32):
        psk_s = None
    return WgPeer(
        public_key=_b64(key),
        endpoint=ep,
        allowed_ips=frozenset(allowed),
        keepalive=int(msg.get_attr("WGPEER_A_PERSISTENT_KEEPALIVE_INTERVAL") or 0),
        preshared_key=psk_s,
    )
