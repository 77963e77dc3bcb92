"""Warm capacity: when a node takes another lease and when it gives one back. Pure.

Field-notes §2: a node ran dry although its subnet was mostly "free", because
cooling addresses were counted as available and a 5 s refill loop lost the race
against a burst. So here:

- Free means free now: addresses of *serving* (allocatable) leases that are
  neither assigned nor cooling. Drained leases contribute nothing.
- The agent asks for another lease as soon as free addresses fall below
  ``MinFreeAddresses`` (NodeIpam reports that right after the allocation that
  crossed it), while addresses remain, so the next ADD never waits for a loop.
- A lease is given back only when it holds no assigned **and** no cooling
  address (releasing a cooling one lets another node hand it out before proxies
  forgot it, §3). A drained lease goes as soon as it is empty; a surplus serving
  lease only after ``LeaseHoldDownSeconds`` empty, never the node's first lease,
  never its last serving one, and only if the node keeps ``MinFreeAddresses``
  without it. That last rule is the acquire rule's mirror, so a release never
  triggers an acquire and the two cannot flap.

``MaxLeasesPerNode`` counts every lease held, draining ones too, with one
exception: a node without any serving lease (its only pool drained) always asks
for one, or it could never move its pods off a drained pool (§3: "a node can
hold more than one lease while it drains").
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Network
from typing import Any

from flannelpy.errors import ConfigError
from flannelpy.ipam.allocator import Accounting

_WHERE = "net-conf.json"
MIN_FREE_KEY = "MinFreeAddresses"
MAX_LEASES_KEY = "MaxLeasesPerNode"
HOLD_DOWN_KEY = "LeaseHoldDownSeconds"


@dataclass(frozen=True)
class CapacitySettings:
    """Warm-capacity settings from net-conf.json (checked once, at parse time)."""

    # addresses; keep at least this many free on serving leases. 0: warm capacity off.
    min_free_addresses: int = 0
    # leases this node may hold at once, draining ones included (Flannel's is 1)
    max_leases_per_node: int = 1
    # seconds a surplus lease must stay empty before it is released
    hold_down_seconds: float = 300.0

    def __post_init__(self) -> None:
        _check_count(MIN_FREE_KEY, self.min_free_addresses, 0, 64)
        _check_count(MAX_LEASES_KEY, self.max_leases_per_node, 1, 2)
        seconds = self.hold_down_seconds
        if (
            isinstance(seconds, bool)
            or not isinstance(seconds, int | float)
            or not (math.isfinite(seconds) and seconds >= 0)
        ):
            raise ConfigError(
                f'{_WHERE}: "{HOLD_DOWN_KEY}" must be a number of seconds >= 0, not '
                f'{_show(seconds)}; write it like "{HOLD_DOWN_KEY}": 300'
            )
        if self.min_free_addresses > 0 and self.max_leases_per_node < 2:
            raise ConfigError(
                f'{_WHERE}: "{MIN_FREE_KEY}" is {self.min_free_addresses} but '
                f'"{MAX_LEASES_KEY}" is {self.max_leases_per_node}, so no further lease could '
                f'ever be acquired; set "{MAX_LEASES_KEY}" to 2 or more, or remove '
                f'"{MIN_FREE_KEY}"'
            )

    @property
    def enabled(self) -> bool:
        return self.min_free_addresses > 0


def parse_capacity(doc: Mapping[str, Any]) -> CapacitySettings:
    """Read MinFreeAddresses, MaxLeasesPerNode and LeaseHoldDownSeconds from the
    net-conf document, keys case-insensitively as Flannel reads them; JSON null
    or a missing key is the default."""
    found: dict[str, tuple[str, Any]] = {}
    wanted = {k.lower(): k for k in (MIN_FREE_KEY, MAX_LEASES_KEY, HOLD_DOWN_KEY)}
    for key, value in doc.items():
        name = wanted.get(key.lower()) if isinstance(key, str) else None
        if name is None:
            continue
        if name in found:
            raise ConfigError(
                f'{_WHERE}: keys "{found[name][0]}" and "{key}" differ only in case and are '
                "read as one key; keep only one of them"
            )
        found[name] = (key, value)
    defaults = CapacitySettings()
    values: dict[str, Any] = {}
    for name, field in (
        (MIN_FREE_KEY, "min_free_addresses"),
        (MAX_LEASES_KEY, "max_leases_per_node"),
        (HOLD_DOWN_KEY, "hold_down_seconds"),
    ):
        value = found.get(name, (name, None))[1]
        values[field] = getattr(defaults, field) if value is None else value
    return CapacitySettings(**values)


@dataclass(frozen=True)
class LeaseUsage:
    """One lease of this node at one instant; ``free`` never includes cooling addresses."""

    subnet: IPv4Network
    total: int
    assigned: int
    cooling: int
    free: int
    allocatable: bool  # False: draining, it receives no new pod address

    @classmethod
    def of(cls, accounting: Accounting, allocatable: bool) -> LeaseUsage:
        a = accounting
        if not isinstance(a.subnet, IPv4Network):  # NodeIpam.usage() lists IPv4 leases only
            raise ValueError(f"warm capacity is IPv4-only, got the lease {a.subnet}")
        return cls(a.subnet, a.total, a.assigned, a.cooling, a.free, allocatable)

    @property
    def empty(self) -> bool:
        """No assigned and no cooling address: the only state in which it may be released."""
        return self.assigned == 0 and self.cooling == 0

    @property
    def state(self) -> str:
        return "serving" if self.allocatable else "draining"


@dataclass(frozen=True)
class CapacityPlan:
    acquire: bool  # ask the store for one more lease from an eligible pool
    release: tuple[IPv4Network, ...]  # empty leases to remove from IPAM, then release
    reason: str  # one sentence for the log


def free_addresses(leases: Iterable[LeaseUsage]) -> int:
    """Addresses a new pod can get now: serving leases only, cooling never counted."""
    return sum(lease.free for lease in leases if lease.allocatable)


def plan_capacity(
    leases: Sequence[LeaseUsage],
    settings: CapacitySettings,
    now: float,
    empty_since: Mapping[IPv4Network, float],
) -> CapacityPlan:
    """What the node should do about its leases (``leases`` oldest first, as IPAM
    walks them); ``empty_since`` is when each empty lease was first seen empty
    (see ``update_empty_since``)."""
    release: list[IPv4Network] = []
    clauses: list[str] = []

    drained = [lease for lease in leases if not lease.allocatable and lease.empty]
    for lease in drained:
        release.append(lease.subnet)
        clauses.append(f"{lease.subnet} is draining and empty: release it")
    held = len(leases) - len(drained)
    serving = [lease for lease in leases if lease.allocatable]
    free = free_addresses(serving)
    minimum = settings.min_free_addresses

    acquire = False
    if not serving:
        acquire = True
        clauses.append("no serving lease: acquire one")
    elif free < minimum:
        if held < settings.max_leases_per_node:
            acquire = True
            clauses.append(
                f"{free} free addresses < {MIN_FREE_KEY} {minimum}: acquire lease "
                f"{held + 1} of at most {settings.max_leases_per_node}"
            )
        else:
            clauses.append(
                f"{free} free addresses < {MIN_FREE_KEY} {minimum} but the node holds "
                f"{held} leases, the {MAX_LEASES_KEY} limit"
            )

    if not acquire:
        first = leases[0].subnet if leases else None
        remaining = len(serving)
        # Newest first: the oldest leases are the ones peers and logs know the node by.
        for lease in reversed(serving):
            if lease.subnet == first or not lease.empty or remaining <= 1:
                continue
            since = empty_since.get(lease.subnet)
            if since is None or now - since < settings.hold_down_seconds:
                continue
            if free - lease.free < minimum:
                continue
            release.append(lease.subnet)
            remaining -= 1
            free -= lease.free
            clauses.append(
                f"{lease.subnet} has been empty for {now - since:.0f} s and the node keeps "
                f"{free} free addresses without it: release it"
            )

    if not clauses:
        clauses.append(f"{free} free addresses on {len(serving)} serving leases: nothing to do")
    return CapacityPlan(acquire, tuple(release), "; ".join(clauses))


def update_empty_since(
    leases: Iterable[LeaseUsage], empty_since: Mapping[IPv4Network, float], now: float
) -> dict[IPv4Network, float]:
    """The next ``empty_since``: empty leases keep their first time seen empty (or
    get ``now``); a lease that is no longer empty, or no longer held, drops out."""
    return {lease.subnet: empty_since.get(lease.subnet, now) for lease in leases if lease.empty}


def _check_count(key: str, value: Any, low: int, example: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(
            f'{_WHERE}: "{key}" must be a whole number >= {low}, not {_show(value)}; '
            f'write it like "{key}": {example}'
        )


def _show(value: Any) -> str:
    """A value as the user wrote it in JSON (non-finite floats as Python spells them)."""
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return repr(value)
