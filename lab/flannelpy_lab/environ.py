"""A lab's settings as ``FLANNELD_*`` variables, for ``flannelpy-lab run`` and ``env``.

Every agent flag is also read from ``FLANNELD_<NAME>``, so a command finds a lab's
store through its environment alone, with no lab option in the product:

- the lab: ``FLANNELD_ETCD_ENDPOINTS`` and ``FLANNELD_ETCD_PREFIX``, for operator
  commands run on the host (``policy``, ``pools``, ``rollout``). The host has a leg on
  the lab's switch, so the lab's etcd is on-link and nothing leaves the machine.
- a node: every flag of that node's agent (``agents.agent_argv``) plus ``NODE_NAME``,
  for commands run inside the node's namespace (``doctor`` finds what the agent uses);
  on a flanneld node, the lab's etcd and ``NODE_NAME``.

The caller's own ``FLANNELD_*`` variables are dropped, so nothing of another cluster
mixes in.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Mapping, Sequence

from flannelpy.config.settings import add_agent_arguments, settings_from_args
from flannelpy.errors import ConfigError
from flannelpy_lab import agents, topology
from flannelpy_lab.errors import LabError
from flannelpy_lab.state import LabState, NodeInfo

ENV_PREFIX = "FLANNELD_"
STORE_FLAGS = ("--etcd-endpoints", "--etcd-prefix")


def store_environ(state: LabState) -> dict[str, str]:
    """The lab's etcd, as the operator commands read it."""
    return {
        "FLANNELD_ETCD_ENDPOINTS": ",".join(state.etcd_endpoints),
        "FLANNELD_ETCD_PREFIX": state.etcd_prefix,
    }


def node_environ(state: LabState, node: NodeInfo) -> dict[str, str]:
    """Every setting of ``node``'s agent as variables, checked to mean what its flags mean."""
    if node.runs_flanneld:  # no agent of ours there: the lab's etcd and the node's name
        return {**store_environ(state), "NODE_NAME": node.name}
    argv = agents.agent_argv(state, node)
    flags = argv[argv.index("agent") + 1 :]
    parser = argparse.ArgumentParser(add_help=False)
    add_agent_arguments(parser)
    parsed, unknown = parser.parse_known_args(flags)
    if unknown:
        raise LabError(
            f"node {node.name}'s agent flags {' '.join(unknown)} are not agent flags; "
            "fix the lab's agent arguments"
        )
    environ = {"NODE_NAME": node.name}
    for action in parser._actions:
        value = getattr(parsed, action.dest, None)
        if not action.option_strings or value is None:
            continue
        environ[ENV_PREFIX + action.dest.upper()] = (
            ",".join(value) if isinstance(value, list) else str(value)
        )
    try:
        same = settings_from_args(argparse.Namespace(), environ) == settings_from_args(
            parsed, {"NODE_NAME": node.name}
        )
    except ConfigError as e:
        raise LabError(f"node {node.name}'s agent flags are not valid: {e}") from e
    if not same:  # e.g. several --iface-regex: one variable holds one regex
        raise LabError(
            f"node {node.name}'s agent flags ({shlex.join(flags)}) cannot all be written as "
            "FLANNELD_* variables; give its agent one value per repeatable flag"
        )
    return environ


def child_environ(settings: Mapping[str, str]) -> dict[str, str]:
    """Our environment without its ``FLANNELD_*`` and ``NODE_NAME``, plus ``settings``."""
    base = {
        k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX) and k != "NODE_NAME"
    }
    return base | dict(settings)


def command_argv(lab: str, node: NodeInfo | None, command: Sequence[str]) -> list[str]:
    """``command`` as it runs: a leading ``flannelpy`` is the one installed beside the lab
    (``python -m flannelpy``, as the lab's agents run); with a node, in its namespace."""
    if not command:
        raise ConfigError("give the command to run after --, e.g. -- flannelpy pools list")
    given = [f for f in STORE_FLAGS if any(a == f or a.startswith(f + "=") for a in command)]
    if given:
        raise ConfigError(f"lab {lab} brings its own etcd; leave out {', '.join(given)}")
    argv = list(command)
    if argv[0] == "flannelpy":
        argv[:1] = [sys.executable, "-m", "flannelpy"]
    return topology.exec_argv(node.namespace, argv) if node is not None else argv


def render(settings: Mapping[str, str]) -> str:
    """``NAME=value`` lines, quoted for a POSIX shell's ``eval``, each exported."""
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in settings.items())
