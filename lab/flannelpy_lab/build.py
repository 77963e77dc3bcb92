"""Building a lab once it is planned: namespaces, switches and the host's link, etcd,
the network config, the control plane and the kubelets, then the agents, waited for
until each has written its subnet.env.

Separate from the ``Lab`` API (``flannelpy_lab.lab``), which plans and records the lab
before calling ``build`` and removes it all on any failure.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from flannelpy_lab import agents, etcd, kube_netpol, plan, prometheus, topology
from flannelpy_lab import kube as control_plane
from flannelpy_lab import kubelet as real_nodes
from flannelpy_lab.agents import SubnetEnv
from flannelpy_lab.errors import LabError
from flannelpy_lab.state import LabState, NodeInfo

Progress = Callable[[str], None]
Save = Callable[[], None]
UP_STEPS = 7  # the 7th, creating pods, only with --pods-per-node above 0


def build(state: LabState, start_agents: bool, timeout: float, say: Progress, save: Save) -> None:
    """Build the planned lab step by step, saving ``state`` (``save``) after each process
    it starts, up to every agent ready (or the kubelets' cluster up)."""
    s = state
    say(f"[2/{UP_STEPS}] building {len(s.nodes)} node namespaces on {len(s.segments)} segment(s)")
    for seg in s.segments:
        topology.build_switch(seg)
    if s.router_namespace:
        topology.build_router(s)
    for node in s.nodes:
        topology.build_node(s, node)
    say(f"[3/{UP_STEPS}] attaching the host at {s.host_address} ({s.host_link})")
    topology.attach_host(s)
    topology.add_host_routes(s)
    if s.etcd_members:
        say(
            f"[4/{UP_STEPS}] starting {len(s.etcd_members)} etcd members at "
            f"{', '.join(s.etcd_endpoints)}"
        )
        for member in s.etcd_members:
            topology.build_etcd_member(s, member)
        save()
        # All at once: a member of a new static cluster waits for its peers.
        for member in s.etcd_members:
            etcd.start_member(s, member)
            save()
        for member in s.etcd_members:
            etcd.wait_member_answering(s, member)
    else:
        say(f"[4/{UP_STEPS}] starting etcd at {s.etcd_endpoint}")
        ref = etcd.start(s)
        s.etcd_pid, s.etcd_start_ticks = ref.pid, ref.start_ticks
        save()
        etcd.wait_answering(s, ref)
    say(f"[5/{UP_STEPS}] writing the network config to {s.etcd_prefix}/config")
    etcd.put_config(
        s,
        plan.net_conf_json(s.network, s.backend, s.direct_routing, s.extra.get("net_conf_extra")),
    )
    if control_plane.STATE_KEY in s.extra:
        say(f"[5/{UP_STEPS}] starting the Kubernetes control plane at {control_plane.api_url(s)}")
        control_plane.start(s, save, say)
    if real_nodes.enabled(s):  # the DaemonSet runs the agents
        real_nodes.start(s, save, say)
        return
    if not start_agents:
        return
    for node in s.nodes:
        agents.start(s, node)
    save()
    wait_all_ready(s, s.nodes, timeout, say, save)
    if kube_netpol.enabled(s) and any(n.runs_flanneld for n in s.nodes):
        say(f"[6/{UP_STEPS}] starting kube-network-policies beside flanneld")
        kube_netpol.start_all(s, save)
    if prometheus.STATE_KEY in s.extra:
        say(f"[6/{UP_STEPS}] starting Prometheus at {prometheus.url(s)}")
        prometheus.start(s)
        save()


def wait_all_ready(
    state: LabState, nodes: list[NodeInfo], timeout: float, say: Progress, save: Save
) -> None:
    """Wait until every agent of ``nodes`` has written a fresh subnet.env, saying how many."""
    pending = list(nodes)
    deadline = time.monotonic() + timeout
    total = len(nodes)
    say(f"[6/{UP_STEPS}] starting agents 0/{total} ready")
    restarts = dict.fromkeys((n.name for n in nodes), 0)
    while pending:
        for node in list(pending):
            try:
                env = agents.check_ready(node, state)
            except LabError:
                retries_left = restarts[node.name] < agents.FLANNELD_RESTARTS
                if not (retries_left and agents.lost_lease_race(node)):
                    raise
                restarts[node.name] += 1
                say(f"      flanneld on {node.name} lost a lease race; restarting it")
                agents.start(state, node)
                save()
                continue
            if env is not None:
                on_ready(state, node, env, save)
                pending.remove(node)
                say(f"[6/{UP_STEPS}] starting agents {total - len(pending)}/{total} ready")
        if pending and time.monotonic() > deadline:
            raise agents.not_ready_error(pending, timeout)
        if pending:
            time.sleep(0.1)


def on_ready(state: LabState, node: NodeInfo, env: SubnetEnv, save: Save) -> None:
    """Record the overlay address of a node whose agent is ready (and give it cni0)."""
    # On a flanneld node cni0 is the bridge plugin's, made at the node's first pod.
    if state.overlay_bridge and not node.runs_flanneld:
        topology.ensure_overlay_bridge(
            node.namespace,
            env.subnet,
            env.mtu,
            env.ipv6_subnet,
        )
    node.overlay_address = env.subnet
    save()
