"""What `flannelpy doctor` knows about a node (gathered by :mod:`.gather`), and what
it reports back: facts in, findings out, plus the previous run's drop counters.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from ipaddress import IPv4Network, IPv6Network
from typing import Any, Literal

from flannelpy.config.netconf import NetworkConfig
from flannelpy.config.settings import AgentSettings
from flannelpy.dataplane.kernel import ForeignRoute
from flannelpy.dataplane.state import (
    ObservedState,
    UnderlayInterface,
)
from flannelpy.dataplane.uapi import WgDeviceConfig
from flannelpy.subnet.lease import Lease

Severity = Literal["ok", "warning", "error"]

BRIDGE = "cni0"  # the pod bridge (flannel's CNI default, ours too)
VETHS = "pod veths"  # the counter group of every pod veth on the bridge, summed
LEASE_CRITICAL_SECONDS = 600.0  # a lease this close to expiry is an error, not a warning
RENEW_SLACK_SECONDS = 300.0  # renewal runs at expiry - margin; allow it this much lateness
STATUS_STALE_MIN_SECONDS = 30.0  # status.json older than max(this, 3 × resync) is stale
LOSS_WARNING = 0.1  # probe loss above this share of the prober's window is worth a look...
LOSS_MIN_PROBES = 10  # ...once that many rounds ran: one lost at start-up is not a trend
DROPS_NOTICE = 10  # new drops on one interface (group) since the last run worth a warning
LIST_LIMIT = 4  # subjects named in one line; the rest are counted
COUNTER_FIELDS = ("rx_dropped", "tx_dropped", "rx_errors", "tx_errors")
SNAPSHOT_VERSION = 1


@dataclass(frozen=True)
class Finding:
    severity: Severity
    check: str  # short name of the check: "routes", "mtu", "firewall", ...
    message: str  # what was found and what it means
    action: str = ""  # what to do; empty for ok findings
    subject: str | None = None  # the peer(s), device(s) or chain(s) concerned


@dataclass(frozen=True)
class LinkCounters:
    rx_dropped: int = 0
    tx_dropped: int = 0
    rx_errors: int = 0
    tx_errors: int = 0

    def __add__(self, other: LinkCounters) -> LinkCounters:
        return LinkCounters(*(getattr(self, f) + getattr(other, f) for f in COUNTER_FIELDS))


@dataclass(frozen=True)
class LinkInfo:
    """One kernel link as ``ip -d -s link`` shows it."""

    name: str
    kind: str | None  # "vxlan", "bridge", "veth"; None for a plain device
    mtu: int
    up: bool  # administratively up (IFF_UP); a bridge without ports has no carrier
    master: str | None = None
    counters: LinkCounters = field(default_factory=LinkCounters)
    carrier: bool = True  # IFF_LOWER_UP: the link can pass packets


def pod_veths(links: Iterable[LinkInfo]) -> list[LinkInfo]:
    """The pods' ends on this node: the veths enslaved to the pod bridge."""
    return [link for link in links if link.kind == "veth" and link.master == BRIDGE]


@dataclass(frozen=True)
class CounterSnapshot:
    """Drop counters of a previous run (``<run_dir>/doctor-last.json``)."""

    taken_at: float  # unix time
    counters: Mapping[str, LinkCounters]


@dataclass(frozen=True)
class WireguardFacts:
    """The WireGuard device as found: which implementation serves it, and its peers."""

    implementation: str | None  # "kernel", "userspace" (wireguard-go), None: no device
    device: WgDeviceConfig | None = None
    pid: int | None = None  # of wireguard-go
    error: str | None = None


@dataclass(frozen=True)
class NodeFacts:
    """Everything diagnose() looks at. ``None`` means unknown (not gathered or failed);
    the ``*_error`` fields say why, and the checks that need the value report it."""

    settings: AgentSettings
    now: float  # unix time of the gathering
    # the store
    config: NetworkConfig | None = None
    leases: tuple[Lease, ...] = ()
    # address pools beyond Network and IPv6Network (etcd mode)
    pool_networks: tuple[IPv4Network | IPv6Network, ...] = ()
    store_error: str | None = None
    own_lease_ttl: float | None = None  # seconds left on our lease; None: unknown / reservation
    # the kernel
    underlay: UnderlayInterface | None = None
    underlay_error: str | None = None
    kernel_error: str | None = None
    vtep_mac: str | None = None  # of the live vxlan device
    observed: ObservedState | None = None
    links: tuple[LinkInfo, ...] = ()
    foreign: tuple[ForeignRoute, ...] = ()
    # the firewall: "table/chain" -> `iptables -S` lines (empty: no such chain)
    chains: Mapping[str, tuple[str, ...]] | None = None
    firewall_error: str | None = None
    random_fully: bool = True
    # nftables mode: "family table" -> `nft list table` text (empty: no such table)
    nft_tables: Mapping[str, str] | None = None
    # NetworkPolicy: does the kernel hold the table inet flannelpy-policy (None: unknown)
    policy_table_present: bool | None = None
    # the agent
    status: Mapping[str, Any] | None = None
    status_error: str | None = None
    status_mtime: float | None = None
    previous: CounterSnapshot | None = None
    wireguard: WireguardFacts | None = None  # with the wireguard backend only
    wireguard_v6: WireguardFacts | None = None  # flannel-wg-v6, with IPv6 enabled too


def parse_snapshot(raw: str) -> CounterSnapshot | None:
    """The previous run's counters; None for anything unreadable (start a new baseline)."""
    try:
        doc = json.loads(raw)
        counters = {
            str(name): LinkCounters(**{f: int(values.get(f, 0)) for f in COUNTER_FIELDS})
            for name, values in doc["counters"].items()
        }
        return CounterSnapshot(float(doc["taken_at"]), counters)
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
