"""The labs on this host, found by their directories and names: which exist, the
underlay networks they hold, claiming a new one (under the lock all labs share) and
removing one (``down``).

Separate from the ``Lab`` API (``flannelpy_lab.lab``) because it works from names and
the recorded state alone: ``down`` succeeds on a half-built lab, one without a state file
and a second time.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from ipaddress import IPv4Network

from flannelpy.dataplane.netns import netns_path
from flannelpy_lab import agents, kube_netpol, plan, procs, prometheus, topology
from flannelpy_lab import kube as control_plane
from flannelpy_lab import kubelet as real_nodes
from flannelpy_lab import state as state_io
from flannelpy_lab.errors import LabError
from flannelpy_lab.state import LabState


def lab_dir(name: str, lab_root: str = plan.LAB_ROOT) -> str:
    return os.path.join(lab_root, plan.validate_name(name))


def list_labs(lab_root: str = plan.LAB_ROOT) -> list[str]:
    """Names of labs with a directory or a namespace on this host."""
    names: set[str] = set()
    if os.path.isdir(lab_root):
        names.update(d for d in os.listdir(lab_root) if plan.NAME_PATTERN.fullmatch(d))
    for ns in topology.list_netns():
        parts = ns.split("-")
        if len(parts) == 3 and parts[0] == "fpl" and plan.NAME_PATTERN.fullmatch(parts[1]):
            names.add(parts[1])
    return sorted(names)


def used_networks(lab_root: str) -> list[IPv4Network]:
    """What a new lab must not overlap: the host's routes and addresses, other labs' segments."""
    used = topology.host_used_networks()
    for name in list_labs(lab_root):
        other = state_io.load(os.path.join(lab_root, name))
        if other:
            used.extend(IPv4Network(s.subnet) for s in other.segments)
    return used


def down(name: str, lab_root: str = plan.LAB_ROOT) -> None:
    """Remove the lab ``name``: processes, namespaces, host link and routes, its directory.

    Idempotent; works without a state file by sweeping the lab's names.
    """
    directory = lab_dir(name, lab_root)
    state = None
    with contextlib.suppress(LabError):  # unreadable state: sweep by name below
        state = state_io.load(directory)
    # Agents and anything else inside the lab's namespaces go first, while etcd
    # still answers (an agent may talk to it on its way out); then etcd, whose
    # members may have namespaces of their own.
    refs = [r for r in (agents.agent_ref(n) for n in state.nodes) if r] if state else []
    refs += kube_netpol.refs(state) if state else []
    member_namespaces = {m.namespace for m in state.etcd_members} if state else set()
    member_namespaces.update(
        ns for ns in topology.lab_namespaces(name) if plan.is_etcd_member_namespace(name, ns)
    )
    namespaces = set(topology.lab_namespaces(name)) - member_namespaces
    if state:
        namespaces.update(n.namespace for n in state.nodes)
    for ns in namespaces:
        refs += _refs(procs.pids_in_netns(netns_path(ns)))
    real_nodes.stop(state, name)  # before the sweep: pods run outside the node namespaces
    procs.stop(set(refs))
    if state:
        prometheus.stop(state)
    procs.stop(_refs([pid for _, pid in procs.pids_of_programs_under(["prometheus"], directory)]))
    # The Kubernetes control plane, if any, from the state or by its command lines (its
    # etcd is swept by its data dir below).
    control_plane.stop(state, directory)
    etcd_refs = _refs(procs.pids_with_files_under(directory))
    for ns in member_namespaces:
        etcd_refs += _refs(procs.pids_in_netns(netns_path(ns)))
    if state and state.etcd_pid:
        etcd_refs.append(procs.ProcessRef(state.etcd_pid, state.etcd_start_ticks or 0))
    for member in state.etcd_members if state else []:
        if member.pid:
            etcd_refs.append(procs.ProcessRef(member.pid, member.start_ticks or 0))
    procs.stop(set(etcd_refs))
    topology.destroy(state, name)
    shutil.rmtree(directory, ignore_errors=True)
    if os.path.exists(directory):
        raise LabError(f"cannot remove {directory}; remove it by hand")


def down_all(lab_root: str = plan.LAB_ROOT) -> list[str]:
    names = list_labs(lab_root)
    for name in names:
        down(name, lab_root)
    return names


def _refs(pids: list[int]) -> list[procs.ProcessRef]:
    return [r for r in (procs.current_ref(p) for p in pids) if r]


def claim(
    name: str,
    nodes: int,
    backend: str,
    direct_routing: bool,
    segments: int,
    network: str,
    etcd_prefix: str,
    overlay_bridge: bool,
    lab_root: str,
    flanneld_nodes: int = 0,
    etcd_members: int = 1,
) -> LabState:
    """Pick free underlay subnets and record the plan, under the lock all labs share."""
    with state_io.root_lock(lab_root):
        directory = lab_dir(name, lab_root)
        leftovers = topology.lab_namespaces(name)
        if os.path.exists(directory) or leftovers or topology.link_exists(plan.host_link(name)):
            raise LabError(
                f"lab {name} exists already (or left pieces behind); "
                f"run `flannelpy-lab down --name {name}` first"
            )
        subnets = plan.choose_subnets(used_networks(lab_root), segments)
        state = plan.plan_lab(
            name,
            nodes,
            backend,
            direct_routing=direct_routing,
            segments=segments,
            network=network,
            etcd_prefix=etcd_prefix,
            subnets=subnets,
            overlay_bridge=overlay_bridge,
            lab_root=lab_root,
            flanneld_nodes=flanneld_nodes,
            etcd_members=etcd_members,
        )
        state_io.save(state)
        return state
