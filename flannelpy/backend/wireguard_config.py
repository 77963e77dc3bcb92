"""The wireguard backend's options (``Backend`` of net-conf.json), checked (pure).

Flannel's names: ``ListenPort``, ``ListenPortV6``, ``PSK`` (base64, as ``wg genpsk``),
``PersistentKeepaliveInterval`` (seconds), ``Mode`` (separate, auto, ipv4, ipv6), ``MTU``;
ours: ``Implementation`` (auto: the kernel module when present, else wireguard-go;
kernel; userspace). Keys match case-insensitively, as in Go's decoder.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from flannelpy.config.netconf import BackendConfig, fold_keys
from flannelpy.dataplane.wgkeys import is_key
from flannelpy.errors import ConfigError

DEVICE = "flannel-wg"
DEVICE_V6 = "flannel-wg-v6"
DEFAULT_LISTEN_PORT = 51820
DEFAULT_LISTEN_PORT_V6 = 51821
OVERHEAD_IPV4 = 60  # outer IPv4 20 + UDP 8 + type/index/counter 16 + Poly1305 tag 16
OVERHEAD_IPV6 = 80  # the same over a 40-byte IPv6 header (Flannel uses 80 for both)
MODES = ("separate", "auto", "ipv4", "ipv6")
IMPLEMENTATIONS = ("auto", "kernel", "userspace")
_WHERE = "net-conf.json"

Mode = Literal["separate", "auto", "ipv4", "ipv6"]


@dataclass(frozen=True)
class WireguardConfig:
    listen_port: int = DEFAULT_LISTEN_PORT
    listen_port_v6: int = DEFAULT_LISTEN_PORT_V6
    psk: str | None = None
    keepalive: int = 0  # seconds; 0 is off
    mode: Mode = "separate"
    implementation: str = "auto"


@dataclass(frozen=True)
class WireguardIdentity:
    """What planning needs of the node's WireGuard: its public key and the options its
    device runs with (kept after a switch away, while the device stays for its peers)."""

    public_key: str
    options: WireguardConfig


def parse_wireguard_config(backend: BackendConfig) -> WireguardConfig:
    """The wireguard options of ``Backend``, checked (pure). Keys match case-insensitively
    as in Go's decoder; every error is one sentence naming the key and the fix."""
    _, values = fold_keys(backend.raw, "Backend ")

    def integer(name: str, default: int, low: int, high: int) -> int:
        value = values.get(name.lower())
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
            raise ConfigError(
                f'{_WHERE}: Backend "{name}" must be a whole number in {low}..{high}, not '
                f'{value!r}; write it like "{name}": {default or 25}'
            )
        return value

    def choice(name: str, default: str, allowed: Sequence[str]) -> str:
        value = values.get(name.lower())
        if value is None or value == "":
            return default
        if not isinstance(value, str) or value.lower() not in allowed:
            raise ConfigError(
                f'{_WHERE}: Backend "{name}" {value!r} is not known; use one of: '
                f"{', '.join(allowed)}"
            )
        return value.lower()

    port = integer("ListenPort", DEFAULT_LISTEN_PORT, 1, 65535)
    port_v6 = integer("ListenPortV6", DEFAULT_LISTEN_PORT_V6, 1, 65535)
    keepalive = integer("PersistentKeepaliveInterval", 0, 0, 65535)
    mode = choice("Mode", "separate", MODES)
    if mode == "ipv6":
        raise ConfigError(
            f'{_WHERE}: Backend "Mode" "ipv6" tunnels over an IPv6 underlay, which flannelpy '
            'does not run yet; use "separate" (the default) or "ipv4"'
        )
    implementation = choice("Implementation", "auto", IMPLEMENTATIONS)
    psk = values.get("psk")
    if psk in (None, ""):
        psk = None
    elif not is_key(psk):
        raise ConfigError(
            f'{_WHERE}: Backend "PSK" must be a base64 WireGuard key (32 bytes), as '
            "`wg genpsk` prints; write a new one or leave the key out"
        )
    return WireguardConfig(
        listen_port=port,
        listen_port_v6=port_v6,
        psk=psk,
        keepalive=keepalive,
        mode=mode,  # type: ignore[arg-type]
        implementation=implementation,
    )


def overlay_mtu(underlay_mtu: int, underlay_is_ipv6: bool = False) -> int:
    return underlay_mtu - (OVERHEAD_IPV6 if underlay_is_ipv6 else OVERHEAD_IPV4)
