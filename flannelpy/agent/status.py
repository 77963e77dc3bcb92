"""What the node tells others: status.json, its status record in the store, readiness
and subnet.env.

The store record is a budget shared by the whole cluster (etcd keeps every revision
until compaction). It is written at once when something an operator acts on changes
(backend, generation, readiness, a blocked change, the set of failing peers), else as
a heartbeat every ``--status-publish-interval`` (jittered, so restarted nodes do not
write together). Probe round counters and times are left out of the change test: they
move every round. Only while a change settles or a rollout is in progress does the
record follow the probe rounds, so the rollout can verify each step.

status.json and readiness are read from any thread (the reconciler's callback,
the HTTP servers); they use only the writer's published ``AgentView``. The
store record and subnet.env are written by the writer alone.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict
from ipaddress import IPv4Interface, IPv6Interface
from typing import TYPE_CHECKING

from flannelpy.agent.events import EventCounts
from flannelpy.agent.probe_tally import ProbeTally
from flannelpy.agent.state import AgentView, Clocks, NodeState
from flannelpy.config.netconf import NetworkConfig
from flannelpy.config.settings import AgentSettings
from flannelpy.control.records import (
    BackendSummary,
    NodeStatus,
    PeerProbe,
)
from flannelpy.dataplane.reconciler import Reconciler, ReconcileResult
from flannelpy.errors import StoreError
from flannelpy.fsutil import rewrite
from flannelpy.observe.health import readiness
from flannelpy.observe.probe_verdict import ProbeResult
from flannelpy.observe.prober import Prober
from flannelpy.subnet.lease import Lease
from flannelpy.subnet.subnet_env import SubnetEnv, write_subnet_env

if TYPE_CHECKING:
    from flannelpy.control.node_control import NodeControl

log = logging.getLogger("flannelpy.agent.status")

STATUS_FILE = "status.json"  # in --run-dir
TRANSITION_SECONDS = 60.0  # after a change, the store status follows every probe round
HEARTBEAT_JITTER = 0.2  # a heartbeat comes 80-100 % of the publish interval after a write


def backend_doc(config: NetworkConfig) -> Mapping[str, object]:
    """The Backend object of a config, as written (``{}`` when it was left out)."""
    return next((v for k, v in config.raw.items() if k.lower() == "backend"), None) or {}


class StatusReporter:
    def __init__(
        self,
        settings: AgentSettings,
        state: NodeState,
        view: Callable[[], AgentView],
        reconciler: Reconciler,
        counts: EventCounts,
        control: NodeControl | None,
        clocks: Clocks,
        jitter: Callable[[], float] = random.random,
    ) -> None:
        self.settings = settings
        self._state = state  # read by the writer's own calls only
        self._view = view  # the published copy, for every other thread
        self._reconciler = reconciler
        self._counts = counts
        self._control = control
        self._clocks = clocks
        self.prober: Prober | None = None  # set once it runs
        self._file_lock = threading.Lock()  # the reconciler's thread and the writer write it
        self._file_text = ""  # what the file holds (written by this process)
        self._probes = ProbesJson()
        self._jitter = jitter  # 0.0 .. 1.0
        self._probe_at: dict[str, float] = {}  # peer key -> its latest round (wall clock)
        self._passed_at: dict[str, float] = {}  # peer key -> its latest passing round
        self._seen: set[str] = set()  # peers with a round seen since the last node_status()
        # peer key -> (its result, when seen) behind its entry in the tally
        self._peer_probe_memo: dict[str, tuple[ProbeResult, float | None]] = {}
        self._tally = ProbeTally()  # every peer's PeerProbe and the summary of them
        self._failing_copy: tuple[int, frozenset[tuple[str, str]]] = (-1, frozenset())
        # the last record written: (what counts as a change: the record less its time and
        # probe summary, and the whole failing set), the whole record less its time
        self._written: tuple[tuple[str, frozenset[tuple[str, str]]], str] = (
            ("", frozenset()),
            "",
        )
        self._written_at = float("-inf")  # monotonic
        self._heartbeat_due = float("-inf")  # monotonic

    # -- any thread ---------------------------------------------------------------------

    def readiness(self) -> tuple[bool, str]:
        view = self._view()
        return readiness(
            lease_held=bool(view.own),
            subnet_env_written=view.subnet_env_written,
            last_reconcile=self._reconciler.last_result,
            rules_in_place=view.rules_in_place,
        )

    def write_file(self, result: ReconcileResult | None, view: AgentView | None = None) -> None:
        """A small JSON file for `lab status` and operators: what this node holds and lacks.
        The writer passes its current view; other threads get the published one."""
        view = view or self._view()
        doc = {
            "node": view.ctx.node_name,
            "backend": view.backend.type_name,
            # Each lease by its IPv4 subnet (IPv6-only: its IPv6 subnet).
            "lease": str(view.own[0].primary_subnet) if view.own else None,
            "leases": [str(x.primary_subnet) for x in view.own],
            "public_ip": str(view.ctx.public_ip),
            "mtu": view.mtu,
            "peers": view.peers,
            "unreachable": [
                {"subnet": str(u.subnet), "public_ip": str(u.public_ip), "reason": u.reason}
                for u in sorted(view.unreachable, key=lambda u: u.subnet)
            ],
            # peer leases refused before they reached the kernel (the doctor lists them)
            "rejected_leases": [{"key": r.key, "reason": r.reason} for r in view.rejected[:100]],
            # --enable-network-policy: synced or not, object counts, refusals (None: off)
            "network_policy": asdict(view.policy) if view.policy is not None else None,
            "converged": result.converged if result else None,
            "failures": list(result.failures[:20]) if result else [],
            "last_reconcile": result.finished_at if result else None,
            "ready": view.ready,
            "ip_masq": self.settings.ip_masq,
            "iptables_forward_rules": self.settings.iptables_forward_rules,
            "backend_config": backend_doc(view.ctx.config),
            "applied_generation": view.applied_generation,
            "blocked": [
                {
                    "change": b.change,
                    "sentence": b.sentence,
                    "since": b.since,
                    "generation": b.generation,
                }
                for b in ([view.blocked] if view.blocked else [])
            ],
            "vtep": view.vtep,
            "mtu_mismatch": [
                {"subnet": str(p.subnet), "public_ip": str(p.public_ip), "mtu": p.advertised}
                for p in view.mtu_mismatched
            ],
            "events": self._counts.events(),
            "capacity_checks": self._counts.capacity_checks,
            "firewall_resyncs": self._counts.firewall_resyncs,
        }
        with self._file_lock:
            text = self._probes.splice(json.dumps(doc, separators=(",", ":")), self.prober)
            if text == self._file_text:
                return  # the file holds it already
            rewrite(os.path.join(self.settings.run_dir, STATUS_FILE), text)
            self._file_text = text

    # -- the writer only ------------------------------------------------------------------

    def probe_seen(self, key: str) -> None:
        self._probe_at[key] = self._clocks.wall()
        self._seen.add(key)

    def _peer_probes(self) -> ProbeTally:
        """The prober's latest results with the times the writer saw them, in the tally;
        remembers each peer's latest passing round (both echoes answered) for
        ``passed_at``. A result changes only with a round the writer is told of
        (``probe_seen``), so while the prober's peer set stays the same, only the peers
        seen since the last call are looked at: a call costs the rounds that came in,
        not every peer. A peer that joined or left has every entry looked at."""
        results = self.prober.results() if self.prober is not None else {}
        tally, memo = self._tally, self._peer_probe_memo
        if results.keys() == tally.probes.keys():
            keys: set[str] | Mapping[str, ProbeResult] = self._seen & results.keys()
        else:
            for gone in tally.probes.keys() - results.keys():
                tally.drop(gone)
                del memo[gone]
                self._passed_at.pop(gone, None)
                self._probe_at.pop(gone, None)
            keys = results
        self._seen = set()
        for key in keys:
            r, at = results[key], self._probe_at.get(key)
            hit = memo.get(key)
            if hit is None or hit[0] is not r or hit[1] != at:
                memo[key] = (r, at)
                tally.set(key, self._peer_probe(key, r, at))
        return tally

    def _peer_probe(self, key: str, r: ProbeResult, at: float | None) -> PeerProbe:
        ok = r.reachable and r.last_error is None and r.mtu_ok is not False
        if at is not None and ok and r.mtu_ok is True:
            self._passed_at[key] = max(at, self._passed_at.get(key, at))
        return PeerProbe(
            reachable=r.reachable,
            mtu_ok=r.mtu_ok,
            ok=ok,
            probes=r.probes,
            at=at or 0.0,
            passed_at=self._passed_at.get(key),
        )

    def node_status(self) -> NodeStatus:
        view = self._state.view()
        ctx = view.ctx
        tally = self._peer_probes()
        return NodeStatus(
            node=ctx.node_name,
            at=self._clocks.wall(),
            ready=view.ready,
            public_ip=str(ctx.public_ip),
            underlay_networks=tuple(str(n) for n in ctx.underlay.networks),
            backend=BackendSummary.of(ctx.config.backend, view.mtu),
            vtep=view.vtep,
            applied_generation=view.applied_generation,
            applied_at=view.applied_at,
            blocked=view.blocked,
            # Both families' subnets: the rollout verifies the probes of each.
            subnets=tuple(str(net) for x in view.own for net in x.subnets),
            probes=tally.summary(),
            public_ipv6=str(ctx.public_ipv6) if ctx.public_ipv6 is not None else None,
            heartbeat_seconds=self.settings.status_publish_interval,
        )

    def _fingerprints(
        self, status: NodeStatus
    ) -> tuple[tuple[str, frozenset[tuple[str, str]]], str]:
        """(what an operator acts on: the record less its time and probe summary, and the
        whole failing set; the whole record less its time)."""
        doc = json.loads(status.to_json())
        doc.pop("At")
        whole = json.dumps(doc, sort_keys=True)
        doc.pop("ProbeSummary")
        tally = self._tally
        if self._failing_copy[0] != tally.failing_version:  # copied once per change
            self._failing_copy = (tally.failing_version, frozenset(tally.failing.items()))
        return (json.dumps(doc, sort_keys=True), self._failing_copy[1]), whole

    def _following_rounds(self) -> bool:
        """A change settles or a rollout verifies its steps: the record follows probe rounds."""
        if self._clocks.wall() - self._state.applied_at < TRANSITION_SECONDS:
            return True
        return self._control is not None and self._control.rollout_in_progress()

    def publish(self, force: bool = False) -> None:
        """Write our status record: at once when something an operator acts on changed,
        after probe rounds while a change settles or a rollout runs, else as a heartbeat."""
        if self._control is None:
            return
        status = self.node_status()
        changes, whole = self._fingerprints(status)
        now = self._clocks.monotonic()
        fresher = (
            whole != self._written[1]
            and now - self._written_at >= self.settings.probe_interval
            and self._following_rounds()
        )
        if not (force or changes != self._written[0] or now >= self._heartbeat_due or fresher):
            return
        try:
            self._control.publish_status(status)
        except StoreError as e:
            log.debug("status not published: %s", e)
            return
        self._written, self._written_at = (changes, whole), now
        interval = self.settings.status_publish_interval
        self._heartbeat_due = now + interval * (1 - HEARTBEAT_JITTER * self._jitter())


class ProbesJson:
    """The ``probes`` member of status.json, each peer's result rendered once: the prober
    keeps the result object of a peer until its next round, so of a thousand peers only
    the few with a new round are rendered again. Used under the file lock."""

    def __init__(self) -> None:
        self._texts: dict[str, tuple[ProbeResult, str]] = {}
        # the results last rendered (the prober's mapping, the same until one changes)
        self._results: Mapping[str, ProbeResult] | None = None
        self._probes = ""  # their rendering

    def splice(self, doc_json: str, prober: Prober | None) -> str:
        """``doc_json`` (a JSON object) with ``"probes": {peer: result}`` as its last member."""
        results = prober.results() if prober is not None else {}
        if results is not self._results:
            old, texts = self._texts, {}
            for key, result in results.items():
                hit = old.get(key)
                if hit is None or hit[0] is not result:
                    hit = (result, f"{json.dumps(key)}:{json.dumps(result.as_status())}")
                texts[key] = hit
            self._texts, self._results = texts, results
            self._probes = ",".join(text for _, text in texts.values())
        return f'{doc_json[:-1]},"probes":{{{self._probes}}}}}\n'


def write_node_subnet_env(
    state: NodeState, settings: AgentSettings, serves: Callable[[Lease], bool]
) -> None:
    """Flannel's subnet.env names one subnet: our first lease that takes new pods."""
    own = state.own
    assert own
    lease = next((x for x in own if serves(x)), own[0])
    v6 = lease.ipv6_subnet if state.config.enable_ipv6 else None
    v4 = lease.subnet if state.config.network is not None else None
    env = SubnetEnv(  # IPv6-only: no FLANNEL_NETWORK / FLANNEL_SUBNET, as Flannel writes it
        network=state.config.network if v4 is not None else None,
        subnet=IPv4Interface(f"{lease.gateway}/{v4.prefixlen}") if v4 is not None else None,
        mtu=state.mtu,
        ipmasq=settings.ip_masq,
        ipv6_network=state.config.ipv6_network if v6 is not None else None,
        ipv6_subnet=IPv6Interface(f"{lease.gateway6}/{v6.prefixlen}") if v6 else None,
    )
    write_subnet_env(settings.subnet_file, env)
    state.subnet_env_written = True
