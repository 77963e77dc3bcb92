"""The network configuration keys the handler reads, each checked as it is read: a
wrong value is the spec's error 7 (invalid network config) naming the key.

Conflist keys, as the reference bridge plugin reads them: ``hairpinMode`` (hairpin on
the host port) and ``isDefaultGateway`` (the pod's default route via the gateway; when
false, only routes to the cluster networks). Both default to true here, Flannel's
delegate settings, which the shipped conflist spells out. Besides them: ``bridge``,
``ipCooldownSeconds``, ``ipWaitSeconds``, ``dns`` and, for GC, the runtime's
``cni.dev/valid-attachments``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

from flannelpy.cni.context import CniSettings, Key
from flannelpy.cni.spec import CniError, Code, Request
from flannelpy.dataplane.podnames import IPNetwork, default_route

VALID_ATTACHMENTS = "cni.dev/valid-attachments"
MAX_WAIT_SECONDS = 300.0  # an ipWaitSeconds beyond this would outlast any runtime's timeout
_BRIDGE_NAME = re.compile(r"^[^/:\s]{1,15}$")


def bridge_name(req: Request, settings: CniSettings) -> str:
    name = req.config.get("bridge", settings.bridge)
    if not isinstance(name, str) or not _BRIDGE_NAME.match(name) or len(name.encode()) > 15:
        raise CniError(
            Code.INVALID_NETWORK_CONFIG,
            f'"bridge" must be an interface name of 1 to 15 bytes, got {name!r}',
        )
    return name


def flag(req: Request, key: str, default: bool) -> bool:
    value = req.config.get(key, default)
    if not isinstance(value, bool):
        raise CniError(
            Code.INVALID_NETWORK_CONFIG, f"{key} must be true or false, got {json.dumps(value)}"
        )
    return value


def destinations(
    req: Request, settings: CniSettings, families: Sequence[int]
) -> tuple[IPNetwork, ...]:
    """What the pod routes via its gateways, for each of ``families``: everything, or
    the cluster's networks of that family."""
    if flag(req, "isDefaultGateway", settings.default_gateway):
        return tuple(default_route(f) for f in families)
    networks = tuple(settings.cluster_networks())
    missing = [f for f in families if not any(n.version == f for n in networks)]
    if missing:
        raise CniError(
            Code.TRY_AGAIN_LATER,
            f"the flannelpy agent does not know the IPv{missing[0]} cluster network yet;"
            " try again later",
        )
    return tuple(n for n in networks if n.version in families)


def seconds(req: Request, key: str, default: float) -> float:
    value = req.config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
        raise CniError(
            Code.INVALID_NETWORK_CONFIG,
            f"{key} must be a number of seconds >= 0, got {json.dumps(value)}",
        )
    return float(value)


def cooldown_seconds(req: Request, settings: CniSettings) -> float:
    return seconds(req, "ipCooldownSeconds", settings.cooldown_seconds)


def wait_seconds(req: Request, settings: CniSettings) -> float:
    wait = seconds(req, "ipWaitSeconds", settings.wait_seconds)
    if wait > MAX_WAIT_SECONDS:
        raise CniError(
            Code.INVALID_NETWORK_CONFIG,
            f"ipWaitSeconds must be at most {MAX_WAIT_SECONDS:g}, got {wait:g}",
        )
    return wait


def valid_attachments(config: Mapping[str, Any]) -> set[Key]:
    raw = config.get(VALID_ATTACHMENTS)
    if not isinstance(raw, list) or not all(
        isinstance(a, dict)
        and isinstance(a.get("containerID"), str)
        and isinstance(a.get("ifname"), str)
        for a in raw
    ):
        raise CniError(
            Code.INVALID_NETWORK_CONFIG,
            f'GC needs "{VALID_ATTACHMENTS}": a list of {{"containerID", "ifname"}} objects',
        )
    return {(a["containerID"], a["ifname"]) for a in raw}


def dns(config: Mapping[str, Any]) -> dict[str, Any]:
    value = config.get("dns")
    return dict(value) if isinstance(value, dict) else {}
