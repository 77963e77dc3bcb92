"""Typed, validated network configuration: Flannel's net-conf.json.

Parsing is pure: bytes and argv/environ in, frozen dataclasses out, or a
ConfigError whose message is one sentence naming the field and the fix.
Nothing here touches the host, except reading the hostname as the last-resort
default node name.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from ipaddress import (
    IPv4Address,
    IPv4Network,
    IPv6Address,
    IPv6Network,
    ip_address,
    ip_network,
)
from typing import Any

from flannelpy.errors import ConfigError

VXLAN_ENCAP_OVERHEAD = 50  # outer Ethernet 14 + IPv4 20 + UDP 8 + VXLAN 8 (IPv4 underlay)
DEFAULT_VXLAN_PORT = 8472  # the Linux kernel's default, and Flannel's

# Backends flannelpy implements, and the ones Flannel has that we do not (so the
# error can say "not supported" rather than "unknown").
SUPPORTED_BACKENDS = ("host-gw", "vxlan", "wireguard")
FLANNEL_ONLY_BACKENDS = frozenset(
    {
        "udp",
        "ipip",
        "alloc",
        "ipsec",
        "extension",
        "tencent-vpc",
        "alivpc",
        "gce",
        "aws-vpc",
    }
)


@dataclass(frozen=True)
class BackendConfig:
    """The ``Backend`` object of net-conf.json. Unknown options are kept in ``raw``."""

    type: str = "vxlan"  # lower-cased: "vxlan", "host-gw", ...
    vni: int = 1
    port: int = 0  # 0: the kernel default (DEFAULT_VXLAN_PORT)
    gbp: bool = False
    learning: bool = False
    direct_routing: bool = False
    mtu: int | None = None  # underlay MTU to assume; None: the interface's own
    raw: Mapping[str, Any] = field(default_factory=dict)

    @property
    def effective_port(self) -> int:
        return self.port or DEFAULT_VXLAN_PORT


@dataclass(frozen=True)
class NetworkConfig:
    """Flannel's net-conf.json, with its defaults applied and checks passed.

    With ``enable_ipv4`` false, ``network`` is None, ``subnet_len`` is 0 and
    ``subnet_min``/``subnet_max`` are 0.0.0.0. With ``enable_ipv6`` false, every
    ``ipv6_*`` field is None.
    """

    network: IPv4Network | None
    subnet_len: int
    subnet_min: IPv4Address
    subnet_max: IPv4Address
    backend: BackendConfig
    enable_ipv4: bool = True
    enable_ipv6: bool = False
    ipv6_network: IPv6Network | None = None
    ipv6_subnet_len: int | None = None
    enable_nftables: bool = False
    backend_defaulted: bool = False  # no Backend key: vxlan was assumed (log a warning)
    raw: Mapping[str, Any] = field(default_factory=dict)  # the whole document, as written
    ipv6_subnet_min: IPv6Address | None = None
    ipv6_subnet_max: IPv6Address | None = None
    # The document's own Backend when this node runs an override of it: what flanneld
    # nodes run (they read no overrides). None: this node runs the document as is.
    cluster_backend: BackendConfig | None = None

    @property
    def flanneld_backend(self) -> BackendConfig:
        """The Backend a flanneld node of this cluster runs: the document's own."""
        return self.cluster_backend or self.backend


# ---------------------------------------------------------------------------
# net-conf.json
# ---------------------------------------------------------------------------

_WHERE = "net-conf.json"

# Sample values, so a type error can show the user what to write.
_EXAMPLES = {
    "Network": '"10.244.0.0/16"',
    "IPv6Network": '"fd00:10:244::/56"',
    "SubnetMin": '"10.244.1.0"',
    "SubnetMax": '"10.244.250.0"',
    "IPv6SubnetMin": '"fd00:10:244:1::"',
    "IPv6SubnetMax": '"fd00:10:244:ff::"',
    "Type": '"vxlan"',
    "SubnetLen": "24",
    "IPv6SubnetLen": "64",
    "VNI": "1",
    "Port": "8472",
    "MTU": "1500",
}


def _show(value: Any) -> str:
    """A JSON value as the user wrote it, shortened for an error message."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def fold_keys(obj: Mapping[str, Any], prefix: str) -> tuple[dict[str, str], dict[str, Any]]:
    """A net-conf.json object's keys matched case-insensitively, as Go's decoder does:
    (folded -> key as spelled, folded -> value). ``prefix`` names the object in errors
    ("" for the top level, "Backend " inside Backend)."""
    spelled: dict[str, str] = {}
    values: dict[str, Any] = {}
    for key, value in obj.items():
        folded = key.lower()
        if folded in spelled:
            raise ConfigError(
                f'{_WHERE}: {prefix}keys "{spelled[folded]}" and "{key}" differ only in '
                "case and Flannel reads them as one key; keep only one of them"
            )
        spelled[folded] = key
        values[folded] = value
    return spelled, values


class _Section:
    """One JSON object of net-conf.json with keys matched case-insensitively, as Go does."""

    def __init__(self, obj: Mapping[str, Any], prefix: str) -> None:
        self._prefix = prefix  # "" for the top level, "Backend " inside Backend
        self._values = fold_keys(obj, prefix)[1]

    def label(self, name: str) -> str:
        return f'{self._prefix}"{name}"'

    def _get(self, name: str) -> Any:
        # JSON null is "not set", as for Go's decoder into a non-pointer field.
        return self._values.get(name.lower())

    def _type_error(self, name: str, value: Any, kind: str, example: str) -> ConfigError:
        return ConfigError(
            f"{_WHERE}: {self.label(name)} must be {kind}, not {_show(value)}; "
            f'write it like "{name}": {example}'
        )

    def str_(self, name: str) -> str | None:
        value = self._get(name)
        if value is None or isinstance(value, str):
            return value
        raise self._type_error(name, value, "a string", _EXAMPLES.get(name, '"..."'))

    def int_(self, name: str) -> int | None:
        value = self._get(name)
        # bool is an int in Python but not in JSON; floats are refused as Go does.
        if value is None or (isinstance(value, int) and not isinstance(value, bool)):
            return value
        raise self._type_error(name, value, "a whole number", _EXAMPLES.get(name, "1"))

    def bool_(self, name: str) -> bool | None:
        value = self._get(name)
        if value is None or isinstance(value, bool):
            return value
        raise self._type_error(name, value, "true or false", "true")

    def object_(self, name: str) -> Mapping[str, Any] | None:
        value = self._get(name)
        if value is None or isinstance(value, dict):
            return value
        raise self._type_error(name, value, "a JSON object", '{"Type": "vxlan"}')


def _load_json(raw: str | bytes) -> dict[str, Any]:
    def refuse_constant(name: str) -> Any:
        raise ValueError(f"{name} is not valid JSON")

    try:
        doc = json.loads(raw, parse_constant=refuse_constant)
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"{_WHERE}: invalid JSON at line {e.lineno} column {e.colno} ({e.msg}); "
            "fix the syntax there"
        ) from e
    except (UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{_WHERE}: not valid JSON ({e}); fix the file's content") from e
    if not isinstance(doc, dict):
        raise ConfigError(
            f"{_WHERE}: the document must be a JSON object, not {_show(doc)}; "
            'write it like {"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan"}}'
        )
    return doc


def parse_network_config(raw: str | bytes) -> NetworkConfig:
    """Parse and check Flannel's net-conf.json, applying Flannel's defaults."""
    doc = _load_json(raw)
    top = _Section(doc, "")
    enable_ipv4 = _flag(top, "EnableIPv4", default=True)
    enable_ipv6 = _flag(top, "EnableIPv6", default=False)
    if not enable_ipv4 and not enable_ipv6:
        raise ConfigError(
            f'{_WHERE}: "EnableIPv4" and "EnableIPv6" are both false; '
            "enable at least one address family"
        )
    v4 = _subnet_range(top, _V4) if enable_ipv4 else None
    v6 = _subnet_range(top, _V6) if enable_ipv6 else None
    backend, defaulted = _backend(top)
    return NetworkConfig(
        network=v4.network if v4 else None,
        subnet_len=v4.subnet_len if v4 else 0,
        subnet_min=v4.subnet_min if v4 else IPv4Address(0),
        subnet_max=v4.subnet_max if v4 else IPv4Address(0),
        backend=backend,
        enable_ipv4=enable_ipv4,
        enable_ipv6=enable_ipv6,
        ipv6_network=v6.network if v6 else None,
        ipv6_subnet_len=v6.subnet_len if v6 else None,
        ipv6_subnet_min=v6.subnet_min if v6 else None,
        ipv6_subnet_max=v6.subnet_max if v6 else None,
        enable_nftables=_flag(top, "EnableNFTables", default=False),
        backend_defaulted=defaulted,
        raw=doc,
    )


def _flag(section: _Section, name: str, default: bool) -> bool:
    value = section.bool_(name)
    return default if value is None else value


@dataclass(frozen=True)
class _Family:
    """The limits Flannel applies per address family."""

    version: int
    network_key: str
    len_key: str
    min_key: str
    max_key: str
    max_network_prefix: int  # the smallest network that holds four subnets
    max_subnet_len: int  # leaves room for a gateway and a pod per subnet
    default_subnet_len: int


_V4 = _Family(4, "Network", "SubnetLen", "SubnetMin", "SubnetMax", 28, 30, 24)
_V6 = _Family(6, "IPv6Network", "IPv6SubnetLen", "IPv6SubnetMin", "IPv6SubnetMax", 124, 126, 64)


@dataclass(frozen=True)
class _Range:
    """A family's Network and the subnet range in it (IPv4 or IPv6 values)."""

    network: Any
    subnet_len: int
    subnet_min: Any
    subnet_max: Any


def _subnet_range(top: _Section, fam: _Family) -> _Range:
    network = _network(top, fam)
    subnet_len = _subnet_len(top, fam, network)
    size = 1 << (network.max_prefixlen - subnet_len)
    # Flannel skips the first subnet: its network address equals the Network's.
    default_min = network.network_address + size
    default_max = network.broadcast_address - (size - 1)  # +1 first could overflow
    low = _bound(top, fam, fam.min_key, network, subnet_len, default_min)
    high = _bound(top, fam, fam.max_key, network, subnet_len, default_max)
    if low > high:
        raise ConfigError(
            f"{_WHERE}: {top.label(fam.min_key)} {low} is above {top.label(fam.max_key)} "
            f"{high}; swap them or widen the range"
        )
    return _Range(network, subnet_len, low, high)


def _network(top: _Section, fam: _Family) -> Any:
    label = top.label(fam.network_key)
    enable_key = "EnableIPv4" if fam.version == 4 else "EnableIPv6"
    text = top.str_(fam.network_key)
    if text is None:
        raise ConfigError(
            f"{_WHERE}: {label} is required when {enable_key} is true; "
            f'add it like "{fam.network_key}": {_EXAMPLES[fam.network_key]}'
        )
    try:
        if "/" not in text:
            raise ValueError("no prefix length")
        # Go's ParseCIDR drops host bits silently; so do we, for compatibility.
        network = ip_network(text.strip(), strict=False)
    except ValueError as e:
        raise ConfigError(
            f"{_WHERE}: {label} {_show(text)} is not a CIDR; write it as address/prefix, "
            f"like {_EXAMPLES[fam.network_key]}"
        ) from e
    if network.version != fam.version:
        other = "IPv6Network" if fam.version == 4 else "Network"
        raise ConfigError(
            f"{_WHERE}: {label} {network} is not an IPv{fam.version} CIDR; "
            f'put IPv{network.version} ranges in "{other}"'
        )
    if network.prefixlen > fam.max_network_prefix:
        raise ConfigError(
            f"{_WHERE}: {label} {network} is too small; use a /{fam.max_network_prefix} "
            "or larger network so it holds at least four subnets"
        )
    return network


def _subnet_len(top: _Section, fam: _Family, network: Any) -> int:
    explicit = top.int_(fam.len_key)
    shortest = network.prefixlen + 2  # at least four subnets; the first is skipped
    if not explicit:  # absent or 0: automatic, as in Flannel
        return max(fam.default_subnet_len, shortest)
    label = top.label(fam.len_key)
    bounds = f"it must be between {shortest} and {fam.max_subnet_len} for {fam.network_key} "
    if explicit > fam.max_subnet_len:
        raise ConfigError(f"{_WHERE}: {label} {explicit} is too long: {bounds}{network}")
    if explicit < shortest:
        raise ConfigError(f"{_WHERE}: {label} {explicit} is too short: {bounds}{network}")
    return explicit


def _bound(
    top: _Section, fam: _Family, key: str, network: Any, subnet_len: int, default: Any
) -> Any:
    text = top.str_(key)
    if text is None:
        return default
    label = top.label(key)
    try:
        addr = ip_address(text.strip())
    except ValueError as e:
        raise ConfigError(
            f"{_WHERE}: {label} {_show(text)} is not an IP address; "
            f"write a subnet's first address, like {_EXAMPLES[key]}"
        ) from e
    if addr.version != fam.version or addr not in network:
        raise ConfigError(
            f"{_WHERE}: {label} {addr} is outside {fam.network_key} {network}; "
            f"use an address inside it or remove {label}"
        )
    aligned = ip_network(f"{addr}/{subnet_len}", strict=False).network_address
    if aligned != addr:
        raise ConfigError(
            f"{_WHERE}: {label} {addr} is not aligned to {fam.len_key} {subnet_len}; use {aligned}"
        )
    return addr


def _backend(top: _Section) -> tuple[BackendConfig, bool]:
    obj = top.object_("Backend")
    if obj is None:
        return BackendConfig(), True
    section = _Section(obj, "Backend ")
    type_ = section.str_("Type")
    choices = ", ".join(SUPPORTED_BACKENDS)
    if not type_:
        raise ConfigError(f'{_WHERE}: Backend has no "Type"; add "Type" with one of: {choices}')
    type_ = type_.strip().lower()
    if type_ in FLANNEL_ONLY_BACKENDS:
        raise ConfigError(
            f'{_WHERE}: flannelpy does not support the "{type_}" backend; '
            f'set Backend "Type" to one of: {choices}'
        )
    if type_ not in SUPPORTED_BACKENDS:
        raise ConfigError(
            f'{_WHERE}: Backend "Type" {_show(type_)} is not a known backend; '
            f"set it to one of: {choices}"
        )
    vni = _ranged(section, "VNI", 1, 1, (1 << 24) - 1)
    port = _ranged(section, "Port", 0, 0, 65535)
    mtu = _ranged(section, "MTU", 0, 0, 65535) or None  # 0: the interface's, as unset
    if mtu is not None and mtu < 68:
        raise ConfigError(
            f'{_WHERE}: Backend "MTU" {mtu} is out of range; use 68..65535 or leave it out '
            "to use the interface's MTU"
        )
    config = BackendConfig(
        type=type_,
        vni=vni,
        port=port,
        gbp=_flag(section, "GBP", default=False),
        learning=_flag(section, "Learning", default=False),
        direct_routing=_flag(section, "DirectRouting", default=False),
        mtu=mtu,
        raw=obj,
    )
    return config, False


def _ranged(section: _Section, name: str, default: int, low: int, high: int) -> int:
    value = section.int_(name)
    if value is None:
        return default
    if not low <= value <= high:
        raise ConfigError(
            f"{_WHERE}: {section.label(name)} {value} is out of range; use {low}..{high}"
        )
    return value
