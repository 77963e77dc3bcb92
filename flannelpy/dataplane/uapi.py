"""WireGuard's cross-platform userspace API (UAPI): a line protocol over a unix socket.

wireguard-go (and every userspace WireGuard) serves it at ``<dir>/<device>.sock``.
A request is ``get=1`` or ``set=1`` followed by ``key=value`` lines and an empty
line; the answer ends with ``errno=N`` and an empty line. Keys are hex, not base64.
Parsing and formatting are pure; :func:`uapi_get` and :func:`uapi_set` do the I/O.
See https://www.wireguard.com/xplatform/.
"""

from __future__ import annotations

import base64
import binascii
import socket
from collections.abc import Iterable
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address, ip_network

from flannelpy.errors import DataplaneError

ZERO_KEY_HEX = "0" * 64
TIMEOUT_SECONDS = 2.0
MAX_REPLY_BYTES = 4 << 20  # a device with thousands of peers answers in well under this


@dataclass(frozen=True)
class WgPeer:
    """One peer as configured on a device. Keys are base64, as leases and ``wg`` show them."""

    public_key: str
    endpoint: tuple[IPv4Address | IPv6Address, int] | None
    allowed_ips: frozenset[IPv4Network | IPv6Network]
    keepalive: int = 0  # seconds; 0 is off
    preshared_key: str | None = None


@dataclass(frozen=True)
class WgDeviceConfig:
    """The part of a device's configuration the agent owns."""

    private_key: str | None
    listen_port: int
    peers: dict[str, WgPeer] = field(default_factory=dict)  # by public key
    # The peers this device has completed a handshake with (observed, never configured).
    handshaken: frozenset[str] = frozenset()


def key_to_hex(key: str) -> str:
    return base64.b64decode(key, validate=True).hex()


def hex_to_key(value: str) -> str:
    return base64.b64encode(bytes.fromhex(value)).decode()


def format_set(
    private_key: str | None,
    listen_port: int | None,
    peers: Iterable[WgPeer],
    remove: Iterable[str] = (),
) -> bytes:
    """A ``set=1`` request: key and port when given, each peer replaced whole."""
    lines = ["set=1"]
    if private_key is not None:
        lines.append(f"private_key={key_to_hex(private_key)}")
    if listen_port is not None:
        lines.append(f"listen_port={listen_port}")
    for key in remove:
        lines += [f"public_key={key_to_hex(key)}", "remove=true"]
    for peer in peers:
        lines.append(f"public_key={key_to_hex(peer.public_key)}")
        psk = key_to_hex(peer.preshared_key) if peer.preshared_key else ZERO_KEY_HEX
        lines.append(f"preshared_key={psk}")
        if peer.endpoint is not None:
            host = peer.endpoint[0]
            host_text = f"[{host}]" if host.version == 6 else str(host)
            lines.append(f"endpoint={host_text}:{peer.endpoint[1]}")
        lines.append(f"persistent_keepalive_interval={peer.keepalive}")
        lines.append("replace_allowed_ips=true")
        lines += [f"allowed_ip={net}" for net in sorted(peer.allowed_ips, key=_net_order)]
    return ("\n".join(lines) + "\n\n").encode()


def _net_order(net: IPv4Network | IPv6Network) -> tuple[int, IPv4Network | IPv6Network]:
    return (net.version, net)


@dataclass
class _PeerBuilder:
    public_key: str
    endpoint: tuple[IPv4Address | IPv6Address, int] | None = None
    allowed: list[IPv4Network | IPv6Network] = field(default_factory=list)
    keepalive: int = 0
    psk: str | None = None
    handshaken: bool = False

    def build(self) -> WgPeer:
        return WgPeer(
            self.public_key, self.endpoint, frozenset(self.allowed), self.keepalive, self.psk
        )


def parse_get(text: str) -> WgDeviceConfig:
    """The answer to ``get=1``: the device's key, port and peers (either family: the
    IPv6 device ``flannel-wg-v6`` has IPv6 endpoints and allowed IPs). Raises
    DataplaneError on an error answer or a bad line."""
    private_key: str | None = None
    listen_port = 0
    peers: list[_PeerBuilder] = []
    try:
        for line in text.splitlines():
            key, _, value = line.partition("=")
            if key == "errno":
                if value != "0":
                    raise DataplaneError(f"the WireGuard device answered errno {value}")
            elif key == "private_key":
                private_key = None if value == ZERO_KEY_HEX else hex_to_key(value)
            elif key == "listen_port":
                listen_port = int(value)
            elif key == "public_key":
                peers.append(_PeerBuilder(hex_to_key(value)))
            elif not peers:
                continue
            elif key == "preshared_key":
                peers[-1].psk = None if value == ZERO_KEY_HEX else hex_to_key(value)
            elif key == "endpoint":
                host, _, port = value.rpartition(":")
                peers[-1].endpoint = (ip_address(host.strip("[]")), int(port))
            elif key == "persistent_keepalive_interval":
                peers[-1].keepalive = int(value)
            elif key == "allowed_ip":
                peers[-1].allowed.append(ip_network(value, strict=False))
            elif key == "last_handshake_time_sec":
                peers[-1].handshaken = int(value) != 0
    except (ValueError, binascii.Error) as e:
        raise DataplaneError(f"unreadable answer from the WireGuard device: {e}") from e
    built = [peer.build() for peer in peers]
    return WgDeviceConfig(
        private_key,
        listen_port,
        {peer.public_key: peer for peer in built},
        frozenset(peer.public_key for peer in peers if peer.handshaken),
    )


def _exchange(path: str, request: bytes) -> str:
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(TIMEOUT_SECONDS)
            sock.connect(path)
            sock.sendall(request)
            chunks: list[bytes] = []
            size = 0
            while True:
                chunk = sock.recv(65536)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
                if size > MAX_REPLY_BYTES:
                    raise DataplaneError(f"the WireGuard device at {path} answered too much")
                # The answer ends with "errno=N\n\n"; the socket stays open for more requests.
                tail = b"".join(chunks[-2:])
                if b"errno=" in tail and tail.endswith(b"\n\n"):
                    break
    except OSError as e:
        raise DataplaneError(f"could not talk to the WireGuard device at {path}: {e}") from e
    return b"".join(chunks).decode(errors="replace")


def uapi_get(path: str) -> WgDeviceConfig:
    return parse_get(_exchange(path, b"get=1\n\n"))


def uapi_set(path: str, request: bytes) -> None:
    answer = _exchange(path, request)
    for line in answer.splitlines():
        if line.startswith("errno=") and line != "errno=0":
            raise DataplaneError(f"the WireGuard device at {path} refused the change: {line}")
