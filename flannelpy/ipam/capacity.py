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

Both families: free addresses are counted per family, and the node asks for
another lease when *either* family falls below ``MinFreeAddresses`` (a node low
on IPv6 addresses takes a lease though IPv4 has room, and the other way round).
A dual-stack lease is one key holding a subnet of each family (Flannel's format),
so it is counted, kept and released as one: released only when every subnet of it
is empty, and a surplus one only if every family keeps ``MinFreeAddresses``
without it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network
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


IPNetwork = IPv4Network | IPv6Network


@dataclass(frozen=True)
class LeaseUsage:
    """One subnet of a lease of this node at one instant; ``free`` never includes
    cooling addresses."""

    subnet: IPNetwork
    total: int
    assigned: int
    cooling: int
    free: int
    allocatable: bool  # False: draining, it receives no new pod address
    # The lease this subnet belongs to, by its first subnet (a dual-stack lease's IPv4
    # one); None: the subnet is a lease of its own.
    lease: IPNetwork | None = None

    @classmethod
    def of(cls, accounting: Accounting, allocatable: bool) -> LeaseUsage:
        a = accounting
        return cls(a.subnet, a.total, a.assigned, a.cooling, a.free, allocatable)

    @property
    def empty(self) -> bool:
        """No assigned and no cooling address: the only state in which it may be released."""
        return self.assigned == 0 and self.cooling == 0

    @property
    def state(self) -> str:
        return "serving" if self.allocatable else "draining"

    @property
    def lease_key(self) -> IPNetwork:
        return self.subnet if self.lease is None else self.lease


@dataclass(frozen=True)
class CapacityPlan:
    acquire: bool  # ask the store for one more lease from eligible pools
    release: tuple[IPNetwork, ...]  # empty leases (by first subnet) to remove, then release
    reason: str  # one sentence for the log


def free_addresses(leases: Iterable[LeaseUsage], family: int | None = None) -> int:
    """Addresses a new pod can get now (in ``family``, None: every one given): serving
    subnets only, cooling never counted."""
    return sum(
        lease.free
        for lease in leases
        if lease.allocatable and (family is None or lease.subnet.version == family)
    )


@dataclass(frozen=True)
class _Lease:
    """One lease: its subnets' usage, one per family."""

    key: IPNetwork
    parts: tuple[LeaseUsage, ...]

    @property
    def allocatable(self) -> bool:
        return all(p.allocatable for p in self.parts)

    @property
    def empty(self) -> bool:
        return all(p.empty for p in self.parts)

    def free(self, family: int) -> int:
        return free_addresses(self.parts, family)


def _by_lease(usage: Sequence[LeaseUsage]) -> list[_Lease]:
    grouped: dict[IPNetwork, list[LeaseUsage]] = {}
    for part in usage:
        grouped.setdefault(part.lease_key, []).append(part)
    return [_Lease(key, tuple(parts)) for key, parts in grouped.items()]


def plan_capacity(
    leases: Sequence[LeaseUsage],
    settings: CapacitySettings,
    now: float,
    empty_since: Mapping[IPNetwork, float],
) -> CapacityPlan:
    """What the node should do about its leases (``leases``: their subnets, oldest
    lease first, as IPAM walks them); ``empty_since`` is when each empty subnet was
    first seen empty (see ``update_empty_since``)."""
    release: list[IPNetwork] = []
    clauses: list[str] = []
    grouped = _by_lease(leases)
    families: list[int] = sorted({part.subnet.version for part in leases})

    drained = [lease for lease in grouped if not lease.allocatable and lease.empty]
    for lease in drained:
        release.append(lease.key)
        clauses.append(f"{lease.key} is draining and empty: release it")
    held = len(grouped) - len(drained)
    serving = [lease for lease in grouped if lease.allocatable]
    free = {f: sum(lease.free(f) for lease in serving) for f in families}
    acquire = _plan_acquire(serving, free, held, settings, clauses)
    if not acquire:
        release += _surplus(grouped, serving, free, settings, now, empty_since, clauses)
    if not clauses:
        clauses.append(f"{_free_text(free)} on {len(serving)} serving leases: nothing to do")
    return CapacityPlan(acquire, tuple(release), "; ".join(clauses))


def _free_text(free: Mapping[int, int]) -> str:
    """``53 free addresses``; with two families ``53 free IPv4 and 12 free IPv6 addresses``."""
    if len(free) == 1:
        return f"{next(iter(free.values()))} free addresses"
    return " and ".join(f"{n} free IPv{f}" for f, n in free.items()) + " addresses"


def _plan_acquire(
    serving: Sequence[_Lease],
    free: Mapping[int, int],
    held: int,
    settings: CapacitySettings,
    clauses: list[str],
) -> bool:
    """Acquire when no lease serves, or a family is short and the limit allows."""
    if not serving:
        clauses.append("no serving lease: acquire one")
        return True
    minimum = settings.min_free_addresses
    short = [f for f, n in free.items() if n < minimum]
    if not short:
        return False
    what = " and ".join(
        f"{free[f]} free {'' if len(free) == 1 else f'IPv{f} '}addresses" for f in short
    )
    if held < settings.max_leases_per_node:
        clauses.append(
            f"{what} < {MIN_FREE_KEY} {minimum}: acquire lease {held + 1} of at most "
            f"{settings.max_leases_per_node}"
        )
        return True
    clauses.append(
        f"{what} < {MIN_FREE_KEY} {minimum} but the node holds {held} leases, the "
        f"{MAX_LEASES_KEY} limit"
    )
    return False


def _surplus(
    grouped: Sequence[_Lease],
    serving: Sequence[_Lease],
    free: Mapping[int, int],
    settings: CapacitySettings,
    now: float,
    empty_since: Mapping[IPNetwork, float],
    clauses: list[str],
) -> list[IPNetwork]:
    """Serving leases empty for the hold-down that every family can spare."""
    first = grouped[0].key if grouped else None
    remaining = len(serving)
    left = dict(free)
    release: list[IPNetwork] = []
    # Newest first: the oldest leases are the ones peers and logs know the node by.
    for lease in reversed(serving):
        if lease.key == first or not lease.empty or remaining <= 1:
            continue
        seen = [empty_since.get(part.subnet) for part in lease.parts]
        if any(t is None for t in seen):
            continue
        since = max(t for t in seen if t is not None)  # empty as a whole since then
        if now - since < settings.hold_down_seconds:
            continue
        after = {f: n - lease.free(f) for f, n in left.items()}
        if any(n < settings.min_free_addresses for n in after.values()):
            continue
        release.append(lease.key)
        remaining -= 1
        left = after
        clauses.append(
            f"{lease.key} has been empty for {now - since:.0f} s and the node keeps "
            f"{_free_text(left)} without it: release it"
        )
    return release


def update_empty_since(
    leases: Iterable[LeaseUsage], empty_since: Mapping[IPNetwork, float], now: float
) -> dict[IPNetwork, float]:
    """The next ``empty_since``: empty subnets keep their first time seen empty (or
    get ``now``); a subnet that is no longer empty, or no longer held, drops out."""
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
