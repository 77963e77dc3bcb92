"""Pod address allocation inside one lease subnet: pure, no I/O, explicit clock.

Rules (field-notes §2, issue 3):

- The network address, the first address (the bridge's gateway) and the
  broadcast address are never handed out, nor are the ``reserved`` ones.
- A released address cools down for ``cooldown`` seconds before it may be
  handed out again, so proxies and peers forget it first. A cooling address is
  never free: not for allocation, not in accounting, not in error messages.
- Order spreads reuse: never-used addresses first, in address order starting
  after the last one handed out (host-local's round-robin), then released
  addresses least recently released first, once their cooldown has passed.
- ``allocate`` is idempotent per (container_id, ifname).
- A held address (``hold``: one another IPAM handed out on this node, e.g.
  host-local under the upstream flanneld) is never handed out and counts as
  assigned, until ``release_held`` frees it into cooldown. Holds are not saved:
  their owner's records are the truth, re-read at every start.

Times are wall-clock seconds (the state outlives the process). A wall clock
stepped backwards can only lengthen a cooldown, never shorten it.

Both families: an IPv6 lease (a /64) is far too large to list, so nothing here
enumerates a range. Addresses that left the never-used set (assigned, released,
held, reserved) are kept in one sorted list, and the next never-used address
after the cursor is found by bisection over it; state grows with the addresses
in use, never with the range. IPv6 has no broadcast address, but its last one is
skipped too, as for IPv4. ``forget_cooled`` (called for IPv6 pools, whose cursor
wraps only after 2^64 allocations) drops released addresses whose cooldown has
passed, so an IPv6 pool's state stays bounded by the pods it serves.
"""

from __future__ import annotations

import bisect
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from ipaddress import (
    IPv4Address,
    IPv4Interface,
    IPv4Network,
    IPv6Address,
    IPv6Interface,
    IPv6Network,
    ip_address,
    ip_network,
)
from typing import Any

from flannelpy.ipam.errors import IpamExhausted

DOC_VERSION = 1

Key = tuple[str, str]  # (container_id, ifname)
IPAddress = IPv4Address | IPv6Address
IPNetwork = IPv4Network | IPv6Network
IPInterface = IPv4Interface | IPv6Interface


@dataclass(frozen=True)
class Allocation:
    """One pod interface's address."""

    ip: IPAddress
    subnet: IPNetwork
    container_id: str
    ifname: str
    assigned_at: float  # wall-clock seconds

    @property
    def gateway(self) -> IPAddress:
        """The subnet's first address, held by the node's bridge."""
        return self.subnet.network_address + 1

    @property
    def family(self) -> int:
        """4 or 6."""
        return self.subnet.version

    @property
    def interface(self) -> IPInterface:
        """The pod's address with the lease's prefix length, e.g. 10.244.1.5/24."""
        if isinstance(self.ip, IPv6Address):
            return IPv6Interface((self.ip, self.subnet.prefixlen))
        return IPv4Interface((self.ip, self.subnet.prefixlen))


@dataclass(frozen=True)
class Accounting:
    """A lease's numbers at one instant; ``free`` never includes cooling addresses."""

    subnet: IPNetwork
    total: int  # allocatable addresses (excludes network, gateway, broadcast, reserved)
    assigned: int
    cooling: int
    free: int  # total - assigned - cooling
    next_free_in: float | None  # seconds until the earliest cooling address frees

    def describe(self) -> str:
        """``10.244.1.0/24: 200 assigned, 53 cooling down (next free in 12 s)``."""
        text = f"{self.subnet}: {self.assigned} assigned, {self.cooling} cooling down"
        if self.next_free_in is not None:
            # Round up: the message must never promise an address earlier than true.
            seconds = math.ceil(round(self.next_free_in, 3))
            text += f" (next free in {seconds} s)"
        return text


def exhaustion_message(accounting: Sequence[Accounting]) -> str:
    """The one sentence an exhausted allocation reports, one clause per lease."""
    if not accounting:
        return (
            "no free address: this node holds no allocatable lease yet "
            "(the agent has not acquired its subnet lease, or every lease is draining)"
        )
    return "no free address in " + "; ".join(a.describe() for a in accounting)


class PoolAllocator:
    """Allocations and cooldown state of one lease subnet (either family)."""

    def __init__(self, subnet: IPNetwork, reserved: Iterable[IPAddress] = ()) -> None:
        self.subnet = subnet
        # The allocatable range: the network address, the gateway (first address)
        # and the last address are never handed out.
        self._lo = int(subnet.network_address) + 2
        self._hi = int(subnet.broadcast_address) - 1
        self._reserved = frozenset(int(ip) for ip in reserved if self._lo <= int(ip) <= self._hi)
        # Every address that is not never-used: assigned, released, held or reserved,
        # sorted. Never-used addresses are the range minus this list.
        self._taken: list[int] = sorted(self._reserved)
        self._by_key: dict[Key, Allocation] = {}
        self._by_ip: dict[int, Allocation] = {}
        # Released, not re-assigned addresses sorted by (released_at, seq): the
        # head is the least recently released; seq keeps ties in release order.
        self._released: list[tuple[float, int, int]] = []
        self._released_ips: set[int] = set()
        self._seq = 0
        self._last: int | None = None  # the last address handed out (round-robin cursor)
        # The JSON entry of every assigned or released address (see to_json).
        self._entries: dict[int, str] = {}
        self._held: dict[int, Key] = {}  # address -> the foreign pod interface holding it

    @property
    def family(self) -> int:
        return self.subnet.version

    # --- queries ---------------------------------------------------------------

    def find(self, container_id: str, ifname: str) -> Allocation | None:
        return self._by_key.get((container_id, ifname))

    def allocations(self) -> list[Allocation]:
        """Current allocations in address order."""
        return [self._by_ip[ip] for ip in sorted(self._by_ip)]

    def accounting(self, now: float, cooldown: float) -> Accounting:
        _check_cooldown(cooldown)
        first_cooling = self._first_cooling_index(now, cooldown)
        cooling = len(self._released) - first_cooling
        next_free_in = self._released[first_cooling][0] + cooldown - now if cooling else None
        total = max(0, self._hi - self._lo + 1) - len(self._reserved)
        assigned = len(self._by_ip) + len(self._held)
        return Accounting(
            subnet=self.subnet,
            total=total,
            assigned=assigned,
            cooling=cooling,
            free=total - assigned - cooling,
            next_free_in=next_free_in,
        )

    # --- changes ---------------------------------------------------------------

    def allocate(self, container_id: str, ifname: str, now: float, cooldown: float) -> Allocation:
        """The existing allocation of (container_id, ifname), or a new one.

        Raises IpamExhausted when every address is assigned or cooling down.
        """
        _check_cooldown(cooldown)
        existing = self.find(container_id, ifname)
        if existing is not None:
            return existing
        ip = self._take_fresh()
        if ip is None:
            ip = self._take_released(now, cooldown)
        if ip is None:
            accounting = self.accounting(now, cooldown)
            raise IpamExhausted(exhaustion_message([accounting]), [accounting])
        allocation = Allocation(self._address(ip), self.subnet, container_id, ifname, now)
        self._assign(allocation)
        self._last = ip
        return allocation

    def release(self, container_id: str, ifname: str, now: float) -> Allocation | None:
        """Free (container_id, ifname)'s address into cooldown; None when it has none."""
        allocation = self._by_key.pop((container_id, ifname), None)
        if allocation is None:
            return None
        ip = int(allocation.ip)
        del self._by_ip[ip]
        self._push_released(ip, now)
        return allocation

    def forget_cooled(self, now: float, cooldown: float) -> int:
        """Drop released addresses whose cooldown has passed: they become never-used
        again (reached by the cursor after it wraps). Returns how many. For pools whose
        range dwarfs their pods (IPv6), where the released list would grow forever."""
        done = self._first_cooling_index(now, cooldown)
        for _, _, ip in self._released[:done]:
            self._released_ips.discard(ip)
            self._entries.pop(ip, None)
            self._untake(ip)
        del self._released[:done]
        return done

    def held(self) -> dict[IPAddress, Key]:
        return {self._address(ip): key for ip, key in sorted(self._held.items())}

    def hold(self, ip: IPAddress, container_id: str, ifname: str) -> bool:
        """Keep ``ip`` for a pod another IPAM gave it to. False when it is not ours to
        keep: outside the allocatable range, or assigned by us (to that pod or another)."""
        if ip.version != self.family:
            return False
        address = int(ip)
        if not self._usable(address) or address in self._by_ip:
            return False
        if address in self._released_ips:
            self._released = [e for e in self._released if e[2] != address]
            self._released_ips.discard(address)
            self._entries.pop(address, None)
        self._take(address)
        self._held[address] = (container_id, ifname)
        return True

    def release_held(self, container_id: str, ifname: str, now: float) -> IPAddress | None:
        """Free the address held for (container_id, ifname) into cooldown; None: none held."""
        for ip, key in self._held.items():
            if key == (container_id, ifname):
                del self._held[ip]
                self._push_released(ip, now)
                return self._address(ip)
        return None

    def release_holds_except(self, keep: set[IPAddress], now: float) -> list[IPAddress]:
        """Free every held address not in ``keep`` (its owner forgot it) into cooldown."""
        freed = [ip for ip in self._held if self._address(ip) not in keep]
        for ip in freed:
            del self._held[ip]
            self._push_released(ip, now)
        return [self._address(ip) for ip in freed]

    # --- persistence -----------------------------------------------------------

    def to_json(self) -> bytes:
        """The state as compact JSON (what the store writes on every change).

        Entries are rendered once, when they change, so a write costs a join
        rather than an encode of the whole pool.
        """
        last = json.dumps(str(self._address(self._last)) if self._last is not None else None)
        allocations = ",".join(self._entries[ip] for ip in sorted(self._by_ip))
        # Least recently released first: the order allocation reuses them in.
        released = ",".join(self._entries[ip] for _, _, ip in self._released)
        return (
            f'{{"version":{DOC_VERSION},"subnet":"{self.subnet}","last":{last},'
            f'"allocations":[{allocations}],"released":[{released}]}}'
        ).encode()

    def to_doc(self) -> dict[str, Any]:
        """The state as a JSON document; ``from_doc`` resumes from it exactly."""
        doc: dict[str, Any] = json.loads(self.to_json())
        return doc

    @classmethod
    def from_doc(cls, doc: Mapping[str, Any], reserved: Iterable[IPAddress] = ()) -> PoolAllocator:
        """Rebuild from ``to_doc()`` output; raises ValueError naming what is wrong."""
        if doc.get("version") != DOC_VERSION:
            raise ValueError(f"unsupported IPAM state version {doc.get('version')!r}")
        try:
            subnet = ip_network(doc["subnet"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"IPAM state has no valid subnet: {doc.get('subnet')!r}") from e
        pool = cls(subnet, reserved)
        for entry in _list(doc, "allocations"):
            ip = pool._parse_usable(entry, "allocation")
            allocation = Allocation(
                ip=pool._address(ip),
                subnet=subnet,
                container_id=_text(entry, "container_id"),
                ifname=_text(entry, "ifname"),
                assigned_at=_number(entry, "assigned_at"),
            )
            if ip in pool._by_ip or (allocation.container_id, allocation.ifname) in pool._by_key:
                raise ValueError(f"IPAM state assigns {allocation.ip} or its container twice")
            pool._assign(allocation)
        for entry in _list(doc, "released"):
            ip = pool._parse_usable(entry, "released address")
            if ip in pool._by_ip or ip in pool._released_ips:
                raise ValueError(f"IPAM state lists released {pool._address(ip)} twice")
            pool._push_released(ip, _number(entry, "released_at"))
        last = doc.get("last")
        if last is not None:
            try:
                parsed = ip_address(last)
                if parsed.version != subnet.version:
                    raise ValueError(last)
                pool._last = int(parsed)
            except ValueError as e:
                raise ValueError(f"IPAM state has an invalid last address {last!r}") from e
        return pool

    # --- internals -------------------------------------------------------------

    def _address(self, ip: int) -> IPAddress:
        return IPv6Address(ip) if self.family == 6 else IPv4Address(ip)

    def _usable(self, ip: int) -> bool:
        return self._lo <= ip <= self._hi and ip not in self._reserved

    def _take(self, ip: int) -> None:
        index = bisect.bisect_left(self._taken, ip)
        if index == len(self._taken) or self._taken[index] != ip:
            self._taken.insert(index, ip)

    def _untake(self, ip: int) -> None:
        index = bisect.bisect_left(self._taken, ip)
        if index < len(self._taken) and self._taken[index] == ip:
            del self._taken[index]

    def _assign(self, allocation: Allocation) -> None:
        ip = int(allocation.ip)
        self._take(ip)
        self._by_ip[ip] = allocation
        self._by_key[(allocation.container_id, allocation.ifname)] = allocation
        self._entries[ip] = _compact(
            {
                "ip": str(allocation.ip),
                "container_id": allocation.container_id,
                "ifname": allocation.ifname,
                "assigned_at": allocation.assigned_at,
            }
        )

    def _take_fresh(self) -> int | None:
        # Round-robin from the last address handed out, as host-local does:
        # it spreads reuse across the range, which cooldown then formalises.
        last = self._last
        start = last + 1 if last is not None and self._lo <= last < self._hi else self._lo
        found = self._next_untaken(start)
        if found is None and start > self._lo:
            found = self._next_untaken(self._lo)
        return found

    def _next_untaken(self, start: int) -> int | None:
        """The lowest never-used address >= ``start`` in range, without listing any:
        ``taken`` is strictly increasing, so ``taken[j] - j`` never decreases, and the
        run of taken addresses from ``start`` on ends where it first exceeds its start."""
        taken = self._taken
        i = bisect.bisect_left(taken, start)
        if i < len(taken) and taken[i] == start:
            j = bisect.bisect_right(range(len(taken)), start - i, lo=i, key=lambda k: taken[k] - k)
            start += j - i
        return start if start <= self._hi else None

    def _take_released(self, now: float, cooldown: float) -> int | None:
        if not self._released:
            return None
        released_at, _, ip = self._released[0]
        if released_at + cooldown > now:  # the oldest still cools, so all do
            return None
        self._released.pop(0)
        self._released_ips.discard(ip)
        return ip

    def _push_released(self, ip: int, released_at: float) -> None:
        self._seq += 1
        self._take(ip)
        bisect.insort(self._released, (released_at, self._seq, ip))
        self._released_ips.add(ip)
        self._entries[ip] = _compact({"ip": str(self._address(ip)), "released_at": released_at})

    def _first_cooling_index(self, now: float, cooldown: float) -> int:
        # Sorted by released_at, so the addresses past cooldown form a prefix.
        return bisect.bisect_right(self._released, now, key=lambda e: e[0] + cooldown)

    def _parse_usable(self, entry: Any, what: str) -> int:
        if not isinstance(entry, Mapping):
            raise ValueError(f"IPAM state has a {what} that is not an object: {entry!r}")
        try:
            parsed = ip_address(entry["ip"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"IPAM state has a {what} without a valid ip: {entry!r}") from e
        ip = int(parsed)
        if parsed.version != self.family or not self._usable(ip):
            raise ValueError(
                f"IPAM state has a {what} {parsed} that is not an allocatable "
                f"address of {self.subnet}"
            )
        return ip


def _compact(entry: dict[str, Any]) -> str:
    return json.dumps(entry, separators=(",", ":"))


def _check_cooldown(cooldown: float) -> None:
    if not cooldown >= 0:
        raise ValueError(f"cooldown must be a number of seconds >= 0, got {cooldown!r}")


def _list(doc: Mapping[str, Any], key: str) -> list[Any]:
    value = doc.get(key, [])
    if not isinstance(value, list):
        raise ValueError(f"IPAM state key {key!r} is not a list")
    return value


def _text(entry: Mapping[str, Any], key: str) -> str:
    value = entry.get(key)
    if not isinstance(value, str) or not value:
        raise ValueError(f"IPAM state entry {entry!r} has no {key}")
    return value


def _number(entry: Mapping[str, Any], key: str) -> float:
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"IPAM state entry {entry!r} has no numeric {key}")
    return float(value)
