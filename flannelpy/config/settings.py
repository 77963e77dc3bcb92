"""The agent's flags: kebab-case, each also settable as FLANNELD_<UPPER_SNAKE>.

Parsing is pure: argv and environ in, a frozen AgentSettings out, or a ConfigError
whose message is one sentence naming the flag and the fix.
"""

from __future__ import annotations

import argparse
import math
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from ipaddress import (
    IPv4Address,
    IPv6Address,
    ip_address,
)
from typing import Any, Literal

from flannelpy.config.etcd_endpoints import check_endpoints, with_schemes
from flannelpy.errors import ConfigError


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
    # How etcd is reached: its JSON gateway over HTTP, or gRPC; "auto" takes gRPC only
    # with a client certificate (etcd's gateway would present the server's own).
    etcd_transport: str = "auto"
    kube_subnet_mgr: bool = False
    kube_api_url: str | None = None
    kubeconfig_file: str | None = None
    kube_annotation_prefix: str = "flannel.alpha.coreos.com"
    net_config_path: str = "/etc/kube-flannel/net-conf.json"
    iface: tuple[str, ...] = ()
    iface_regex: tuple[str, ...] = ()
    iface_can_reach: str | None = None  # an IPv4 address
    public_ip: IPv4Address | None = None
    # The IPv6 address to advertise (dual stack); None: the underlay interface's global one.
    public_ipv6: str | None = None
    subnet_file: str = "/run/flannel/subnet.env"
    subnet_lease_renew_margin: int = 60  # minutes before expiry, 1..1439
    ip_masq: bool = False
    ip_masq_fully_random_disable: bool = False  # MASQUERADE without --random-fully
    iptables_resync: float = 5.0  # seconds
    iptables_forward_rules: bool = True
    ip_blackhole_route: bool = False  # blackhole route for the node's own subnet
    # Kubernetes mode: set our Node's NetworkUnavailable condition to False once up.
    set_node_network_unavailable: bool = True
    v: int = 0  # klog's verbosity, as flanneld takes it; above 0 turns on debug logs
    healthz_ip: str = "0.0.0.0"
    healthz_port: int = 0  # 0: off
    # Also serve /metrics on the healthz port (it listens on every address by default,
    # so metrics stay on --metrics-addr unless asked).
    healthz_metrics: bool = False
    # flannelpy's own
    node_name: str | None = None  # default: $NODE_NAME, else the hostname
    state_dir: str = "/var/lib/flannelpy"
    run_dir: str = "/run/flannelpy"
    # host-local's data dir for Flannel's network: the addresses of pods a flanneld made
    # on this node before ours took over are held, never handed out again ("" = off).
    host_local_dir: str = "/var/lib/cni/networks/cbr0"
    allow_overlap: bool = False
    # seconds between periodic reconciles (events trigger sooner); the kernel is read back
    # at most once a minute by them (reconciler.FULL_DUMP_SECONDS)
    resync_interval: float = 10.0
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
    # at most this many peers probed per probe interval; a larger cluster is covered over
    # several intervals (one cycle), so the prober's cost does not grow with the cluster
    probe_peers_per_interval: int = 100
    # This cluster's name for cluster-scoped address pools (flannelpy.io/cluster/<name>);
    # None: only pools shared by every cluster.
    cluster_name: str | None = None
    # seconds between heartbeat status records in the store (etcd mode) when nothing
    # changed, jittered down to 80 %; a change an operator acts on is written at once,
    # and probe rounds are followed only while a change settles or a rollout runs
    status_publish_interval: float = 300.0
    # Kubernetes mode: enforce NetworkPolicy for this node's pods (nftables table
    # inet flannelpy-policy); off, as Flannel has none.
    enable_network_policy: bool = False


NETWORK_POLICY_NEEDS_KUBE = (
    "needs Kubernetes mode, since etcd mode has no Pods or NetworkPolicies; "
    "add --kube-subnet-mgr or remove it"
)

ETCD_TRANSPORTS = ("auto", "gateway", "grpc")
_Kind = Literal["str", "bool", "int", "float", "csv", "repeat"]

_BOOL_WORDS = {"1": True, "t": True, "true": True, "0": False, "f": False, "false": False}
_LOG_LEVELS = {
    "debug": "debug",
    "info": "info",
    "warn": "warning",
    "warning": "warning",
    "error": "error",
}
# Flannel's annotation prefix regexp (pkg/subnet/kube/annotations.go), on the prefix
# after its slash or dash is appended.
_FLANNEL_ANNOTATION_PREFIX = re.compile(r"(?:[a-z0-9_-]+\.)+[a-z0-9_-]+/(?:[a-z0-9_-]+-)?")
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
    _Flag(
        "etcd_transport",
        "str",
        "how to reach etcd: gateway (JSON over HTTP), grpc, or auto (grpc only with "
        "--etcd-certfile)",
    ),
    _Flag("kube_subnet_mgr", "bool", "use the Kubernetes API (Node podCIDR) instead of etcd"),
    _Flag("kube_api_url", "str", "Kubernetes API server URL (default: in-cluster)"),
    _Flag("kubeconfig_file", "str", "kubeconfig to use outside a pod"),
    _Flag("kube_annotation_prefix", "str", "prefix of the node annotations"),
    _Flag("net_config_path", "str", "net-conf.json to read in Kubernetes mode"),
    _Flag("iface", "repeat", "underlay interface name or IP; repeat to try several in order"),
    _Flag(
        "iface_regex",
        "repeat",
        "regex of underlay interface names or IPs; repeatable",
        split_commas=False,
    ),
    _Flag("iface_can_reach", "str", "pick the interface that routes to this IPv4 address"),
    _Flag("public_ip", "str", "IPv4 address to advertise to peers"),
    _Flag(
        "public_ipv6",
        "str",
        "IPv6 address to advertise to peers (dual stack; default: the interface's)",
    ),
    _Flag("subnet_file", "str", "where to write subnet.env"),
    _Flag("subnet_lease_renew_margin", "int", "renew the lease this many minutes before expiry"),
    _Flag("ip_masq", "bool", "masquerade traffic leaving the overlay"),
    _Flag(
        "ip_masq_fully_random_disable",
        "bool",
        "masquerade without --random-fully (fully random source ports)",
    ),
    _Flag("iptables_resync", "float", "seconds between firewall rule checks"),
    _Flag("iptables_forward_rules", "bool", "add FORWARD accept rules for the network"),
    _Flag(
        "ip_blackhole_route",
        "bool",
        "blackhole route for the node's own subnet, beneath cni0's connected route",
    ),
    _Flag(
        "set_node_network_unavailable",
        "bool",
        "set the Node's NetworkUnavailable condition to False once up (Kubernetes mode)",
    ),
    _Flag("v", "int", "klog verbosity as flanneld takes it; above 0 means --log-level debug"),
    _Flag("healthz_ip", "str", "address of the /healthz and /readyz server"),
    _Flag("healthz_port", "int", "port of the /healthz and /readyz server (0: off)"),
    _Flag("healthz_metrics", "bool", "also serve /metrics on the --healthz-port server"),
    _Flag("node_name", "str", "this node's name (default: $NODE_NAME, else the hostname)"),
    _Flag("state_dir", "str", "directory for IPAM and other persistent state"),
    _Flag("run_dir", "str", "directory for the CNI socket and other runtime files"),
    _Flag(
        "host_local_dir",
        "str",
        "host-local's data dir of pods made by a flanneld before this agent, whose "
        "addresses are held (empty: none)",
    ),
    _Flag("allow_overlap", "bool", "start even if Network overlaps a route on this node"),
    _Flag("resync_interval", "float", "seconds between full kernel reconciles"),
    _Flag("startup_timeout", "float", "seconds to retry an unreachable store before giving up"),
    _Flag("subnet_lease_ttl", "int", "lifetime of a subnet lease in seconds"),
    _Flag("log_format", "str", "log format: text or json"),
    _Flag("log_level", "str", "log level: debug, info, warning or error"),
    _Flag("metrics_addr", "str", "HOST:PORT of /metrics, /healthz and /readyz, or off"),
    _Flag(
        "vxlan_tx_checksum_off",
        "bool",
        "turn off tx checksum offload on the vxlan device (VXLAN checksum bug fix)",
    ),
    _Flag("probe_interval", "float", "seconds between probe rounds to each peer"),
    _Flag(
        "probe_peers_per_interval",
        "int",
        "peers probed per probe interval at most; more are covered over several intervals",
    ),
    _Flag(
        "cluster_name",
        "str",
        "this cluster's name, for address pools tagged flannelpy.io/cluster/<name>",
    ),
    _Flag(
        "status_publish_interval",
        "float",
        "seconds between this node's heartbeat status records in etcd when nothing "
        "changed (jittered 80-100 %; a change is written at once)",
    ),
    _Flag(
        "enable_network_policy",
        "bool",
        "enforce NetworkPolicy for this node's pods in nftables (Kubernetes mode only)",
    ),
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
                flag.option,
                nargs="?",
                const="true",
                default=None,
                metavar="BOOL",
                help=help_text,
            )
        elif flag.kind == "repeat":
            group.add_argument(flag.option, action="append", default=None, help=help_text)
        else:
            group.add_argument(
                flag.option, default=None, metavar=flag.field.upper(), help=help_text
            )


def go_style_argv(args: Sequence[str]) -> list[str]:
    """``args`` with the agent's flags in Go's spellings turned into ours.

    flanneld parses with Go's flag package, where ``-name`` and ``--name`` are the same
    flag and ``-v`` is klog's verbosity, so ``-etcd-endpoints=http://e:2379`` and
    ``-v 2`` are common in existing manifests. Only names of agent flags are rewritten
    (and nothing after ``--``), so any other text still reaches the parser as given.
    """
    names = {flag.option[2:] for flag in _FLAGS}
    out: list[str] = []
    for i, arg in enumerate(args):
        if arg == "--":
            return out + list(args[i:])
        single = arg.startswith("-") and not arg.startswith("--")
        if single and arg[1:].split("=", 1)[0] in names:
            arg = "-" + arg
        out.append(arg)
    return out


def start_notes(settings: AgentSettings) -> list[str]:
    """Sentences to log at start about flags taken for compatibility with flanneld."""
    notes: list[str] = []
    return notes


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
    with_schemes(values, _DEFAULTS["etcd_endpoints"])
    # klog's -v above 0 shows flanneld's verbose logs; ours are the debug level.
    if values.get("v", 0) > 0 and "log_level" not in values:
        values["log_level"] = "debug"
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


def _check_ipv6(text: str, source: str) -> str:
    try:
        return str(IPv6Address(text))
    except ValueError:
        raise ConfigError(
            f"{source} {text!r} is not an IPv6 address; give one like 2001:db8::10"
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


# A cluster name as a Kubernetes label value: it often is one.
_CLUSTER_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")


def check_cluster_name(name: str, source: str = "--cluster-name") -> str:
    """``name`` if it can be a cluster scope; raises ConfigError. Pool tags
    (``flannelpy.subnet.pools``) check their cluster names with it too."""
    if not _CLUSTER_NAME.fullmatch(name):
        raise ConfigError(
            f"{source} {name!r} is not a cluster name; use 1-63 letters, digits, '-', '_' "
            "or '.', starting and ending with a letter or digit"
        )
    return name


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
    """Flannel's rule (newAnnotations): at most one slash; ``/`` appended when there is
    none, else ``-`` unless it ends in ``/`` or ``-``; then its regexp, whole, must
    match. The part before the slash is also a DNS subdomain, as the API server demands
    of an annotation key (Flannel lets an underscore through there, and the API refuses
    its patches later)."""
    if value.count("/") > 1:
        raise ConfigError(
            f"{source} {value!r} has more than one slash; use a prefix like "
            "flannel.alpha.coreos.com or example.com/flannel"
        )
    full = value if "/" in value else value + "/"
    if not full.endswith(("/", "-")):
        full += "-"
    domain = full.split("/", 1)[0]
    if (
        not _FLANNEL_ANNOTATION_PREFIX.fullmatch(full)
        or len(domain) > 253
        or not _DNS_SUBDOMAIN.fullmatch(domain)
    ):
        raise ConfigError(
            f"{source} {value!r} is not an annotation prefix; use a lower-case DNS name, "
            "optionally followed by a slash and lower-case letters, digits, '-' or '_', "
            "like flannel.alpha.coreos.com or example.com/flannel_"
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
            f"{source} {value!r} is not IP:PORT; write it like 127.0.0.1:9403 or [::1]:9403, or off"
        ) from None
    return f"[{addr}]:{int(port)}" if addr.version == 6 else f"{addr}:{int(port)}"


# Per-field checks on converted values; each returns the (normalised) value.
_CHECKS: dict[str, Callable[[Any, str], Any]] = {
    "etcd_endpoints": check_endpoints,
    "etcd_prefix": _check_prefix,
    "kube_annotation_prefix": _check_annotation_prefix,
    "iface_regex": _check_regexes,
    "iface_can_reach": _check_can_reach,
    "public_ip": _check_ipv4,
    "public_ipv6": _check_ipv6,
    "subnet_lease_renew_margin": _in_range(1, 1439, "minutes"),
    "iptables_resync": _positive("seconds"),
    "healthz_ip": _check_ip,
    "healthz_port": _in_range(0, 65535, "(0 turns the server off)"),
    "resync_interval": _positive("seconds"),
    "probe_interval": _in_range(0.2, 3600, "seconds"),
    "probe_peers_per_interval": _in_range(1, 100000, "peers"),
    "cluster_name": check_cluster_name,
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
        raise ConfigError("--etcd-keyfile and --etcd-certfile go together; give both or neither")
    if settings.etcd_transport not in ETCD_TRANSPORTS:
        source = sources.get("etcd_transport", "--etcd-transport")
        raise ConfigError(
            f"{source} {settings.etcd_transport!r} is not a transport; give one of "
            f"{', '.join(ETCD_TRANSPORTS)}"
        )
    if settings.enable_network_policy and not settings.kube_subnet_mgr:
        source = sources.get("enable_network_policy", "--enable-network-policy")
        raise ConfigError(f"{source} {NETWORK_POLICY_NEEDS_KUBE}")
