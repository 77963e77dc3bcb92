"""The lab's etcd: one member in the host namespace, on the host's lab address, or
(``--etcd-members 3``) a static cluster whose members each run in a namespace of their
own on segment 1's switch, so a test can kill one or cut it off with a firewall rule
inside its namespace.

Listening only on the lab address keeps it off the machine's other interfaces
and lets several labs run side by side (each has its own address). Clients
here disable gRPC's HTTP proxy support: a proxy from the environment would
carry lab traffic out of the machine.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from ipaddress import IPv4Network
from typing import Any
from urllib.parse import urlsplit

import pyetcd
from pyetcd import etcdrpc

from flannelpy.subnet.keys import key_to_subnet
from flannelpy.subnet.lease import LeaseAttrs
from flannelpy_lab import plan, procs, topology
from flannelpy_lab.errors import LabError
from flannelpy_lab.state import EtcdMemberInfo, LabState

START_TIMEOUT = 20.0  # seconds for etcd to answer after start
RPC_TIMEOUT = 2.0  # seconds per request
GRPC_OPTIONS = [("grpc.enable_http_proxy", 0)]


def _binary() -> str:
    binary = shutil.which("etcd")
    if binary is None:
        raise LabError("etcd is not on PATH; install an etcd server (3.4 or newer)")
    return binary


def etcd_argv(state: LabState) -> list[str]:
    binary = _binary()
    host = urlsplit(state.etcd_endpoint).hostname
    peer = f"http://{host}:2380"
    return [
        binary,
        "--name", f"fpl-{state.name}",
        "--data-dir", state.etcd_data_dir,
        "--listen-client-urls", state.etcd_endpoint,
        "--advertise-client-urls", state.etcd_endpoint,
        "--listen-peer-urls", peer,
        "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"fpl-{state.name}={peer}",
        "--initial-cluster-state", "new",
        "--logger", "zap",
        "--log-outputs", "stderr",
        "--log-level", "warn",
    ]  # fmt: skip


def member_argv(state: LabState, member: EtcdMemberInfo) -> list[str]:
    """One member of the lab's static cluster, run inside its namespace. ``ip netns exec``
    execs etcd, so the pid started is etcd's own."""
    return topology.exec_argv(member.namespace, [
        _binary(),
        "--name", member.name,
        "--data-dir", member.data_dir,
        "--listen-client-urls", member.client_url,
        "--advertise-client-urls", member.client_url,
        "--listen-peer-urls", member.peer_url,
        "--initial-advertise-peer-urls", member.peer_url,
        "--initial-cluster", plan.initial_cluster(state.etcd_members),
        # A lab-unique token: a member never joins another lab's cluster by mistake.
        "--initial-cluster-token", f"fpl-{state.name}",
        "--initial-cluster-state", "new",
        # etcd 3.5's default: a member back from a partition rejoins without forcing
        # an election (it still drops its leader while cut off, so watches move).
        "--pre-vote",
        "--logger", "zap",
        "--log-outputs", "stderr",
        "--log-level", "warn",
    ])  # fmt: skip


def start(state: LabState) -> procs.ProcessRef:
    os.makedirs(state.lab_dir, exist_ok=True)
    return procs.spawn_detached(etcd_argv(state), state.etcd_log)


def start_member(state: LabState, member: EtcdMemberInfo) -> procs.ProcessRef:
    os.makedirs(os.path.dirname(member.data_dir), exist_ok=True)
    ref = procs.spawn_detached(member_argv(state, member), member.log)
    member.pid, member.start_ticks = ref.pid, ref.start_ticks
    return ref


def member_ref(member: EtcdMemberInfo) -> procs.ProcessRef | None:
    return procs.ref_of(member.pid, member.start_ticks)


@contextmanager
def client(endpoint: str, timeout: float = RPC_TIMEOUT) -> Iterator[Any]:
    url = urlsplit(endpoint)
    c = pyetcd.client(
        host=url.hostname, port=url.port or 2379, timeout=timeout, grpc_options=GRPC_OPTIONS
    )
    try:
        yield c
    finally:
        c.close()


def wait_answering(
    state: LabState,
    ref: procs.ProcessRef,
    timeout: float = START_TIMEOUT,
    endpoint: str | None = None,
    log_path: str | None = None,
) -> None:
    """Return once etcd (at ``endpoint``, by default the lab's) serves a linearizable read,
    which needs a leader; fail early, with its log, if it exits."""
    endpoint = endpoint or state.etcd_endpoint
    log_path = log_path or state.etcd_log
    deadline = time.monotonic() + timeout
    last: Exception | None = None
    while time.monotonic() < deadline:
        if not procs.alive(ref):
            raise LabError(
                f"etcd exited during start; last lines of {log_path}:\n" + procs.log_tail(log_path)
            )
        # A fresh client per try: pyetcd shuns an endpoint for minutes after one failure.
        try:
            with client(endpoint, timeout=1.0) as c:
                c.get(f"{state.etcd_prefix}/config")
            return
        except Exception as e:  # pyetcd raises several unrelated types while starting
            last = e
            time.sleep(0.2)
    raise LabError(
        f"etcd at {endpoint} did not answer within {timeout:g} s ({last}); see {log_path}"
    )


def wait_member_answering(
    state: LabState, member: EtcdMemberInfo, timeout: float = START_TIMEOUT
) -> None:
    ref = member_ref(member)
    if ref is None:
        raise LabError(f"etcd member {member.name} is not running; start it first")
    wait_answering(state, ref, timeout, member.client_url, member.log)


def _endpoint_list(endpoints: str | Sequence[str]) -> list[str]:
    return [endpoints] if isinstance(endpoints, str) else list(endpoints)


def _on_any(endpoints: str | Sequence[str], fn: Any) -> Any:
    """``fn(client)`` on the first endpoint that answers; the last error if none does."""
    last: Exception | None = None
    for endpoint in _endpoint_list(endpoints):
        try:
            with client(endpoint) as c:
                return fn(c)
        except Exception as e:  # pyetcd's errors share no base worth naming
            last = e
    assert last is not None
    raise last


def put_config(state: LabState, config_json: str) -> None:
    _on_any(state.etcd_endpoints, lambda c: c.put(f"{state.etcd_prefix}/config", config_json))


def read_leases(endpoints: str | Sequence[str], prefix: str) -> list[dict[str, Any]]:
    """Every lease under ``<prefix>/subnets/`` as a JSON-ready dict, sorted by subnet,
    read from the first of ``endpoints`` that answers."""
    subnets_prefix = f"{prefix.rstrip('/')}/subnets/"

    def read(c: Any) -> list[dict[str, Any]]:
        leases = []
        for value, meta in c.get_prefix(subnets_prefix):
            key = meta.key.decode()[len(subnets_prefix) :]
            leases.append(_lease_doc(key, value))
        return leases

    return sorted(_on_any(endpoints, read), key=_sort_key)


def read_lease_values(endpoints: str | Sequence[str], prefix: str) -> dict[str, bytes]:
    """Every value under ``<prefix>/subnets/`` as stored, by key suffix (the bytes
    flanneld would read)."""
    subnets_prefix = f"{prefix.rstrip('/')}/subnets/"

    def read(c: Any) -> dict[str, bytes]:
        return {
            meta.key.decode()[len(subnets_prefix) :]: bytes(value)
            for value, meta in c.get_prefix(subnets_prefix)
        }

    result: dict[str, bytes] = _on_any(endpoints, read)
    return result


def member_status(member: EtcdMemberInfo, timeout: float = 1.0) -> dict[str, Any]:
    """What ``lab status`` shows of one member: running, its id, the leader it sees."""
    doc: dict[str, Any] = {
        "name": member.name,
        "namespace": member.namespace,
        "client_url": member.client_url,
        "pid": member.pid,
        "running": procs.alive(member_ref(member)),
        "id": None,
        "leader_id": None,
        "raft_term": None,
        "error": None,
    }
    if not doc["running"]:
        return doc
    try:
        # Maintenance.Status, not pyetcd's status(): that one also lists the members,
        # which a member cut off from the leader cannot answer.
        with client(member.client_url, timeout) as c:
            resp = c.maintenancestub.Status(etcdrpc.StatusRequest(), timeout, metadata=c.metadata)
        doc.update(
            id=f"{resp.header.member_id:x}",
            leader_id=f"{resp.leader:x}",
            raft_term=int(resp.raftTerm),
        )
    except Exception as e:  # pyetcd/gRPC errors share no base worth naming
        doc["error"] = str(e) or type(e).__name__
    return doc


def cluster_status(state: LabState) -> list[dict[str, Any]]:
    """Every member's status, each marked ``leader`` when a majority-side member names it."""
    return mark_leader([member_status(m) for m in state.etcd_members])


def mark_leader(docs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Set ``leader`` on the member a majority of all members names as leader (a member
    cut off from the rest may still name an old one; without a majority: none)."""
    leader_ids = [d["leader_id"] for d in docs if d["leader_id"] not in (None, "0")]
    leader = max(set(leader_ids), key=leader_ids.count) if leader_ids else None
    if leader is not None and leader_ids.count(leader) * 2 <= len(docs):
        leader = None
    for d in docs:
        d["leader"] = d["id"] is not None and d["id"] == leader
    return docs


def leader(state: LabState) -> EtcdMemberInfo | None:
    """The member the cluster's majority follows, None while there is no leader."""
    for member, doc in zip(state.etcd_members, cluster_status(state), strict=True):
        if doc["leader"]:
            return member
    return None


def _lease_doc(key: str, value: bytes) -> dict[str, Any]:
    doc: dict[str, Any] = dict.fromkeys(("subnet", "public_ip", "backend", "node_name", "error"))
    doc["key"] = key
    try:
        subnet, subnet6 = key_to_subnet(key)
        attrs = LeaseAttrs.from_json(value)
    except ValueError as e:
        doc["error"] = str(e)
        return doc
    doc.update(
        subnet=str(subnet) if subnet is not None else None,  # None: IPv6-only
        ipv6_subnet=str(subnet6) if subnet6 is not None else None,
        public_ip=str(attrs.public_ip) if attrs.public_ip is not None else None,
        backend=attrs.backend_type,
        node_name=attrs.node_name,
        backend_data=dict(attrs.backend_data) if attrs.backend_data else None,
        public_ipv6=str(attrs.public_ipv6) if attrs.public_ipv6 is not None else None,
    )
    return doc


def _sort_key(doc: dict[str, Any]) -> tuple[int, int, str]:
    subnet = doc["subnet"]
    if subnet is None:  # undecodable, or IPv6-only (by key)
        return (1, 0, doc["key"])
    return (0, int(IPv4Network(subnet).network_address), doc["key"])
