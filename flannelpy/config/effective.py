"""The agent's effective settings, left in its run dir for the commands run beside it.

The agent writes ``<run-dir>/settings.json`` at start: how it reaches its store (etcd
endpoints and prefix, TLS file paths, or Kubernetes mode), the interface it chose, its
node name and its directories. ``flannelpy doctor`` with no flags reads it, so on a node
(or ``kubectl exec`` into the agent's pod) it looks at what the agent uses, not at the
defaults and the host name. Explicit flags and FLANNELD_* variables still win: the file
only supplies defaults, as FLANNELD_* text, through the one validation path of
:mod:`flannelpy.config.settings`.

Secrets never go in it (no etcd user name or password: the file is world-readable,
and a command that needs them takes them as the agent does).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

from flannelpy.config.settings import AgentSettings
from flannelpy.errors import ConfigError
from flannelpy.fsutil import atomic_write

SETTINGS_FILE = "settings.json"
MAX_FILE_BYTES = 64 * 1024  # far above a real file; a larger one is not ours
VERSION = 1

# Exactly what is written: what a command needs to find the store, the kernel state
# and the files the agent keeps. Paths only for TLS; never etcd_username/etcd_password.
FIELDS: tuple[str, ...] = (
    "etcd_endpoints",
    "etcd_prefix",
    "etcd_keyfile",
    "etcd_certfile",
    "etcd_cafile",
    "etcd_transport",
    "kube_subnet_mgr",
    "kube_api_url",
    "kubeconfig_file",
    "kube_annotation_prefix",
    "net_config_path",
    "iface",
    "public_ip",
    "node_name",
    "run_dir",
    "state_dir",
    "subnet_file",
    "subnet_lease_renew_margin",
    "resync_interval",
    "allow_overlap",
    "ip_masq",
    "iptables_forward_rules",
)
IFACE_VARIABLES = ("FLANNELD_IFACE", "FLANNELD_IFACE_REGEX", "FLANNELD_IFACE_CAN_REACH")
SECRETS = frozenset({"etcd_username", "etcd_password"})
assert not SECRETS & set(FIELDS)


def effective_doc(settings: AgentSettings, node_name: str, iface: str) -> dict[str, Any]:
    """The file's content. ``node_name`` and ``iface`` are what the agent resolved (its
    name after $NODE_NAME and the host name; the interface it picked by name, IP, regex
    or route), so a reader finds the same ones without repeating the search."""
    resolved: dict[str, Any] = {"node_name": node_name, "iface": (iface,)}
    doc: dict[str, Any] = {"Version": VERSION}
    for name in FIELDS:
        value = resolved[name] if name in resolved else getattr(settings, name)
        if isinstance(value, tuple):
            value = list(value)
        elif value is not None and not isinstance(value, str | bool | int | float):
            value = str(value)  # an IPv4Address
        doc[name] = value
    return doc


def write_effective(settings: AgentSettings, node_name: str, iface: str) -> None:
    """Replace ``<run-dir>/settings.json``; raises OSError."""
    text = json.dumps(effective_doc(settings, node_name, iface), indent=2, sort_keys=True)
    atomic_write(os.path.join(settings.run_dir, SETTINGS_FILE), text + "\n", durable=False)


def read_effective(run_dir: str) -> dict[str, str]:
    """``<run-dir>/settings.json`` as FLANNELD_* variables; empty when there is none (no
    agent ran here). Raises ConfigError naming the file when it is not one of ours."""
    path = os.path.join(run_dir, SETTINGS_FILE)
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise ConfigError(
            f"cannot read the agent's settings in {path} ({e}); pass the agent's flags instead"
        ) from e
    try:
        if len(data) > MAX_FILE_BYTES:
            raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
        doc = json.loads(data)
        if not isinstance(doc, dict):
            raise ValueError("not a JSON object")
        return settings_environ(doc)
    except (ValueError, RecursionError) as e:
        raise ConfigError(
            f"{path} is not the agent's settings file ({e}); remove it or "
            "pass the agent's flags instead"
        ) from e


def settings_environ(doc: Mapping[str, Any]) -> dict[str, str]:
    """A settings document as FLANNELD_* text; raises ValueError on a wrong type. Keys
    this version does not know are skipped (a newer agent may write more)."""
    if doc.get("Version") != VERSION:
        raise ValueError(f"Version is {doc.get('Version')!r}, not {VERSION}")
    env: dict[str, str] = {}
    for name in FIELDS:
        value = doc.get(name)
        if value is None:
            continue
        if isinstance(value, list):
            if not all(isinstance(item, str) for item in value):
                raise ValueError(f"{name} holds a list of other things than text")
            text = ",".join(value)
        elif isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, str | int | float):
            text = str(value)
        else:
            raise ValueError(f"{name} is a {type(value).__name__}")
        if text:
            env["FLANNELD_" + name.upper()] = text
    return env


def with_agent_defaults(
    run_dir: str, environ: Mapping[str, str], chose_iface: bool = False
) -> dict[str, str]:
    """``environ`` over the agent's settings from ``run_dir``: what is set wins (an
    empty variable is unset, as settings parsing has it). An interface chosen by the
    caller in any way (``chose_iface``: by a flag) replaces the agent's whole choice."""
    given = {k: v for k, v in environ.items() if v}
    defaults = read_effective(run_dir)
    if chose_iface or any(var in given for var in IFACE_VARIABLES):
        defaults.pop("FLANNELD_IFACE", None)
    return {**defaults, **given}
