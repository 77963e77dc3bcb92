"""Migration of one node between the upstream flanneld and our agent, with pods running.

``flannelpy-lab migrate --name L --node n3 --to flannelpy|flanneld`` does what an
operator does on a real node, in this order:

to flannelpy (from flanneld)
    stop flanneld (SIGTERM; it leaves flannel.1, its routes, cni0 and the lease);
    replace the node's conflist by ours; start our agent. The agent takes the lease
    back by PublicIP (same subnet), keeps flannel.1 (same MAC), takes over
    flanneld's routes and holds the addresses host-local handed out
    (``--host-local-dir``, the node's host-local data dir).
to flanneld (from ours)
    stop our agent (it leaves the data plane and the lease); write our IPAM's
    live allocations into host-local's data dir, so host-local never hands one
    out again, and for each of our pods the delegate config the flannel plugin's
    ADD would have saved in its dataDir, so its DEL releases the address; replace
    the conflist by Flannel's; start flanneld.

The lab state records the node's new kind, so ``status``, ``pod add`` and ``down``
follow it. Pods made before keep their addresses; a later DEL of such a pod goes
through whichever conflist the node has then (as with a runtime that reads the
current config), and both sides release it: ours from its IPAM or its holds,
the flannel plugin through bridge + host-local from the config saved for it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass

from flannelpy.ipam import hostlocal
from flannelpy.ipam.manager import NodeIpam
from flannelpy_lab import agents, flanneld, pods
from flannelpy_lab.agents import SubnetEnv
from flannelpy_lab.errors import LabError
from flannelpy_lab.lab import Lab
from flannelpy_lab.state import KIND_FLANNELD, KIND_FLANNELPY, NodeInfo

KINDS = (KIND_FLANNELPY, KIND_FLANNELD)


@dataclass(frozen=True)
class MigrationResult:
    node: str
    from_kind: str
    to_kind: str
    subnet: str  # the lease's gateway address, unchanged: "10.244.3.1/24"
    exported: int  # host-local entries written for our allocations (to flanneld)
    seconds: float  # from stopping one agent to the other being ready


def migrate(
    lab: Lab,
    node_name: str,
    to: str,
    timeout: float = agents.READY_TIMEOUT,
    while_stopped: Callable[[], None] | None = None,
) -> MigrationResult:
    """Stop the node's agent, start the other kind in its place, wait until it is ready;
    raise LabError when the node is that kind already or its lease subnet changed.
    ``while_stopped`` runs while neither agent runs (a test's change to the cluster)."""
    if to not in KINDS:
        raise LabError(f"--to must be one of {', '.join(KINDS)}, not {to!r}")
    node = lab.node(node_name)
    if node.agent_kind == to:
        raise LabError(f"node {node_name} runs {to} already")
    before = agents.read_subnet_env(node)
    if before is None:
        raise LabError(
            f"node {node_name} has no subnet.env at {node.subnet_env}: "
            "its agent never became ready, so it has nothing to hand over"
        )
    if "cni_exec" not in lab.state.extra:
        lab.install_cni()
    from_kind = node.agent_kind
    started = time.monotonic()
    lab.kill_agent(node_name)
    if while_stopped is not None:
        while_stopped()
    exported = 0
    if to == KIND_FLANNELD:
        pods.install_flannel_plugin(lab.state)
        exported = export_allocations(node, before)
    old_conflist = node.conflist
    node.agent_kind = to
    lab.state.extra.setdefault("migrations", []).append(
        {"node": node_name, "from": from_kind, "to": to, "at": time.time()}
    )
    lab._save()
    lab.start_agent(node_name)
    lab.wait_ready(node_name, timeout)
    if os.path.exists(old_conflist) and old_conflist != node.conflist:
        os.unlink(old_conflist)  # the runtime reads one config: the running agent's
    pods.write_conflist(node)
    after = agents.read_subnet_env(node)
    if after is None or after.subnet is None or after.subnet != before.subnet:
        raise LabError(
            f"node {node_name} changed its lease from {before.subnet} to "
            f"{after.subnet if after else 'none'} when migrating to {to}; see {node.agent_log}"
        )
    return MigrationResult(
        node_name, from_kind, to, after.subnet, exported, time.monotonic() - started
    )


def export_allocations(node: NodeInfo, env: SubnetEnv) -> int:
    """Write our IPAM's allocations (and the addresses it holds for host-local's pods)
    into host-local's data dir, and for each of our pods the delegate config the flannel
    plugin's DEL replays (it does nothing for a container it has none for), with our
    agent stopped; returns the host-local files written."""
    state_dir = os.path.join(node.node_dir, "state", "ipam")
    if not os.path.isdir(state_dir):
        return 0
    with NodeIpam(state_dir, fsync=False) as ipam:
        entries = ipam.host_local_entries()
    containers = {entry.container_id for entry in entries}
    flanneld.write_delegate_confs(node, env, pods.NETWORK_NAME, containers)
    return hostlocal.write_allocations(flanneld.host_local_network_dir(node), entries)
