"""The one writer: every input is an event on one queue, handled by one thread.

The writer owns ``NodeState`` and calls the concerns (own leases, planning,
capacity, live config, firewall, status). After each event it runs the
follow-ups the event may have made due, in a fixed order (recover lost leases,
the config decision, our lease's attributes, capacity), then publishes a fresh
``AgentView`` for readers on other threads. So a plan is always computed from
a whole state, never from fields another thread is halfway through changing.

During start-up the starting thread is the writer; ``NodeAgent`` hands the
role to its main loop once the node is ready.
"""

from __future__ import annotations

import logging
import queue
import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol

from flannelpy.agent.capacity import Capacity
from flannelpy.agent.events import (
    TICK_CAPACITY,
    TICK_FIREWALL,
    TICK_RENEW,
    TICK_STATUS,
    CapacityLow,
    ControlChanged,
    Event,
    EventCounts,
    LeaseLost,
    LeasesChanged,
    PolicyInputsChanged,
    ProbeReported,
    Tick,
    WireguardConfirmed,
    kind_of,
)
from flannelpy.agent.firewall_sync import FirewallSync
from flannelpy.agent.leases import OwnLeases
from flannelpy.agent.live_config import ConfigSwitch, LiveConfig
from flannelpy.agent.planning import Planner
from flannelpy.agent.state import AgentView, Clocks, NodeState, SayOnce
from flannelpy.agent.status import StatusReporter, write_node_subnet_env
from flannelpy.agent.vtep import VtepMac
from flannelpy.backend.base import Backend, NodeContext
from flannelpy.backend.wireguard_config import DEVICE_V6 as WG_DEVICE_V6
from flannelpy.backend.wireguard_runtime import WireguardRuntime
from flannelpy.cni.pods import PodSide
from flannelpy.config.settings import AgentSettings
from flannelpy.dataplane.kernel import Kernel
from flannelpy.dataplane.reconciler import PolicyRules, Reconciler, ReconcileResult
from flannelpy.errors import DataplaneError, StoreError
from flannelpy.ipam.capacity import CapacitySettings
from flannelpy.observe.health import Heartbeats
from flannelpy.observe.metrics import AgentMetrics, LinkProvider
from flannelpy.observe.probe_rounds import Transport
from flannelpy.observe.probe_verdict import ProbeResult
from flannelpy.store.open_store import StoreTraits
from flannelpy.subnet.lease import Lease
from flannelpy.subnet.manager import SubnetManager
from flannelpy.subnet.memo import LeaseSnapshot
from flannelpy.subnet.pools import Pool, primary_pools
from flannelpy.subnet.subnet_env import read_previous_subnets

if TYPE_CHECKING:
    # NetworkPolicy (off by default, Kubernetes mode): its compiler loads when it is on.
    from flannelpy.agent.netpol import NetworkPolicySync
    from flannelpy.control.node_control import ControlSnapshot, NodeControl
    from flannelpy.store.policy_inputs import PolicySource

log = logging.getLogger("flannelpy.agent.writer")

RETRY_PAUSE_SECONDS = 1.0  # after a failed follow-up, before the next try


class ProbeTransport(Transport, Protocol):
    def close(self) -> None: ...


# (overlay MTU provider, readiness provider) -> the CNI side
PodsFactory = Callable[[Callable[[], int], Callable[[], bool]], PodSide]


@dataclass
class AgentParts:
    """Every adapter the agent runs with, built by ``agent.compose`` (or fakes in tests)."""

    settings: AgentSettings
    manager: SubnetManager
    kernel: Kernel
    backend: Backend
    ctx: NodeContext
    pods: PodsFactory
    metrics: AgentMetrics = field(default_factory=AgentMetrics)
    control: NodeControl | None = None
    vtep_mac: str | None = None  # loaded once a VTEP is wanted (always with vxlan)
    firewall: FirewallSync | None = None  # None: no flag asks for masq or forward rules
    applied_generation: int | None = None
    pools: list[Pool] | None = None
    capacity: CapacitySettings | None = None
    probe_transport: Callable[[], ProbeTransport] | None = None  # raises DataplaneError
    link_stats: Callable[[str], LinkProvider] | None = None  # (underlay name) -> provider
    clocks: Clocks = field(default_factory=Clocks)
    ticker: bool = True  # False in tests, which put their own Tick events
    jitter: Callable[[], float] = random.random  # 0.0 .. 1.0: spreads the status heartbeat
    # The node's WireGuard key and devices (the reconciler applies the planned ones).
    wireguard: WireguardRuntime | None = None
    store_traits: StoreTraits = field(default_factory=StoreTraits)  # etcd's unless told
    # --enable-network-policy: the store's policy inputs and the kernel's policy table.
    policy_source: PolicySource | None = None
    policy_table: PolicyRules | None = None


class Writer:
    def __init__(self, parts: AgentParts, beats: Heartbeats) -> None:
        settings, metrics, clocks = parts.settings, parts.metrics, parts.clocks
        self.settings = settings
        self.store_traits = parts.store_traits
        self.metrics = metrics
        self.clocks = clocks
        self.beats = beats
        self.queue: queue.Queue[Event] = queue.Queue()
        self.counts = EventCounts()
        self.state = s = NodeState(
            backend=parts.backend,
            ctx=parts.ctx,
            pools=list(parts.pools or primary_pools(parts.ctx.config)),
            capacity=parts.capacity or CapacitySettings(),
            known_devices=set(parts.backend.device_names(parts.ctx)),
            applied_generation=parts.applied_generation,
            applied_at=clocks.wall(),
        )
        self.view: AgentView = s.view()
        self.loops_running = False  # heartbeats exist from then on
        self._pause_until = 0.0
        say_once = SayOnce(log)
        self.reconciler = Reconciler(
            parts.kernel,
            settings.resync_interval,
            self.on_reconciled,
            metrics.reconcile_error,
            wireguard=parts.wireguard,
            firewall=parts.firewall,
            policy=parts.policy_table,
        )
        self.netpol: NetworkPolicySync | None = None
        if parts.policy_source is not None:
            from flannelpy.agent.netpol import NetworkPolicySync

            self.netpol = NetworkPolicySync(s, parts.policy_source, self.queue.put)
        self.kernel = parts.kernel
        vtep = VtepMac(parts.kernel, settings.state_dir, parts.vtep_mac)
        self.leases = OwnLeases(
            s,
            parts.manager,
            vtep,
            metrics,
            settings.cluster_name,
            settings.subnet_lease_renew_margin * 60.0,
            clocks,
        )
        self.planner = Planner(s, self.reconciler, vtep, metrics, clocks.monotonic)
        self.planner.undecodable = parts.manager.undecodable
        self.firewall = parts.firewall
        s.rules_in_place = parts.firewall is None
        self.status = StatusReporter(
            settings,
            s,
            lambda: self.view,
            self.reconciler,
            self.counts,
            parts.control,
            clocks,
            parts.jitter,
        )
        self.pods = parts.pods(lambda: self.view.mtu, lambda: self.view.ready)
        self.capacity, self.live = self._capacity_and_live_config(parts, say_once)

    def _capacity_and_live_config(
        self, parts: AgentParts, say_once: SayOnce
    ) -> tuple[Capacity, LiveConfig]:
        settings, s = self.settings, self.state
        capacity = Capacity(
            s,
            self.leases,
            parts.manager,
            self.pods,
            self.metrics,
            self.counts,
            say_once,
            cluster=settings.cluster_name,
            several_leases_per_node=parts.store_traits.several_leases_per_node,
            on_low_free=self.on_low_free,
            clocks=self.clocks,
        )
        live = LiveConfig(
            s,
            settings,
            parts.control,
            metrics=self.metrics,
            say_once=say_once,
            clocks=self.clocks,
            wireguard=parts.wireguard,
            store_traits=parts.store_traits,
        )
        return capacity, live

    # -- producers: any thread --------------------------------------------------------

    def on_leases(self, leases: Mapping[str, Lease], revision: int) -> None:
        self.queue.put(LeasesChanged(leases, revision))  # the store's own snapshot: no copy

    def on_control(self, snapshot: ControlSnapshot) -> None:
        self.queue.put(ControlChanged(snapshot))

    def on_probes(self, results: Sequence[tuple[str, ProbeResult]]) -> None:
        """The rounds one prober tick finished: one event for all of them."""
        self.queue.put(ProbeReported(tuple(results)))

    def on_low_free(self, free: int) -> None:
        """IPAM's warning, from a CNI request's thread: only enqueue."""
        self.queue.put(CapacityLow(free))

    def on_wireguard_confirmed(self, device: str, keys: frozenset[str]) -> None:
        """A WireGuard device's callback, on its thread: only enqueue."""
        self.queue.put(WireguardConfirmed(keys, ipv6=device == WG_DEVICE_V6))

    def on_reconciled(self, result: ReconcileResult) -> None:
        """The reconciler's callback, on its thread: metrics, status.json."""
        self.metrics.observe_reconcile(result)
        if self.loops_running:  # the start reconcile comes before the heartbeats exist
            self.beats.beat("reconciler")
        self.status.write_file(result)

    # -- the writer -------------------------------------------------------------------

    def publish_view(self) -> None:
        if self.firewall is not None:  # what the reconciler's last firewall step left
            self.state.rules_in_place = self.firewall.in_place
        self.view = self.state.view()

    def handle(self, event: Event, settle: bool = True) -> None:
        """Act on one event, then (``settle``) on whatever it made due."""
        s = self.state
        # Probe results change nothing readers see; they arrive every prober tick, so
        # the view (which walks every lease) is rebuilt for it only if follow-ups ran.
        refresh = not isinstance(event, ProbeReported) or (settle and self.pending())
        if isinstance(event, LeasesChanged):
            if self.leases.take_snapshot(event.leases):
                self.queue.put(LeaseLost())
            self.planner.replan()
            s.first_snapshot = True
        elif isinstance(event, LeaseLost):
            s.lease_lost = True
        elif isinstance(event, ControlChanged):
            self.live.take(event.snapshot)
        elif isinstance(event, ProbeReported):
            prober = self.planner.prober
            for key, r in event.results:
                self.status.probe_seen(key)
                # A round that began before its peer left is not reported: the peer's
                # series went when it left (Planner.follow_peers).
                if prober is None or prober.follows(key):
                    self.metrics.probe(key, r.reachable, r.rtt_seconds, r.loss_ratio, r.mtu_ok)
        elif isinstance(event, CapacityLow):
            s.capacity_due = True
        elif isinstance(event, WireguardConfirmed):
            ctx = (
                replace(s.ctx, wireguard_confirmed_v6=event.keys)
                if event.ipv6
                else replace(s.ctx, wireguard_confirmed=event.keys)
            )
            if ctx != s.ctx:
                s.ctx = ctx
                self.planner.replan()  # held pairs move to the tunnel, the VTEP may go
        elif isinstance(event, PolicyInputsChanged):
            if self.netpol is not None and self.netpol.take():
                s.policy_due = True  # the new table reaches the reconciler with the plan
        elif isinstance(event, Tick):
            self._on_tick(event.name)
        if settle:
            self.settle()
        if refresh:
            self.publish_view()
        kind = kind_of(event)
        if kind is not None:
            self.counts.handled(kind)
            self.metrics.agent_event(kind)

    def _on_tick(self, name: str) -> None:
        if name == TICK_STATUS:
            self.beats.beat("status")
            self.status.write_file(self.reconciler.last_result, self.state.view())
            self.status.publish()
        elif name == TICK_CAPACITY:
            self.state.capacity_due = True
        elif name == TICK_RENEW:
            self.leases.renew_due()
        elif name == TICK_FIREWALL:
            self.beats.beat("firewall")
            if self.reconciler.resync_firewall():
                self.counts.firewall_resynced()  # tests wait on it rather than on the clock
        # TICK_CONTROL: settle() looks at a blocked or failed change when it is due.

    def pending(self) -> bool:
        s = self.state
        return (
            s.lease_lost
            or s.attrs_dirty
            or s.capacity_due
            or self.live.due()
            or self.planner.linger_over()
            or s.replan_due
            or s.policy_due
            or s.subnet_env_due
            or s.status_due
        )

    def settle(self) -> None:
        """The follow-ups, in order; a failed one pauses them all briefly."""
        s = self.state
        if self.clocks.monotonic() < self._pause_until:
            return
        if s.lease_lost:
            s.lease_lost = False
            try:
                self._recover_lost_leases()
            except StoreError as e:
                log.warning("re-acquiring the lease failed, retrying: %s", e)
                s.lease_lost = True
                self._pause()
                return
        switch = self.live.run_if_due()
        if switch is not None:
            self._finish_switch(switch)
        if self.planner.linger_over():
            self.planner.replan()  # a device that left the plan goes now
        if s.attrs_dirty:
            s.attrs_dirty = False
            if not self.leases.rewrite_attrs():
                s.attrs_dirty = True
                self._pause()
        if s.capacity_due:
            try:
                self.capacity.manage()
            except (StoreError, DataplaneError, OSError) as e:
                log.warning("lease capacity check failed, retrying: %s", e)
                s.capacity_due = True
                self._pause()
        self._follow_up()

    def _finish_switch(self, switch: ConfigSwitch) -> None:
        """Every step after a switch of backend or MTU, in order and each idempotent: a
        step that fails leaves the switch unfinished, and the next try runs them all."""
        s = self.state
        try:
            self.planner.replan()
            # CNI requests and the bridge take the new MTU from here on, and the prober the
            # replanned paths': switching back from wireguard, the kept device's while pairs
            # still run through it (a view from before the plan would probe at the new MTU
            # over those pairs, and lose the probe).
            self.publish_view()
            result = self.reconciler.reconcile_once("config change")
            if not self.leases.rewrite_attrs():
                s.attrs_dirty = True
                raise StoreError("could not advertise the new backend on our lease; retrying")
            mtu = s.backend.mtu(s.ctx)
            self.metrics.overlay_mtu(mtu)
            self.capacity.sync_ipam(again=True)  # the bridge takes its new MTU
            self.write_subnet_env()
        except Exception:
            self.live.failed_to_apply()
            return
        self.live.finished(switch, mtu, result.converged if result else None)

    def _follow_up(self) -> None:
        """What the steps above asked of the others, in one order: a new plan (routes and
        the firewall's ranges), then subnet.env, then the status record."""
        s = self.state
        if s.replan_due:
            s.replan_due = s.policy_due = False
            self.planner.replan()  # with the policy table too
        elif s.policy_due:
            s.policy_due = False
            self.planner.replan_policy()
        if s.subnet_env_due:
            s.subnet_env_due = False
            self.write_subnet_env()
        if s.status_due:
            s.status_due = False
            self.status.write_file(self.reconciler.last_result, s.view())
            self.status.publish(force=True)

    def _pause(self) -> None:
        self._pause_until = self.clocks.monotonic() + RETRY_PAUSE_SECONDS

    def _recover_lost_leases(self) -> None:
        recovery = self.leases.recover_lost()
        if not recovery.changed:
            return
        s = self.state
        s.replan_due = True
        if recovery.first_moved_from is not None or recovery.forgotten:
            # Pods on an old subnet keep their addresses on disk; new pods use the new one.
            s.capacity_due = True
            s.subnet_env_due = s.subnet_env_due or recovery.first_moved_from is not None

    def write_subnet_env(self) -> None:
        write_node_subnet_env(self.state, self.settings, self.capacity.serves)

    def run(self, stop_is_set: Callable[[], bool]) -> None:
        """The main loop: drain the queue until stopped (a Stop event wakes it)."""
        self.settle()  # whatever arrived while the node started
        self.publish_view()
        while not stop_is_set():
            try:
                event = self.queue.get(timeout=0.5)
            except queue.Empty:
                if self.pending():  # a follow-up waits for its retry pause to end
                    self.settle()
                    self.publish_view()
                continue
            for each in self.take_queued(event):
                self.handle(each)

    def take_queued(self, first: Event) -> list[Event]:
        """``first`` and whatever else waits on the queue, in order, less the lease lists
        that a newer one replaces: each carries every lease, so a burst of watch events
        that arrived while the writer planned costs one plan, not one each. The skipped
        ones are counted as handled (the newest one stands for them)."""
        events = [first]
        while True:
            try:
                events.append(self.queue.get_nowait())
            except queue.Empty:
                break
        lists = [e for e in events if isinstance(e, LeasesChanged)]
        newest = lists[-1] if lists else None
        if newest is not None and isinstance(newest.leases, LeaseSnapshot):
            # The newest follows what the skipped ones followed (their keys changed too).
            for earlier in reversed(lists[:-1]):
                newest.leases.absorb(earlier.leases)
        kept = [e for e in events if not isinstance(e, LeasesChanged) or e is newest]
        for _ in range(len(events) - len(kept)):
            self.counts.handled("leases")
            self.metrics.agent_event("leases")
        return kept

    # -- start-up steps (the starting thread is the writer then) -------------------------

    def acquire_first(self) -> Lease:
        lease = self.leases.acquire(*read_previous_subnets(self.settings.subnet_file))
        self.state.own = [lease]
        self.publish_view()
        return lease

    def wait_first_snapshot(self, timeout: float) -> None:
        """Handle events until the first full lease list is in (never program an empty
        peer set over a live one). Follow-ups wait for the main loop."""
        deadline = time.monotonic() + timeout
        while not self.state.first_snapshot:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StoreError(
                    f"no lease list from the store within {timeout:.0f} s; "
                    "check that the store is reachable and healthy"
                )
            try:
                event = self.queue.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                continue
            self.handle(event, settle=False)

    def after_first_snapshot(self) -> None:
        if self.store_traits.several_leases_per_node:  # leases outlive a restart
            self.leases.adopt(self.planner.bounds())
            self.planner.replan()
        self.capacity.manage()  # may add a lease (warm capacity, a drained pool)
        self.publish_view()

    def become_ready(self, result: ReconcileResult | None) -> None:
        # Ready before subnet.env appears: runtimes (and the lab) take subnet.env as the
        # sign that ADD works, so nothing may be left to do once it is written.
        self.state.ready = True
        self.publish_view()
        self.write_subnet_env()
        self.publish_view()
        self.status.write_file(result, self.view)
        self.status.publish(force=True)
