"""Simulated agents for rollout tests: they follow the store contract, not the kernel.

Each tick, a simulated node reads the network config, its override and the rollout
record as a real agent does (in Kubernetes mode, ``kube_mode``, not the record: each
agent checks the policy itself), decides with the agent's own pure function
(:func:`flannelpy.control.change.decide_change`) whether to apply the wanted Backend,
block it per the disruption policy, or apply it forced (keeping the record the agent
would write, in ``forced``), and publishes a status with a VTEP per the transition rule and
one probe result per peer: reachable when the path rule finds a path between the
two nodes' running backends, unless the test breaks that pair. Works over any
Store (FakeStore in unit tests, etcd in integration tests).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from ipaddress import IPv4Address, IPv4Network

from flannelpy.backend.paths import NodeView, pairs_without_path
from flannelpy.config.netconf import VXLAN_ENCAP_OVERHEAD, BackendConfig
from flannelpy.control.change import decide_change, wanted_config
from flannelpy.control.records import (
    BackendSummary,
    BlockedChange,
    ForceRecord,
    NodeOverride,
    NodeStatus,
    PeerProbe,
    ProbeSummary,
)
from flannelpy.store.etcd.kv import Store
from flannelpy.subnet.keys import config_key, override_key, rollout_key, status_key

UNDERLAY_MTU = 1500


def config_json(backend: Mapping[str, object], policy: Mapping[str, object] | None = None) -> str:
    doc: dict[str, object] = {"Network": "10.244.0.0/16", "Backend": backend}
    if policy is not None:
        doc["DisruptionPolicy"] = policy
    return json.dumps(doc)


@dataclass
class SimNode:
    name: str
    ip: str
    segment: str  # the underlay network, e.g. "100.64.0.0/24"
    subnet: str
    running: BackendConfig = field(default_factory=BackendConfig)
    applied_generation: int | None = None
    applied_at: float = 0.0
    blocked: BlockedChange | None = None
    ready: bool = True
    ignore_type: str | None = None  # never apply this backend type (an apply timeout)
    probes: dict[str, PeerProbe] = field(default_factory=dict)
    started: bool = False

    def mtu(self, backend: BackendConfig | None = None) -> int:
        b = backend or self.running
        return (b.mtu or UNDERLAY_MTU) - (VXLAN_ENCAP_OVERHEAD if b.type == "vxlan" else 0)


def five_nodes(two_segments: bool = False) -> list[SimNode]:
    """n1..n5 on 100.64.0.0/24; with ``two_segments`` n4 and n5 on 100.64.1.0/24."""
    nodes = []
    for i in range(1, 6):
        seg = 1 if two_segments and i >= 4 else 0
        nodes.append(
            SimNode(f"n{i}", f"100.64.{seg}.{i + 1}", f"100.64.{seg}.0/24", f"10.244.{i}.0/24")
        )
    return nodes


class SimCluster:
    def __init__(
        self,
        store: Store,
        prefix: str,
        nodes: Sequence[SimNode],
        clock: Callable[[], float],
        policy_clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        kube_mode: bool = False,
    ) -> None:
        self.store = store
        self.kube_mode = kube_mode
        self.forced: list[tuple[str, str, ForceRecord]] = []  # what agents record
        self.prefix = prefix
        self.nodes = {n.name: n for n in nodes}
        self.clock = clock
        self.policy_clock = policy_clock
        self.broken: set[frozenset[str]] = set()  # pairs whose probes fail
        self.lost: list[tuple[str, str]] = []  # (from, to) of every failed probe round
        self.stuck_vteps: set[str] = set()  # nodes that never drop their VTEP
        self.lock = threading.Lock()

    def node(self, name: str) -> SimNode:
        return self.nodes[name]

    def break_pairs(self, node: str, peers: Iterable[str]) -> None:
        self.broken.update(frozenset((node, p)) for p in peers)

    # -- one round ---------------------------------------------------------------

    def tick(self) -> None:
        with self.lock:
            kv = self.store.get(config_key(self.prefix))
            assert kv is not None, "write the network config first"
            record_kv = self.store.get(rollout_key(self.prefix))
            record = json.loads(record_kv.value) if record_kv else None
            if self.kube_mode:
                record = None  # a Kubernetes-mode agent never reads the rollout record
            # Probe rounds reflect the paths before this round's changes: a change is
            # verified by the rounds that follow it, as with a real prober.
            for node in self.nodes.values():
                self._probe(node, self.nodes)
            for node in self.nodes.values():
                self._follow(node, kv.value, record)
            for node in self.nodes.values():
                self.store.put(
                    status_key(self.prefix, node.name), self._status(node).to_json().encode()
                )

    def _follow(self, node: SimNode, config_raw: bytes, record: dict | None) -> None:
        kv = self.store.get(override_key(self.prefix, node.name))
        override = NodeOverride.from_json(kv.value) if kv else None
        wanted_cfg = wanted_config(config_raw, override)
        wanted = wanted_cfg.backend
        generation = override.generation if override else None
        if not node.started:  # first start: run what we are told, no policy involved
            node.running, node.started = wanted, True
            node.applied_generation, node.applied_at = generation, self.clock()
            return
        if node.ignore_type == wanted.type:
            return
        decision = decide_change(
            replace(wanted_cfg, backend=node.running),
            node.mtu(),
            wanted_cfg,
            node.mtu(wanted),
            override,
            record,
            self.policy_clock(),
        )
        if decision.action == "block":
            node.blocked = BlockedChange(
                generation, ", ".join(decision.changes), decision.sentence or "", self.clock()
            )
            return
        if decision.forced is not None and (node.name, decision.forced) not in {
            (n, f) for n, _, f in self.forced
        }:
            self.forced.append((node.name, ", ".join(decision.changes), decision.forced))
        node.blocked = None
        if wanted != node.running or generation != node.applied_generation:
            node.running = wanted
            node.applied_generation = generation
            node.applied_at = self.clock()

    def _has_vtep(self, node: SimNode, statuses: dict[str, SimNode]) -> bool:
        if node.name in self.stuck_vteps:
            return True
        return node.running.type == "vxlan" or any(
            p.running.type == "vxlan" for p in statuses.values() if p.name != node.name
        )

    def _view(self, node: SimNode, statuses: dict[str, SimNode]) -> NodeView:
        return NodeView(
            node.name,
            IPv4Address(node.ip),
            (IPv4Network(node.segment),),
            node.running,
            self._has_vtep(node, statuses),
        )

    def _probe(self, node: SimNode, statuses: dict[str, SimNode]) -> None:
        for peer in statuses.values():
            if peer.name == node.name:
                continue
            no_path = pairs_without_path([self._view(node, statuses), self._view(peer, statuses)])
            ok = not no_path and frozenset((node.name, peer.name)) not in self.broken
            if not ok:
                self.lost.append((node.name, peer.name))
            before = node.probes.get(peer.subnet)
            node.probes[peer.subnet] = PeerProbe(
                reachable=ok,
                mtu_ok=ok,
                ok=ok,
                probes=(before.probes if before else 0) + 1,
                at=self.clock(),
            )

    def _status(self, node: SimNode) -> NodeStatus:
        return NodeStatus(
            node=node.name,
            at=self.clock(),
            ready=node.ready,
            public_ip=node.ip,
            underlay_networks=(node.segment,),
            backend=BackendSummary.of(node.running, node.mtu()),
            vtep=self._has_vtep(node, self.nodes),
            applied_generation=node.applied_generation,
            applied_at=node.applied_at,
            blocked=node.blocked,
            subnets=(node.subnet,),
            probes=ProbeSummary.of(node.probes),
        )


class AgentThreads:
    """Ticks a SimCluster every ``interval`` seconds in a thread (integration tests)."""

    def __init__(self, cluster: SimCluster, interval: float = 0.05) -> None:
        self.cluster = cluster
        self.interval = interval
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.thread = threading.Thread(target=self._run, name="sim-agents", daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.cluster.tick()
            except Exception as e:  # reported by the test
                self.errors.append(e)
            self.stop.wait(self.interval)

    def __enter__(self) -> AgentThreads:
        self.cluster.tick()
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)
