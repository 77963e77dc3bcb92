"""The node agent's lifecycle: start order, supervised threads, shutdown.

Start-up order matters and is the whole of ``NodeAgent.start``: everything that
can be refused was refused by ``agent.compose`` before the host changed; then
leave the effective settings in the run dir (for the doctor); acquire our lease;
wait for the first full lease snapshot (never program an empty peer set over a
live one); adopt our other leases; capacity; one synchronous reconcile (devices,
routes, then the firewall's rules); the loops; the CNI server; ready; only then
subnet.env. After that the writer (``agent.writer``) is the only thread that
changes the node's state; the others (lease, control and policy watches, reconciler,
kernel event watch, prober, ticker) feed it events, all under one stop event: when
one of them dies, all stop within a grace period.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from flannelpy.agent.capacity import CAPACITY_TICK
from flannelpy.agent.events import (
    TICK_CAPACITY,
    TICK_CONTROL,
    TICK_FIREWALL,
    TICK_RENEW,
    TICK_STATUS,
    Stop,
    Tick,
)
from flannelpy.agent.live_config import CONTROL_RETRY_SECONDS
from flannelpy.agent.planning import probe_source6
from flannelpy.agent.writer import AgentParts, ProbeTransport, Writer
from flannelpy.config.effective import write_effective
from flannelpy.dataplane.kernel import Kernel
from flannelpy.errors import DataplaneError
from flannelpy.heap import release_free_memory
from flannelpy.observe import kernel_counters
from flannelpy.observe.health import HealthServer, Heartbeats
from flannelpy.observe.prober import Prober

log = logging.getLogger("flannelpy.agent.node")

FIRST_SNAPSHOT_TIMEOUT = 30.0  # seconds to wait for the first lease list after acquiring
THREAD_GRACE_SECONDS = 5.0
STATUS_INTERVAL_SECONDS = 2.0  # how often <run-dir>/status.json is refreshed
RENEW_TICK_SECONDS = 5.0  # how often the writer looks for a lease due for renewal


class NodeAgent:
    def __init__(self, parts: AgentParts) -> None:
        self.parts = parts
        self.settings = parts.settings
        self.metrics = parts.metrics
        self.manager = parts.manager
        self.beats = Heartbeats()
        self.writer = Writer(parts, self.beats)
        if parts.wireguard is not None:  # its handshakes decide when a pair leaves vxlan
            parts.wireguard.on_confirmed = self.writer.on_wireguard_confirmed
        self.stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._servers: list[HealthServer] = []
        self._probe_transport: ProbeTransport | None = None
        self._failure: BaseException | None = None

    @property
    def ready(self) -> bool:
        return self.writer.view.ready

    def start(self) -> None:
        w, parts = self.writer, self.parts
        self._write_effective_settings()
        self.metrics.overlay_mtu(w.state.mtu)
        if parts.link_stats is not None:  # a real kernel: its counters too
            self.metrics.set_link_provider(parts.link_stats(parts.ctx.underlay.name))
            counters = kernel_counters.for_agent(self.settings.state_dir)
            self.metrics.set_kernel_provider(counters)
            w.pods.add_listener(counters.on_cni)  # keeps each pod's table open while it lives
        self.metrics.set_ipam_provider(w.pods.ipam.accounting)
        if w.netpol is not None and parts.policy_table is not None:
            netpol, table = w.netpol, parts.policy_table
            self.metrics.set_policy_provider(lambda: netpol.reading(table.counters))
            w.pods.add_listener(netpol.on_cni)  # pods attached before their Pod is read
        self._start_servers()
        lease = w.acquire_first()
        ensure_ip_forwarding(parts.kernel)
        if parts.ctx.config.enable_ipv6:
            ensure_ip_forwarding(parts.kernel, ipv6=True)
        w.capacity.sync_ipam()
        self._spawn("lease-watch", lambda stop: self.manager.watch_leases(w.on_leases, stop))
        if parts.control is not None:
            control = parts.control
            self._spawn("control-watch", lambda stop: control.watch(w.on_control, stop))
        if w.netpol is not None:  # until its first full sync the kernel's table is kept
            netpol = w.netpol
            self._spawn("policy-watch", lambda stop: netpol.source.watch(netpol.changed, stop))
        w.wait_first_snapshot(FIRST_SNAPSHOT_TIMEOUT)
        w.after_first_snapshot()
        result = w.reconciler.reconcile_once("start")
        if result is not None and not result.converged:
            log.warning("initial reconcile incomplete failures=%d", len(result.failures))
        w.publish_view()
        # Liveness: each loop must turn within a few of its periods.
        self.beats.register("reconciler", self.settings.resync_interval * 3 + 5)
        self.beats.register("status", STATUS_INTERVAL_SECONDS * 5 + 5)
        if parts.firewall is not None:
            self.beats.register("firewall", self.settings.iptables_resync * 3 + 5)
        w.loops_running = True
        self._spawn("reconciler", w.reconciler.run)
        self._spawn("kernel-watch", lambda stop: parts.kernel.watch(w.reconciler.trigger, stop))
        if parts.ticker:
            self._spawn("ticker", self._tick)
        self._start_prober()
        w.pods.start()
        self.beats.add_check("cni-server", w.pods.serving)  # /healthz covers its accept loop
        # What the start parsed and planned all at once (the lease list, the first plan's
        # temporaries) is garbage now; its free pages go back before we say ready.
        release_free_memory()
        w.become_ready(result)
        log.info(
            "agent ready subnet=%s mtu=%s program_seconds=%.3f",
            lease.subnet,
            w.state.mtu,
            result.duration_seconds if result else 0.0,
        )

    def _write_effective_settings(self) -> None:
        """<run-dir>/settings.json, for the doctor run on this node without flags."""
        ctx = self.parts.ctx
        try:
            write_effective(self.settings, ctx.node_name, ctx.underlay.name)
        except OSError as e:  # only a convenience for commands; the agent runs on
            log.warning(
                "cannot write the effective settings run_dir=%s: %s", self.settings.run_dir, e
            )

    def run_until_stopped(self) -> None:
        """The writer's loop on this thread until stopped, then shutdown."""
        try:
            self.writer.run(self.stop.is_set)
        except BaseException as e:
            log.exception("task failed task=writer")
            self._failure = self._failure or e
        finally:
            self.shutdown()
        if self._failure is not None:
            raise self._failure

    def shutdown(self) -> None:
        """Stop loops; leave the data plane and the lease in place (a restart must not
        disturb traffic, and the lease is reused by PublicIP)."""
        self.stop.set()
        self.writer.queue.put(Stop())
        self.writer.reconciler.trigger("stopping")  # wakes its loop, which then sees stop
        self.writer.pods.stop()
        if self._probe_transport is not None:
            self._probe_transport.close()
        for server in self._servers:
            server.stop()
        deadline = time.monotonic() + THREAD_GRACE_SECONDS
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                log.warning("task did not stop in time task=%s", thread.name)
        self.manager.close()

    def _spawn(self, name: str, target: Callable[[threading.Event], None]) -> None:
        def supervised() -> None:
            try:
                target(self.stop)
            except BaseException as e:  # a root task died: stop them all
                if not self.stop.is_set():
                    log.exception("task failed task=%s", name)
                    self._failure = e
                    self.stop.set()
                    self.writer.queue.put(Stop())

        thread = threading.Thread(target=supervised, name=name, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _start_servers(self) -> None:
        """/metrics, /healthz and /readyz: on --metrics-addr, and on Flannel's
        --healthz-ip/--healthz-port when set (what the DaemonSet's probes use). Up before
        the lease, so liveness holds while we wait for the store or a podCIDR."""
        addrs = []
        if self.settings.metrics_addr:  # None: --metrics-addr=off
            addrs.append(self.settings.metrics_addr)
        if self.settings.healthz_port:
            addrs.append(f"{self.settings.healthz_ip}:{self.settings.healthz_port}")
        healthz = f"{self.settings.healthz_ip}:{self.settings.healthz_port}"
        for addr in addrs:
            # The healthz port listens on every address (hostNetwork): metrics only if asked.
            metrics_here = addr != healthz or self.settings.healthz_metrics
            server = HealthServer(
                addr,
                self.metrics.registry,
                self.writer.status.readiness,
                self.beats.live,
                serve_metrics=metrics_here,
            )
            server.start()
            self._servers.append(server)

    def _start_prober(self) -> None:
        if self.parts.probe_transport is None:
            return
        try:
            transport = self.parts.probe_transport()
        except DataplaneError as e:
            log.warning("peer prober disabled: %s", e)
            return
        self._probe_transport = transport
        w = self.writer
        prober = Prober(
            transport,
            mtu_provider=lambda: w.view.probe_mtu,
            own_address_provider=lambda: lease.gateway if (lease := w.view.lease) else None,
            own_address6_provider=lambda: probe_source6(w.view.ctx, w.view.lease),
            interval_seconds=self.settings.probe_interval,
            timeout_seconds=min(1.0, self.settings.probe_interval / 2),
            peers_per_interval=self.settings.probe_peers_per_interval,
            on_results=w.on_probes,
        )
        w.planner.prober = w.status.prober = prober
        w.planner.follow_peers()  # the peers known so far; no replan: the plan is current
        self._spawn("prober", prober.run)

    def _tick(self, stop: threading.Event) -> None:
        """Timer events for the writer: what must be looked at again without an input."""
        periods = {
            TICK_STATUS: STATUS_INTERVAL_SECONDS,
            TICK_CAPACITY: CAPACITY_TICK,
            TICK_RENEW: RENEW_TICK_SECONDS,
            TICK_CONTROL: CONTROL_RETRY_SECONDS,
        }
        if self.parts.firewall is not None:
            periods[TICK_FIREWALL] = self.settings.iptables_resync
        now = time.monotonic()
        due = {name: now + period for name, period in periods.items()}
        while not stop.wait(max(0.0, min(due.values()) - time.monotonic())):
            now = time.monotonic()
            for name, at in due.items():
                if at <= now:
                    self.writer.queue.put(Tick(name))
                    due[name] = now + periods[name]


def ensure_ip_forwarding(kernel: Kernel, ipv6: bool = False) -> None:
    """Pods' traffic is routed through the node. The kernel writes the sysctl only when it
    is off: in an unprivileged container /proc/sys is read-only, and kubeadm requires it on."""
    name = "net.ipv6.conf.all.forwarding" if ipv6 else "net.ipv4.ip_forward"
    try:
        kernel.set_sysctl(name, "1")
    except DataplaneError as e:
        raise DataplaneError(
            f"IPv{6 if ipv6 else 4} forwarding is off on this node and cannot be turned on "
            f"from here ({e}); set {name}=1 on the node"
        ) from e
