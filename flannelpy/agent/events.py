"""What the writer is told: every input to the agent, as one small frozen value.

Other threads (the lease and control watches, the prober, IPAM's low-free
callback in a CNI request, the ticker) only build one of these and put it on
the writer's queue; the writer alone acts on it. ``kind_of`` names the kind
that ``flannelpy_agent_events_total`` and status.json's ``events`` count.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flannelpy.observe.metric_families import AGENT_EVENT_KINDS
from flannelpy.observe.probe_verdict import ProbeResult
from flannelpy.subnet.lease import Lease

if TYPE_CHECKING:  # the control module pulls in the etcd client; the type alone is enough
    from flannelpy.control.node_control import ControlSnapshot

EVENT_KINDS = AGENT_EVENT_KINDS

# Timer names (Tick.name): what the ticker asks the writer to look at again.
TICK_STATUS = "status"  # rewrite status.json, publish the status record
TICK_CAPACITY = "capacity"  # drained leases empty and hold-downs end without an event
TICK_RENEW = "renew"  # renew leases that are due
TICK_CONTROL = "control"  # a blocked change may be allowed now; a failed apply is retried
TICK_FIREWALL = "firewall"  # resync the masq and forward rules


@dataclass(frozen=True)
class LeasesChanged:
    """Every lease in the store (ours included) after the first list or a watch batch."""

    leases: Mapping[str, Lease]
    revision: int


@dataclass(frozen=True)
class LeaseLost:
    """A lease of ours vanished from the store or was taken over."""


@dataclass(frozen=True)
class ControlChanged:
    snapshot: ControlSnapshot


@dataclass(frozen=True)
class ProbeReported:
    """The rounds one prober tick finished: (peer key, its new result) each."""

    results: tuple[tuple[str, ProbeResult], ...]


@dataclass(frozen=True)
class CapacityLow:
    """IPAM left fewer free addresses than MinFreeAddresses (or none)."""

    free: int


@dataclass(frozen=True)
class WireguardConfirmed:
    """A WireGuard device has now completed a handshake with the peers of these public
    keys: flannel-wg, or flannel-wg-v6 (``ipv6``), which holds the IPv6 half of a pair."""

    keys: frozenset[str]
    ipv6: bool = False


@dataclass(frozen=True)
class PolicyInputsChanged:
    """NetworkPolicies, Pods or Namespaces changed (any number of them: coalesced); the
    writer reads the store's snapshot when it handles this."""


@dataclass(frozen=True)
class Tick:
    name: str


@dataclass(frozen=True)
class Stop:
    """Wakes the writer at shutdown; not counted."""


Event = (
    LeasesChanged
    | LeaseLost
    | ControlChanged
    | ProbeReported
    | CapacityLow
    | WireguardConfirmed
    | PolicyInputsChanged
    | Tick
    | Stop
)


# The counted kind of each event class (Stop is not counted).
_KINDS: dict[type, str] = {
    LeasesChanged: "leases",
    LeaseLost: "lease_lost",
    ControlChanged: "control",
    ProbeReported: "probe",
    CapacityLow: "capacity",
    Tick: "tick",
    WireguardConfirmed: "handshake",
    PolicyInputsChanged: "policy",
}
assert set(_KINDS.values()) == set(AGENT_EVENT_KINDS)


def kind_of(event: Event) -> str | None:
    """The counted kind of ``event`` (None for Stop)."""
    return _KINDS.get(type(event))


class EventCounts:
    """Events the writer finished handling, by kind, capacity evaluations and firewall
    resyncs: what tests read to know that nothing happened without sleeping. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events = dict.fromkeys(EVENT_KINDS, 0)
        self._capacity_checks = 0
        self._firewall_resyncs = 0

    def handled(self, kind: str) -> None:
        with self._lock:
            self._events[kind] += 1

    def capacity_checked(self) -> None:
        with self._lock:
            self._capacity_checks += 1

    def firewall_resynced(self) -> None:
        with self._lock:
            self._firewall_resyncs += 1

    def events(self) -> dict[str, int]:
        with self._lock:
            return dict(self._events)

    @property
    def capacity_checks(self) -> int:
        with self._lock:
            return self._capacity_checks

    @property
    def firewall_resyncs(self) -> int:
        with self._lock:
            return self._firewall_resyncs
