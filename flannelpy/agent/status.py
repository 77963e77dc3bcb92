"""What the node tells others: status.json, its status record in the store, readiness
and subnet.env.

status.json and readiness are read from any thread (the reconciler's callback,
the HTTP servers); they use only the writer's published ``AgentView``. The
store record and subnet.env are written by the writer alone.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from ipaddress import IPv4Interface
from pathlib import Path
from typing import TYPE_CHECKING

from flannelpy.agent.events import EventCounts
from flannelpy.agent.state import AgentView, Clocks, NodeState
from flannelpy.config.netconf import NetworkConfig
from flannelpy.config.settings import AgentSettings
from flannelpy.control.records import BackendSummary, NodeStatus, PeerProbe
from flannelpy.dataplane.reconciler import Reconciler, ReconcileResult
from flannelpy.errors import StoreError
from flannelpy.fsutil import atomic_write
from flannelpy.observe.health import readiness
from flannelpy.observe.prober import Prober
from flannelpy.subnet.lease import Lease
from flannelpy.subnet.subnet_env import SubnetEnv, write_subnet_env

if TYPE_CHECKING:
    from flannelpy.control.node_control import NodeControl

log = logging.getLogger("flannelpy.agent.status")

STATUS_FILE = "status.json"  # in --run-dir
TRANSITION_SECONDS = 60.0  # after a change, the store status follows every probe round


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
        self._probe_at: dict[str, float] = {}
        self._published: tuple[str, float] = ("", 0.0)  # status without times, when

    # -- any thread ---------------------------------------------------------------------

    def readiness(self) -> tuple[bool, str]:
        view = self._view()
        desired = self._reconciler.desired
        return readiness(
            lease_held=bool(view.own),
            subnet_env_written=view.subnet_env_written,
            last_reconcile=self._reconciler.last_result,
            rules_in_place=view.rules_in_place,
            unprogrammed_peers=len(desired.unreachable) if desired else 0,
        )

    def write_file(self, result: ReconcileResult | None, view: AgentView | None = None) -> None:
        """A small JSON file for `lab status` and operators: what this node holds and lacks.
        The writer passes its current view; other threads get the published one."""
        view = view or self._view()
        doc = {
            "node": view.ctx.node_name,
            "backend": view.backend.type_name,
            "lease": str(view.own[0].subnet) if view.own else None,
            "leases": [str(x.subnet) for x in view.own],
            "public_ip": str(view.ctx.public_ip),
            "mtu": view.mtu,
            "peers": view.peers,
            "unreachable": [
                {"subnet": str(u.subnet), "public_ip": str(u.public_ip), "reason": u.reason}
                for u in sorted(view.unreachable, key=lambda u: u.subnet)
            ],
            "converged": result.converged if result else None,
            "failures": list(result.failures[:20]) if result else [],
            "last_reconcile": result.finished_at if result else None,
            "ready": view.ready,
            "ip_masq": self.settings.ip_masq,
            "iptables_forward_rules": self.settings.iptables_forward_rules,
            "probes": (
                {key: r.as_status() for key, r in self.prober.results().items()}
                if self.prober is not None
                else {}
            ),
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
        }
        with self._file_lock:
            atomic_write(
                Path(self.settings.run_dir) / STATUS_FILE, json.dumps(doc, indent=1),
                durable=False,
            )  # fmt: skip

    # -- the writer only ------------------------------------------------------------------

    def probe_seen(self, key: str) -> None:
        self._probe_at[key] = self._clocks.wall()

    def node_status(self) -> NodeStatus:
        view = self._state.view()
        ctx = view.ctx
        results = self.prober.results() if self.prober is not None else {}
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
            subnets=tuple(str(x.subnet) for x in view.own),
            probes={
                key: PeerProbe(
                    reachable=r.reachable,
                    mtu_ok=r.mtu_ok,
                    ok=r.reachable and r.last_error is None and r.mtu_ok is not False,
                    probes=r.probes,
                    at=self._probe_at.get(key, 0.0),
                )
                for key, r in results.items()
            },
        )

    def publish(self, force: bool = False) -> None:
        """Write our status record: at once when something an operator acts on changed,
        after every probe round while a change settles, else every publish interval."""
        if self._control is None:
            return
        status = self.node_status()
        doc = json.loads(status.to_json())
        doc.pop("At")
        for probe in doc["Probes"].values():
            probe.pop("At")
        fingerprint = json.dumps(doc, sort_keys=True)
        last, when = self._published
        now = self._clocks.monotonic()
        settling = self._clocks.wall() - self._state.applied_at < TRANSITION_SECONDS
        due = now - when >= self.settings.status_publish_interval
        if not (force or settling or due or fingerprint != last):
            return
        try:
            self._control.publish_status(status)
        except StoreError as e:
            log.debug("status not published: %s", e)
            return
        self._published = (fingerprint, now)


def write_node_subnet_env(
    state: NodeState, settings: AgentSettings, serves: Callable[[Lease], bool]
) -> None:
    """Flannel's subnet.env names one subnet: our first lease that takes new pods."""
    own = state.own
    assert own and state.config.network is not None
    lease = next((x for x in own if serves(x)), own[0])
    env = SubnetEnv(
        network=state.config.network,
        subnet=IPv4Interface(f"{lease.gateway}/{lease.subnet.prefixlen}"),
        mtu=state.mtu,
        ipmasq=settings.ip_masq,
    )
    write_subnet_env(settings.subnet_file, env)
    state.subnet_env_written = True
