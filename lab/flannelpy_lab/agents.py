"""Agents in node namespaces: their command line, start, and readiness.

An agent is ready when it has written a fresh ``subnet.env`` (newer than its
start: a file left by an earlier run does not count, yet stays in place
because the agent reuses its subnet). The lab then gives the node its overlay
address (``topology.ensure_overlay_bridge``).

Per node, the lab state may add flags (``extra["node_agent_args"]``: node ->
flags, after the lab-wide ``extra["agent_args"]``) and a source tree to run the
agent from (``extra["node_agent_source"]``: node -> a directory holding
``flannelpy/``), e.g. two cluster names in one lab, or a previous release on one
node next to this one. Both take effect at the node's next agent start.

A node whose ``agent_kind`` is flanneld runs the real flanneld instead
(``flannelpy_lab.flanneld``), with the same pid, log and start-time fields; it is
ready once its fresh subnet.env is written and its lease is in etcd.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from ipaddress import IPv4Interface, IPv6Interface, IPv6Network

import flannelpy
from flannelpy_lab import flanneld, procs, prometheus, topology
from flannelpy_lab.errors import LabError
from flannelpy_lab.state import LabState, NodeInfo

READY_TIMEOUT = 60.0  # seconds for an agent to write subnet.env
REQUIRED_ENV = ("FLANNEL_NETWORK", "FLANNEL_SUBNET", "FLANNEL_MTU")
NODE_ARGS_KEY = "node_agent_args"  # in LabState.extra: {node: [flag, ...]}
NODE_SOURCE_KEY = "node_agent_source"  # in LabState.extra: {node: source root}


@dataclass(frozen=True)
class SubnetEnv:
    network: str | None  # None IPv6-only (no FLANNEL_NETWORK)
    subnet: str | None  # the lease's first address with its prefix, "10.244.3.1/24"
    mtu: int
    ipmasq: bool
    ipv6_subnet: str | None = None  # FLANNEL_IPV6_SUBNET (dual stack), "fd10:244:0:3::1/64"
    ipv6_network: str | None = None  # FLANNEL_IPV6_NETWORK (dual stack), "fd10:244::/56"


def agent_argv(state: LabState, node: NodeInfo) -> list[str]:
    """The agent's command line (run inside the node namespace)."""
    run_dir = os.path.join(node.node_dir, "run")
    argv = [
        sys.executable, "-m", "flannelpy", "agent",
        "--iface", node.underlay_iface,
        "--node-name", node.name,
        "--subnet-file", node.subnet_env,
        "--state-dir", os.path.join(node.node_dir, "state"),
        "--run-dir", run_dir,
        "--ip-masq",
        "--log-level", "info",
    ]  # fmt: skip
    kube_api = state.extra.get("kube_api_url")
    if kube_api:
        # Kubernetes mode: leases come from Node objects at that API server; the
        # network config is the ConfigMap's net-conf.json, here a file of the lab.
        argv += [
            "--kube-subnet-mgr",
            "--kube-api-url",
            kube_api,
            "--net-config-path",
            kube_net_conf_path(state),
        ]
        # The real control plane (flannelpy_lab.kube): the ServiceAccount's token.
        kubeconfig = state.extra.get("kube_kubeconfig")
        if kubeconfig:
            argv += ["--kubeconfig-file", kubeconfig]
        if state.extra.get("network_policy"):  # kube.NETWORK_POLICY_KEY
            argv.append("--enable-network-policy")
    else:
        argv += [
            "--etcd-endpoints",
            ",".join(state.etcd_endpoints),
            "--etcd-prefix",
            state.etcd_prefix,
        ]
    argv += prometheus.metrics_addr(state, str(node.ip))  # scraped from the host side
    argv += list(state.extra.get("agent_args", []))
    return argv + list(state.extra.get(NODE_ARGS_KEY, {}).get(node.name, []))


def kube_net_conf_path(state: LabState) -> str:
    return os.path.join(state.lab_dir, "net-conf.json")


def agent_source(state: LabState, node: NodeInfo) -> str | None:
    """The source root the node's agent runs from; None: this flannelpy."""
    source: str | None = state.extra.get(NODE_SOURCE_KEY, {}).get(node.name)
    return source


def agent_env(source_root: str | None = None) -> dict[str, str]:
    """Our environment, plus the directory holding the flannelpy to run (by default this
    one) first on PYTHONPATH, so ``-m flannelpy`` finds it."""
    env = dict(os.environ)
    if source_root is None:
        source_root = os.path.dirname(os.path.dirname(os.path.abspath(flannelpy.__file__)))
    else:
        # ``-m`` puts the working directory before PYTHONPATH: a checkout there
        # would shadow the tree asked for.
        env["PYTHONSAFEPATH"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, env.get("PYTHONPATH")) if p)
    return env


def prepare_dirs(node: NodeInfo) -> None:
    for sub in ("run/flannel", "state"):
        os.makedirs(os.path.join(node.node_dir, sub), exist_ok=True)


def start(state: LabState, node: NodeInfo) -> procs.ProcessRef:
    """Start the node's agent (ours or flanneld) detached; record its pid and start time."""
    prepare_dirs(node)
    if node.runs_flanneld:
        env = flanneld.environ(state)
        argv = flanneld.argv(state, node)
    else:
        env = agent_env(agent_source(state, node))
        argv = agent_argv(state, node)
        # The node's host-local data dir (the host's filesystem is shared): where a
        # flanneld that ran here before left its pods' addresses. As the variable of
        # --host-local-dir, which an agent of an older source ignores.
        env["FLANNELD_HOST_LOCAL_DIR"] = flanneld.host_local_network_dir(node)
    env["NODE_NAME"] = node.name  # the downward API's job in a DaemonSet
    started_at = time.time()
    procs.mark_start(node.agent_log, node.agent_kind)
    ref = procs.spawn_detached(topology.exec_argv(node.namespace, argv), node.agent_log, env)
    node.agent_pid, node.agent_start_ticks = ref.pid, ref.start_ticks
    node.agent_started_at = started_at
    node.overlay_address = None
    return ref


def agent_ref(node: NodeInfo) -> procs.ProcessRef | None:
    return procs.ref_of(node.agent_pid, node.agent_start_ticks)


V4_ENV = ("FLANNEL_NETWORK", "FLANNEL_SUBNET")


def parse_subnet_env(text: str, source: str = "subnet.env") -> SubnetEnv:
    """Parse Flannel's subnet.env; raise ValueError naming missing or bad keys."""
    values: dict[str, str] = {}
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    # IPv6-only (Flannel's too) has no FLANNEL_NETWORK/FLANNEL_SUBNET, but the IPv6 pair.
    v6_only = "FLANNEL_SUBNET" not in values and "FLANNEL_IPV6_SUBNET" in values
    required = [k for k in REQUIRED_ENV if not (v6_only and k in V4_ENV)]
    missing = [k for k in required if k not in values]
    if missing:
        raise ValueError(f"{source} lacks {', '.join(missing)}")
    try:
        subnet = None if v6_only else str(IPv4Interface(values["FLANNEL_SUBNET"]))
        mtu = int(values["FLANNEL_MTU"])
    except ValueError as e:
        raise ValueError(f"{source} has a bad FLANNEL_SUBNET or FLANNEL_MTU: {e}") from e
    return SubnetEnv(
        network=values.get("FLANNEL_NETWORK"),
        subnet=subnet,
        mtu=mtu,
        ipmasq=values.get("FLANNEL_IPMASQ", "false").lower() == "true",
        ipv6_subnet=_ipv6_interface(values.get("FLANNEL_IPV6_SUBNET")),
        ipv6_network=_ipv6_network(values.get("FLANNEL_IPV6_NETWORK")),
    )


def _ipv6_network(text: str | None) -> str | None:
    try:
        return str(IPv6Network(text)) if text else None
    except ValueError:
        return None


def _ipv6_interface(text: str | None) -> str | None:
    try:
        return str(IPv6Interface(text)) if text else None
    except ValueError:
        return None


def read_subnet_env(
    node: NodeInfo, newer_than: float | None = None, path: str | None = None
) -> SubnetEnv | None:
    """The node's subnet.env (at ``path``, by default where the lab's agent writes it), or
    None if missing, older than ``newer_than`` or half-written."""
    path = path or node.subnet_env
    try:
        st = os.stat(path)
        if newer_than is not None and st.st_mtime < newer_than:
            return None
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    try:
        return parse_subnet_env(text, path)
    except ValueError:
        return None


def check_ready(node: NodeInfo, state: LabState | None = None) -> SubnetEnv | None:
    """The fresh subnet.env if the agent is ready; raise LabError if the agent has exited.

    A flanneld node (given the lab ``state``) must also have its lease in etcd."""
    env = read_subnet_env(node, newer_than=node.agent_started_at)
    if env is not None and (
        state is None or not node.runs_flanneld or flanneld.has_lease(state, node)
    ):
        return env
    if not procs.alive(agent_ref(node)):
        raise LabError(
            f"the agent of node {node.name} exited before writing {node.subnet_env}; "
            f"last lines of {node.agent_log}:\n{procs.log_tail(node.agent_log)}"
        )
    return None


# flanneld (v0.28.9, etcd mode) picks a random free subnet and exits when another agent
# created the same one between its read and its write ("failed to acquire lease: subnet
# already exists"): agents started together hit it about once in a few hundred starts.
# Flannel's DaemonSet restarts the pod; the lab does what it would.
FLANNELD_LEASE_RACE = "failed to acquire lease: subnet already exists"
FLANNELD_RESTARTS = 3


def lost_lease_race(node: NodeInfo) -> bool:
    """Did the node's flanneld exit on the lease race, in its latest start's log?"""
    return node.runs_flanneld and FLANNELD_LEASE_RACE in procs.latest_run(node.agent_log)


def not_ready_error(nodes: list[NodeInfo], timeout: float) -> LabError:
    first = nodes[0]
    names = ", ".join(n.name for n in nodes)
    return LabError(
        f"agents of {names} wrote no subnet.env within {timeout:g} s; "
        f"last lines of {first.agent_log}:\n{procs.log_tail(first.agent_log)}"
    )
