"""The one path by which kernel state changes: observe, diff, apply.

It runs when the desired state changes (lease events), when the kernel reports
that something of ours changed (another tool deleted a route), and on a timer.
Triggers that arrive while a pass runs coalesce into one more pass.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol, TypeVar

from flannelpy import heap
from flannelpy.dataplane.diff import Identities, diff
from flannelpy.dataplane.kernel import Kernel
from flannelpy.dataplane.state import (
    Address,
    Changes,
    DesiredState,
    FdbEntry,
    Neighbour,
    NftTableSpec,
    ObservedState,
    PodRanges,
    VxlanLink,
    same_plan,
)
from flannelpy.errors import DataplaneError, FlannelpyError

if TYPE_CHECKING:
    from flannelpy.dataplane.wgspec import WgDeviceSpec

log = logging.getLogger("flannelpy.reconciler")
PLAN_CHANGED = "desired state changed"  # the pass's reason when only the plan changed
PERIODIC = "periodic resync"  # the reason of a pass the timer made (nothing triggered it)
POLICY_CHANGED = "policy table changed"  # a table written at once, outside a pass
READ_BACK = "policy table read back"  # the loop's step after such a write: no pass
# A periodic pass reads the kernel back at most this often (seconds) while the kernel's
# notifications reported nothing of ours: every deletion, device change and route of
# another tool wakes a pass that dumps at once (``netlink_events``), so what is left for
# the timer to find is a neighbour or FDB entry rewritten in place by another tool.
# The other periodic checks (the policy table, wireguard devices) keep the interval.
FULL_DUMP_SECONDS = 60.0
Scope = tuple[frozenset[str], frozenset[str]]  # what a pass reads: links, owned devices
KERNEL_EVENTS_WAIT = 0.02  # seconds a pass for kernel events waits for the rest of a burst


def after_apply(
    desired: DesiredState, observed: ObservedState, changes: Changes, owned: frozenset[str]
) -> ObservedState | None:
    """What a dump would find after ``changes`` (the diff of ``desired`` and ``observed``)
    were all applied: the planned entries, as :meth:`Kernel.observe` reports them (the
    neighbours and FDB entries of our own devices only). None when a device was created,
    re-created or changed: its attributes are the kernel's to report (a MAC it chose)."""
    if changes.links_to_create or changes.links_to_delete or changes.links_to_update:
        return None
    names = frozenset(link.name for link in observed.links)
    # The observed entries are on owned devices (a dump reads those only, a view keeps
    # those only): the plan is all on them when what it added is.
    compared = changes.compared if changes.compared and changes.compared.whole else None
    return ObservedState(
        links=observed.links,
        addresses=_on(desired.addresses, names),
        routes=desired.routes,
        neighbours=_on(desired.neighbours, owned, compared.neighbours[0] if compared else None),
        fdb=_on(desired.fdb, owned, compared.fdb_added if compared else None),
    )


def _as_planned(desired: DesiredState, owned: frozenset[str]) -> ObservedState:
    """What a dump finds of routes, neighbours and FDB entries when the kernel holds
    ``desired``: a dump that finds them so reports these sets (:meth:`Kernel.observe`)."""
    return ObservedState(
        links=frozenset(),
        addresses=frozenset(),
        routes=desired.routes,
        neighbours=_on(desired.neighbours, owned),
        fdb=_on(desired.fdb, owned),
    )


E = TypeVar("E", Address, Neighbour, FdbEntry)
_IFNAME = operator.attrgetter("ifname")


def _on(
    entries: frozenset[E], devices: frozenset[str], added: frozenset[E] | None = None
) -> frozenset[E]:
    """``entries`` on ``devices`` (all of them, as a plan has it, without a copy).
    ``added``: the entries not known to be on ``devices`` (the others are), if known."""
    if set(map(_IFNAME, entries if added is None else added)) <= devices:  # in C
        return entries
    return frozenset(entry for entry in entries if entry.ifname in devices)


@dataclass(frozen=True)
class ReconcileResult:
    reason: str
    changes: Changes
    failures: tuple[str, ...]
    duration_seconds: float
    finished_at: float = field(default_factory=time.time)

    @property
    def converged(self) -> bool:
        return not self.failures


class WireguardDevices(Protocol):
    """Where the planned WireGuard devices go (the node's wireguard runtime)."""

    def apply(self, specs: Iterable[WgDeviceSpec]) -> None: ...


class Firewall(Protocol):
    """Where the planned pod ranges go (the node's masq and forward rules)."""

    def apply(self, ranges: PodRanges) -> bool:
        """True once every rule is in place; raises while the firewall never worked."""
        ...


class PolicyRules(Protocol):
    """Where the planned NetworkPolicy table goes (:class:`~.policy_table.PolicyTable`)."""

    def apply(self, desired: NftTableSpec, read_back: bool = True) -> str | None:
        """Make the table ``desired``; why it was rebuilt whole, if it was. Raises
        DataplaneError. ``read_back=False``: the read-back of a write may wait for
        :meth:`remember`."""
        ...

    def remember(self) -> None:
        """Take the read-back a write left owed, if any (off a change's way)."""
        ...

    def counters(self, table: str) -> dict[str, int]:
        """The packets each named counter of the table counted (for ``/metrics``)."""
        ...


# Same-node pod-to-pod traffic crosses cni0 as bridged frames: the forward hook, where
# the policy table judges it, sees them only with these on (module br_netfilter).
BRIDGE_NF_SYSCTLS = ("net.bridge.bridge-nf-call-iptables", "net.bridge.bridge-nf-call-ip6tables")


class Reconciler:
    def __init__(
        self,
        kernel: Kernel,
        interval: float,
        on_result: Callable[[ReconcileResult], None] | None = None,
        on_error: Callable[[], None] | None = None,
        wireguard: WireguardDevices | None = None,
        firewall: Firewall | None = None,
        policy: PolicyRules | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self._kernel = kernel
        self._monotonic = monotonic
        self._dumped_at = float("-inf")  # when a pass last read the kernel
        self._policy = policy
        self._bridge_nf_on = False
        self._policy_failure: str | None = None
        self._policy_done: NftTableSpec | None = None  # the table last put in place, no failure
        self.policy_rebuilds = 0  # whole-table rebuilds (start, missing, changed)
        self._wireguard = wireguard
        self._firewall = firewall
        self._firewall_done: PodRanges | None = None  # the ranges whose rules are in place
        self._wireguard_failure: str | None = None
        self._interval = interval
        self._on_result = on_result
        self._on_error = on_error
        self._lock = threading.Lock()
        self._pass_lock = threading.Lock()  # one pass at a time: the loop, or a caller's
        self._desired: DesiredState | None = None
        self._stale_links: frozenset[str] = frozenset()
        self._wake = threading.Event()
        self._reasons: set[str] = set()
        self.last_result: ReconcileResult | None = None
        # The kernel's state of ours as the last pass left it (and what it was read for),
        # or None when that pass failed somewhere or changed a device.
        self._view: tuple[Scope, ObservedState] | None = None
        # The last diff and its inputs: a timer's pass between dumps, with the plan and the
        # view of the pass before, would compare a thousand entries to find nothing again.
        self._last_diff: tuple[DesiredState, ObservedState, Changes] | None = None
        # The identities of the view in _view, once a pass deleted or replaced entries
        # (diff.Identities).
        self._identities: Identities | None = None
        self.dumps = 0  # passes that read the kernel (the others knew it from the last)
        self._dumped_entries = 0  # routes, neighbours and FDB entries the last dump found

    @property
    def desired(self) -> DesiredState | None:
        with self._lock:
            return self._desired

    def set_desired(self, desired: DesiredState, stale_links: frozenset[str] = frozenset()) -> None:
        """Replace the desired state. ``stale_links`` are devices of ours to remove if present
        (e.g. the vxlan device after switching to host-gw)."""
        with self._lock:
            changed = not same_plan(desired, self._desired) or stale_links != self._stale_links
            self._desired = desired
            self._stale_links = stale_links
        if changed:
            self.trigger(PLAN_CHANGED)

    def set_desired_policy(self, desired: DesiredState) -> None:
        """Replace the desired state with one whose policy table alone is new (the caller
        says so: the planner's last plan with a new table). When no pass is running and a
        table is in place, the table is brought to it at once, on the caller's thread: a
        pass would first compare every route and neighbour again to find nothing, and a
        policy change waits for no thread to wake. Otherwise, or if the write fails, the
        next pass does it (and reports a failure as for any pass). The write's read-back
        (the reference for the next comparison) is left to the loop's thread."""
        with self._lock:
            self._desired = desired
        if self._policy_done is not None and self._pass_lock.acquire(blocking=False):
            try:
                failures = self._apply_policy(desired, POLICY_CHANGED, read_back=False)
            finally:
                self._pass_lock.release()
            if not failures:
                self.trigger(READ_BACK)
                return
        self.trigger(PLAN_CHANGED)

    def trigger(self, reason: str) -> None:
        with self._lock:
            self._reasons.add(reason)
        self._wake.set()

    def reconcile_once(self, reason: str = "requested") -> ReconcileResult | None:
        """One pass. Returns None while no desired state is known (never act blind:
        programming an empty peer set at start-up would delete live routes)."""
        with self._pass_lock:
            dumps = self.dumps
            result = self._pass(reason)
            dumped = self._dumped_entries if self.dumps != dumps else 0
        # The dump's entries, diffed, are garbage now: at thousands of peers they leave
        # megabytes of free pages with the allocator unless handed back.
        heap.after_bulk(dumped)
        return result

    def _pass(self, reason: str) -> ReconcileResult | None:
        with self._lock:
            desired = self._desired
            stale = self._stale_links
        if desired is None:
            return None
        started = time.monotonic()
        # The devices first: a route into flannel-wg must find its peer there.
        failures = self._apply_wireguard(desired)
        scope = (
            frozenset({link.name for link in desired.links} | stale),
            desired.owned_devices | stale,
        )
        known = observed = self._known(reason, scope)
        self._view = None  # until this pass has applied all it found to do
        if observed is None:
            observed = self._kernel.observe(*scope, expected=_as_planned(desired, scope[1]))
            self.dumps += 1
            self._dumped_entries = (
                len(observed.routes) + len(observed.neighbours) + len(observed.fdb)
            )
            self._dumped_at = self._monotonic()
            self._identities = None  # counted again below, if this pass deletes or replaces
        changes = self._diff(desired, observed)
        if not changes.empty:
            result = self._kernel.apply(changes)
            failures += result.failures + self._configure_new_links(changes.links_to_create)
            repaired = {k: v for k, v in changes.counts.items() if v}
            log.info(
                "reconciled reason=%r %s",
                reason,
                " ".join(f"{k}={v}" for k, v in sorted(repaired.items())),
            )
            for failure in failures[:10]:
                log.warning("reconcile failure: %s", failure)
        if failures:
            view = None
        elif known is not None and changes.empty:
            view = known  # the kernel as the pass before left it: the same view
        else:
            view = after_apply(desired, observed, changes, scope[1])
        self._view = (scope, view) if view is not None else None
        self._follow_identities(desired, observed, view, changes)
        if self._last_diff is not None and self._last_diff[1] is not view:
            # Only the kept view can meet a plan again: a dump's own entries (three
            # objects and their addresses per peer, beside the plan's equal ones) go now.
            self._last_diff = None
        failures += self._apply_firewall(desired)  # after the routes, as at start
        failures += self._apply_policy(desired, reason)
        if self._policy is not None:
            self._remember_policy()
        if changes.compared is not None:  # used: its sets (a start's: every entry) go now
            changes = replace(changes, compared=None)
        outcome = ReconcileResult(reason, changes, failures, time.monotonic() - started)
        self.last_result = outcome
        if self._on_result is not None:
            self._on_result(outcome)
        return outcome

    def _diff(self, desired: DesiredState, observed: ObservedState) -> Changes:
        """``diff(desired, observed)``; the last one again for the same two objects (it is
        a pure function of them). Only a kept view meets its plan twice: a dump or an
        applied change gives a new observed state."""
        last = self._last_diff
        if last is not None and last[0] is desired and last[1] is observed:
            return last[2]
        changes = diff(desired, observed, self._identities)
        self._last_diff = (desired, observed, replace(changes, compared=None))
        return changes

    def _follow_identities(
        self,
        desired: DesiredState,
        observed: ObservedState,
        view: ObservedState | None,
        changes: Changes,
    ) -> None:
        """Keep :class:`Identities` of the view the next pass starts from: changed by what
        this pass changed, or counted anew from a dump once a pass deletes or replaces
        something (a peer gone, a new VTEP MAC: the next such pass walks none of the
        entries)."""
        counted = self._identities
        if view is None:
            self._identities = None
        elif (
            counted is not None
            and counted.routes is observed.routes
            and (counted.neighbours is observed.neighbours)
        ):
            if view is not observed:
                # The diff's differences are the view's when the view is the plan.
                compared = changes.compared
                planned = compared is not None and compared.whole
                as_planned = planned and view.neighbours is desired.neighbours
                counted.follow(view, compared if as_planned else None)
        elif changes.compared is not None and (
            changes.compared.routes[1] or changes.compared.neighbours[1]
        ):  # this pass replaced or deleted entries: the next such pass needs counts
            self._identities = Identities(view)
        else:
            self._identities = None

    def _known(self, reason: str, scope: Scope) -> ObservedState | None:
        """What the kernel holds of ours without a dump, when a pass is only for a new
        plan, or is the timer's within FULL_DUMP_SECONDS of the last dump: the state the
        last pass left, if it left the kernel exactly as planned and nothing was reported
        since (another tool's change, lost notifications and every other reason dump the
        kernel again)."""
        if self._view is None or self._view[0] != scope:
            return None
        recent = self._monotonic() - self._dumped_at < FULL_DUMP_SECONDS
        if reason == PLAN_CHANGED or (reason == PERIODIC and recent):
            return self._view[1]
        return None

    def _apply_firewall(self, desired: DesiredState) -> tuple[str, ...]:
        """The rules for new ranges (after the routes). Unchanged ranges are left to
        :meth:`resync_firewall`, on the firewall's own timer: a pass runs on every lease
        event, and the rules need not be read back as often."""
        ranges = desired.firewall
        if self._firewall is None or ranges is None or ranges == self._firewall_done:
            return ()
        # Raises while the firewall never worked: the agent's start stops there.
        if not self._firewall.apply(ranges):
            return ("firewall rules not in place yet; the firewall timer retries",)
        self._firewall_done = ranges
        return ()

    def _apply_policy(
        self, desired: DesiredState, reason: str, read_back: bool = True
    ) -> tuple[str, ...]:
        """The NetworkPolicy table, checked and brought to the desired one; None desired
        (off, or not synced since start) leaves the kernel's table as it is. A pass only
        for a new plan whose table is the one last written leaves it too, as it leaves the
        routes undumped: every lease event makes such a pass, and reading the table back
        costs an nft run; the timer's and the kernel's passes still check it."""
        if self._policy is None or desired.policy is None:
            return ()
        if reason == PLAN_CHANGED and desired.policy is self._policy_done:
            return ()
        failures: list[str] = []
        if not self._bridge_nf_on:
            try:
                for name in BRIDGE_NF_SYSCTLS:
                    self._kernel.set_sysctl(name, "1")
                self._bridge_nf_on = True
            except DataplaneError as e:
                failures.append(
                    f"{name} cannot be set ({e}); set {name}=1 on the node (with the "
                    "br_netfilter module loaded) so that policy judges traffic between pods "
                    "of this node"
                )
        try:
            if self._policy.apply(desired.policy, read_back) is not None:
                self.policy_rebuilds += 1
        except DataplaneError as e:
            failures.append(f"policy: {e}")
        self._policy_done = None if failures else desired.policy
        failure = "; ".join(failures) or None
        if failure is not None and failure != self._policy_failure:  # said once
            log.warning("reconcile failure: %s", failure)
        self._policy_failure = failure
        return tuple(failures)

    def _remember_policy(self) -> None:
        assert self._policy is not None
        try:
            self._policy.remember()
        except DataplaneError as e:  # the next change finds no reference and rebuilds
            log.warning("reading the policy table back failed: %s", e)

    def resync_firewall(self) -> bool:
        """Check and repair the firewall's rules alone (its timer; a full pass would read
        every route too). False when there is nothing to check yet."""
        with self._pass_lock:
            desired = self.desired
            ranges = desired.firewall if desired is not None else None
            if self._firewall is None or ranges is None:
                return False
            try:
                if self._firewall.apply(ranges):
                    self._firewall_done = ranges
            except FlannelpyError as e:
                log.warning("firewall resync failed: %s", e)
            return True

    def _configure_new_links(self, links: Iterable[VxlanLink]) -> tuple[str, ...]:
        """A VTEP just created (or re-created, which starts from the defaults again): router
        adverts off, as flanneld sets them (an overlay device must not configure itself from
        them), and, when asked, transmit checksum offload off."""
        failures: list[str] = []
        for link in links:
            try:
                self._kernel.set_sysctl(f"net/ipv6/conf/{link.name}/accept_ra", "0")
            except DataplaneError as e:  # a host without IPv6 has none (flanneld ignores it)
                log.debug("accept_ra not set device=%s reason=%s", link.name, e)
            if link.tx_checksum_off:
                try:
                    self._kernel.set_tx_checksum(link.name, False)
                except DataplaneError as e:
                    failures.append(f"tx checksum offload of {link.name} not turned off: {e}")
        return tuple(failures)

    def _apply_wireguard(self, desired: DesiredState) -> tuple[str, ...]:
        if self._wireguard is None:
            return ()
        try:
            self._wireguard.apply(desired.wireguard)
        except (DataplaneError, OSError) as e:  # the next pass tries again
            failure = f"wireguard: {e}"
            if failure != self._wireguard_failure:  # said once, not every pass
                log.warning("reconcile failure: %s", failure)
            self._wireguard_failure = failure
            return (failure,)
        self._wireguard_failure = None
        return ()

    def run(self, stop: threading.Event) -> None:
        """Loop until ``stop``: a pass on every trigger, and at least every ``interval``."""
        while not stop.is_set():
            self._wake.wait(self._interval)
            if stop.is_set():
                return
            # Let a burst of kernel events (one deletion often brings several) arrive,
            # so that it costs one pass rather than one per event. A new plan alone goes
            # at once: the writer already made one plan of its burst of lease events.
            with self._lock:
                kernel_news = bool(self._reasons - {PLAN_CHANGED, READ_BACK})
            if kernel_news:
                stop.wait(KERNEL_EVENTS_WAIT)
            self._wake.clear()
            with self._lock:
                reasons = sorted(self._reasons) or [PERIODIC]
                self._reasons.clear()
            if reasons == [READ_BACK] and self._policy is not None:
                with self._pass_lock:  # a table written outside a pass: no pass for it
                    self._remember_policy()
                continue
            # A pass takes an owed read-back anyway; as a reason it would cost a dump.
            reasons = [r for r in reasons if r != READ_BACK] or [PLAN_CHANGED]
            try:
                self.reconcile_once(", ".join(reasons))
            except Exception:
                # A failed pass (netlink hiccup) must not end the loop; the next
                # trigger or tick retries, and readiness reports the failure.
                log.exception("reconcile pass failed")
                if self._on_error is not None:
                    self._on_error()
                self._wake.set()
                stop.wait(1.0)
