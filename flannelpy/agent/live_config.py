"""Live config: compare what this node is told to run with what it runs, and decide per
the disruption policy (apply, block, or say a restart is needed).

It decides and switches the node's state in memory; what must follow a switch
(a new plan, a reconcile pass, the lease's attributes, IPAM and subnet.env) is the
writer's to run, in its order: ``run_if_due`` returns the switch still to finish, and
the writer calls :meth:`LiveConfig.finished` once every step succeeded.

What was applied is remembered in ``<state-dir>/applied-backend.json``, so a
restart keeps the backend this node last applied: a change that arrived
meanwhile still goes through the policy, like any live change.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from flannelpy.agent.state import Clocks, NodeState, SayOnce
from flannelpy.agent.status import backend_doc
from flannelpy.backend.base import Backend, NodeContext
from flannelpy.backend.registry import get_backend
from flannelpy.backend.wireguard_config import parse_wireguard_config
from flannelpy.backend.wireguard_runtime import WireguardRuntime
from flannelpy.config.netconf import NetworkConfig
from flannelpy.config.settings import AgentSettings
from flannelpy.control.change import ChangeDecision, decide_change, wanted_config
from flannelpy.control.records import BackendSummary, BlockedChange, NodeOverride
from flannelpy.errors import ConfigError, StoreError
from flannelpy.fsutil import atomic_write
from flannelpy.ipam.capacity import parse_capacity
from flannelpy.observe.metrics import AgentMetrics
from flannelpy.store.open_store import StoreTraits
from flannelpy.subnet.pools import Pool, records_to_pools

if TYPE_CHECKING:
    from flannelpy.control.node_control import ControlSnapshot, NodeControl

log = logging.getLogger("flannelpy.agent.live_config")

BLOCKED_RECHECK_SECONDS = 30.0  # a blocked change is looked at again this often (windows open)
CONTROL_RETRY_SECONDS = 5.0  # a config change whose application failed is retried this often
APPLIED_FILE = "applied-backend.json"  # in --state-dir: the Backend this node last applied


class LiveConfig:
    def __init__(
        self,
        state: NodeState,
        settings: AgentSettings,
        control: NodeControl | None,
        *,
        metrics: AgentMetrics,
        say_once: SayOnce,
        clocks: Clocks,
        wireguard: WireguardRuntime | None = None,
        store_traits: StoreTraits | None = None,
    ) -> None:
        self.state = state
        self.settings = settings
        self.control = control
        self.metrics = metrics
        self.say_once = say_once
        self.clocks = clocks
        self.store_traits = store_traits or StoreTraits()
        self.wireguard = wireguard
        self.snapshot: ControlSnapshot | None = None
        self.pending = False  # a snapshot not looked at yet
        self.failed = False  # the last application raised: retry
        self._last_check = clocks.monotonic()
        self._blocked_counted: set[tuple[int | None, tuple[str, ...]]] = set()
        self._unfinished: ConfigSwitch | None = None  # switched to, not every step done yet

    def take(self, snapshot: ControlSnapshot) -> None:
        self.snapshot = snapshot
        self.pending = True

    def due(self) -> bool:
        since = self.clocks.monotonic() - self._last_check
        return self.pending or (
            (self.state.blocked is not None and since >= BLOCKED_RECHECK_SECONDS)
            or (self.failed and since >= CONTROL_RETRY_SECONDS)
        )

    def run_if_due(self) -> ConfigSwitch | None:
        """Look at the latest snapshot when due; the switch the writer must finish (a new
        one, or one whose steps failed before and no newer change replaced), if any."""
        if not self.due():
            return None
        self.pending = False
        self._last_check = self.clocks.monotonic()
        try:
            self.evaluate()
        except Exception:
            self.failed_to_apply()
            return None
        self.failed = False
        return self._unfinished

    def failed_to_apply(self) -> None:
        # Like a failed reconcile pass: a retry follows (it finishes a change already
        # switched to, else looks again), and the log has the cause.
        log.exception("applying the network config failed; retrying")
        self.failed = True

    def evaluate(self) -> None:
        """Compare what we are told to run with what we run, and act per the policy."""
        snap = self.snapshot
        s = self.state
        if snap is None or snap.config is None:
            return
        if snap.override_error:
            self.say_once(
                snap.override_error, "ignoring this node's override: %s", snap.override_error
            )
        self._take_pools(snap)
        try:
            wanted = wanted_config(snap.config, snap.override)
            backend = get_backend(wanted.backend.type)
            if (wanted.network is None) != (s.config.network is None):
                raise ConfigError("EnableIPv4 or Network changed; restart the agent to apply it")
            if (wanted.enable_ipv6, wanted.ipv6_network) != (
                s.config.enable_ipv6,
                s.config.ipv6_network,
            ):
                raise ConfigError(
                    "EnableIPv6 or IPv6Network changed; restart the agent to apply it"
                )
        except (ConfigError, ValueError) as e:
            self.say_once(f"config:{e}", "not applying the new network config: %s", e)
            return
        ctx = replace(s.ctx, config=wanted)
        generation = snap.override.generation if snap.override else None
        try:
            decision = decide_change(
                s.config,
                s.mtu,
                wanted,
                backend.mtu(ctx),
                snap.override,
                snap.rollout,
                datetime.fromtimestamp(self.clocks.wall(), UTC),
                self.store_traits.config_remedy,
            )
        except ConfigError as e:  # e.g. a DisruptionPolicy that does not parse
            self.say_once(f"config:{e}", "not applying the new network config: %s", e)
            return
        if decision.action == "restart-needed":
            self.say_once(f"restart:{wanted.raw}", "%s", decision.sentence)
            return
        if decision.action == "block":
            self._block(decision, generation)
            return
        if s.blocked is not None:
            log.info("blocked change no longer pending change=%s", s.blocked.change)
            s.blocked = None
        if decision.action == "apply":
            self._apply(wanted, ctx, backend, decision, snap.override)
        if generation != s.applied_generation and self._unfinished is None:
            s.applied_generation = generation
            s.applied_at = self.clocks.wall()
            s.status_due = True

    def _take_pools(self, snap: ControlSnapshot) -> None:
        """Pool records and warm-capacity settings apply at once (never disruptive)."""
        if not self.store_traits.several_leases_per_node:
            return  # Kubernetes mode: one podCIDR per node, no pools
        s = self.state
        pools, ignored = records_to_pools(s.config, snap.pools, self.settings.etcd_prefix)
        for problem in ignored:
            self.say_once(f"pool:{problem}", "ignoring an address pool record: %s", problem)
        capacity = s.capacity
        if snap.config is not None:
            try:
                capacity = parse_capacity(json.loads(snap.config))
            except (ConfigError, ValueError) as e:
                self.say_once(f"capacity:{e}", "keeping the warm-capacity settings: %s", e)
        if pools != s.pools or capacity != s.capacity:
            if pools != s.pools:
                log.info("address pools changed pools=%s", pool_summary(pools))
            s.pools = pools
            s.capacity = capacity
            self.metrics.lease_limit(capacity.max_leases_per_node)
            s.capacity_due = True  # IPAM's low-free watch follows the new settings there
            s.replan_due = True  # the firewall's ranges follow the pools

    def _block(self, decision: ChangeDecision, generation: int | None) -> None:
        s = self.state
        change = ", ".join(decision.changes)
        key = (generation, decision.changes)
        if key not in self._blocked_counted:
            self._blocked_counted.add(key)
            self.metrics.blocked_operation("backend_change")
            log.warning("%s", decision.sentence)
        if s.blocked is None or s.blocked.change != change:
            s.blocked = BlockedChange(
                generation, change, decision.sentence or "", self.clocks.wall()
            )
            s.status_due = True
            if self.control is not None:  # a block starting (again) is one occurrence
                try:
                    self.control.record_blocked(s.ctx.node_name, change, s.blocked.sentence)
                except StoreError as e:
                    log.warning("could not record the blocked change: %s", e)

    def _apply(
        self,
        wanted: NetworkConfig,
        ctx: NodeContext,
        backend: Backend,
        decision: ChangeDecision,
        override: NodeOverride | None,
    ) -> None:
        s = self.state
        if backend.type_name == "wireguard":
            # Load the key (and choose kernel or userspace) before anything switches:
            # planning takes it from the context.
            if self.wireguard is None:
                raise ConfigError("this agent has no WireGuard runtime; restart it to switch")
            options = parse_wireguard_config(wanted.backend)
            ctx = replace(ctx, wireguard_identity=self.wireguard.prepare(options))
        if decision.forced is not None:
            log.warning(
                "disruptive change forced past the disruption policy change=%r reason=%r by=%s",
                ", ".join(decision.changes),
                decision.forced.reason,
                decision.forced.by,
            )
            if self.control is not None:
                try:
                    self.control.record_forced(
                        s.ctx.node_name, ", ".join(decision.changes), decision.forced
                    )
                except StoreError as e:
                    log.warning("could not record the forced change in the store: %s", e)
        target = ConfigSwitch(
            wanted,
            override.generation if override else None,
            decision.changes,
            self._unfinished.before
            if self._unfinished
            else BackendSummary.of(s.config.backend, s.mtu),
        )
        s.backend = backend
        s.ctx = ctx
        s.known_devices.update(backend.device_names(ctx))
        # From the switch on, the change is pending until every step has succeeded: a
        # step that raises leaves it for the next retry, which runs them all again.
        self._unfinished = target

    def finished(self, target: ConfigSwitch, mtu: int, converged: bool | None) -> None:
        """Every step after the switch succeeded: the applied state (generation,
        applied-backend.json) moves now, and only now."""
        s = self.state
        save_applied(self.settings.state_dir, target.config, target.generation)
        s.applied_generation = target.generation
        s.applied_at = self.clocks.wall()
        self._unfinished = None
        after = BackendSummary.of(target.config.backend, mtu)
        if target.changes:
            log.info(
                "backend changed from=%s to=%s generation=%s converged=%s",
                target.before.describe(),
                after.describe(),
                target.generation,
                converged,
            )
        else:
            log.info("network config change applied backend=%s", after.describe())
        s.status_due = True


@dataclass(frozen=True)
class ConfigSwitch:
    """A change switched to in memory whose steps have not all succeeded yet."""

    config: NetworkConfig
    generation: int | None
    changes: tuple[str, ...]
    before: BackendSummary  # what the node ran before the switch, for the log


def save_applied(state_dir: str, config: NetworkConfig, generation: int | None) -> None:
    doc = {"Backend": backend_doc(config), "Generation": generation or 0}
    atomic_write(Path(state_dir) / APPLIED_FILE, json.dumps(doc), durable=True)


def load_applied(state_dir: str) -> NodeOverride | None:
    """The Backend this node last applied, in the form of an override."""
    try:
        return NodeOverride.from_json((Path(state_dir) / APPLIED_FILE).read_bytes())
    except FileNotFoundError:
        return None
    except ValueError as e:
        log.warning("ignoring %s: %s", APPLIED_FILE, e)
        return None


def pool_summary(pools: Sequence[Pool]) -> str:
    return ", ".join(
        f"{p.network}"
        + (f"[{','.join(f'{k}={v}' for k, v in sorted(p.tags.items()))}]" if p.tags else "")
        for p in pools
    )
