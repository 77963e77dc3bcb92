"""The CNI spec as data: versions, error codes, request validation, results per version.

Standard library only: the agent imports it to validate what the thin executable
forwards, and nothing here may pull heavy imports into a tool that only wants
the types. ``parse_request`` is the one gate for untrusted input: whatever the
environment and stdin hold, it returns a ``Request`` or raises ``CniError``
with a spec code and one sentence naming what to fix, never anything else.

Results follow the spec's "Success" format of the requested version: 1.x drops
the per-address ``"version"`` key that 0.3.x/0.4.0 carry. Interfaces always
carry ``mac`` (podman rejects a result without it).
"""

from __future__ import annotations

import enum
import ipaddress
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SUPPORTED_VERSIONS: tuple[str, ...] = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")
LATEST_VERSION = SUPPORTED_VERSIONS[-1]
COMMANDS: tuple[str, ...] = ("ADD", "DEL", "CHECK", "GC", "STATUS", "VERSION")
MAX_CONTAINER_ID = 200  # characters; see _check_env


class Code(enum.IntEnum):
    """The spec's well-known error codes (100+ are ours)."""

    INCOMPATIBLE_VERSION = 1
    UNSUPPORTED_FIELD = 2
    UNKNOWN_CONTAINER = 3
    INVALID_ENVIRONMENT = 4
    IO_FAILURE = 5
    DECODE_FAILURE = 6
    INVALID_NETWORK_CONFIG = 7
    TRY_AGAIN_LATER = 11
    NOT_AVAILABLE = 50
    NOT_AVAILABLE_LIMITED = 51
    NO_ADDRESS = 100  # plugin-specific: the node's leases have no free address
    INTERNAL = 999


class CniError(Exception):
    """A spec error: printed as JSON on stdout, the executable exits 1."""

    def __init__(self, code: int, msg: str, details: str = "") -> None:
        super().__init__(msg)
        self.code = int(code)
        self.msg = msg
        self.details = details

    def to_json(self, cni_version: str) -> bytes:
        doc: dict[str, Any] = {"cniVersion": cni_version, "code": self.code, "msg": self.msg}
        if self.details:  # the spec's Go types omit an empty "details"
            doc["details"] = self.details
        return json.dumps(doc).encode()


@dataclass(frozen=True)
class Request:
    command: str
    container_id: str
    netns: str
    ifname: str
    args: dict[str, str]
    path: tuple[str, ...]
    config: dict[str, Any]
    cni_version: str
    network_name: str
    prev_result: dict[str, Any] | None
    runtime_config: dict[str, Any]


@dataclass(frozen=True)
class Interface:
    name: str
    mac: str
    sandbox: str = ""


@dataclass(frozen=True)
class IPConfig:
    address: str  # CIDR, e.g. "10.244.1.5/24"
    gateway: str | None = None
    interface: int | None = None  # index into Result.interfaces


@dataclass(frozen=True)
class RouteEntry:
    dst: str
    gw: str | None = None


@dataclass(frozen=True)
class Result:
    cni_version: str
    interfaces: tuple[Interface, ...] = ()
    ips: tuple[IPConfig, ...] = ()
    routes: tuple[RouteEntry, ...] = ()
    dns: dict[str, Any] = field(default_factory=dict)


# --- request validation --------------------------------------------------------

# skel's table: the variables each command cannot do without (empty counts as missing).
REQUIRED_ENV: dict[str, tuple[str, ...]] = {
    "ADD": ("CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_PATH"),
    "CHECK": ("CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_PATH"),
    "DEL": ("CNI_CONTAINERID", "CNI_IFNAME", "CNI_PATH"),
    "GC": ("CNI_PATH",),
    "STATUS": ("CNI_PATH",),
    "VERSION": (),
}
# Commands younger than the oldest version we speak.
MIN_VERSION: dict[str, str] = {"CHECK": "0.4.0", "GC": "1.1.0", "STATUS": "1.1.0"}

_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.\-]*")
_IFNAMSIZ = 16  # the kernel's limit includes the trailing NUL
_ENV_CODE = Code.INVALID_ENVIRONMENT
_CONFIG_CODE = Code.INVALID_NETWORK_CONFIG


def _version_index(version: str) -> int:
    return SUPPORTED_VERSIONS.index(version)


def reply_version(stdin: bytes) -> str:
    """The cniVersion to answer in when the request itself may be unusable.

    The request's own cniVersion if it looks like a version (digits and dots,
    at most 15 characters), else the latest. The executables (client.py,
    forwarder.c) apply the same rule for VERSION and for their own errors.
    """
    try:
        doc = json.loads(stdin.decode("utf-8"))
    except (ValueError, RecursionError):
        return LATEST_VERSION
    value = doc.get("cniVersion") if isinstance(doc, dict) else None
    if isinstance(value, str) and 0 < len(value) <= 15 and not value.strip("0123456789."):
        return value
    return LATEST_VERSION


def parse_request(env: Mapping[str, str], stdin: bytes) -> Request:
    """Validate a CNI invocation; raise CniError (and nothing else) when it is unusable."""
    try:
        return _parse_request(env, stdin)
    except CniError:
        raise
    except Exception as e:  # a gap in the checks below must still answer in spec form
        raise CniError(Code.INTERNAL, f"the CNI request could not be validated: {e!r}") from e


def _parse_request(env: Mapping[str, str], stdin: bytes) -> Request:
    command = _command(env)
    if command == "VERSION":
        return _version_request(stdin)
    container_id, netns, ifname, path = _check_env(command, env)
    args = parse_cni_args(env.get("CNI_ARGS", ""))
    config = _decode_config(stdin)
    name, version = _check_config(config)
    minimum = MIN_VERSION.get(command)
    if minimum and _version_index(version) < _version_index(minimum):
        raise CniError(
            Code.INCOMPATIBLE_VERSION,
            f"{command} needs cniVersion {minimum} or later but the network configuration "
            f"says {version}; raise its cniVersion",
        )
    prev_result = _optional_object(config, "prevResult")
    runtime_config = _optional_object(config, "runtimeConfig") or {}
    return Request(
        command=command,
        container_id=container_id,
        netns=netns,
        ifname=ifname,
        args=args,
        path=path,
        config=config,
        cni_version=version,
        network_name=name,
        prev_result=prev_result,
        runtime_config=runtime_config,
    )


def _command(env: Mapping[str, str]) -> str:
    command = env.get("CNI_COMMAND", "")
    if not command:
        raise CniError(_ENV_CODE, f"CNI_COMMAND is not set; set it to one of {', '.join(COMMANDS)}")
    if command not in COMMANDS:
        raise CniError(
            _ENV_CODE,
            f"CNI_COMMAND {command!r} is not a CNI command; use one of {', '.join(COMMANDS)}",
        )
    return command


def _version_request(stdin: bytes) -> Request:
    # VERSION never fails: it is how a runtime learns what to send.
    try:
        doc = json.loads(stdin.decode("utf-8"))
    except (ValueError, RecursionError):
        doc = None
    config = doc if isinstance(doc, dict) else {}
    return Request("VERSION", "", "", "", {}, (), config, reply_version(stdin), "", None, {})


def _check_env(command: str, env: Mapping[str, str]) -> tuple[str, str, str, tuple[str, ...]]:
    missing = [name for name in REQUIRED_ENV[command] if not env.get(name)]
    if missing:
        raise CniError(
            _ENV_CODE,
            f"{command} needs {', '.join(missing)} in the environment; the container runtime "
            "must set them",
        )
    container_id = env.get("CNI_CONTAINERID", "")
    if container_id and not _SAFE_NAME.fullmatch(container_id):
        raise CniError(
            _ENV_CODE,
            f"CNI_CONTAINERID {container_id[:80]!r} is not a valid container ID; it must start "
            "with a letter or digit followed by letters, digits, '_', '.' or '-'",
        )
    if len(container_id) > MAX_CONTAINER_ID:
        # The ID names per-attachment state files (ours and the runtime's CNI cache),
        # and a file name holds at most 255 bytes; runtimes use 64.
        raise CniError(
            _ENV_CODE,
            f"CNI_CONTAINERID is {len(container_id)} characters long; at most "
            f"{MAX_CONTAINER_ID} are supported",
        )
    ifname = env.get("CNI_IFNAME", "")
    if ifname:
        _check_ifname(ifname)
    path = tuple(p for p in env.get("CNI_PATH", "").split(":") if p)
    return container_id, env.get("CNI_NETNS", ""), ifname, path


def _check_ifname(ifname: str) -> None:
    size = len(ifname.encode("utf-8", "surrogatepass"))
    bad_char = any(c in "/:" or c.isspace() for c in ifname)
    if size >= _IFNAMSIZ or bad_char or ifname in (".", ".."):
        raise CniError(
            _ENV_CODE,
            f"CNI_IFNAME {ifname[:40]!r} is not a valid interface name; use at most 15 bytes, "
            "no '/', ':' or whitespace, and not '.' or '..'",
        )


def parse_cni_args(text: str) -> dict[str, str]:
    """CNI_ARGS "K=V;K=V" (libcni's rule: exactly one '=' per pair) → dict."""
    if not text:
        return {}
    args: dict[str, str] = {}
    for pair in text.split(";"):
        key, sep, value = pair.partition("=")
        if not key or not sep or "=" in value:
            raise CniError(
                _ENV_CODE,
                f"CNI_ARGS {text[:80]!r} is not a list of KEY=VALUE pairs separated by ';'; "
                f"fix the pair {pair[:40]!r}",
            )
        args[key] = value
    return args


def _decode_config(stdin: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(stdin.decode("utf-8"))
    except (ValueError, RecursionError) as e:
        raise CniError(
            Code.DECODE_FAILURE,
            "the network configuration on stdin is not valid UTF-8 JSON; pass the network "
            "config as a JSON object",
            str(e)[:200],
        ) from e
    if not isinstance(doc, dict):
        # Code 6 as libcni's skel answers it: its decoder cannot unmarshal a non-object.
        raise CniError(
            Code.DECODE_FAILURE,
            f"the network configuration on stdin is a JSON {type(doc).__name__}, not an "
            "object; pass the network config as a JSON object",
        )
    return doc


def _check_config(config: dict[str, Any]) -> tuple[str, str]:
    for key in ("cniVersion", "name", "type"):
        value = config.get(key)
        if not isinstance(value, str) or not value:
            raise CniError(
                _CONFIG_CODE,
                f'the network configuration needs "{key}" as a non-empty string; add it',
            )
    name = config["name"]
    if not _SAFE_NAME.fullmatch(name):
        raise CniError(
            _CONFIG_CODE,
            f"network name {name[:80]!r} is not valid; it must start with a letter or digit "
            "followed by letters, digits, '_', '.' or '-'",
        )
    version = config["cniVersion"]
    if version not in SUPPORTED_VERSIONS:
        raise CniError(
            Code.INCOMPATIBLE_VERSION,
            f"cniVersion {version[:20]!r} is not supported; use one of "
            f"{', '.join(SUPPORTED_VERSIONS)}",
        )
    return name, version


def _optional_object(config: dict[str, Any], key: str) -> dict[str, Any] | None:
    value = config.get(key)
    if value is not None and not isinstance(value, dict):
        raise CniError(_CONFIG_CODE, f'"{key}" in the network configuration must be an object')
    return value


# --- results -------------------------------------------------------------------


def version_reply(cni_version: str) -> bytes:
    """VERSION's answer: the version in use and every version we speak."""
    return json.dumps(
        {"cniVersion": cni_version, "supportedVersions": list(SUPPORTED_VERSIONS)}
    ).encode()


def render_result(result: Result, cni_version: str) -> bytes:
    """The ADD result in ``cni_version``'s format (key order as libcni writes it)."""
    if cni_version not in SUPPORTED_VERSIONS:
        raise CniError(
            Code.INCOMPATIBLE_VERSION,
            f"cannot write a result in cniVersion {cni_version[:20]!r}; use one of "
            f"{', '.join(SUPPORTED_VERSIONS)}",
        )
    legacy = _version_index(cni_version) < _version_index("1.0.0")
    doc: dict[str, Any] = {"cniVersion": cni_version}
    # libcni omits empty lists; dns is always present.
    if result.interfaces:
        doc["interfaces"] = [_render_interface(i) for i in result.interfaces]
    if result.ips:
        doc["ips"] = [_render_ip(ip, legacy) for ip in result.ips]
    if result.routes:
        doc["routes"] = [_render_route(r) for r in result.routes]
    doc["dns"] = dict(result.dns)
    return json.dumps(doc).encode()


def _render_interface(iface: Interface) -> dict[str, Any]:
    doc = {"name": iface.name, "mac": iface.mac}
    if iface.sandbox:
        doc["sandbox"] = iface.sandbox
    return doc


def _render_ip(ip: IPConfig, legacy: bool) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    if legacy:  # 0.3.x/0.4.0 name the family; 1.x infers it from the address
        doc["version"] = "6" if ":" in ip.address else "4"
    if ip.interface is not None:
        doc["interface"] = ip.interface
    doc["address"] = ip.address
    if ip.gateway:
        doc["gateway"] = ip.gateway
    return doc


def _render_route(route: RouteEntry) -> dict[str, Any]:
    doc = {"dst": route.dst}
    if route.gw:
        doc["gw"] = route.gw
    return doc


def parse_result(doc: Any, cni_version: str) -> Result:
    """A result document (a prevResult, a stored ADD result) → Result.

    Reads every supported version's format; fields this module does not model
    (route mtu, interface pciID, ...) are dropped. ``cni_version`` applies when
    the document names none. Raises CniError(7) naming the bad field.
    """
    if not isinstance(doc, dict):
        raise _result_error("the result", "must be a JSON object")
    version = doc.get("cniVersion", cni_version)
    if not isinstance(version, str):
        raise _result_error('"cniVersion"', "must be a string")
    return Result(
        cni_version=version,
        interfaces=tuple(
            _parse_interface(item, f"interfaces[{n}]")
            for n, item in enumerate(_list(doc, "interfaces"))
        ),
        ips=tuple(_parse_ip(item, f"ips[{n}]") for n, item in enumerate(_list(doc, "ips"))),
        routes=tuple(
            _parse_route(item, f"routes[{n}]") for n, item in enumerate(_list(doc, "routes"))
        ),
        dns=_dns(doc.get("dns")),
    )


def _result_error(where: str, problem: str) -> CniError:
    return CniError(_CONFIG_CODE, f"{where} in the CNI result {problem}; fix the result")


def _list(doc: dict[str, Any], key: str) -> list[Any]:
    value = doc.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise _result_error(f'"{key}"', "must be a list")
    return value


def _object(item: Any, where: str) -> dict[str, Any]:
    if not isinstance(item, dict):
        raise _result_error(where, "must be an object")
    return item


def _string(item: dict[str, Any], key: str, where: str, required: bool) -> str | None:
    value = item.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str) or (required and not value):
        raise _result_error(f'{where}."{key}"', "must be a non-empty string")
    return value


def _parse_interface(item: Any, where: str) -> Interface:
    obj = _object(item, where)
    name = _string(obj, "name", where, required=True) or ""
    mac = _string(obj, "mac", where, required=False) or ""
    sandbox = _string(obj, "sandbox", where, required=False) or ""
    return Interface(name=name, mac=mac, sandbox=sandbox)


def _parse_ip(item: Any, where: str) -> IPConfig:
    obj = _object(item, where)
    address = _string(obj, "address", where, required=True) or ""
    gateway = _string(obj, "gateway", where, required=False) or None
    index = obj.get("interface")
    if index is not None and (not isinstance(index, int) or isinstance(index, bool) or index < 0):
        raise _result_error(f'{where}."interface"', "must be a non-negative integer")
    try:
        if "/" not in address:
            raise ValueError(address)
        ipaddress.ip_interface(address)
        if gateway is not None:
            ipaddress.ip_address(gateway)
    except ValueError as e:
        raise _result_error(where, "must hold an address in CIDR form and a plain gateway") from e
    return IPConfig(address=address, gateway=gateway, interface=index)


def _parse_route(item: Any, where: str) -> RouteEntry:
    obj = _object(item, where)
    dst = _string(obj, "dst", where, required=True) or ""
    gw = _string(obj, "gw", where, required=False) or None
    try:
        ipaddress.ip_network(dst, strict=False)
        if gw is not None:
            ipaddress.ip_address(gw)
    except ValueError as e:
        raise _result_error(where, "must hold a destination in CIDR form and a plain gw") from e
    return RouteEntry(dst=dst, gw=gw)


def _dns(value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _result_error('"dns"', "must be an object")
    return dict(value)
