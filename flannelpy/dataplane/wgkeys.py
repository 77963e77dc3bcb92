"""WireGuard keys: X25519 (RFC 7748) in pure Python, and the node's key file.

The private key is generated once and kept in a 0600 file, so a restart or a reboot
keeps the public key peers know. Used once per key, never per packet.
"""

from __future__ import annotations

import base64
import logging
import os

from flannelpy.errors import ConfigError
from flannelpy.fsutil import atomic_write

log = logging.getLogger("flannelpy.dataplane.wireguard")

_P = 2**255 - 19
_A24 = 121665


def _x25519(scalar: bytes, u: bytes) -> bytes:
    """RFC 7748 X25519 (Montgomery ladder). Used once per key, never per packet."""
    k = int.from_bytes(scalar, "little")
    k &= ~7
    k &= ~(128 << 8 * 31)
    k |= 64 << 8 * 31
    x1 = int.from_bytes(u, "little") & ((1 << 255) - 1)
    x2, z2, x3, z3 = 1, 0, x1, 1
    swap = 0
    for t in reversed(range(255)):
        bit = (k >> t) & 1
        swap ^= bit
        if swap:
            x2, x3, z2, z3 = x3, x2, z3, z2
        swap = bit
        a, b = x2 + z2, x2 - z2
        aa, bb = a * a, b * b
        e = aa - bb
        c, d = x3 + z3, x3 - z3
        da, cb = d * a, c * b
        x3 = (da + cb) ** 2 % _P
        z3 = x1 * (da - cb) ** 2 % _P
        x2 = aa * bb % _P
        z2 = e * (aa + _A24 * e) % _P
    if swap:
        x2, z2 = x3, z3
    return (x2 * pow(z2, _P - 2, _P) % _P).to_bytes(32, "little")


def public_key(private_key: str) -> str:
    """The base64 public key of a base64 private key, as ``wg pubkey`` prints it."""
    raw = base64.b64decode(private_key, validate=True)
    if len(raw) != 32:
        raise ValueError("a WireGuard key is 32 bytes")
    return base64.b64encode(_x25519(raw, (9).to_bytes(32, "little"))).decode()


def generate_private_key() -> str:
    raw = bytearray(os.urandom(32))
    raw[0] &= 248
    raw[31] = (raw[31] & 127) | 64
    return base64.b64encode(bytes(raw)).decode()


def is_key(value: object) -> bool:
    """A base64 WireGuard key (32 bytes): what a lease's PublicKey must be."""
    if not isinstance(value, str) or len(value) != 44:
        return False
    try:
        return len(base64.b64decode(value, validate=True)) == 32
    except ValueError:
        return False


def load_or_create_key(path: str) -> str:
    """The node's private key from ``path``, generated and written (0600) the first time.

    An unreadable key is refused, not replaced: peers know its public half, and a
    silently new key would cut the node off until every peer saw the new lease."""
    try:
        with open(path) as f:
            key = f.read().strip()
    except FileNotFoundError:
        key = generate_private_key()
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        atomic_write(path, (key + "\n").encode(), mode=0o600)
        log.info("generated the WireGuard key path=%s", path)
        return key
    except OSError as e:
        raise ConfigError(f"cannot read the WireGuard key {path}: {e}; fix its permissions") from e
    if not is_key(key):
        raise ConfigError(
            f"{path} does not hold a WireGuard private key (base64, 32 bytes); "
            "remove it to have a new one generated, or write one made by `wg genkey`"
        )
    return key
