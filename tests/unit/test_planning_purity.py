"""Planning is pure: the planner returns values and only the reconciler writes.

A wireguard node plans a cluster with a recording kernel and a recording WireGuard
runtime: nothing is written while it plans; one reconcile pass then hands the runtime the
planned devices (before the kernel gets the routes into them) and the kernel the rest.
"""

from __future__ import annotations

from collections.abc import Iterable
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

from flannelpy.agent.events import LeasesChanged
from flannelpy.backend.wireguard_runtime import WireguardRuntime
from flannelpy.dataplane.state import Changes
from flannelpy.dataplane.wgkeys import generate_private_key, public_key
from flannelpy.dataplane.wgspec import WgDeviceSpec
from flannelpy.subnet.keys import lease_key
from flannelpy.subnet.lease import LeaseAttrs
from tests.support.agent_fakes import PREFIX, AgentHarness, net_conf

PEER_KEY = public_key(generate_private_key())


class RecordingRuntime(WireguardRuntime):
    """A runtime whose devices are only recorded, with every write in ``writes``."""

    def __init__(self, tmp_path: Path, writes: list[str]) -> None:
        super().__init__(
            str(tmp_path / "wg.key"),
            str(tmp_path / "wgrun"),
            implementation="userspace",
            make_device=self._device,
        )
        self.writes = writes
        self.applied: list[frozenset[WgDeviceSpec]] = []

    def _device(self, name: str, *_: object) -> RecordingRuntime:
        self.writes.append(f"start {name}")
        return self

    def set_desired(self, spec: WgDeviceSpec) -> None:
        self.writes.append(f"configure {spec.name}")

    def stop(self) -> None:
        self.writes.append("stop")

    def apply(self, specs: Iterable[WgDeviceSpec]) -> None:
        self.applied.append(frozenset(specs))
        super().apply(self.applied[-1])


def test_planning_a_wireguard_cluster_writes_nothing_and_the_reconciler_writes_it_all(
    tmp_path: Path,
) -> None:
    writes: list[str] = []
    rt = RecordingRuntime(tmp_path, writes)
    agent = AgentHarness(tmp_path, config=net_conf({"Type": "wireguard"}), wireguard=rt)
    peer = LeaseAttrs(IPv4Address("192.168.1.11"), "wireguard", {"PublicKey": PEER_KEY}, mtu=1440)
    agent.store.put(lease_key(PREFIX, IPv4Network("10.244.200.0/24")), peer.to_json().encode())
    try:
        plan_then_reconcile(agent, rt, writes)
    finally:
        agent.stop()


def plan_then_reconcile(agent: AgentHarness, rt: RecordingRuntime, writes: list[str]) -> None:
    kernel_writes: list[Changes] = agent.kernel.applied
    writer = agent.writer
    writer.acquire_first()
    leases, revision = agent.manager.list_leases()
    writer.handle(LeasesChanged(leases, revision))  # plans the cluster: two nodes
    assert writer.reconciler.desired is not None
    (planned,) = writer.reconciler.desired.wireguard
    assert {p.public_key for p in planned.peers} == {PEER_KEY}
    assert writes == [] and rt.applied == [] and kernel_writes == []  # nothing written

    writer.reconciler.reconcile_once("test")
    assert rt.applied == [frozenset({planned})]
    assert writes == ["start flannel-wg", "configure flannel-wg"]
    (changes,) = kernel_writes
    assert {r.ifname for r in changes.routes_to_set} == {"flannel-wg"}  # into the device
