"""Fakes for driving a NodeAgent through its event queue: an etcd-backed agent on the
in-memory FakeStore, with a recording kernel, fake pod plumbing and a hand-moved clock.

The watches here list once and then wait, so every later input reaches the writer only
when a test puts it on the queue (``AgentHarness.deliver_leases`` and friends) and is
handled only when the test says so (``drain``): no thread races the assertions.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from ipaddress import IPv4Interface, IPv4Network, IPv6Address, IPv6Interface, ip_interface
from pathlib import Path
from typing import Any

from flannelpy.agent.events import ControlChanged, Event, LeasesChanged, Tick
from flannelpy.agent.firewall_sync import FirewallSync
from flannelpy.agent.node import NodeAgent
from flannelpy.agent.state import Clocks
from flannelpy.agent.writer import AgentParts
from flannelpy.backend.base import NodeContext
from flannelpy.backend.registry import get_backend
from flannelpy.backend.wireguard_config import parse_wireguard_config
from flannelpy.backend.wireguard_runtime import WireguardRuntime
from flannelpy.config.settings import AgentSettings
from flannelpy.control.node_control import ControlSnapshot
from flannelpy.dataplane.kernel import ApplyResult
from flannelpy.dataplane.reconciler import PolicyRules
from flannelpy.dataplane.state import Changes
from flannelpy.dataplane.wgspec import WgDeviceSpec
from flannelpy.errors import StoreUnavailable
from flannelpy.ipam.capacity import parse_capacity
from flannelpy.ipam.manager import NodeIpam
from flannelpy.store.etcd.config import put_network_config
from flannelpy.store.etcd.kv import FakeStore
from flannelpy.store.etcd.manager import EtcdSubnetManager
from flannelpy.store.node_control import EtcdNodeControl
from flannelpy.store.policy_inputs import PolicySource
from flannelpy.subnet.keys import lease_key
from flannelpy.subnet.lease import Lease
from flannelpy.subnet.manager import LeasesCallback
from tests.support.fakes import FakeKernel, underlay

PREFIX = "/coreos.com/network"
NODE = "node-a"
NODE_IP = "192.168.1.10"
NODE_IPV6 = "fd00:64::10"  # advertised when the config enables IPv6


class FakeClock:
    """One clock for wall and monotonic time, moved only by the test."""

    def __init__(self, start: float = 1_700_000_000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class ListOnceManager(EtcdSubnetManager):
    """The real etcd manager on a FakeStore whose watch lists once, then waits; later
    snapshots are the test's to deliver. ``fail_renewals`` makes that many renewals
    raise StoreUnavailable first."""

    fail_renewals = 0

    def watch_leases(self, on_leases: LeasesCallback, stop: threading.Event) -> None:
        leases, revision = self.list_leases()
        on_leases(leases, revision)
        stop.wait()

    def renew_lease(self, lease: Lease) -> Lease:
        if self.fail_renewals > 0:
            self.fail_renewals -= 1
            raise StoreUnavailable("injected: the store is away")
        return super().renew_lease(lease)


class ReadOnceControl(EtcdNodeControl):
    """The real etcd node control whose watch delivers one snapshot, then waits."""

    def fresh(self) -> ControlSnapshot:
        for name in self._keys:
            self._read(name)
        return self.snapshot()

    def watch(self, on_change: Callable[[ControlSnapshot], None], stop: threading.Event) -> None:
        on_change(self.fresh())
        stop.wait()


class HostTouchingKernel(FakeKernel):
    """Records every call that would look at or change the host."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def find_underlay(self, *args: object, **kwargs: object) -> Any:
        self.calls.append("find_underlay")
        return super().find_underlay()

    def survey(self, ignore_devices: Any) -> Any:
        self.calls.append("survey")
        return []

    def apply(self, changes: Changes) -> ApplyResult:
        self.calls.append("apply")
        return super().apply(changes)

    def set_sysctl(self, name: str, value: str) -> None:
        self.calls.append("set_sysctl")


@dataclass
class FakePods:
    """The CNI side with real IPAM (on disk, in a temp dir) and a recorded bridge."""

    state_dir: str
    mtu: Callable[[], int]
    ready: Callable[[], bool]
    gateways: set[IPv4Interface | IPv6Interface] = field(default_factory=set)
    bridge_mtus: list[int] = field(default_factory=list)
    listeners: list[Callable[[Any, bytes, int | None, bytes], None]] = field(default_factory=list)
    started: bool = False

    def __post_init__(self) -> None:
        self._ipam = NodeIpam(self.state_dir, cooldown_seconds=0, fsync=False)

    @property
    def ipam(self) -> NodeIpam:
        return self._ipam

    def use_leases(
        self, subnets: Sequence[IPv4Network], serving: Sequence[IPv4Network] | None = None
    ) -> None:
        self._ipam.set_leases(subnets, serving)
        self.gateways |= {ip_interface(f"{n.network_address + 1}/{n.prefixlen}") for n in subnets}
        self.bridge_mtus.append(self.mtu())

    def remove_gateway(self, gateway: IPv4Interface | IPv6Interface) -> None:
        self.gateways.discard(gateway)

    def add_listener(self, listener: Callable[[Any, bytes, int | None, bytes], None]) -> None:
        self.listeners.append(listener)

    def start(self) -> None:
        self.started = True

    def stop(self) -> None:
        self.started = False

    def serving(self) -> tuple[bool, str]:
        return True, "ok"

    def add_pod(self, container_id: str) -> object:
        return self._ipam.allocate(container_id, "eth0")


def net_conf(backend: dict[str, Any] | None = None, **extra: Any) -> str:
    import json

    doc: dict[str, Any] = {"Network": "10.244.0.0/16", "SubnetLen": 24}
    doc["Backend"] = backend or {"Type": "vxlan"}
    doc.update(extra)
    return json.dumps(doc)


def agent_settings(tmp: Path, **overrides: Any) -> AgentSettings:
    values: dict[str, Any] = {
        "etcd_prefix": PREFIX,
        "state_dir": str(tmp / "state"),
        "run_dir": str(tmp / "run"),
        "subnet_file": str(tmp / "run" / "subnet.env"),
        "metrics_addr": None,
        "iptables_forward_rules": False,
        "node_name": NODE,
    }
    values.update(overrides)
    return AgentSettings(**values)


class AgentHarness:
    """A NodeAgent on fakes; the test thread is its writer (``drain`` handles events)."""

    def __init__(
        self,
        tmp: Path,
        store: FakeStore | None = None,
        config: str | None = None,
        kernel: FakeKernel | None = None,
        clock: FakeClock | None = None,
        jitter: Callable[[], float] | None = None,
        wireguard: WireguardRuntime | None = None,
        firewall: FirewallSync | None = None,
        policy_source: PolicySource | None = None,
        policy_table: PolicyRules | None = None,
        **settings: Any,
    ) -> None:
        self.clock = clock or FakeClock()
        self.store = store or FakeStore(clock=self.clock)
        self.settings = agent_settings(tmp, **settings)
        netconf = put_network_config(self.store, PREFIX, config or net_conf())
        self.kernel = kernel or FakeKernel()
        self.manager = ListOnceManager(self.store, self.settings, clock=self.clock)
        self.control = ReadOnceControl(self.store, PREFIX, NODE)
        link = underlay(NODE_IP)
        if netconf.enable_ipv6:
            link = replace(link, ip6=IPv6Address(NODE_IPV6))
        ctx = NodeContext(
            config=netconf,
            underlay=link,
            public_ip=underlay(NODE_IP).ip if netconf.enable_ipv4 else None,
            public_ipv6=IPv6Address(NODE_IPV6) if netconf.enable_ipv6 else None,
            node_name=NODE,
            wireguard_confirmed=frozenset(),  # as the agent's composition
            wireguard_confirmed_v6=frozenset(),
            vtep_tx_checksum_off=self.settings.vxlan_tx_checksum_off,
        )
        if wireguard is not None and netconf.backend.type == "wireguard":
            options = parse_wireguard_config(netconf.backend)
            ctx = replace(ctx, wireguard_identity=wireguard.prepare(options))
        self.pods: FakePods | None = None

        def pods(mtu: Callable[[], int], ready: Callable[[], bool]) -> FakePods:
            self.pods = FakePods(str(tmp / "state" / "ipam"), mtu, ready)
            return self.pods

        self.agent = NodeAgent(
            AgentParts(
                settings=self.settings,
                manager=self.manager,
                kernel=self.kernel,
                backend=get_backend(netconf.backend.type),
                ctx=ctx,
                pods=pods,
                capacity=parse_capacity(netconf.raw),
                control=self.control,
                clocks=Clocks(wall=self.clock, monotonic=self.clock),
                ticker=False,
                # Seeded: a run of a test is the same every time, and still spread.
                jitter=jitter or random.Random(7).random,
                wireguard=wireguard,
                firewall=firewall,
                policy_source=policy_source,
                policy_table=policy_table,
            )
        )
        self.writer = self.agent.writer
        self.status_file = Path(self.settings.run_dir) / "status.json"

    # -- driving ----------------------------------------------------------------------

    def start(self) -> None:
        self.agent.start()
        self.writer.settle()  # what the main loop does first

    def put(self, event: Event) -> None:
        self.writer.queue.put(event)

    def drain(self) -> int:
        """Handle every queued event on this thread; how many."""
        handled = 0
        while not self.writer.queue.empty():
            self.writer.handle(self.writer.queue.get_nowait())
            handled += 1
        return handled

    def deliver_leases(self) -> None:
        """What the lease watch would deliver now: the store's whole lease list."""
        leases, revision = self.manager.list_leases()
        self.put(LeasesChanged(leases, revision))
        self.drain()

    def deliver_control(self) -> None:
        self.put(ControlChanged(self.control.fresh()))
        self.drain()

    def tick(self, name: str, advance: float = 0.0) -> None:
        self.clock.advance(advance)
        self.put(Tick(name))
        self.drain()

    def stop(self) -> None:
        self.agent.shutdown()

    # -- reading ----------------------------------------------------------------------

    def own_subnets(self) -> list[IPv4Network]:
        return [lease.subnet for lease in self.writer.state.own]

    def status(self) -> dict[str, Any]:
        import json

        doc: dict[str, Any] = json.loads(self.status_file.read_text())
        return doc

    def reconcile(self) -> None:
        self.writer.reconciler.reconcile_once("test")


class NoWgDevice:
    """A WireGuard device that starts nothing: it takes what the reconciler applies."""

    def __init__(self, *_: object) -> None:
        pass

    def set_desired(self, spec: WgDeviceSpec) -> None:
        pass

    def stop(self) -> None:
        pass


def wireguard_agent(tmp: Path, *peers: Lease) -> tuple[AgentHarness, WireguardRuntime]:
    """An agent running wireguard whose devices start nothing, with ``peers`` in the store
    (not started), and its WireGuard runtime."""
    rt = WireguardRuntime(
        str(tmp / "wireguard.key"),
        str(tmp / "wgrun"),
        implementation="userspace",
        make_device=NoWgDevice,
    )
    agent = AgentHarness(tmp, config=net_conf({"Type": "wireguard"}), wireguard=rt)
    for peer in peers:
        agent.store.put(lease_key(PREFIX, peer.subnet), peer.attrs.to_json().encode())
    return agent, rt
