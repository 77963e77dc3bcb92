"""subnet.env: the file the flannel CNI plugin reads (Flannel's exact format).

Written by the agent once it holds a lease, read by the CNI plugin on every
ADD, and read back by the agent at start to prefer the same subnet again::

    FLANNEL_NETWORK=10.244.0.0/16
    FLANNEL_SUBNET=10.244.1.1/24
    FLANNEL_IPV6_NETWORK=fd00:10:244::/56     (only with IPv6)
    FLANNEL_IPV6_SUBNET=fd00:10:244:1::1/64   (only with IPv6)
    FLANNEL_MTU=1450
    FLANNEL_IPMASQ=true

In IPv6-only mode (EnableIPv4 false) the two IPv4 keys are absent, as in Flannel's.

FLANNEL_SUBNET is the lease's first usable address with the lease's prefix,
not its network address: the CNI plugin gives that address to the bridge.
FLANNEL_IPMASQ is true when the agent masquerades (``--ip-masq``); the plugin
then tells the bridge plugin *not* to (``ipMasq = !FLANNEL_IPMASQ``).

The file is a contract between processes, so it is replaced atomically (a
reader sees the old or the new file, never half of one) and read loudly: a
file missing keys is an error naming them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from ipaddress import IPv4Interface, IPv4Network, IPv6Interface, IPv6Network
from typing import TypeVar

from flannelpy.errors import ConfigError
from flannelpy.fsutil import atomic_write

T = TypeVar("T")

log = logging.getLogger(__name__)

FILE_MODE = 0o644  # the CNI plugin may run as another user; the content is not secret
REQUIRED_KEYS = ("FLANNEL_NETWORK", "FLANNEL_SUBNET", "FLANNEL_MTU", "FLANNEL_IPMASQ")
V4_KEYS = ("FLANNEL_NETWORK", "FLANNEL_SUBNET")
V6_KEYS = ("FLANNEL_IPV6_NETWORK", "FLANNEL_IPV6_SUBNET")


@dataclass(frozen=True)
class SubnetEnv:
    """The file's values. ``network``/``subnet`` are None only in IPv6-only mode."""

    network: IPv4Network | None  # FLANNEL_NETWORK, the whole cluster network
    subnet: IPv4Interface | None  # FLANNEL_SUBNET, e.g. 10.244.1.1/24 for lease 10.244.1.0/24
    mtu: int  # FLANNEL_MTU, the overlay MTU pods should use
    ipmasq: bool  # FLANNEL_IPMASQ, true when the agent does the masquerading
    ipv6_network: IPv6Network | None = None
    ipv6_subnet: IPv6Interface | None = None

    @classmethod
    def for_lease(
        cls,
        network: IPv4Network,
        lease_subnet: IPv4Network,
        mtu: int,
        ipmasq: bool,
        ipv6_network: IPv6Network | None = None,
        ipv6_lease_subnet: IPv6Network | None = None,
    ) -> SubnetEnv:
        """Build the file's content from the network and the lease's subnet(s)."""
        return cls(
            network=network,
            subnet=first_usable(lease_subnet),
            mtu=mtu,
            ipmasq=ipmasq,
            ipv6_network=ipv6_network,
            ipv6_subnet=first_usable_v6(ipv6_lease_subnet) if ipv6_lease_subnet else None,
        )

    @property
    def lease_subnet(self) -> IPv4Network:
        """The lease's subnet, e.g. 10.244.1.0/24 for FLANNEL_SUBNET=10.244.1.1/24."""
        if self.subnet is None:
            raise ConfigError("subnet.env has no FLANNEL_SUBNET (IPv6-only); use ipv6_subnet")
        return self.subnet.network


def first_usable(subnet: IPv4Network) -> IPv4Interface:
    """10.244.1.0/24 → 10.244.1.1/24 (Flannel increments the network address by one)."""
    return IPv4Interface(f"{subnet.network_address + 1}/{subnet.prefixlen}")


def first_usable_v6(subnet: IPv6Network) -> IPv6Interface:
    return IPv6Interface(f"{subnet.network_address + 1}/{subnet.prefixlen}")


def render(env: SubnetEnv) -> str:
    """The file's text, keys in Flannel's order, booleans as Go prints them."""
    lines = []
    if env.network is not None and env.subnet is not None:
        lines += [f"FLANNEL_NETWORK={env.network}", f"FLANNEL_SUBNET={env.subnet}"]
    if env.ipv6_network is not None and env.ipv6_subnet is not None:
        lines += [
            f"FLANNEL_IPV6_NETWORK={env.ipv6_network}",
            f"FLANNEL_IPV6_SUBNET={env.ipv6_subnet}",
        ]
    lines += [f"FLANNEL_MTU={env.mtu}", f"FLANNEL_IPMASQ={'true' if env.ipmasq else 'false'}"]
    return "\n".join(lines) + "\n"


def write_subnet_env(path: str, env: SubnetEnv) -> None:
    """Replace ``path`` atomically with ``render(env)``, creating its directory."""
    atomic_write(path, render(env).encode("ascii"), mode=FILE_MODE, dir_mode=0o755)


def parse(text: str) -> dict[str, str]:
    """KEY=VALUE lines; blank lines and ``#`` comments ignored, optional quotes removed."""
    values: dict[str, str] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#") or "=" not in line:
            continue
        key, _, value = line.partition("=")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        values[key.strip()] = value
    return values


def from_text(text: str, source: str = "subnet.env") -> SubnetEnv:
    """Parse and validate; ConfigError names missing keys or the bad value."""
    values = parse(text)
    has_v4 = [k for k in V4_KEYS if k in values]
    has_v6 = [k for k in V6_KEYS if k in values]
    # Each family's pair is all or nothing; IPv4 may be absent only when IPv6 is there.
    v4_needed = has_v4 or len(has_v6) != len(V6_KEYS)
    missing = [k for k in REQUIRED_KEYS if k not in values and (k not in V4_KEYS or v4_needed)]
    missing += [k for k in V6_KEYS if has_v6 and k not in values]
    if missing:
        raise ConfigError(
            f"{source} is missing {', '.join(missing)}; let the agent rewrite it or add them"
        )
    return SubnetEnv(
        network=(
            _field(source, values, "FLANNEL_NETWORK", lambda v: IPv4Network(v, strict=True))
            if has_v4
            else None
        ),
        subnet=_field(source, values, "FLANNEL_SUBNET", IPv4Interface) if has_v4 else None,
        mtu=_field(source, values, "FLANNEL_MTU", _positive_int),
        ipmasq=_field(source, values, "FLANNEL_IPMASQ", _go_bool),
        ipv6_network=(
            _field(source, values, "FLANNEL_IPV6_NETWORK", lambda v: IPv6Network(v, strict=True))
            if has_v6
            else None
        ),
        ipv6_subnet=(
            _field(source, values, "FLANNEL_IPV6_SUBNET", IPv6Interface) if has_v6 else None
        ),
    )


def read_subnet_env(path: str) -> SubnetEnv | None:
    """The file's content, or None when it does not exist."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path} cannot be read ({e}); fix or remove the file") from e
    return from_text(text, source=path)


def read_previous_subnet(path: str) -> IPv4Network | None:
    """The IPv4 lease subnet recorded by the last run (FLANNEL_SUBNET), to ask for the
    same one again. See :func:`read_previous_subnets`."""
    return read_previous_subnets(path)[0]


def read_previous_subnets(path: str) -> tuple[IPv4Network | None, IPv6Network | None]:
    """The lease subnets recorded by the last run: FLANNEL_SUBNET and FLANNEL_IPV6_SUBNET
    (as in Flannel), to ask for the same ones again.

    A missing file is normal on a first start; an unreadable one or a bad value is
    logged and ignored, because the worst outcome is a different subnet, not a
    failed start.
    """
    try:
        with open(path, encoding="ascii") as f:
            text = f.read()
    except FileNotFoundError:
        return None, None
    except (OSError, UnicodeDecodeError) as e:
        log.warning("previous subnet file unreadable, ignoring it path=%s error=%s", path, e)
        return None, None
    values = parse(text)
    v4 = _previous(path, values, "FLANNEL_SUBNET", IPv4Interface)
    v6 = _previous(path, values, "FLANNEL_IPV6_SUBNET", IPv6Interface)
    if v4 is None and v6 is None:
        log.warning("previous subnet file has no FLANNEL_SUBNET, ignoring it path=%s", path)
    return (
        v4.network if isinstance(v4, IPv4Interface) else None,
        v6.network if isinstance(v6, IPv6Interface) else None,
    )


def _previous(path: str, values: dict[str, str], key: str, convert: Callable[[str], T]) -> T | None:
    value = values.get(key)
    if value is None:
        return None
    try:
        return convert(value)
    except ValueError as e:
        log.warning(
            "previous subnet unparsable, ignoring it path=%s key=%s value=%r error=%s",
            path,
            key,
            value,
            e,
        )
        return None


def _field(source: str, values: dict[str, str], key: str, convert: Callable[[str], T]) -> T:
    try:
        return convert(values[key])
    except ValueError as e:
        raise ConfigError(f"{source}: {key}={values[key]!r} is invalid ({e}); fix the value") from e


def _positive_int(value: str) -> int:
    n = int(value)
    if n <= 0:
        raise ValueError("must be a positive integer")
    return n


def _go_bool(value: str) -> bool:
    # Flannel writes Go's %v of a bool; accept the spellings Go's ParseBool does.
    lowered = value.lower()
    if lowered in ("true", "1", "t"):
        return True
    if lowered in ("false", "0", "f"):
        return False
    raise ValueError("expected true or false")
