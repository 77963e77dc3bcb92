"""Typed, validated configuration: Flannel's net-conf.json and the agent's flags.

Parsing is pure: bytes and argv/environ in, frozen dataclasses out, or a
ConfigError whose message is one sentence naming the field and the fix.
Nothing here touches the host, except reading the hostname as the last-resort
default node name.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from ipaddress import (
    IPv4Address,
    IPv4Network,
    IPv6Address,
    IPv6Network,
    ip_address,
    ip_network,
)
from typing import Any, Literal
from urllib.parse import urlsplit

from flannelpy.errors import ConfigError

VXLAN_ENCAP_OVERHEAD = 50  # outer Ethernet 14 + IPv4 20 + UDP 8 + VXLAN 8 (IPv4 underlay)
DEFAULT_VXLAN_PORT = 8472  # the Linux kernel's default, and Flannel's

# Backends flannelpy implements, and the ones Flannel has that we do not (so the
# error can say "not supported" rather than "unknown").
SUPPORTED_BACKENDS = ("host-gw", "vxlan")
FLANNEL_ONLY_BACKENDS = frozenset(
    {
        "udp",
        "wireguard",
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


@dataclass(frozen=True)
class AgentSettings:
    """The agent's flags (kebab-case, each also settable as FLANNELD_<UPPER_SNAKE>)."""

    etcd_endpoints: tuple[str, ...] = ("http://127.0.0.1:4001", "http://127.0.0.1:2379")
    etcd_prefix: str = "/coreos.com/network"  # no trailing slash
    etcd_keyfile: str | None = None
    etcd_certfile: str | None = None
    etcd_cafile: str | None = None
    etcd_username: str | None = None
    etcd_password: str | None = None
    kube_subnet_mgr: bool = False
    kube_api_url: str | None = None
    kubeconfig_file: str | None = None
    kube_annotation_prefix: str = "flannel.alpha.coreos.com"
    net_config_path: str = "/etc/kube-flannel/net-conf.json"
    iface: tuple[str, ...] = ()
    iface_regex: tuple[str, ...] = ()
    iface_can_reach: str | None = None  # an IPv4 address
    public_ip: IPv4Address | None = None
    subnet_file: str = "/run/flannel/subnet.env"
    subnet_lease_renew_margin: int = 60  # minutes before expiry, 1..1439
    ip_masq: bool = False
    iptables_resync: float = 5.0  # seconds
    iptables_forward_rules: bool = True
    healthz_ip: str = "0.0.0.0"
    healthz_port: int = 0  # 0: off
    # flannelpy's own
    node_name: str | None = None  # default: $NODE_NAME, else the hostname
    state_dir: str = "/var/lib/flannelpy"
    run_dir: str = "/run/flannelpy"
    allow_overlap: bool = False
    resync_interval: float = 10.0  # seconds between full reconciles (events trigger sooner)
    startup_timeout: float = 30.0  # seconds to keep retrying an unreachable store at start
    subnet_lease_ttl: int = 24 * 3600  # seconds; Flannel's is fixed at 24 h
    log_format: str = "text"  # text | json
    log_level: str = "info"  # debug | info | warning | error
    # HOST:PORT of /metrics, /healthz and /readyz; None ("off"): no server. Port 0: any free one.
    metrics_addr: str | None = "127.0.0.1:9403"
    # Turn off tx checksum offload on the vxlan device: Flannel's documented fix for
    # the kernel bug that corrupts VXLAN UDP checksums on some NICs and drivers.
    vxlan_tx_checksum_off: bool = False
    probe_interval: float = 5.0  # seconds between two probe rounds to one peer
    # This cluster's name for cluster-scoped address pools (flannelpy.io/cluster/<name>);
    # None: only pools shared by every cluster.
    cluster_name: str | None = None
    # seconds between status records in the store (etcd mode) when nothing changed;
    # a change, and every probe round while a change settles, is written at once
    status_publish_interval: float = 10.0


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
_V6 = _Family(
    6, "IPv6Network", "IPv6SubnetLen", "IPv6SubnetMin", "IPv6SubnetMax", 124, 126, 64
)


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
            f"add it like \"{fam.network_key}\": {_EXAMPLES[fam.network_key]}"
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
            f"{_WHERE}: {label} {addr} is not aligned to {fam.len_key} {subnet_len}; "
            f"use {aligned}"
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


# ---------------------------------------------------------------------------
# Agent flags
# ---------------------------------------------------------------------------

_Kind = Literal["str", "bool", "int", "float", "csv", "repeat"]

_BOOL_WORDS = {"1": True, "t": True, "true": True, "0": False, "f": False, "false": False}
_LOG_LEVELS = {
    "debug": "debug",
    "info": "info",
    "warn": "warning",
    "warning": "warning",
    "error": "error",
}
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")


@dataclass(frozen=True)
class _Flag:
    """One agent flag: its AgentSettings field, how its text is read, and its help."""

    field: str
    kind: _Kind
    help: str
    split_commas: bool = True  # for "repeat": split FLANNELD_* (and flag values) on commas

    @property
    def option(self) -> str:
        return "--" + self.field.replace("_", "-")

    @property
    def env(self) -> str:
        return "FLANNELD_" + self.field.upper()


_FLAGS: tuple[_Flag, ...] = (
    _Flag("etcd_endpoints", "csv", "etcd URLs, comma-separated"),
    _Flag("etcd_prefix", "str", "etcd key prefix of the network config and leases"),
    _Flag("etcd_keyfile", "str", "TLS client key for etcd"),
    _Flag("etcd_certfile", "str", "TLS client certificate for etcd"),
    _Flag("etcd_cafile", "str", "CA bundle that signs etcd's server certificate"),
    _Flag("etcd_username", "str", "etcd user name"),
    _Flag("etcd_password", "str", "etcd password"),
    _Flag("kube_subnet_mgr", "bool", "use the Kubernetes API (Node podCIDR) instead of etcd"),
    _Flag("kube_api_url", "str", "Kubernetes API server URL (default: in-cluster)"),
    _Flag("kubeconfig_file", "str", "kubeconfig to use outside a pod"),
    _Flag("kube_annotation_prefix", "str", "prefix of the node annotations"),
    _Flag("net_config_path", "str", "net-conf.json to read in Kubernetes mode"),
    _Flag("iface", "repeat", "underlay interface name or IP; repeat to try several in order"),
    _Flag("iface_regex", "repeat", "regex of underlay interface names or IPs; repeatable",
          split_commas=False),
    _Flag("iface_can_reach", "str", "pick the interface that routes to this IPv4 address"),
    _Flag("public_ip", "str", "IPv4 address to advertise to peers"),
    _Flag("subnet_file", "str", "where to write subnet.env"),
    _Flag("subnet_lease_renew_margin", "int", "renew the lease this many minutes before expiry"),
    _Flag("ip_masq", "bool", "masquerade traffic leaving the overlay"),
    _Flag("iptables_resync", "float", "seconds between firewall rule checks"),
    _Flag("iptables_forward_rules", "bool", "add FORWARD accept rules for the network"),
    _Flag("healthz_ip", "str", "address of the /healthz and /readyz server"),
    _Flag("healthz_port", "int", "port of the /healthz and /readyz server (0: off)"),
    _Flag("node_name", "str", "this node's name (default: $NODE_NAME, else the hostname)"),
    _Flag("state_dir", "str", "directory for IPAM and other persistent state"),
    _Flag("run_dir", "str", "directory for the CNI socket and other runtime files"),
    _Flag("allow_overlap", "bool", "start even if Network overlaps a route on this node"),
    _Flag("resync_interval", "float", "seconds between full kernel reconciles"),
    _Flag("startup_timeout", "float", "seconds to retry an unreachable store before giving up"),
    _Flag("subnet_lease_ttl", "int", "lifetime of a subnet lease in seconds"),
    _Flag("log_format", "str", "log format: text or json"),
    _Flag("log_level", "str", "log level: debug, info, warning or error"),
    _Flag("metrics_addr", "str", "HOST:PORT of /metrics, /healthz and /readyz, or off"),
    _Flag("vxlan_tx_checksum_off", "bool",
          "turn off tx checksum offload on the vxlan device (VXLAN checksum bug fix)"),
    _Flag("probe_interval", "float", "seconds between probe rounds to each peer"),
    _Flag("cluster_name", "str",
          "this cluster's name, for address pools tagged flannelpy.io/cluster/<name>"),
    _Flag("status_publish_interval", "float",
          "seconds between this node's status records in etcd when nothing changed"),
)

_DEFAULTS: dict[str, Any] = {f.name: f.default for f in fields(AgentSettings)}


def add_agent_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the agent's flags. Values stay text here; settings_from_args checks them,
    so a flag and its FLANNELD_* variable go through one validation path."""
    group = parser.add_argument_group("agent", "each flag is also read from FLANNELD_<NAME>")
    for flag in _FLAGS:
        default = _DEFAULTS[flag.field]
        shown = ",".join(default) if isinstance(default, tuple) else default
        help_text = f"{flag.help} (env {flag.env}"
        help_text += f"; default {shown})" if shown not in (None, ()) else ")"
        help_text = help_text.replace("%", "%%")
        if flag.kind == "bool":
            # Flannel style: --ip-masq, --ip-masq=true, --ip-masq=false.
            group.add_argument(
                flag.option, nargs="?", const="true", default=None, metavar="BOOL",
                help=help_text,
            )
        elif flag.kind == "repeat":
            group.add_argument(flag.option, action="append", default=None, help=help_text)
        else:
            group.add_argument(flag.option, default=None, metavar=flag.field.upper(),
                               help=help_text)


def settings_from_args(ns: argparse.Namespace, environ: Mapping[str, str]) -> AgentSettings:
    """Merge flags, FLANNELD_* variables and defaults (in that order) and check them."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for flag in _FLAGS:
        picked = _pick(flag, ns, environ)
        if picked is None:
            continue
        text, source = picked
        values[flag.field] = _convert(flag, text, source)
        sources[flag.field] = source
    for name, check in _CHECKS.items():
        if values.get(name) is not None:
            values[name] = check(values[name], sources[name])
    if values.get("node_name") is None:
        values["node_name"] = environ.get("NODE_NAME") or socket.gethostname()
    settings = AgentSettings(**values)
    _check_together(settings, sources)
    return settings


def _pick(
    flag: _Flag, ns: argparse.Namespace, environ: Mapping[str, str]
) -> tuple[Any, str] | None:
    """(text, source) from the flag if given, else from the environment, else None."""
    given = getattr(ns, flag.field, None)
    if given is not None:
        return given, flag.option
    # An empty variable is unset, as in Flannel's flagutil.
    env = environ.get(flag.env)
    if env:
        return ([env] if flag.kind == "repeat" else env), flag.env
    return None


def _convert(flag: _Flag, text: Any, source: str) -> Any:
    if flag.kind == "repeat":
        items = [part for chunk in text for part in _split(chunk, flag.split_commas)]
        return tuple(items)
    assert isinstance(text, str)
    if flag.kind == "bool":
        return _parse_bool(text, source)
    if flag.kind == "int":
        return _parse_int(text, source)
    if flag.kind == "float":
        return _parse_float(text, source)
    if flag.kind == "csv":
        return tuple(_split(text, True))
    value = text.strip()
    if value:
        return value
    if _DEFAULTS[flag.field] is None:
        return None
    raise ConfigError(f"{source} is empty; give it a value or leave it out to use the default")


def _split(text: str, commas: bool) -> list[str]:
    parts = text.split(",") if commas else [text]
    return [p.strip() for p in parts if p.strip()]


def _parse_bool(text: str, source: str) -> bool:
    try:
        return _BOOL_WORDS[text.strip().lower()]
    except KeyError:
        raise ConfigError(f"{source} {text!r} is not a boolean; use true or false") from None


def _parse_int(text: str, source: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise ConfigError(
            f"{source} {text!r} is not a whole number; give a number like 60"
        ) from None


def _parse_float(text: str, source: str) -> float:
    try:
        value = float(text.strip())
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ConfigError(f"{source} {text!r} is not a number of seconds; give seconds like 5")
    return value


def _check_endpoints(urls: tuple[str, ...], source: str) -> tuple[str, ...]:
    if not urls:
        raise ConfigError(f"{source} is empty; give etcd URLs like http://127.0.0.1:2379")
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"{source} entry {url!r} is not an etcd URL; write it like "
                "http://127.0.0.1:2379 or https://etcd-0:2379"
            )
    return urls


def _check_prefix(prefix: str, source: str) -> str:
    # path.Join in Flannel ignores a trailing slash; strip it so keys match.
    trimmed = prefix.rstrip("/")
    if not trimmed:
        raise ConfigError(
            f"{source} {prefix!r} has no key path; use a path like /coreos.com/network"
        )
    return trimmed


def _check_ipv4(text: str, source: str) -> IPv4Address:
    try:
        return IPv4Address(text)
    except ValueError:
        raise ConfigError(
            f"{source} {text!r} is not an IPv4 address; give one like 192.168.1.10"
        ) from None


def _check_ip(text: str, source: str) -> str:
    try:
        return str(ip_address(text))
    except ValueError:
        raise ConfigError(
            f"{source} {text!r} is not an IP address; give one like 0.0.0.0 or 127.0.0.1"
        ) from None


def _in_range(low: float, high: float, unit: str) -> Callable[[Any, str], Any]:
    def check(value: Any, source: str) -> Any:
        if not low <= value <= high:
            raise ConfigError(f"{source} {value} is out of range; use {low}..{high} {unit}")
        return value

    return check


def _positive(unit: str) -> Callable[[Any, str], Any]:
    def check(value: Any, source: str) -> Any:
        if value <= 0:
            raise ConfigError(f"{source} {value} must be positive; give a number of {unit}")
        return value

    return check


def _check_cluster_name(value: str, source: str) -> str:
    from flannelpy.subnet.pools import check_cluster_name

    return check_cluster_name(value, source)


def _check_log_format(value: str, source: str) -> str:
    folded = value.lower()
    if folded not in ("text", "json"):
        raise ConfigError(f"{source} {value!r} is not a log format; use text or json")
    return folded


def _check_log_level(value: str, source: str) -> str:
    try:
        return _LOG_LEVELS[value.lower()]
    except KeyError:
        raise ConfigError(
            f"{source} {value!r} is not a log level; use debug, info, warning or error"
        ) from None


def _check_annotation_prefix(value: str, source: str) -> str:
    if len(value) > 253 or not _DNS_SUBDOMAIN.fullmatch(value):
        raise ConfigError(
            f"{source} {value!r} is not a DNS subdomain; use lower-case names like "
            "flannel.alpha.coreos.com"
        )
    return value


def _check_regexes(values: tuple[str, ...], source: str) -> tuple[str, ...]:
    for value in values:
        try:
            re.compile(value)
        except re.error as e:
            raise ConfigError(f"{source} {value!r} is not a valid regex ({e}); fix it") from e
    return values


def _check_can_reach(value: str, source: str) -> str:
    return str(_check_ipv4(value, source))


def _check_listen_addr(value: str, source: str) -> str | None:
    """``IP:PORT`` or ``[IPv6]:PORT``, normalised; "off" turns the server off (None)."""
    if value.lower() == "off":
        return None
    host, sep, port = value.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        if not sep or not port.isdigit() or int(port) > 65535:
            raise ValueError("no port")
        addr = ip_address(host[1:-1] if bracketed else host)
        if addr.version == 6 and not bracketed:
            raise ValueError("IPv6 needs brackets")
    except ValueError:
        raise ConfigError(
            f"{source} {value!r} is not IP:PORT; write it like 127.0.0.1:9403 or [::1]:9403, "
            "or off"
        ) from None
    return f"[{addr}]:{int(port)}" if addr.version == 6 else f"{addr}:{int(port)}"


# Per-field checks on converted values; each returns the (normalised) value.
_CHECKS: dict[str, Callable[[Any, str], Any]] = {
    "etcd_endpoints": _check_endpoints,
    "etcd_prefix": _check_prefix,
    "kube_annotation_prefix": _check_annotation_prefix,
    "iface_regex": _check_regexes,
    "iface_can_reach": _check_can_reach,
    "public_ip": _check_ipv4,
    "subnet_lease_renew_margin": _in_range(1, 1439, "minutes"),
    "iptables_resync": _positive("seconds"),
    "healthz_ip": _check_ip,
    "healthz_port": _in_range(0, 65535, "(0 turns the server off)"),
    "resync_interval": _positive("seconds"),
    "probe_interval": _in_range(0.2, 3600, "seconds"),
    "cluster_name": _check_cluster_name,
    "status_publish_interval": _in_range(1, 3600, "seconds"),
    "startup_timeout": _positive("seconds"),
    "subnet_lease_ttl": _positive("seconds"),
    "log_format": _check_log_format,
    "log_level": _check_log_level,
    "metrics_addr": _check_listen_addr,
}


def _check_together(settings: AgentSettings, sources: Mapping[str, str]) -> None:
    margin = settings.subnet_lease_renew_margin
    ttl = settings.subnet_lease_ttl
    if margin * 60 >= ttl:
        margin_src = sources.get("subnet_lease_renew_margin", "--subnet-lease-renew-margin")
        ttl_src = sources.get("subnet_lease_ttl", "--subnet-lease-ttl")
        raise ConfigError(
            f"{margin_src} {margin} minutes is not shorter than the lease lifetime "
            f"({ttl_src} {ttl} seconds = {ttl / 60:g} minutes); lower the margin or raise "
            "the lifetime"
        )
    if (settings.etcd_keyfile is None) != (settings.etcd_certfile is None):
        raise ConfigError(
            "--etcd-keyfile and --etcd-certfile go together; give both or neither"
        )
