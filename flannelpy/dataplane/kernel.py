"""The kernel adapter protocol: everything above the dataplane sees only this.

The real implementation is :mod:`flannelpy.dataplane.netlink` (pyroute2, plus a
batched fast path for bulk writes); unit tests pass a recording fake.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network
from typing import TYPE_CHECKING, Protocol

from flannelpy.dataplane.state import Changes, ObservedState, UnderlayInterface

if TYPE_CHECKING:
    from flannelpy.dataplane.adopt import FlannelRouteShape


@dataclass(frozen=True)
class ApplyResult:
    """How many entries of each kind were written, and the failures (never raised mid-batch)."""

    applied: dict[str, int]
    failures: tuple[str, ...] = ()


@dataclass(frozen=True)
class ForeignRoute:
    """A route or address on the node that is not ours, for the overlap survey."""

    network: IPv4Network
    description: str  # e.g. "route 10.244.0.0/16 dev eth1" or "address 10.244.3.7/24 on eth0"
    # Of a route, for telling a route another Flannel left (dataplane.adopt) from a foreign
    # one; not part of its identity.
    protocol: int = field(default=0, compare=False)
    gateway: IPv4Address | None = field(default=None, compare=False)
    device: str = field(default="", compare=False)
    is_address: bool = field(default=False, compare=False)


class Kernel(Protocol):
    def find_underlay(
        self,
        ifaces: Iterable[str] = (),
        iface_regexes: Iterable[str] = (),
        can_reach: IPv4Address | None = None,
        public_ip: IPv4Address | None = None,
        ipv6_only: bool = False,
    ) -> UnderlayInterface:
        """Flannel's interface choice: explicit names, then regexes, then the route to
        ``can_reach``, else the default route's interface. Raises InterfaceNotFound.
        ``ipv6_only``: by --iface/--iface-regex only, an interface with a global IPv6
        address (see :func:`~flannelpy.dataplane.underlay.choose_underlay_v6`)."""
        ...

    def survey(self, ignore_devices: Iterable[str]) -> list[ForeignRoute]:
        """Routes (main table, not ours, not default) and addresses not on ``ignore_devices``."""
        ...

    def observe(
        self,
        link_names: Iterable[str],
        owned_devices: Iterable[str],
        expected: ObservedState | None = None,
    ) -> ObservedState:
        """Dump links named ``link_names`` (vxlan ones), their addresses, routes with our
        protocol, and permanent neighbours/FDB entries on ``owned_devices``. ``expected``:
        what the kernel should hold of the last three; a kind found exactly as expected is
        reported as that very set (the same answer, without a dump's own objects)."""
        ...

    def apply(self, changes: Changes) -> ApplyResult:
        """Apply in Changes' field order. Idempotent: a missing entry on delete and an
        existing one on set are success."""
        ...

    def link_mac(self, name: str) -> str | None:
        """The MAC of link ``name``, or None when it does not exist."""
        ...

    def watch(self, on_event: Callable[[str], None], stop: threading.Event) -> None:
        """Block until ``stop``: call ``on_event(kind)`` ("route", "neighbour", "fdb", "link",
        "address") when one of ours may have been deleted or changed by someone else."""
        ...

    def set_sysctl(self, name: str, value: str) -> None:
        """Write /proc/sys/<name with dots as slashes> (e.g. net.ipv4.ip_forward)."""
        ...

    def set_tx_checksum(self, name: str, on: bool) -> None:
        """Turn link ``name``'s transmit checksum offload on or off (ethtool -K tx)."""
        ...

    def adopt_routes(self, shape: FlannelRouteShape) -> None:
        """From now on, count routes of ``shape`` that a Flannel before us left for its
        peers as ours: ``observe`` reports them, so the reconciler replaces or deletes them."""
        ...
