"""etcd mode's SubnetManager: Flannel's lease keys and JSON over any Store.

Each lease key (:func:`flannelpy.subnet.keys.lease_key`) is attached to a real
etcd lease of ``--subnet-lease-ttl`` seconds (24 h, as Flannel); a key without
an etcd lease is a permanent reservation and stays one when reused. The choice
of subnet is :mod:`flannelpy.subnet.choose`'s; this class only does I/O, over
the :class:`~flannelpy.store.etcd.kv.Store` protocol (the gRPC adapter is
:mod:`flannelpy.store.etcd.client`, the in-memory fake is in ``kv``).
"""

from __future__ import annotations

import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from ipaddress import IPv4Network, IPv6Network

from flannelpy.config.netconf import NetworkConfig
from flannelpy.config.settings import AgentSettings
from flannelpy.control.records import NodeStatus, heartbeat_deadline, names_holder
from flannelpy.errors import (
    ConfigError,
    KeyExists,
    MalformedWatchEvent,
    RevisionCompacted,
    StoreError,
    StoreUnavailable,
)
from flannelpy.retry import Backoff
from flannelpy.store.etcd.config import read_network_config
from flannelpy.store.etcd.kv import GrantedLease, Store, WatchEvent
from flannelpy.subnet.choose import LeaseChoice, choose_lease, choose_new_subnet
from flannelpy.subnet.keys import (
    key_to_subnet,
    lease_key,
    status_key,
    subnet_to_key,
    subnets_prefix,
)
from flannelpy.subnet.lease import Lease, LeaseAttrs
from flannelpy.subnet.manager import CallbackFailed, LeasesCallback, guarded
from flannelpy.subnet.memo import LeaseSnapshot
from flannelpy.subnet.pools import Pool
from flannelpy.subnet.validate import UNDECODABLE, Rejection

log = logging.getLogger(__name__)

RACE_RETRIES = 10  # Flannel's: acquire re-lists and chooses again after a lost race
# How long past its renewal time a holder may still renew (its retries run every minute).
RENEW_GRACE_SECONDS = 300.0


def _wait(stop: threading.Event, seconds: float) -> None:
    stop.wait(seconds)


def _utc(unix: float) -> str:
    return datetime.fromtimestamp(unix, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


class EtcdSubnetManager:
    """SubnetManager over etcd (or any Store), keeping Flannel's keys and JSON.

    ``clock`` gives unix time for lease expirations; ``sleep(stop, seconds)``
    waits between watch reconnects and must return early once ``stop`` is set.
    ``on_watch_restart(reason)`` is told each time the watch must re-list:
    "compacted" or "unavailable" (for metrics). ``backoff`` makes the watch's
    reconnect delays (tests pass one without jitter).
    """

    def __init__(
        self,
        store: Store,
        settings: AgentSettings,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[threading.Event, float], None] = _wait,
        rng: random.Random | None = None,
        on_watch_restart: Callable[[str], None] | None = None,
        backoff: Callable[[], Backoff] = Backoff,
    ) -> None:
        self._store = store
        self._on_watch_restart = on_watch_restart
        self._prefix = settings.etcd_prefix.rstrip("/")
        self._subnets = subnets_prefix(self._prefix)
        self._ttl = settings.subnet_lease_ttl
        margin = settings.subnet_lease_renew_margin * 60  # when every holder renews
        self._margin = float(min(margin, settings.subnet_lease_ttl))
        self._heartbeat = settings.status_publish_interval  # a holder's, unless it says
        self._acquired = False  # the first acquire is the agent's start
        self._clock = clock
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._backoff = backoff
        self._warned: set[str] = set()
        self._warned_lock = threading.Lock()
        self._undecodable: dict[str, Rejection] = {}  # by key suffix; guarded by the lock
        # The acquisition's list plus its own write, when that is the store at the write's
        # revision: the lease watch's first list (guarded by the lock).
        self._listed_at_acquire: tuple[dict[str, Lease], int] | None = None

    # -- config --------------------------------------------------------------

    def get_network_config(self) -> NetworkConfig:
        return read_network_config(self._store, self._prefix)[1]

    # -- reading leases ------------------------------------------------------

    def list_leases(self) -> tuple[dict[str, Lease], int]:
        """Every parseable lease under ``<prefix>/subnets/``, by key, and the revision."""
        items, revision = self._store.get_prefix(self._subnets)
        with self._warned_lock:
            self._undecodable.clear()  # a fresh list says what is undecodable now
        leases = {}
        for kv in items:
            lease = self._parse(kv.key, kv.value, kv.mod_revision, kv.lease_id)
            if lease is not None:
                leases[lease.key] = lease
        return leases, revision

    def _parse(self, key: str, value: bytes, mod_revision: int, lease_id: int) -> Lease | None:
        suffix = key[len(self._subnets) :]
        try:
            subnet, ipv6_subnet = key_to_subnet(suffix)
            if subnet_to_key(subnet, ipv6_subnet) != suffix:
                raise ValueError("the key is not in canonical ADDRESS-PREFIXLEN form")
            attrs = LeaseAttrs.from_json(value)
        except ValueError as e:
            self._warn_once(key, str(e))
            with self._warned_lock:
                self._undecodable[suffix] = Rejection(suffix, UNDECODABLE, str(e)[:200])
            return None
        with self._warned_lock:
            self._undecodable.pop(suffix, None)
        # Expiration is only known for leases we write ourselves (it would cost one
        # request per lease); store_lease_id tells a TTL lease from a reservation.
        return Lease(
            subnet=subnet,
            attrs=attrs,
            expiration=None,
            ipv6_subnet=ipv6_subnet,
            revision=mod_revision,
            store_lease_id=lease_id or None,
        )

    def undecodable(self) -> dict[str, Rejection]:
        """The values under subnets/ that are no lease (by key suffix), as last seen."""
        with self._warned_lock:
            return dict(self._undecodable)

    def _key(self, lease: Lease) -> str:
        """The etcd key of a lease: ``<prefix>/subnets/10.244.1.0-24``."""
        return self._subnets + lease.key

    def _warn_once(self, key: str, error: str) -> None:
        with self._warned_lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning("ignoring a key under subnets/ that is not a lease key=%s error=%s", key, error)

    # -- acquire / renew / release ------------------------------------------

    def acquire_lease(
        self,
        attrs: LeaseAttrs,
        previous_subnet: IPv4Network | None,
        pools: Sequence[Pool] | None = None,
        cluster: str | None = None,
        previous_ipv6_subnet: IPv6Network | None = None,
    ) -> Lease:
        config = self.get_network_config()
        for attempt in range(1, RACE_RETRIES + 1):
            leases, listed = self.list_leases()
            choice = choose_lease(
                config,
                list(leases.values()),
                attrs,
                previous_subnet,
                self._rng,
                pools=pools,
                cluster=cluster,
                holder_gone=self._holder_gone,
                previous_ipv6_subnet=previous_ipv6_subnet,
            )
            if choice.name_conflict is not None:
                self._name_conflict(choice.name_conflict, attrs)
            for stale in choice.delete:
                if self._store.delete_if_mod_revision(self._key(stale), stale.revision):
                    log.info(
                        "deleted our lease that no longer fits the network config "
                        "subnet=%s public_ip=%s network=%s",
                        stale.subnet,
                        stale.attrs.public_ip,
                        config.network,
                    )
            lease = self._write_choice(choice, attrs)
            if lease is not None:
                self._log_acquired(choice, lease)
                if not self._acquired:  # the start: the lease watch begins next
                    self._keep_list(leases, listed, lease, attrs)
                self._acquired = True
                return lease
            log.info(
                "lost a race for a subnet; choosing again subnet=%s attempt=%d",
                choice.subnet,
                attempt,
            )
        raise StoreError(
            f"could not acquire a lease in {RACE_RETRIES} attempts: other nodes kept taking "
            "the chosen subnets first; retry, and check for many nodes starting at once"
        )

    def _keep_list(
        self, leases: dict[str, Lease], listed: int, ours: Lease, attrs: LeaseAttrs
    ) -> None:
        """At the start, if nothing but our write came after the list (its revision is
        the next), the list plus our lease is the store at that revision: the lease
        watch's first list is this one rather than every lease read again, which at
        5,000 leases is a tenth of a second here and as much of etcd's work, on every
        node that starts. Later lists are read afresh."""
        if ours.revision != listed + 1:
            return
        key = lease_key(self._prefix, ours.subnet, ours.ipv6_subnet)
        own = self._parse(key, attrs.to_json().encode(), ours.revision, ours.store_lease_id or 0)
        if own is not None:
            with self._warned_lock:
                self._listed_at_acquire = ({**leases, own.key: own}, ours.revision)

    def _first_list(self) -> tuple[dict[str, Lease], int]:
        with self._warned_lock:
            kept, self._listed_at_acquire = self._listed_at_acquire, None
        return kept if kept is not None else self.list_leases()

    def _holder_gone(self, lease: Lease) -> bool:
        """Proof that the node holding ``lease`` (under our node name) stopped, either
        way (README, "Two nodes, one name"): its etcd lease is well past the renewal every
        holder makes ``margin`` before expiry, or its status heartbeat has been silent
        past :func:`~flannelpy.control.records.heartbeat_deadline`. A reservation (no
        etcd lease) is never proven gone; nor is anything while etcd cannot say."""
        if lease.store_lease_id is None:
            return False
        try:
            remaining = self._store.lease_remaining(lease.store_lease_id)
        except StoreError:
            return False
        if remaining is None:
            return True  # expired: its key goes with it
        if remaining < self._margin - min(RENEW_GRACE_SECONDS, self._margin / 2):
            return True
        deadline = self._heartbeat_deadline(lease)
        return deadline is not None and self._clock() > deadline

    def _heartbeat_deadline(self, lease: Lease) -> float | None:
        """When the holder's heartbeat counts as stopped, from the status record under its
        name if that record is the holder's own (flanneld writes none); else None."""
        name = lease.attrs.node_name
        if name is None:
            return None
        try:
            kv = self._store.get(status_key(self._prefix, name))
        except StoreError:
            return None
        if kv is None:
            return None
        try:
            status = NodeStatus.from_json(kv.value)
        except ValueError:
            return None
        if not names_holder(status, lease.attrs.public_ip, lease.attrs.public_ipv6):
            return None
        return heartbeat_deadline(status, self._heartbeat)

    def _name_conflict(self, other: Lease, attrs: LeaseAttrs) -> None:
        """Another live node leases under our name: refuse at start; later (a lost lease
        being re-acquired) take a fresh subnet rather than its lease."""
        if self._acquired:
            log.warning(
                "another live node holds a lease under this node's name; not taking it "
                "subnet=%s node=%s its_public_ip=%s",
                other.subnet,
                attrs.node_name,
                other.attrs.public_ip,
            )
            return
        deadline = self._heartbeat_deadline(other)
        when = (
            f"start this node again after {_utc(deadline)}, when its status heartbeat will "
            f"have been silent long enough to prove it, or delete {self._key(other)} now"
            if deadline is not None
            else f"delete {self._key(other)} from etcd"
        )
        raise ConfigError(
            f"node name {attrs.node_name!r} is already used by the live node at "
            f"{other.attrs.public_ip} (it holds lease {other.subnet} and renews it), so this "
            f"node at {attrs.public_ip} refuses to start; give each node its own name "
            f"(--node-name or NODE_NAME), or, if {other.attrs.public_ip} is really gone, "
            f"{when}"
        )

    def create_lease(self, attrs: LeaseAttrs, pools: Sequence[Pool], cluster: str | None) -> Lease:
        """One more lease for this node, in the first eligible pool with room (field
        notes §3). Raises PoolExhausted naming every pool and why, or StoreError."""
        config = self.get_network_config()
        for attempt in range(1, RACE_RETRIES + 1):
            leases, _ = self.list_leases()
            new = choose_new_subnet(config, pools, cluster, list(leases.values()), self._rng)
            choice = LeaseChoice(new.subnet, new.ipv6_subnet, "free", pool=new.pool)
            lease = self._write_choice(choice, attrs)
            if lease is not None:
                log.info(
                    "additional lease acquired subnet=%s pool=%s public_ip=%s",
                    lease.subnet,
                    new.pool.network,
                    attrs.public_ip,
                )
                return lease
            log.info(
                "lost a race for a subnet; choosing again subnet=%s attempt=%d", new.subnet, attempt
            )
        raise StoreError(
            f"could not acquire another lease in {RACE_RETRIES} attempts: other nodes kept "
            "taking the chosen subnets first; it is retried"
        )

    def _write_choice(self, choice: LeaseChoice, attrs: LeaseAttrs) -> Lease | None:
        existing = choice.existing
        # Flannel keeps a reservation (a key without an etcd lease) permanent on reuse.
        permanent = existing is not None and existing.store_lease_id is None
        key = lease_key(self._prefix, choice.subnet, choice.ipv6_subnet)
        value = attrs.to_json().encode()
        granted = None if permanent else self._store.grant_lease(self._ttl)
        lease_id = granted.id if granted else 0
        try:
            if existing is not None:
                revision = self._store.put_if_mod_revision(key, value, existing.revision, lease_id)
            else:
                revision = self._store.create(key, value, lease_id)
        except KeyExists:
            revision = None
        except StoreError:
            self._revoke_quietly(granted)
            raise
        if revision is None or (existing is None and self._lost_dual_race(choice, key, revision)):
            self._revoke_quietly(granted)
            return None
        return self._own_lease(choice.subnet, choice.ipv6_subnet, attrs, revision, granted)

    def _lost_dual_race(self, choice: LeaseChoice, key: str, revision: int) -> bool:
        """A dual-stack key names both subnets, so creating it does not stop another node
        from creating, at the same moment, a key with one of the same subnets and another
        of the other family. Whichever was created first keeps it: a later one (ours, at
        ``revision``) is deleted again and the caller chooses anew."""
        if choice.subnet is None or choice.ipv6_subnet is None:
            return False
        leases, _ = self.list_leases()
        earlier = [
            other
            for other_key, other in leases.items()
            if self._subnets + other_key != key
            and (other.subnet == choice.subnet or other.ipv6_subnet == choice.ipv6_subnet)
            and other.revision < revision
        ]
        if not earlier:
            return False
        self._store.delete_if_mod_revision(key, revision)
        log.info(
            "another node took one of the chosen subnets first; choosing again "
            "subnet=%s ipv6_subnet=%s",
            choice.subnet,
            choice.ipv6_subnet,
        )
        return True

    def _own_lease(
        self,
        subnet: IPv4Network | None,
        ipv6_subnet: IPv6Network | None,
        attrs: LeaseAttrs,
        revision: int,
        granted: GrantedLease | None,
    ) -> Lease:
        return Lease(
            subnet=subnet,
            attrs=attrs,
            expiration=self._clock() + granted.ttl if granted else None,
            ipv6_subnet=ipv6_subnet,
            revision=revision,
            store_lease_id=granted.id if granted else None,
        )

    def _log_acquired(self, choice: LeaseChoice, lease: Lease) -> None:
        old = choice.existing
        if choice.reason == "node-name" and old is not None:
            log.warning(
                "took over the lease of this node's previous address subnet=%s node=%s "
                "old_public_ip=%s public_ip=%s",
                lease.subnet,
                lease.attrs.node_name,
                old.attrs.public_ip,
                lease.attrs.public_ip,
            )
            return
        log.info(
            "lease acquired subnet=%s ipv6_subnet=%s public_ip=%s reason=%s expiration=%s",
            lease.subnet,
            lease.ipv6_subnet,
            lease.attrs.public_ip,
            choice.reason,
            lease.expiration,
        )

    def renew_lease(self, lease: Lease) -> Lease:
        """Grant a fresh etcd lease and rewrite the key with it (same key, new expiry).

        If our key vanished (expired while etcd was unreachable, or deleted by
        hand) it is re-created when still free; if another node holds it now,
        StoreError tells the caller to acquire a new lease.
        """
        permanent = lease.store_lease_id is None and lease.expiration is None
        value = lease.attrs.to_json().encode()
        granted = None if permanent else self._store.grant_lease(self._ttl)
        lease_id = granted.id if granted else 0
        try:
            revision = self._store.put_if_mod_revision(
                self._key(lease), value, lease.revision, lease_id
            ) or self._rewrite_after_conflict(lease, value, lease_id)
        except StoreError:
            self._revoke_quietly(granted)
            raise
        if lease.store_lease_id and lease.store_lease_id != lease_id:
            # The key now hangs on the new etcd lease; the old one holds nothing.
            self._revoke_quietly(GrantedLease(lease.store_lease_id, 0))
        renewed = self._own_lease(lease.subnet, lease.ipv6_subnet, lease.attrs, revision, granted)
        log.debug("lease renewed subnet=%s expiration=%s", renewed.subnet, renewed.expiration)
        return renewed

    def _rewrite_after_conflict(self, lease: Lease, value: bytes, lease_id: int) -> int:
        key = self._key(lease)
        current = self._store.get(key)
        if current is None:
            try:
                revision = self._store.create(key, value, lease_id)
            except KeyExists:
                current = self._store.get(key)
            else:
                log.warning("our lease was gone from etcd; re-created it subnet=%s", lease.subnet)
                return revision
        if current is not None and self._same_holder(current.value, lease.attrs):
            # Our own earlier write (e.g. a renew whose reply was lost): rewrite over it.
            rewritten = self._store.put_if_mod_revision(key, value, current.mod_revision, lease_id)
            if rewritten is not None:
                return rewritten
        holder = self._holder(current.value) if current is not None else "another node"
        raise StoreError(
            f"lease {lease.subnet} is now held by {holder}; acquire a new lease for this node"
        )

    @staticmethod
    def _same_holder(value: bytes, attrs: LeaseAttrs) -> bool:
        try:
            other = LeaseAttrs.from_json(value)
        except ValueError:
            return False
        return other.public_ip == attrs.public_ip and other.node_name == attrs.node_name

    @staticmethod
    def _holder(value: bytes) -> str:
        try:
            other = LeaseAttrs.from_json(value)
        except ValueError:
            return "a value that is not a lease"
        name = f" (node {other.node_name})" if other.node_name else ""
        return f"PublicIP {other.public_ip}{name}"

    def release_lease(self, lease: Lease) -> bool:
        """Delete our lease key (if still ours) and its etcd lease. True if the key went."""
        deleted = self._store.delete_if_mod_revision(self._key(lease), lease.revision)
        if lease.store_lease_id:
            self._revoke_quietly(GrantedLease(lease.store_lease_id, 0))
        log.info("lease released subnet=%s deleted=%s", lease.subnet, deleted)
        return deleted

    def _revoke_quietly(self, granted: GrantedLease | None) -> None:
        if granted is None:
            return
        try:
            self._store.revoke_lease(granted.id)
        except StoreError as e:
            # Harmless: an etcd lease without keys just expires.
            log.debug("revoking an unused etcd lease failed lease_id=%x error=%s", granted.id, e)

    # -- watch ---------------------------------------------------------------

    def watch_leases(self, on_leases: LeasesCallback, stop: threading.Event) -> None:
        """List, then watch from the listed revision, until ``stop`` is set.

        Compaction → re-list. Store outage → back off, then re-list rather than
        resume: etcd silently cancels a watch from a revision it does not have yet
        (an etcd restored from an older backup), which would hang us forever. A
        malformed event (no put or delete of a key under subnets/) → back off and
        re-list: its batch is never applied, so it can never remove a peer.
        Any other error (a bug, a value no parser foresaw) is logged, counted as
        "error" and handled like an outage: the watch never ends on input.
        Exceptions raised by ``on_leases`` propagate.
        """
        deliver = guarded(on_leases)
        backoff = self._backoff()
        leases: dict[str, Lease] | None = None
        delivered: LeaseSnapshot | None = None  # what on_leases saw last
        revision = 0
        while not stop.is_set():
            try:
                if leases is None:
                    leases, revision = self._first_list()
                    if leases != delivered:
                        backoff.reset()  # news reached us: the store works again
                    delivered = LeaseSnapshot(leases)  # a list: what changed is unknown
                    deliver(delivered, revision)
                stream = self._store.watch_prefix(self._subnets, revision + 1, stop)
                for batch in stream:
                    for event in batch.events:
                        self._check(event, revision)
                    for event in batch.events:
                        self._apply(leases, event)
                    revision = batch.revision
                    keys = frozenset(e.key[len(self._subnets) :] for e in batch.events)
                    delivered = LeaseSnapshot(leases, keys, delivered)
                    deliver(delivered, revision)
                    # Only delivered news proves the store healthy: a watch created and
                    # cancelled at once (no leader), over an unchanged list, backs off.
                    backoff.reset()
            except RevisionCompacted as e:
                log.warning(
                    "lease watch fell behind a compaction; re-listing revision=%d compacted=%d",
                    revision,
                    e.compacted_revision,
                )
                self._watch_restarted("compacted")
                leases = None
            except (StoreUnavailable, MalformedWatchEvent) as e:
                delay = backoff.next()
                log.warning("lease watch re-lists after a delay delay=%.1f error=%s", delay, e)
                self._watch_restarted(
                    "malformed" if isinstance(e, MalformedWatchEvent) else "unavailable"
                )
                leases = None
                self._sleep(stop, delay)
            except CallbackFailed as e:
                assert e.__cause__ is not None
                raise e.__cause__ from None
            except Exception as e:
                delay = backoff.next()
                log.exception(
                    "lease watch failed; re-listing after a delay delay=%.1f error=%s", delay, e
                )
                self._watch_restarted("error")
                leases = None
                self._sleep(stop, delay)

    def _watch_restarted(self, reason: str) -> None:
        if self._on_watch_restart is not None:
            self._on_watch_restart(reason)

    def _check(self, event: WatchEvent, revision: int) -> None:
        """Whatever the store adapter let through: a batch is applied whole or not at all."""
        if (
            event.kind not in ("put", "delete")
            or not event.key.startswith(self._subnets)
            or event.mod_revision <= revision
        ):
            raise MalformedWatchEvent(
                f"the lease watch sent a {event.kind!r} event for key {event.key[:200]!r} at "
                f"revision {event.mod_revision}, after revision {revision}; re-listing"
            )

    def _apply(self, leases: dict[str, Lease], event: WatchEvent) -> None:
        suffix = event.key[len(self._subnets) :]
        if event.kind == "delete":
            leases.pop(suffix, None)
            with self._warned_lock:
                self._undecodable.pop(suffix, None)
            return
        lease = self._parse(event.key, event.value, event.mod_revision, event.lease_id)
        if lease is None:
            leases.pop(suffix, None)  # a lease overwritten with garbage is gone
        else:
            leases[lease.key] = lease

    def close(self) -> None:
        self._store.close()
