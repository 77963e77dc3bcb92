"""The node's IPAM: one PoolAllocator per lease, persisted before every answer.

Each operation takes a thread lock, then the state directory's file lock,
re-reads any pool file another process changed and applies the change in memory; the
pool's file is written before the answer, in a batch shared with the requests that
changed pools meanwhile (group commit, ``ipam.store``): a burst of ADDs writes and
fsyncs each pool file a few times, not once per address. So an answer given to a CNI
request is on disk: a SIGKILLed agent restarts with every allocation it handed out and
every cooldown it started (cooldowns are wall-clock times, so a restart does not free
cooling addresses early).

Pools of leases the node no longer holds stay loaded and on disk, so their
pods can still be found, released and garbage-collected; they get no new
allocations. A lease leaves IPAM for good only through ``remove_lease_if_empty``,
which refuses while any of its addresses is assigned or cooling.

Warm capacity (``ipam.capacity``): ``set_low_free_watch`` names a threshold and a
callback; the allocation that leaves fewer free addresses than that (or an ADD
that finds none) calls it before returning, so the agent asks for another lease
while addresses remain instead of waiting for a periodic loop (field-notes §2).

Both families: leases of either family may be given to ``set_leases``; a pod gets
one address per family that has a lease (``allocate_all``), each in its family's
pool file, so crash-safety is the same for both (an address without a CNI record,
from an ADD that died between the two, is released by the start-up GC). Warm
capacity is judged per family: ``usage()`` lists the subnets of both, and the low-free
watch counts the free addresses of the family an allocation was made in (an
IPv6SubnetLen of /120 runs dry as a /24 does).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import TracebackType

from flannelpy.errors import ConfigError, StoreError
from flannelpy.ipam.allocator import (
    Accounting,
    Allocation,
    IPAddress,
    IPNetwork,
    PoolAllocator,
    exhaustion_message,
)
from flannelpy.ipam.capacity import LeaseUsage
from flannelpy.ipam.errors import IpamExhausted
from flannelpy.ipam.hostlocal import HostLocalEntry, remove_entry
from flannelpy.ipam.store import IpamStore

log = logging.getLogger("flannelpy.ipam")

# Called with the free addresses left on serving leases of the family an allocation was
# made in (cooling ones not counted).
LowFreeCallback = Callable[[int], None]

# Lower bound of one wait step, so a clock that rounds cannot spin the loop.
_MIN_WAIT_STEP = 0.001


class NodeIpam:
    """Thread-safe pod address management for the leases of one node."""

    def __init__(
        self,
        state_dir: str,
        cooldown_seconds: float = 30,
        wait_seconds: float = 0,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[float], None] = time.sleep,
        fsync: bool = True,
        host_local_dir: str | None = None,
    ) -> None:
        _check_seconds("ipCooldownSeconds", cooldown_seconds)
        _check_seconds("ipWaitSeconds", wait_seconds)
        self.cooldown_seconds = cooldown_seconds
        self.wait_seconds = wait_seconds
        self._clock = clock
        self._sleep = sleep
        self._lock = threading.Lock()
        self._waiters: list[object] = []  # tickets of allocate() calls waiting, oldest first
        self._deferred = threading.local()  # .tickets: commits allocate_all_deferred left
        self._store = IpamStore(state_dir, fsync=fsync, lock=self._lock, reload=self._reload)
        self._pools: dict[IPNetwork, PoolAllocator] = {}
        self._leases: list[IPNetwork] = []
        self._allocatable: list[IPNetwork] = []
        self._low_free: tuple[int, LowFreeCallback | None] = (0, None)
        # host-local's data dir on this node (ipam.hostlocal): its entries are held for
        # their pods, and a release forgets the released pod's entry there too.
        self._host_local_dir = host_local_dir
        self._foreign: list[HostLocalEntry] = []
        # The longest cooldown any request asked for (a CNI config may set its own):
        # emptiness, which decides a lease's release, must not end a cooldown early.
        # On disk, so a restart with a shorter default does not end one either.
        self._longest_cooldown = cooldown_seconds
        # Load every pool on disk: DEL and GC must work before the lease is known.
        with self._locked():
            for subnet in self._store.subnets():
                self._pools[subnet] = self._load(subnet)
            persisted = self._store.load_longest_cooldown()
            if persisted is not None:
                self._longest_cooldown = max(self._longest_cooldown, persisted)

    @contextmanager
    def _locked(self) -> Iterator[None]:
        """Both locks for one operation. What it wrote is durable when this returns: the
        pool files are written and the directory fsync'd after both locks are released,
        in a batch shared with the requests that wrote meanwhile (``IpamStore.commit``).
        An operation that fails still commits what it saved (it holds the file lock)."""
        ticket: int | None = None
        ok = False
        try:
            with self._lock:
                try:
                    with self._store.locked():
                        yield
                finally:
                    ticket = self._store.take_ticket()
            ok = True
        finally:
            if ticket is not None and not ok:
                with contextlib.suppress(StoreError):
                    self._store.commit(ticket)
        if ticket is None:
            return
        deferred: list[int] | None = getattr(self._deferred, "tickets", None)
        if deferred is not None:  # allocate_all_deferred's caller commits
            deferred.append(ticket)
        else:
            self._store.commit(ticket)

    def close(self) -> None:
        with self._lock:
            self._store.close()

    def __enter__(self) -> NodeIpam:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def families(self) -> list[int]:
        """The address families pods get (those with a lease), IPv4 first."""
        return sorted({s.version for s in self._leases})

    def set_leases(
        self,
        subnets: Sequence[IPNetwork],
        allocatable: Sequence[IPNetwork] | None = None,
    ) -> None:
        """The node's leases in preference order (oldest first); ``allocatable``
        (default: all) may receive new addresses, walked in the leases' order; the
        others are draining. Pools of leases not listed keep their allocations."""
        chosen = list(subnets) if allocatable is None else list(allocatable)
        unknown = [s for s in chosen if s not in subnets]
        if unknown:
            raise ValueError(f"allocatable subnets {unknown} are not among the leases {subnets}")
        # One order for everything: the leases'. A caller's set decides only which.
        chosen = [s for s in subnets if s in chosen]
        with self._locked():
            for subnet in subnets:
                if subnet not in self._pools:
                    self._pools[subnet] = self._load(subnet)
            self._leases = list(subnets)
            self._allocatable = chosen

    def hold_foreign(self, entries: Sequence[HostLocalEntry]) -> list[HostLocalEntry]:
        """Hold exactly ``entries``, addresses another IPAM on this node gave its pods (the
        current ones: a hold no longer listed is freed into cooldown), in the pools of
        known leases. Returns the entries held; one assigned by us is skipped, with a
        warning when to another pod."""
        with self._locked():
            self._refresh()
            self._foreign = list(entries)
            held: list[HostLocalEntry] = []
            now = self._clock()
            for subnet, pool in self._pools.items():
                mine = [e for e in self._foreign if e.ip in subnet]
                changed = bool(pool.release_holds_except({e.ip for e in mine}, now))
                for entry in mine:
                    if pool.held().get(entry.ip) == (entry.container_id, entry.ifname):
                        held.append(entry)
                    elif pool.hold(entry.ip, entry.container_id, entry.ifname):
                        held.append(entry)
                        changed = True
                    else:
                        self._warn_unheld(pool, entry)
                if changed:
                    self._save(subnet)
            return held

    @staticmethod
    def _warn_unheld(pool: PoolAllocator, entry: HostLocalEntry) -> None:
        ours = next((a for a in pool.allocations() if a.ip == entry.ip), None)
        if ours is not None and (ours.container_id, ours.ifname) != (
            entry.container_id,
            entry.ifname,
        ):
            log.warning(
                "host-local and this agent both gave an address ip=%s host_local=%s/%s "
                "ours=%s/%s; one of the two pods must be re-created",
                entry.ip,
                entry.container_id,
                entry.ifname,
                ours.container_id,
                ours.ifname,
            )

    def set_low_free_watch(self, threshold: int, callback: LowFreeCallback | None) -> None:
        """Call ``callback(free)`` whenever an allocation leaves fewer than ``threshold``
        free addresses on the serving leases, or an ADD finds none.

        It runs in the CNI request's thread, without IPAM's locks, after the
        allocation is on disk and before the answer is sent: it must only wake
        whoever acquires the lease (set an event), never do I/O itself. An
        exception it raises is logged, not passed to the CNI request.
        Threshold 0 or callback None: off.
        """
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise ValueError(f"threshold must be a whole number >= 0, got {threshold!r}")
        self._low_free = (threshold, callback)

    def usage(self) -> list[LeaseUsage]:
        """Per current lease, in the leases' order: assigned, cooling and free (cooling
        never counts as free) with the default cooldown, and whether it is serving."""
        with self._locked():
            self._refresh()
            now = self._clock()
            return [
                LeaseUsage.of(
                    self._pools[s].accounting(now, self.cooldown_seconds), s in self._allocatable
                )
                for s in self._leases
            ]

    def is_empty(self, subnet: IPNetwork) -> bool:
        """No address of ``subnet`` is assigned or cooling (by the longest cooldown any
        request used): only then may its lease be released."""
        with self._locked():
            self._refresh()
            return self._is_empty(subnet, self._clock())

    def remove_lease_if_empty(self, subnet: IPNetwork) -> bool:
        """Forget ``subnet`` and delete its state file if no address of it is assigned
        or cooling; False (and nothing changes) otherwise.

        Check and removal happen under IPAM's locks, so no ADD can land on the
        lease in between: call this first and release the lease in the store only
        when it returns True. A subnet IPAM never knew is removed trivially.
        """
        with self._locked():
            self._refresh()
            if not self._is_empty(subnet, self._clock()):
                return False
            self._leases = [s for s in self._leases if s != subnet]
            self._allocatable = [s for s in self._allocatable if s != subnet]
            self._pools.pop(subnet, None)
            self._store.delete(subnet)
            return True

    def allocate(
        self,
        container_id: str,
        ifname: str,
        cooldown: float | None = None,
        wait: float | None = None,
        family: int | None = None,
    ) -> Allocation:
        """The existing allocation of (container_id, ifname) in ``family`` (default: the
        first family with a lease, IPv4 first), or a new one from the first allocatable
        lease of that family with a free address, on disk before returning.

        When every address is assigned or cooling, waits for the next cooling
        address if it frees within ``wait`` seconds; otherwise raises
        IpamExhausted at once (a wait that cannot succeed is not slept).
        """
        cooldown = self.cooldown_seconds if cooldown is None else cooldown
        wait = self.wait_seconds if wait is None else wait
        _check_seconds("ipCooldownSeconds", cooldown)
        _check_seconds("ipWaitSeconds", wait)
        if family is None:
            family = (self.families() or [4])[0]
        deadline = self._clock() + wait
        ticket = object()  # our place among waiting requests, once we wait
        threshold, on_low = self._low_free
        watching = threshold > 0 and on_low is not None
        left: int | None = None  # free addresses of the family after this request, if watched
        allocation: Allocation | None = None
        exhausted: IpamExhausted | None = None
        try:
            while True:
                with self._locked():
                    self._refresh()
                    found = self._find(container_id, ifname, family)
                    if found is not None:
                        return found
                    if cooldown > self._longest_cooldown:
                        self._store.save_longest_cooldown(cooldown)  # before it can matter
                        self._longest_cooldown = cooldown
                    now = self._clock()
                    # Freed addresses go to waiting requests in arrival order: an ADD that
                    # came later must not take the address a bounded wait is waiting for.
                    # A request that will not wait takes any free one (it would fail else).
                    ahead = self._ahead(ticket) if wait > 0 else 0
                    serving = [s for s in self._allocatable if s.version == family]
                    for subnet in serving:
                        pool = self._pools[subnet]
                        free = pool.accounting(now, cooldown).free
                        if free > ahead:
                            allocation = pool.allocate(container_id, ifname, now, cooldown)
                            self._save(subnet)
                            break
                        ahead -= free
                    if allocation is not None:
                        if watching:
                            left = self._free(now, cooldown, family)
                        break
                    accounting = [self._pools[s].accounting(now, cooldown) for s in serving]
                    step = _next_free_in(accounting)
                    owed = sum(a.free for a in accounting) > 0  # to earlier waiters, soon taken
                    if (step is None and not owed) or now + (step or 0) > deadline:
                        exhausted = IpamExhausted(exhaustion_message(accounting), accounting)
                        break
                    if ticket not in self._waiters:
                        self._waiters.append(ticket)
                # Sleep without the locks so releases and other requests proceed.
                self._sleep(max(step or 0, _MIN_WAIT_STEP))
        finally:
            with self._lock:
                if ticket in self._waiters:
                    self._waiters.remove(ticket)
        if allocation is None:
            assert exhausted is not None
            if watching:
                self._notify_low(on_low, 0)
            raise exhausted
        if left is not None and left < threshold:
            self._notify_low(on_low, left)
        return allocation

    def allocate_all(
        self,
        container_id: str,
        ifname: str,
        cooldown: float | None = None,
        wait: float | None = None,
    ) -> list[Allocation]:
        """One allocation per family with a lease, IPv4 first (see ``allocate``). When a
        later family has no free address, the ones this call made are released again."""
        families = self.families()
        if not families:
            return [self.allocate(container_id, ifname, cooldown, wait)]  # raises: no lease
        had = {a.family for a in self.find_all(container_id, ifname)}
        made: list[Allocation] = []
        try:
            for family in families:
                made.append(self.allocate(container_id, ifname, cooldown, wait, family))
        except BaseException:
            for alloc in made:
                if alloc.family not in had:
                    self._release_one(alloc)
            raise
        return made

    def allocate_all_deferred(
        self,
        container_id: str,
        ifname: str,
        cooldown: float | None = None,
        wait: float | None = None,
    ) -> tuple[list[Allocation], Callable[[], None]]:
        """``allocate_all``, and the commit of the state directory's fsync, left to the
        caller: it must call it before it answers anyone, and may run it beside other
        work meanwhile (ADD runs it in the thread that then writes the record, while the
        pod is plumbed). The pool file itself is written (and fsync'd) when this returns."""
        self._deferred.tickets = []
        try:
            allocations = self.allocate_all(container_id, ifname, cooldown, wait)
        except BaseException:
            tickets, self._deferred.tickets = self._deferred.tickets, None
            if tickets:
                self._store.commit(max(tickets))
            raise
        tickets, self._deferred.tickets = self._deferred.tickets, None
        if not tickets:
            return allocations, lambda: None
        last = max(tickets)
        return allocations, lambda: self._store.commit(last)

    def _release_one(self, alloc: Allocation) -> None:
        with self._locked():
            self._refresh()
            pool = self._pools.get(alloc.subnet)
            if pool is not None and pool.find(alloc.container_id, alloc.ifname) == alloc:
                pool.release(alloc.container_id, alloc.ifname, self._clock())
                self._save(alloc.subnet)

    def release(self, container_id: str, ifname: str) -> Allocation | None:
        """Put (container_id, ifname)'s addresses (every family) into cooldown; returns
        the first family's, None when it has none. Durable when this returns, in a batch
        shared with whatever else changed meanwhile (a DEL runs it after its reply)."""
        with self._locked():
            return self._release(container_id, ifname)

    def _release(self, container_id: str, ifname: str) -> Allocation | None:
        """release's work, under both locks."""
        self._refresh()
        first: Allocation | None = None
        for subnet, pool in sorted(self._pools.items(), key=_by_family):
            released = pool.release(container_id, ifname, self._clock())
            if released is not None:
                self._save(subnet)
                self._forget_host_local(released.ip, container_id, ifname)
                first = first or released
        if first is not None:
            return first
        # A pod host-local gave its addresses (one per family).
        for subnet, pool in sorted(self._pools.items(), key=_by_family):
            ip = pool.release_held(container_id, ifname, self._clock())
            if ip is not None:
                self._save(subnet)
                self._foreign = [e for e in self._foreign if e.ip != ip]
                self._forget_host_local(ip, container_id, ifname)
                first = first or Allocation(ip, subnet, container_id, ifname, self._clock())
        return first

    def _forget_host_local(self, ip: IPAddress, container_id: str, ifname: str) -> None:
        # Else a restart would hold the released address for a pod that is gone.
        if self._host_local_dir:
            remove_entry(self._host_local_dir, HostLocalEntry(ip, container_id, ifname))

    def find(self, container_id: str, ifname: str) -> Allocation | None:
        """The first family's allocation of (container_id, ifname)."""
        found = self.find_all(container_id, ifname)
        return found[0] if found else None

    def find_all(self, container_id: str, ifname: str) -> list[Allocation]:
        """Every allocation of (container_id, ifname), IPv4 first."""
        with self._locked():
            self._refresh()
            every = (p.find(container_id, ifname) for p in self._pools.values())
            return sorted((a for a in every if a is not None), key=_alloc_order)

    def allocations(self) -> list[Allocation]:
        """Every allocation on every pool (current or former leases), by address."""
        with self._locked():
            self._refresh()
            return self._allocations()

    def host_local_entries(self) -> list[HostLocalEntry]:
        """Every address this node's pods hold (ours and held ones), as host-local records
        them (both families): what host-local must know before it serves this node again."""
        with self._locked():
            self._refresh()
            entries = [HostLocalEntry(a.ip, a.container_id, a.ifname) for a in self._allocations()]
            for pool in self._pools.values():
                entries += [HostLocalEntry(ip, *key) for ip, key in pool.held().items()]
            return sorted(entries, key=lambda e: (e.ip.version, int(e.ip)))

    def accounting(self) -> list[Accounting]:
        """Per current lease, then per former lease that still has pods, with the
        default cooldown. Cooling addresses are never counted as free."""
        with self._locked():
            self._refresh()
            now = self._clock()
            result = [self._pools[s].accounting(now, self.cooldown_seconds) for s in self._leases]
            for subnet, pool in sorted(self._pools.items(), key=_by_family):
                if subnet not in self._leases:
                    former = pool.accounting(now, self.cooldown_seconds)
                    if former.assigned:
                        result.append(former)
            return result

    def gc(self, keep: Callable[[Allocation], bool]) -> list[Allocation]:
        """Release (into cooldown) every allocation ``keep`` rejects; returns them.

        ``keep`` runs without the locks (it may be slow, e.g. ask the runtime), so an
        allocation re-made meanwhile for the same container is left alone.
        """
        rejected = [a for a in self.allocations() if not keep(a)]
        released: list[Allocation] = []
        with self._locked():
            self._refresh()
            now = self._clock()
            changed: set[IPNetwork] = set()
            for old in rejected:
                pool = self._pools.get(old.subnet)
                if pool is None or pool.find(old.container_id, old.ifname) != old:
                    continue
                if pool.release(old.container_id, old.ifname, now) is not None:
                    released.append(old)
                    changed.add(old.subnet)
            for subnet in sorted(changed, key=_net_order):
                self._save(subnet)
        return released

    # --- internals (called with both locks held, unless said otherwise) -----------

    def _free(self, now: float, cooldown: float, family: int) -> int:
        serving = [s for s in self._allocatable if s.version == family]
        return sum(self._pools[s].accounting(now, cooldown).free for s in serving)

    def _is_empty(self, subnet: IPNetwork, now: float) -> bool:
        pool = self._pools.get(subnet)
        if pool is None:  # perhaps another process's file
            pool = self._load(subnet)
        acc = pool.accounting(now, self._longest_cooldown)
        return acc.assigned == 0 and acc.cooling == 0

    @staticmethod
    def _notify_low(callback: LowFreeCallback | None, free: int) -> None:
        # Without the locks: the callback may read usage() (it should not, but must not
        # deadlock if it does). The allocation is on disk whatever the callback does.
        if callback is None:
            return
        try:
            callback(free)
        except Exception:
            log.exception("low free-address callback failed free=%d", free)

    def _ahead(self, ticket: object) -> int:
        """How many waiting requests are served before ``ticket``'s."""
        if ticket in self._waiters:
            return self._waiters.index(ticket)
        return len(self._waiters)

    def _find(self, container_id: str, ifname: str, family: int) -> Allocation | None:
        for pool in self._pools.values():
            if pool.family != family:
                continue
            found = pool.find(container_id, ifname)
            if found is not None:
                return found
        return None

    def _allocations(self) -> list[Allocation]:
        every = [a for pool in self._pools.values() for a in pool.allocations()]
        return sorted(every, key=_alloc_order)

    def _load(self, subnet: IPNetwork) -> PoolAllocator:
        doc = self._store.load(subnet)
        if doc is None:
            return PoolAllocator(subnet)
        try:
            pool = PoolAllocator.from_doc(doc)
        except ValueError as e:
            raise self._store.corrupt(subnet, str(e)) from e
        if pool.subnet != subnet:
            raise self._store.corrupt(subnet, f"it holds the state of {pool.subnet}")
        return pool

    def _refresh(self) -> None:
        # Another agent process on the same directory may have written a pool.
        self._reload([s for s in self._pools if self._store.changed(s)])

    def _reload(self, subnets: Sequence[IPNetwork]) -> None:
        """These pools as on disk (also after a batch holding their changes failed)."""
        for subnet in subnets:
            if subnet in self._pools:
                pool = self._pools[subnet] = self._load(subnet)
                for entry in self._foreign:  # holds are not on disk
                    if entry.ip in subnet:
                        pool.hold(entry.ip, entry.container_id, entry.ifname)

    def _save(self, subnet: IPNetwork) -> None:
        pool = self._pools[subnet]
        if subnet.version == 6:  # bounded state: see PoolAllocator.forget_cooled
            pool.forget_cooled(self._clock(), self._longest_cooldown)
        self._store.save(subnet, pool.to_json())


def _net_order(subnet: IPNetwork) -> tuple[int, IPNetwork]:
    return (subnet.version, subnet)


def _by_family(item: tuple[IPNetwork, PoolAllocator]) -> tuple[int, IPNetwork]:
    return _net_order(item[0])


def _alloc_order(alloc: Allocation) -> tuple[int, IPAddress]:
    return (alloc.family, alloc.ip)


def _next_free_in(accounting: Sequence[Accounting]) -> float | None:
    waits = [a.next_free_in for a in accounting if a.next_free_in is not None]
    return min(waits) if waits else None


def _check_seconds(name: str, value: float) -> None:
    if not value >= 0:
        raise ConfigError(f"{name} must be a number of seconds >= 0, got {value!r}")
