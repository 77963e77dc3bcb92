"""The ``Lab`` API: bring a lab up, drive it from tests, tear it down.

``Lab.up`` plans the lab (pure, ``plan.py``), records the plan in state.json
*before* building anything, then builds step by step, saving state after each
process it starts. Any failure, Ctrl-C included, tears down whatever was built;
``down`` works from the recorded state and also sweeps anything left with the
lab's names, so it succeeds on a half-built lab and a second time.

The build steps are in ``flannelpy_lab.build``; finding, claiming and removing labs on
the host (``down``, ``list_labs``, ...) in ``flannelpy_lab.registry``, re-exported here.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Sequence
from ipaddress import IPv4Interface, IPv4Network
from typing import Any

from flannelpy.errors import ConfigError
from flannelpy_lab import (
    agents,
    etcd,
    flanneld,
    kube_netpol,
    kubeflannel,
    plan,
    pods,
    procs,
    prometheus,
    status,
    topology,
)
from flannelpy_lab import dns as cluster_dns_peer
from flannelpy_lab import kube as control_plane
from flannelpy_lab import kubelet as real_nodes
from flannelpy_lab import proxy as kube_proxy
from flannelpy_lab import state as state_io
from flannelpy_lab.build import UP_STEPS, Progress, on_ready, wait_all_ready
from flannelpy_lab.build import build as build_lab
from flannelpy_lab.errors import LabError
from flannelpy_lab.registry import claim, down, down_all, lab_dir, list_labs, used_networks
from flannelpy_lab.state import EtcdMemberInfo, LabState, NodeInfo, PodInfo

__all__ = ["UP_STEPS", "Lab", "down", "down_all", "lab_dir", "list_labs", "used_networks"]


def _quiet(_: str) -> None:
    pass


class Lab:
    """A running lab, as recorded in its state file."""

    def __init__(self, state: LabState) -> None:
        self.state = state

    # -- life cycle -------------------------------------------------------

    @classmethod
    def up(
        cls,
        name: str,
        nodes: int = 3,
        backend: str = "vxlan",
        direct_routing: bool = False,
        segments: int = 1,
        network: str = plan.DEFAULT_NETWORK,
        etcd_prefix: str = plan.DEFAULT_ETCD_PREFIX,
        *,
        start_agents: bool = True,
        overlay_bridge: bool = False,
        pods_per_node: int = 0,
        cni_exec: str = "auto",
        timeout: float = agents.READY_TIMEOUT,
        progress: Progress | None = None,
        lab_root: str = plan.LAB_ROOT,
        flanneld_nodes: int = 0,
        etcd_members: int = 1,
        net_conf_extra: dict[str, Any] | None = None,
        kube: bool = False,
        with_prometheus: bool = False,
        kubelets: bool = False,
        proxy_mode: str = kube_proxy.DEFAULT_MODE,
        network_policy: bool = False,
        image_archives: Sequence[str] = (),
        cluster_dns: bool = False,
        host_pod_routes: bool = False,
        network_agent: str = "flannelpy",
    ) -> Lab:
        """Build a lab and wait until every agent is ready; on any failure remove it all.

        ``net_conf_extra``: more top-level net-conf.json keys, e.g. {"EnableNFTables": True}.

        The last ``flanneld_nodes`` nodes run the real flanneld (``flannelpy_lab.flanneld``).
        ``etcd_members`` above 1: a static etcd cluster, each member in a namespace of its
        own (``flannelpy_lab.etcd``), and every agent given all their URLs.

        ``kube``: Kubernetes mode against a real control plane (``flannelpy_lab.kube``)
        on the host side; the agents run with ``--kube-subnet-mgr``.

        ``with_prometheus``: a real Prometheus on the host's lab address scraping every
        agent, the manifests' alert rules loaded (``flannelpy_lab.prometheus``).

        ``kubelets`` (implies ``kube``): a real kubelet, containerd and kube-proxy (in
        ``proxy_mode``, iptables or nftables) per node, the agents run by the manifests'
        DaemonSet, a test Deployment (``flannelpy_lab.kubelet``); every ``image_archives``
        (``podman save`` archives) is imported into every node's containerd beside them;
        ``cluster_dns``: CoreDNS as the cluster DNS (``flannelpy_lab.dns``);
        ``host_pod_routes``: the host routes each podCIDR to its node, so kube-apiserver
        reaches pods (``network`` must then be one no other lab on the host uses);
        ``network_agent`` "flanneld": Flannel's flanneld and CNI plugin are the network
        instead of the DaemonSet (``flannelpy_lab.kubeflannel``).

        ``network_policy`` (needs ``kube``): the agents enforce NetworkPolicy
        (``--enable-network-policy``, the manifests' ``network-policy`` component); with
        ``kube``, flanneld nodes run kube-network-policies beside flanneld, as Flannel's chart
        does (``flannelpy_lab.kube_netpol``): every node with ``network_agent`` "flanneld"."""
        say = progress or _quiet
        kube = kube or kubelets
        plan.validate_request(
            name,
            nodes,
            backend,
            direct_routing,
            segments,
            network,
            flanneld_nodes,
            etcd_members,
        )
        kube_proxy.validate_mode(proxy_mode, kubelets)
        kubeflannel.validate(network_agent, kubelets, flanneld_nodes)
        if network_agent == "flanneld":
            flanneld_nodes = nodes  # every node runs flanneld (its agent_kind says so)
        if network_policy and not kube:
            raise LabError(
                "--enable-network-policy needs --kube or --kubelet: etcd mode has no Pods or "
                "NetworkPolicies"
            )
        real_nodes.validate_image_archives(image_archives, kubelets)
        if (cluster_dns or host_pod_routes) and not kubelets:
            raise LabError(
                "--cluster-dns and --host-pod-routes need --kubelet: the other labs run no "
                "Deployment and no API server proxy"
            )
        # Before anything is set up: a Go peer not built yet is built now (first use, saying
        # so), and one that cannot be built fails fast, naming its build script.
        flanneld_binary = flanneld.binary() if flanneld_nodes else None
        flannel_cni_binary = flanneld.cni_plugin_binary() if flanneld_nodes else None
        # Flannel's chart runs kube-network-policies beside flanneld when netpol is on.
        netpol_binary = kube_netpol.binary() if flanneld_nodes and network_policy else None
        if kube:
            control_plane.bin_dir(build=True)
        coredns_binary = cluster_dns_peer.binary() if cluster_dns else None
        say(f"[1/{UP_STEPS}] choosing underlay addresses")
        state = claim(
            name,
            nodes,
            backend,
            direct_routing,
            segments,
            network,
            etcd_prefix,
            overlay_bridge,
            lab_root,
            flanneld_nodes,
            etcd_members,
        )
        if flanneld_binary:
            state.extra["flanneld_binary"] = flanneld_binary
            state.extra["flannel_cni_binary"] = flannel_cni_binary
        if net_conf_extra:
            state.extra["net_conf_extra"] = dict(net_conf_extra)
        if kube:
            control_plane.record(state)
        if network_policy:
            state.extra[control_plane.NETWORK_POLICY_KEY] = True
        if netpol_binary:
            state.extra[kube_netpol.BINARY_KEY] = netpol_binary
        if kubelets:
            control_plane.record(state)[control_plane.KUBELETS_KEY] = True
            nodes_record = real_nodes.record(state)
            nodes_record["proxy_mode"] = proxy_mode
            nodes_record["network_agent"] = network_agent
            nodes_record["image_archives"] = [os.path.abspath(p) for p in image_archives]
            if coredns_binary:
                nodes_record["coredns_binary"] = coredns_binary
            nodes_record["host_pod_routes"] = host_pod_routes
        if with_prometheus:
            prometheus.record(state)
        lab = cls(state)
        try:
            build_lab(lab.state, start_agents, timeout, say, lab._save)
            if start_agents and pods_per_node and not kubelets:
                lab._add_initial_pods(pods_per_node, cni_exec, say)
        except BaseException:
            say("lab up failed; removing what was built")
            try:
                down(name, lab_root)
            except Exception as e:  # keep the original error; report this one beside it
                say(f"removing lab {name} failed too: {e}")
            raise
        return lab

    def _add_initial_pods(self, per_node: int, cni_exec: str, say: Progress) -> None:
        form = self.install_cni(cni_exec)
        total = per_node * len(self.state.nodes)
        say(f"[7/{UP_STEPS}] creating {total} pods through the CNI executable ({form} build)")
        for node in self.state.nodes:
            for _ in range(per_node):
                self.add_pod(node.name)

    def install_cni(self, form: str = "auto") -> str:
        """Install the CNI executable and every node's conflist; returns the form installed."""
        installed = pods.install_executable(self.state, form)
        if any(node.runs_flanneld for node in self.state.nodes):
            pods.install_flannel_plugin(self.state)
        for node in self.state.nodes:
            pods.write_conflist(node)
        self.state.extra["cni_exec"] = installed
        self._save()
        return installed

    def add_pod(
        self,
        node: str,
        name: str | None = None,
        port_mappings: list[dict[str, Any]] | None = None,
        kube_pod: str | None = None,
    ) -> PodInfo:
        """A new pod on ``node`` through the real CNI executable (ADD of the node's conflist);
        ``kube_pod`` (namespace/name): with the kubelet's CNI_ARGS naming it so."""
        if "cni_exec" not in self.state.extra:
            self.install_cni()
        try:
            return pods.add_pod(self.state, node, name, port_mappings, kube_pod)
        finally:
            self._save()

    def delete_pod(self, name: str) -> None:
        try:
            pods.delete_pod(self.state, name)
        finally:
            self._save()

    @property
    def pods(self) -> list[PodInfo]:
        return list(self.state.pods)

    def pod(self, name: str) -> PodInfo:
        return self.state.pod(name)

    @classmethod
    def load(cls, name: str, lab_root: str = plan.LAB_ROOT) -> Lab:
        state = state_io.load(lab_dir(name, lab_root))
        if state is None:
            raise LabError(
                f"there is no lab {name!r}; start one with `flannelpy-lab up --name {name}`"
            )
        return cls(state)

    def down(self) -> None:
        down(self.state.name, os.path.dirname(self.state.lab_dir))

    def _save(self) -> None:
        state_io.save(self.state)

    # -- inspection -------------------------------------------------------

    @property
    def name(self) -> str:
        return self.state.name

    @property
    def etcd_endpoint(self) -> str:
        return self.state.etcd_endpoint

    @property
    def nodes(self) -> list[NodeInfo]:
        return list(self.state.nodes)

    def node(self, node: str) -> NodeInfo:
        return self.state.node(node)

    def status(self) -> dict[str, Any]:
        """The ``lab status --json`` document."""
        return status.collect(self.state)

    def exec(
        self, node: str, argv: list[str], check: bool = True, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the node's namespace, capturing text output."""
        return _run_checked(self.node(node).namespace, argv, check, timeout, f"node {node}")

    def ping(self, src_node: str, dst_node: str, attempts: int = 1) -> bool:
        """Does ``src_node`` reach ``dst_node`` over the overlay (cni0 address to cni0 address)?"""
        src, dst = self.node(src_node), self.node(dst_node)
        a, b = status.overlay_address(src), status.overlay_address(dst)
        return status.ping(src, _ip(a), _ip(b), attempts)

    def ping_underlay(self, src_node: str, dst_node: str) -> bool:
        src, dst = self.node(src_node), self.node(dst_node)
        return status.ping(src, str(src.ip), str(dst.ip))

    # -- agents' store and arguments ---------------------------------------

    def kubectl(
        self, *args: str, stdin: str | None = None, check: bool = True, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """The real kubectl, as cluster admin, against the lab's control plane (``--kube``);
        ``timeout`` bounds the process (give a ``--timeout`` of its own more room)."""
        self._require_control_plane()
        return control_plane.kubectl(self.state, *args, stdin=stdin, check=check, timeout=timeout)

    def sync_kube_net_conf(self) -> str:
        """Wait until the agents' file shows the ConfigMap's net-conf.json (the lab's
        projector keeps it in step, as the kubelet does a ConfigMap volume); returns it."""
        self._require_control_plane()
        return control_plane.sync_net_conf(self.state)

    def stop_kube_apiserver(self) -> None:
        """Stop the control plane's kube-apiserver (agents, etcd and the controller-manager
        keep running); ``start_kube_apiserver`` brings it back."""
        self._require_control_plane()
        control_plane.stop_apiserver(self.state, self._save)

    def start_kube_apiserver(self) -> float:
        """Start kube-apiserver again; returns the seconds until it was ready."""
        self._require_control_plane()
        return control_plane.start_apiserver(self.state, self._save)

    def bump_kube_etcd_revision(self, writes: int = 1) -> None:
        """Move the control plane's etcd revision on without touching any Kubernetes
        object (``flannelpy_lab.kube.bump_etcd_revision``)."""
        self._require_control_plane()
        control_plane.bump_etcd_revision(self.state, writes)

    def recreate_kube_node(self, node: str, pod_cidr: str) -> None:
        """Delete the node's Node and register it again with ``pod_cidr``, as an operator
        moves a node to another podCIDR; its agent keeps running."""
        self._require_control_plane()
        control_plane.recreate_node(self.state, self.node(node), pod_cidr)

    def _require_control_plane(self) -> None:
        if control_plane.STATE_KEY not in self.state.extra:
            raise LabError(
                f"lab {self.name} runs no Kubernetes control plane; start it "
                f"with `flannelpy-lab up --kube --name {self.name}`"
            )

    def set_agent_args(self, args: list[str]) -> None:
        """Extra flags for every agent started from now on (e.g. a shorter resync)."""
        self.state.extra["agent_args"] = list(args)
        self._save()

    def set_node_agent_args(self, node: str, args: list[str]) -> None:
        """Extra flags for ``node``'s agent alone, after the lab-wide ones (e.g.
        ``--cluster-name a``), from its next start; ``[]`` drops them."""
        self.node(node)
        self.state.extra.setdefault(agents.NODE_ARGS_KEY, {})[node] = list(args)
        self._save()

    def set_node_agent_source(self, node: str, source_root: str | None) -> None:
        """Run ``node``'s agent from another source tree, a directory holding
        ``flannelpy/`` (e.g. a previous release extracted with ``git archive``), from
        its next start; None: this flannelpy again. The tree is the caller's to remove."""
        self.node(node)
        sources = self.state.extra.setdefault(agents.NODE_SOURCE_KEY, {})
        if source_root is None:
            sources.pop(node, None)
        else:
            root = os.path.abspath(source_root)
            if not os.path.isfile(os.path.join(root, "flannelpy", "__main__.py")):
                raise LabError(
                    f"{root} holds no flannelpy package (no flannelpy/__main__.py); give "
                    "the directory that contains flannelpy/"
                )
            sources[node] = root
        self._save()

    def start_agents(self, timeout: float = agents.READY_TIMEOUT) -> None:
        """Start every node's agent and wait until all are ready."""
        for node in self.state.nodes:
            agents.start(self.state, node)
        self._save()
        wait_all_ready(self.state, self.state.nodes, timeout, _quiet, self._save)
        if prometheus.STATE_KEY in self.state.extra and not procs.alive(prometheus.ref(self.state)):
            prometheus.start(self.state)  # a lab built with start_agents=False
            self._save()

    # -- etcd -------------------------------------------------------------

    def stop_etcd(self) -> None:
        """Stop the lab's etcd, every member (an outage, for tests); agents keep running."""
        s = self.state
        if s.etcd_pid:
            procs.stop([procs.ProcessRef(s.etcd_pid, s.etcd_start_ticks or 0)])
        s.etcd_pid = s.etcd_start_ticks = None
        refs = [r for r in (etcd.member_ref(m) for m in s.etcd_members) if r]
        procs.stop(refs)
        for member in s.etcd_members:
            member.pid = member.start_ticks = None
        self._save()

    def start_etcd(self) -> None:
        """Start the lab's etcd again (every member) on the same addresses and data."""
        s = self.state
        if s.etcd_members:
            for member in s.etcd_members:
                if not procs.alive(etcd.member_ref(member)):
                    etcd.start_member(s, member)
            self._save()
            for member in s.etcd_members:
                etcd.wait_member_answering(s, member)
            return
        ref = etcd.start(s)
        s.etcd_pid, s.etcd_start_ticks = ref.pid, ref.start_ticks
        self._save()
        etcd.wait_answering(s, ref)

    @property
    def etcd_endpoints(self) -> list[str]:
        return self.state.etcd_endpoints

    def etcd_status(self) -> list[dict[str, Any]]:
        """Each etcd member's status (``etcd.cluster_status``); empty for a one-member lab."""
        return etcd.cluster_status(self.state)

    def etcd_leader(self) -> EtcdMemberInfo | None:
        """The member the majority follows; None while the cluster has no leader."""
        return etcd.leader(self.state)

    def kill_etcd_member(self, member: str, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to one member and wait until it has exited."""
        info = self.state.etcd_member(member)
        ref = etcd.member_ref(info)
        if ref is not None and procs.signal_process(ref, sig) and procs.wait_gone([ref], 10.0):
            raise LabError(f"etcd member {info.name} (pid {ref.pid}) survived signal {sig}")
        info.pid = info.start_ticks = None
        self._save()

    def start_etcd_member(self, member: str, wait: bool = True) -> None:
        """Start one member again on its data dir; with ``wait``, until it serves reads
        (which needs a majority of members up)."""
        info = self.state.etcd_member(member)
        if procs.alive(etcd.member_ref(info)):
            raise LabError(f"etcd member {info.name} runs already (pid {info.pid})")
        etcd.start_member(self.state, info)
        self._save()
        if wait:
            etcd.wait_member_answering(self.state, info)

    def exec_etcd_member(
        self, member: str, argv: list[str], check: bool = True, timeout: float = 30.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in a member's namespace (e.g. ``iptables`` to cut it off)."""
        info = self.state.etcd_member(member)
        return _run_checked(info.namespace, argv, check, timeout, f"etcd member {info.name}")

    # -- agents -----------------------------------------------------------

    def start_agent(self, node: str) -> NodeInfo:
        """Start the node's agent (it must not be running); does not wait for it."""
        info = self.node(node)
        if procs.alive(agents.agent_ref(info)):
            raise LabError(f"the agent of node {node} runs already (pid {info.agent_pid})")
        agents.start(self.state, info)
        self._save()
        return info

    def kill_agent(
        self, node: str, sig: int = signal.SIGTERM, wait: bool = True, timeout: float = 10.0
    ) -> None:
        """Send ``sig`` to the node's agent; with ``wait``, until it has exited."""
        info = self.node(node)
        ref = agents.agent_ref(info)
        if ref is None or not procs.signal_process(ref, sig):
            return
        if wait and procs.wait_gone([ref], timeout):
            raise LabError(
                f"the agent of node {node} (pid {ref.pid}) still runs {timeout:g} s after "
                f"signal {signal.Signals(sig).name}"
            )

    def wait_ready(self, node: str, timeout: float = agents.READY_TIMEOUT) -> NodeInfo:
        """Wait for the node's agent to write a fresh subnet.env; then set its overlay address."""
        info = self.node(node)
        deadline = time.monotonic() + timeout
        while True:
            env = agents.check_ready(info, self.state)
            if env is not None:
                on_ready(self.state, info, env, self._save)
                return info
            if time.monotonic() > deadline:
                raise agents.not_ready_error([info], timeout)
            time.sleep(0.1)

    def recreate_node(
        self, node: str, new_address: str | None = None, timeout: float = agents.READY_TIMEOUT
    ) -> NodeInfo:
        """Re-create a node as a new machine would be: new namespace, new underlay address.

        Keeps the node directory (subnet.env, agent state); restarts the agent
        and waits for it. ``new_address`` is an address in the node's segment
        (with or without prefix); by default the next free one from .100.
        """
        info = self.node(node)
        had_agent = info.agent_pid is not None
        ref = agents.agent_ref(info)
        if ref:
            procs.stop([ref])
        topology.delete_node(self.state, info)
        info.underlay_address = self._new_address(info, new_address)
        info.overlay_address = None
        self._save()
        topology.build_node(self.state, info)
        if had_agent:
            self.start_agent(node)
            self.wait_ready(node, timeout)
        return info

    def _new_address(self, info: NodeInfo, wanted: str | None) -> str:
        subnet = IPv4Network(self.state.segments[info.segment - 1].subnet)
        if wanted is None:
            used = [plan.host_number(n) for n in self.state.nodes]
            return str(plan.address(subnet, plan.next_free_host(used)))
        iface = IPv4Interface(wanted if "/" in wanted else f"{wanted}/{subnet.prefixlen}")
        taken = {n.ip for n in self.state.nodes if n.name != info.name}
        taken |= {m.ip for m in self.state.etcd_members}
        reserved = {subnet.network_address + h for h in (plan.ROUTER_HOST, plan.HOST_HOST)}
        if (
            iface.network != subnet
            or iface.ip in taken | reserved
            or iface.ip in (subnet.network_address, subnet.broadcast_address)
        ):
            raise ConfigError(f"address {wanted} is not a free host address of segment {subnet}")
        return str(iface)


def _ip(address: str | None) -> str | None:
    return address.split("/")[0] if address else None


def _run_checked(
    namespace: str, argv: list[str], check: bool, timeout: float, where: str
) -> subprocess.CompletedProcess[str]:
    proc = topology.run_in(namespace, argv, timeout)
    if check and proc.returncode != 0:
        raise LabError(
            f"`{' '.join(argv)}` on {where} exited with {proc.returncode}: "
            f"{(proc.stderr or proc.stdout).strip()[-500:]}"
        )
    return proc
