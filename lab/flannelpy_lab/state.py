"""The lab's record of itself: ``<lab dir>/state.json``.

Everything ``status``, ``down`` and other processes (tests, ``flannelpy-lab run``)
need is here, written atomically after every change so that a half-built lab
can still be torn down exactly. A file lock under the lab root serialises
address allocation between labs started at the same time.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields
from ipaddress import IPv4Address, IPv4Interface, IPv6Address, IPv6Interface
from typing import Any

from flannelpy_lab.errors import LabError

STATE_FILE = "state.json"
LOCK_FILE = ".lock"
KIND_FLANNELPY = "flannelpy"  # NodeInfo.agent_kind: our agent
KIND_FLANNELD = "flanneld"  # the real upstream flanneld (flannelpy_lab.flanneld)


@dataclass
class NodeInfo:
    """One lab node: its namespace, underlay, files and agent process."""

    name: str
    namespace: str
    segment: int  # 1 or 2
    underlay_iface: str  # inside the node namespace
    underlay_address: str  # "100.64.0.1/24"
    switch_port: str  # the veth peer's name in the switch namespace
    node_dir: str
    subnet_env: str
    agent_log: str
    agent_pid: int | None = None
    agent_start_ticks: int | None = None  # /proc start time: tells a reused pid apart
    agent_started_at: float | None = None  # unix time; an older subnet.env is stale
    overlay_address: str | None = None  # cni0's address, "10.244.3.1/24", once ready
    agent_kind: str = KIND_FLANNELPY  # what the node runs: KIND_FLANNELPY or KIND_FLANNELD

    @property
    def ip(self) -> IPv4Address:
        return IPv4Interface(self.underlay_address).ip

    @property
    def overlay_ip(self) -> IPv4Address | None:
        return IPv4Interface(self.overlay_address).ip if self.overlay_address else None

    @property
    def runs_flanneld(self) -> bool:
        return self.agent_kind == KIND_FLANNELD

    @property
    def run_dir(self) -> str:
        return os.path.join(self.node_dir, "run")

    @property
    def cni_socket(self) -> str:
        return os.path.join(self.run_dir, "cni.sock")

    @property
    def conflist(self) -> str:
        """The conflist a container runtime on this node reads (its /etc/cni/net.d)."""
        name = "10-flannel.conflist" if self.runs_flanneld else "10-flannelpy.conflist"
        return os.path.join(self.node_dir, "cni", "net.d", name)

    @property
    def cni_cache_dir(self) -> str:
        return os.path.join(self.node_dir, "cni", "cache")


@dataclass
class PodInfo:
    """A pod: a network namespace attached through the real CNI executable."""

    name: str  # unique in the lab, e.g. "n1-p1"
    node: str
    namespace: str  # its netns name, e.g. "fpl-demo-n1-p1"
    container_id: str
    ifname: str = "eth0"
    address: str | None = None  # "10.244.3.5/24", from the CNI result
    address6: str | None = None  # "fc00:0:0:3::5/64": the IPv6 one, on an IPv6-enabled node
    kube_pod: str | None = None  # "namespace/name" the runtime names it by (K8S_POD_* args)

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.namespace}"

    @property
    def ip(self) -> IPv4Address | None:
        return IPv4Interface(self.address).ip if self.address else None

    @property
    def ip6(self) -> IPv6Address | None:
        return IPv6Interface(self.address6).ip if self.address6 else None


@dataclass
class SegmentInfo:
    """One underlay L2 segment: a bridge in its own switch namespace."""

    index: int
    subnet: str
    switch_namespace: str
    bridge_mac: str
    router_address: str | None = None  # the router's leg, with two segments


@dataclass
class EtcdMemberInfo:
    """One member of a multi-member lab etcd: its own namespace on segment 1's switch."""

    name: str  # etcd's --name, "fpl-demo-e1"
    namespace: str
    switch_port: str
    underlay_iface: str
    underlay_address: str  # "100.64.0.241/24"
    client_url: str
    peer_url: str
    data_dir: str
    log: str
    pid: int | None = None
    start_ticks: int | None = None

    @property
    def ip(self) -> IPv4Address:
        return IPv4Interface(self.underlay_address).ip


@dataclass
class LabState:
    name: str
    backend: str
    direct_routing: bool
    network: str
    etcd_prefix: str
    lab_dir: str
    segments: list[SegmentInfo]
    router_namespace: str | None
    host_link: str  # host side of the veth into segment 1
    host_address: str  # its address, "100.64.0.254/24"
    host_routes: list[dict[str, str]]  # {"dst", "via"} added on the host
    etcd_endpoint: str  # with several members: the first member's client URL
    etcd_data_dir: str
    etcd_log: str
    overlay_bridge: bool  # the lab creates cni0 on each node once its agent is ready
    nodes: list[NodeInfo]
    etcd_pid: int | None = None
    etcd_start_ticks: int | None = None
    version: int = 1
    extra: dict[str, Any] = field(default_factory=dict)
    pods: list[PodInfo] = field(default_factory=list)
    # Empty: one etcd in the host namespace at etcd_endpoint (the default lab).
    etcd_members: list[EtcdMemberInfo] = field(default_factory=list)

    @property
    def etcd_endpoints(self) -> list[str]:
        """Every client URL of the lab's etcd, as agents are given them."""
        return [m.client_url for m in self.etcd_members] or [self.etcd_endpoint]

    def etcd_member(self, name: str) -> EtcdMemberInfo:
        for member in self.etcd_members:
            if member.name == name or member.namespace.endswith("-" + name):
                return member
        known = ", ".join(m.name for m in self.etcd_members) or "none (a one-member lab)"
        raise LabError(f"lab {self.name} has no etcd member {name!r}; its members are {known}")

    @property
    def cni_bin_dir(self) -> str:
        return os.path.join(self.lab_dir, "cni", "bin")

    @property
    def cni_path(self) -> str:
        """CNI_PATH on every lab node: our executable, then the reference plugins."""
        return f"{self.cni_bin_dir}:/usr/lib/cni"

    def pod(self, name: str) -> PodInfo:
        for pod in self.pods:
            if pod.name == name:
                return pod
        known = ", ".join(p.name for p in self.pods) or "none"
        raise LabError(f"lab {self.name} has no pod {name!r}; its pods are {known}")

    @property
    def state_path(self) -> str:
        return os.path.join(self.lab_dir, STATE_FILE)

    def node(self, name: str) -> NodeInfo:
        for node in self.nodes:
            if node.name == name:
                return node
        known = ", ".join(n.name for n in self.nodes)
        raise LabError(f"lab {self.name} has no node {name!r}; its nodes are {known}")

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, doc: dict[str, Any], source: str) -> LabState:
        try:
            data = _only_fields(cls, doc, source)
            data["segments"] = [
                SegmentInfo(**_only_fields(SegmentInfo, s, source)) for s in doc["segments"]
            ]
            data["nodes"] = [NodeInfo(**_only_fields(NodeInfo, n, source)) for n in doc["nodes"]]
            data["pods"] = [
                PodInfo(**_only_fields(PodInfo, p, source)) for p in doc.get("pods", [])
            ]
            data["etcd_members"] = [
                EtcdMemberInfo(**_only_fields(EtcdMemberInfo, m, source))
                for m in doc.get("etcd_members", [])
            ]
            return cls(**data)
        except (KeyError, TypeError) as e:
            raise LabError(f"{source} is not a lab state file ({e}); remove the lab by name") from e


def _only_fields(cls: type, doc: Any, source: str) -> dict[str, Any]:
    if not isinstance(doc, dict):
        raise LabError(f"{source} holds {type(doc).__name__} where an object was expected")
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in doc.items() if k in names}


def save(state: LabState) -> None:
    """Write state.json atomically (temp file + rename), so readers never see half a file."""
    os.makedirs(state.lab_dir, exist_ok=True)
    tmp = f"{state.state_path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(state.to_json())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, state.state_path)


def load(lab_dir: str) -> LabState | None:
    """The state in ``lab_dir``, or None if there is none."""
    path = os.path.join(lab_dir, STATE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    try:
        doc = json.loads(raw)
    except json.JSONDecodeError as e:
        raise LabError(f"{path} is not valid JSON ({e}); remove the lab by name") from e
    return LabState.from_dict(doc, path)


@contextmanager
def root_lock(lab_root: str) -> Iterator[None]:
    """Exclusive lock over all labs' allocation and host changes."""
    os.makedirs(lab_root, exist_ok=True)
    fd = os.open(os.path.join(lab_root, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
