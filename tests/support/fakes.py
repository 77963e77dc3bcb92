"""A recording fake of the Kernel protocol that applies Changes to in-memory state."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import replace
from ipaddress import IPv4Address, IPv4Network

from flannelpy.backend.base import NodeContext
from flannelpy.config.netconf import BackendConfig, NetworkConfig
from flannelpy.dataplane.kernel import ApplyResult, ForeignRoute
from flannelpy.dataplane.state import Changes, ObservedState, UnderlayInterface
from flannelpy.dataplane.wgspec import WgDeviceSpec
from flannelpy.subnet.lease import Lease, LeaseAttrs


class FakeKernel:
    def __init__(self) -> None:
        self.state = ObservedState()
        self.applied: list[Changes] = []
        self.observe_calls = 0
        self.expected: ObservedState | None = None  # what the last observe was told
        self.fail_next_routes = False
        self.tx_checksum_writes: list[tuple[str, bool]] = []
        self.sysctls: dict[str, str] = {}

    def find_underlay(self, *args: object, **kwargs: object) -> UnderlayInterface:
        return underlay()

    def survey(self, ignore_devices: Iterable[str]) -> list[ForeignRoute]:
        return []

    def adopt_routes(self, shape: object) -> None:
        self.adopted = shape  # a fake kernel holds no routes a Flannel left

    def observe(
        self,
        link_names: Iterable[str],
        owned_devices: Iterable[str],
        expected: ObservedState | None = None,
    ) -> ObservedState:
        self.observe_calls += 1
        self.expected = expected
        names = set(link_names)
        owned = set(owned_devices)
        s = self.state
        return ObservedState(
            links=frozenset(link for link in s.links if link.name in names),
            addresses=frozenset(a for a in s.addresses if a.ifname in names),
            routes=s.routes,
            neighbours=frozenset(n for n in s.neighbours if n.ifname in owned),
            fdb=frozenset(f for f in s.fdb if f.ifname in owned),
        )

    def apply(self, changes: Changes) -> ApplyResult:
        self.applied.append(changes)
        s = self.state
        gone = set(changes.links_to_delete)
        links = {link for link in s.links if link.name not in gone}
        links |= set(changes.links_to_create)
        updated = {link.name: link for link in changes.links_to_update}
        links = {updated.get(link.name, link) for link in links}
        keep = lambda items: {i for i in items if i.ifname not in gone}  # noqa: E731
        routes = keep(s.routes) - set(changes.routes_to_delete)
        neighbours = keep(s.neighbours) - set(changes.neighbours_to_delete)
        fdb = keep(s.fdb) - set(changes.fdb_to_delete)
        addresses = (keep(s.addresses) - set(changes.addresses_to_delete)) | set(
            changes.addresses_to_add
        )
        failures: tuple[str, ...] = ()
        replaced = {(m.ifname, m.ip) for m in changes.neighbours_to_set}
        neighbours = {n for n in neighbours if (n.ifname, n.ip) not in replaced}
        neighbours |= set(changes.neighbours_to_set)
        fdb |= set(changes.fdb_to_set)
        if self.fail_next_routes:
            self.fail_next_routes = False
            failures = tuple(f"route {r.dst}: injected failure" for r in changes.routes_to_set)
        else:
            dsts = {r.dst for r in changes.routes_to_set}
            routes = {r for r in routes if r.dst not in dsts} | set(changes.routes_to_set)
        self.state = replace(
            s,
            links=frozenset(links),
            routes=frozenset(routes),
            neighbours=frozenset(neighbours),
            fdb=frozenset(fdb),
            addresses=frozenset(addresses),
        )
        return ApplyResult(applied=dict(changes.counts), failures=failures)

    def link_mac(self, name: str) -> str | None:
        return next((link.mac for link in self.state.links if link.name == name), None)

    def watch(self, on_event: Callable[[str], None], stop: threading.Event) -> None:
        stop.wait()

    def set_sysctl(self, name: str, value: str) -> None:
        self.sysctls[name] = value

    def set_tx_checksum(self, name: str, on: bool) -> None:
        self.tx_checksum_writes.append((name, on))


def underlay(
    ip: str = "192.168.1.10", networks: tuple[str, ...] = ("192.168.1.0/24",), mtu: int = 1500
) -> UnderlayInterface:
    return UnderlayInterface(
        name="eth0",
        index=2,
        ip=IPv4Address(ip),
        networks=tuple(IPv4Network(n) for n in networks),
        mtu=mtu,
    )


def network_config(backend: str = "vxlan", **options: object) -> NetworkConfig:
    return NetworkConfig(
        network=IPv4Network("10.244.0.0/16"),
        subnet_len=24,
        subnet_min=IPv4Address("10.244.1.0"),
        subnet_max=IPv4Address("10.244.255.0"),
        backend=BackendConfig(type=backend, **options),  # type: ignore[arg-type]
    )


def context(backend: str = "vxlan", ip: str = "192.168.1.10", **options: object) -> NodeContext:
    return NodeContext(
        config=network_config(backend, **options),
        underlay=underlay(ip),
        public_ip=IPv4Address(ip),
        node_name="node-a",
    )


def lease(
    subnet: str,
    public_ip: str,
    backend: str = "vxlan",
    mac: str | None = None,
    mtu: int | None = 1450,
) -> Lease:
    """A peer's lease; one of ours (it advertises its MTU) unless ``mtu`` is None."""
    data = {"VNI": 1, "VtepMAC": mac} if backend == "vxlan" else None
    return Lease(
        subnet=IPv4Network(subnet),
        attrs=LeaseAttrs(
            public_ip=IPv4Address(public_ip), backend_type=backend, backend_data=data, mtu=mtu
        ),
    )


class DeviceRecorder:
    """Takes a WireGuard runtime's planned devices instead of a real device."""

    def __init__(self) -> None:
        self.specs: list[WgDeviceSpec] = []

    def set_desired(self, spec: WgDeviceSpec) -> None:
        self.specs.append(spec)
