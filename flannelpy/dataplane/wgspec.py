"""A WireGuard device's desired state and its difference from the device (pure).

The backend plans a :class:`WgDeviceSpec` per device; :func:`peer_changes` is what to
write so the device matches it, :func:`confirmed_peers` which planned peers have
completed a handshake.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from ipaddress import IPv4Interface, IPv6Interface

from flannelpy.dataplane.uapi import WgDeviceConfig, WgPeer


@dataclass(frozen=True)
class WgDeviceSpec:
    """Everything of one WireGuard device the agent owns."""

    name: str
    listen_port: int
    mtu: int
    # our lease's network address /32 (/128 on flannel-wg-v6), as Flannel's
    address: IPv4Interface | IPv6Interface | None
    peers: frozenset[WgPeer] = frozenset()


@dataclass(frozen=True)
class PeerChanges:
    private_key: str | None = None  # set when the device's differs
    listen_port: int | None = None
    remove: tuple[str, ...] = ()
    set: tuple[WgPeer, ...] = ()
    counts: dict[str, int] = field(default_factory=dict, compare=False)

    @property
    def empty(self) -> bool:
        return (
            self.private_key is None
            and self.listen_port is None
            and not self.remove
            and not self.set
        )


def peer_changes(spec: WgDeviceSpec, private_key: str, observed: WgDeviceConfig) -> PeerChanges:
    """What to write so the device matches ``spec``: peers missing, differing or extra."""
    wanted = {peer.public_key: peer for peer in spec.peers}
    remove = tuple(sorted(k for k in observed.peers if k not in wanted))
    to_set = tuple(peer for key, peer in sorted(wanted.items()) if observed.peers.get(key) != peer)
    key = private_key if observed.private_key != private_key else None
    port = spec.listen_port if observed.listen_port != spec.listen_port else None
    return PeerChanges(
        private_key=key,
        listen_port=port,
        remove=remove,
        set=to_set,
        counts={
            "peers_removed": len(remove),
            "peers_set": len(to_set),
            "key": int(key is not None),
            "port": int(port is not None),
        },
    )


def confirmed_peers(
    spec: WgDeviceSpec, previous: frozenset[str], observed: WgDeviceConfig
) -> frozenset[str]:
    """The planned peers a handshake has been completed with, now or before (pure). Kept
    once seen: a restarted wireguard-go forgets its handshakes, but the peer knows our key
    and answers the next one, so its route need not go back to vxlan meanwhile."""
    wanted = {peer.public_key for peer in spec.peers}
    return frozenset((previous | observed.handshaken) & wanted)
