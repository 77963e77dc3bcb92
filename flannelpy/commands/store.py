"""How the operator commands (policy, pools, rollout) reach etcd.

They take the agent's own ``--etcd-*`` flags — same names, same FLANNELD_*
variables, same checks — so a command finds the store exactly as the agent on
the node does (the netns lab hands its etcd over in those variables). All three
are etcd-mode tools: with FLANNELD_KUBE_SUBNET_MGR set they refuse, each saying
what to do in Kubernetes mode instead.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import fields
from typing import TYPE_CHECKING

from flannelpy.config.settings import AgentSettings, add_agent_arguments, settings_from_args
from flannelpy.errors import ConfigError

if TYPE_CHECKING:
    from flannelpy.store.etcd.client import EtcdStore

STORE_TIMEOUT = 3.0  # seconds per etcd request: a person is waiting
STORE_FLAGS = tuple(f.name for f in fields(AgentSettings) if f.name.startswith("etcd_"))


def add_agent_flags(
    parser: argparse.ArgumentParser, dests: tuple[str, ...], title: str, description: str
) -> argparse._ArgumentGroup:
    """Put the agent's own flags named by ``dests`` into a new group of ``parser``: the
    very same actions, so an operator's command takes each flag, FLANNELD_* variable and
    default exactly as the agent does."""
    agent = argparse.ArgumentParser(add_help=False)
    add_agent_arguments(agent)
    group = parser.add_argument_group(title, description)
    for action in agent._actions:
        if action.dest in dests:
            group._add_action(action)
    return group


def add_store_arguments(parser: argparse.ArgumentParser) -> None:
    """The agent's ``--etcd-*`` flags on ``parser``."""
    add_agent_flags(
        parser,
        STORE_FLAGS,
        "store",
        "etcd, as the agent reaches it (each flag also read from FLANNELD_<NAME>)",
    )


def store_parent() -> argparse.ArgumentParser:
    """A parent parser (``parents=[...]``) with the store arguments."""
    parent = argparse.ArgumentParser(add_help=False)
    add_store_arguments(parent)
    return parent


def store_settings(
    args: argparse.Namespace, environ: Mapping[str, str], kube_refusal: str
) -> AgentSettings:
    """The etcd to talk to, from the agent's flags and env. ``kube_refusal`` is the
    sentence for FLANNELD_KUBE_SUBNET_MGR (Kubernetes mode)."""
    settings = settings_from_args(args, environ)
    if settings.kube_subnet_mgr:
        raise ConfigError(kube_refusal)
    return settings


@contextmanager
def connected(settings: AgentSettings) -> Iterator[EtcdStore]:
    from flannelpy.store.etcd.client import connect_etcd

    store = connect_etcd(settings, timeout=STORE_TIMEOUT)
    try:
        yield store
    finally:
        store.close()
