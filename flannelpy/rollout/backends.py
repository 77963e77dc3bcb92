"""A rollout's backends (pure): the target document, what a node runs, what it will run."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from functools import lru_cache
from typing import Any

from flannelpy.backend.wireguard_config import OVERHEAD_IPV4 as WIREGUARD_OVERHEAD_IPV4
from flannelpy.config.netconf import (
    VXLAN_ENCAP_OVERHEAD,
    BackendConfig,
    NetworkConfig,
    parse_network_config,
)
from flannelpy.control.policy import (
    disruptive_changes,
)
from flannelpy.control.records import BackendSummary
from flannelpy.errors import ConfigError


def _backend_key(doc: Mapping[str, Any]) -> str | None:
    """The spelling of the Backend key in a net-conf.json document (keys are case-blind)."""
    return next((key for key in doc if key.lower() == "backend"), None)


def with_backend(doc: Mapping[str, Any], backend: Mapping[str, Any]) -> dict[str, Any]:
    """``doc`` with its Backend replaced by ``backend``; every other key stays as written,
    in its place, and the Backend key keeps its spelling."""
    key = _backend_key(doc)
    if key is None:
        return {**doc, "Backend": dict(backend)}
    return {
        k: (dict(backend) if k == key else v)
        for k, v in doc.items()
        if k == key or k.lower() != "backend"
    }


def rewrite_backend(raw: bytes, backend: Mapping[str, Any]) -> tuple[str, NetworkConfig, bool]:
    """A valid net-conf.json ``raw`` with its Backend replaced by ``backend``: the new text,
    the config it parses to, and whether anything changed (False: a resumed step already
    wrote it). Both stores write through this so etcd and the ConfigMap get the same
    bytes. Raises ConfigError when the result is not a valid config."""
    doc = json.loads(raw)  # the caller parsed it as a config already: an object
    out = with_backend(doc, backend)
    # Keep the layout the operator wrote (indented or on one line) so a diff of the
    # config shows only the Backend.
    if "\n" in raw.decode("utf-8", "replace").strip():
        data = json.dumps(out, indent=2, ensure_ascii=False) + "\n"
    else:
        data = json.dumps(out, ensure_ascii=False)
    try:
        config = parse_network_config(data)
    except ConfigError as e:
        raise ConfigError(f"the config with the target Backend is invalid: {e}") from e
    return data, config, out != doc


def _set(doc: dict[str, Any], name: str, value: Any) -> None:
    """Set a Backend option, replacing it under whatever case it was written in."""
    for key in [k for k in doc if k.lower() == name.lower()]:
        del doc[key]
    doc[name] = value


def target_backend(
    config: NetworkConfig,
    backend_type: str,
    direct_routing: bool = False,
    vni: int | None = None,
    port: int | None = None,
    mtu: int | None = None,
) -> dict[str, Any]:
    """The config's Backend with the given options replaced (DirectRouting always)."""
    key = _backend_key(config.raw)
    base = config.raw.get(key) if key else None
    doc: dict[str, Any] = dict(base) if isinstance(base, Mapping) else {}
    _set(doc, "Type", backend_type)
    _set(doc, "DirectRouting", direct_routing)
    for name, value in (("VNI", vni), ("Port", port), ("MTU", mtu)):
        if value is not None:
            _set(doc, name, value)
    return doc


def parse_target(config: NetworkConfig, target: Mapping[str, Any]) -> BackendConfig:
    """Check ``target`` with net-conf.json's own parser, in the config it will be part of.
    Raises ConfigError."""
    return parse_network_config(json.dumps(with_backend(config.raw, target))).backend


# A Network for parsing a Backend document alone; only the Backend part is used.
_ANY_NETWORK = "10.0.0.0/8"


@lru_cache(maxsize=64)
def _parse_backend_json(text: str) -> BackendConfig:
    return parse_network_config(f'{{"Network": "{_ANY_NETWORK}", "Backend": {text}}}').backend


def backend_config(doc: Mapping[str, Any]) -> BackendConfig:
    """A Backend document (as in net-conf.json or an override) parsed. Raises ConfigError."""
    return _parse_backend_json(json.dumps(doc, sort_keys=True))


# What each backend's encapsulation costs over an IPv4 underlay (rollouts plan IPv4 MTUs).
_ENCAP_OVERHEAD = {"vxlan": VXLAN_ENCAP_OVERHEAD, "wireguard": WIREGUARD_OVERHEAD_IPV4}


def _overhead(backend_type: str) -> int:
    return _ENCAP_OVERHEAD.get(backend_type, 0)


def expected_summary(current: BackendSummary, target: BackendConfig) -> BackendSummary:
    """What a node will report once it runs ``target``. Its underlay MTU is inferred from
    what it runs now (overlay MTU plus encapsulation) unless the target sets one."""
    underlay = target.mtu or current.mtu + _overhead(current.type)
    return BackendSummary(
        type=target.type,
        vni=target.vni,
        port=target.effective_port,
        direct_routing=target.direct_routing,
        mtu=underlay - _overhead(target.type),
    )


def runs(summary: BackendSummary, target: BackendConfig) -> bool:
    """Whether a node reporting ``summary`` runs ``target``. The MTU counts only when the
    target sets one: otherwise it follows the node's interface, which we cannot see."""
    if summary.type != target.type:
        return False
    if target.type == "vxlan" and (
        summary.vni != target.vni
        or summary.port != target.effective_port
        or summary.direct_routing != target.direct_routing
    ):
        return False
    return not target.mtu or summary.mtu == target.mtu - _overhead(target.type)


def running_backend(summary: BackendSummary) -> BackendConfig:
    return BackendConfig(
        type=summary.type,
        vni=summary.vni,
        port=summary.port,
        direct_routing=summary.direct_routing,
    )


def short(summary: BackendSummary, detail: bool = False) -> str:
    """``vxlan (MTU 1450)``, ``vxlan+DirectRouting (MTU 1450)``, ``host-gw (MTU 1500)``;
    with ``detail``, a vxlan backend's VNI and port too."""
    name = backend_name(running_backend(summary))
    vxlan = detail and summary.type == "vxlan"
    extra = f"VNI {summary.vni}, port {summary.port}, " if vxlan else ""
    return f"{name} ({extra}MTU {summary.mtu})"


def backend_name(backend: BackendConfig) -> str:
    dr = backend.type == "vxlan" and backend.direct_routing
    return backend.type + ("+DirectRouting" if dr else "")


def describe_transition(current: BackendSummary, target: BackendSummary) -> str:
    detail = current.type == target.type == "vxlan" and (
        current.vni != target.vni or current.port != target.port
    )
    return f"{short(current, detail)} -> {short(target, detail)}"


def disruptions(current: BackendSummary, target: BackendConfig) -> list[str]:
    """The disruptive differences (policy's words) between what a node runs and the target."""
    expected = expected_summary(current, target)
    return disruptive_changes(
        running_backend(current),
        replace(target, port=target.effective_port),
        current.mtu,
        expected.mtu,
    )
