"""etcd mode: Flannel's keyspace and lease JSON over etcd v3.

Layout (shared with flanneld, so both can run in one cluster)::

    <prefix>/config                  net-conf.json
    <prefix>/subnets/10.244.1.0-24   {"PublicIP": ..., "BackendType": ..., "BackendData": ...}

Each lease key is attached to a real etcd lease of ``--subnet-lease-ttl``
seconds (24 h, as Flannel); a key without an etcd lease is a permanent
reservation and stays one when reused.

Two layers: :class:`EtcdStore` is a thin adapter from pyetcd to the
:class:`~flannelpy.subnet.store.Store` protocol (failover between endpoints,
TLS, auth, timeouts, gRPC errors mapped to ours); :class:`EtcdSubnetManager`
implements the SubnetManager protocol over any Store, with the choice of
subnet left to :mod:`flannelpy.subnet.choose`.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network
from typing import Any, TypeVar
from urllib.parse import urlsplit

import grpc
import pyetcd
from pyetcd import exceptions as etcd_exc
from pyetcd.watch import WatchResponse

from flannelpy.config.netconf import NetworkConfig, parse_network_config
from flannelpy.config.settings import AgentSettings
from flannelpy.errors import (
    ConfigError,
    KeyExists,
    RevisionCompacted,
    StoreError,
    StoreUnavailable,
)
from flannelpy.retry import Backoff
from flannelpy.subnet.choose import LeaseChoice, choose_lease, choose_new_subnet
from flannelpy.subnet.etcd.kv import GrantedLease, KeyValue, Store, WatchBatch, WatchEvent
from flannelpy.subnet.lease import Lease, LeaseAttrs, key_to_subnet, subnet_to_key
from flannelpy.subnet.manager import LeasesCallback
from flannelpy.subnet.pools import Pool

log = logging.getLogger("flannelpy.subnet.etcd.client")

REQUEST_TIMEOUT = 5.0  # seconds per etcd request, so a dead member never hangs a call
RACE_RETRIES = 10  # Flannel's: acquire re-lists and chooses again after a lost race
WATCH_POLL = 0.1  # seconds: how often a blocked watch looks at its stop event

# gRPC channel options: reconnect soon after etcd comes back (the default backoff
# grows to 120 s), and detect a silently dead peer on long-lived watch streams.
# etcd refuses keepalive pings more often than every 5 s, hence 10 s.
_GRPC_OPTIONS = [
    # etcd is always reached directly: an HTTP proxy set in the environment (for image
    # pulls, say) must not carry lease traffic, nor take lab traffic off the machine.
    ("grpc.enable_http_proxy", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
]

# pyetcd raises these when the member cannot be reached in time.
_UNREACHABLE = (
    etcd_exc.ConnectionFailedError,
    etcd_exc.ConnectionTimeoutError,
    etcd_exc.InternalServerError,
    etcd_exc.NoServerAvailableError,
    etcd_exc.WatchTimedOut,
)
_UNREACHABLE_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
}

T = TypeVar("T")


# ---------------------------------------------------------------------------
# Store adapter
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Endpoint:
    url: str
    host: str
    port: int
    secure: bool


def parse_endpoints(urls: Sequence[str]) -> list[_Endpoint]:
    """``http://127.0.0.1:2379`` → host, port, TLS or not. Raises ConfigError."""
    endpoints = []
    for raw in urls:
        url = raw.strip()
        parts = urlsplit(url if "://" in url else f"http://{url}")
        try:
            port = parts.port or 2379
        except ValueError:
            port = -1
        if parts.scheme not in ("http", "https") or not parts.hostname or port <= 0:
            raise ConfigError(
                f"--etcd-endpoints: {raw!r} is not an etcd URL; write it like "
                "http://127.0.0.1:2379 or https://etcd.example:2379"
            )
        endpoints.append(_Endpoint(url, parts.hostname, port, parts.scheme == "https"))
    if not endpoints:
        raise ConfigError("--etcd-endpoints is empty; give at least one etcd URL")
    return endpoints


def _read(path: str | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"{flag}: cannot read {path}: {e.strerror}; fix the path") from e


def _rpc_details(error: BaseException) -> str:
    """The gRPC status text behind a pyetcd exception (pyetcd drops it)."""
    for candidate in (error, error.__cause__, error.__context__):
        if isinstance(candidate, grpc.RpcError):
            code = candidate.code() if hasattr(candidate, "code") else None
            details = candidate.details() if hasattr(candidate, "details") else None
            name = code.name if code is not None else "UNKNOWN"
            return f"{name}: {details}"
    return str(error) or type(error).__name__


def _error_kind(error: BaseException) -> str:
    """A failed request's gRPC status in snake case ("permission_denied"), else "request"."""
    code = _rpc_code(error.__cause__) if error.__cause__ is not None else None
    return code.name.lower() if code is not None else "request"


def _rpc_code(error: BaseException) -> grpc.StatusCode | None:
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        code = error.code()
        return code if isinstance(code, grpc.StatusCode) else None
    return None


class EtcdStore:
    """:class:`~flannelpy.subnet.store.Store` over etcd v3 (pyetcd), with failover.

    Requests go to one endpoint until it fails to answer, then to the next;
    only when every endpoint failed does a call raise StoreUnavailable. Clients
    connect lazily, so constructing this never blocks.
    """

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        cafile: str | None = None,
        certfile: str | None = None,
        keyfile: str | None = None,
        username: str | None = None,
        password: str | None = None,
        timeout: float = REQUEST_TIMEOUT,
        on_error: Callable[[str], None] | None = None,
    ) -> None:
        self._endpoints = parse_endpoints(endpoints)
        # Told the kind of every failed request, for metrics: "unavailable" (no
        # endpoint answered) or the gRPC status in snake case ("permission_denied").
        self._on_error = on_error
        if (certfile is None) != (keyfile is None):
            raise ConfigError(
                "--etcd-certfile and --etcd-keyfile go together; give both or neither"
            )
        if (username is None) != (password is None):
            raise ConfigError(
                "--etcd-username and --etcd-password go together; give both or neither"
            )
        self._credentials: grpc.ChannelCredentials | None = None
        if any(ep.secure for ep in self._endpoints):
            self._credentials = grpc.ssl_channel_credentials(
                root_certificates=_read(cafile, "--etcd-cafile"),
                private_key=_read(keyfile, "--etcd-keyfile"),
                certificate_chain=_read(certfile, "--etcd-certfile"),
            )
        self._username = username
        self._password = password
        self._timeout = timeout
        self._lock = threading.Lock()
        self._clients: dict[int, pyetcd.MultiEndpointEtcd3Client] = {}
        self._current = 0
        self._closed = False

    @property
    def endpoints(self) -> list[str]:
        return [ep.url for ep in self._endpoints]

    # -- connection handling -------------------------------------------------

    def _client(self, index: int) -> pyetcd.MultiEndpointEtcd3Client:
        with self._lock:
            client = self._clients.get(index)
        if client is not None:
            return client
        ep = self._endpoints[index]
        # time_retry=0: never let pyetcd park an endpoint as failed; we pick endpoints.
        endpoint = pyetcd.Endpoint(
            ep.host, ep.port, secure=ep.secure, creds=self._credentials if ep.secure else None,
            time_retry=0, opts=_GRPC_OPTIONS,
        )  # fmt: skip
        try:
            # With a user, the constructor authenticates (one request) to get a token.
            client = pyetcd.MultiEndpointEtcd3Client(
                endpoints=[endpoint], timeout=self._timeout,
                user=self._username, password=self._password,
            )  # fmt: skip
        except BaseException:
            endpoint.close()
            raise
        if not ep.secure:
            # gRPC refuses call credentials on a plaintext channel; the token also
            # travels as metadata, which is all etcd reads.
            client.call_credentials = None
        with self._lock:
            existing = self._clients.setdefault(index, client)
        if existing is not client:
            client.close()
        return existing

    def _drop_client(self, index: int) -> None:
        with self._lock:
            client = self._clients.pop(index, None)
        if client is not None:
            client.close()

    def _call(self, what: str, fn: Callable[[pyetcd.MultiEndpointEtcd3Client], T]) -> T:
        """Run ``fn`` on the current endpoint, failing over to the others in turn."""
        if self._closed:
            raise StoreError(f"etcd {what}: the store is closed")
        failures = []
        with self._lock:
            start = self._current
        for step in range(len(self._endpoints)):
            index = (start + step) % len(self._endpoints)
            try:
                result = self._call_one(index, what, fn)
            except StoreUnavailable as e:
                failures.append(f"{self._endpoints[index].url}: {e}")
                continue
            except StoreError as e:
                self._report(_error_kind(e))
                raise
            with self._lock:
                self._current = index
            return result
        self._report("unavailable")
        raise StoreUnavailable(
            f"etcd {what}: no endpoint answered ({'; '.join(failures)}); check that etcd "
            "runs and that --etcd-endpoints and the TLS flags point at it"
        )

    def _report(self, kind: str) -> None:
        if self._on_error is not None:
            self._on_error(kind)

    def _call_one(
        self, index: int, what: str, fn: Callable[[pyetcd.MultiEndpointEtcd3Client], T]
    ) -> T:
        for attempt in range(2):
            try:
                return fn(self._client(index))
            except _UNREACHABLE as e:
                raise StoreUnavailable(_rpc_details(e)) from e
            except grpc.RpcError as e:
                code = _rpc_code(e)
                if code in _UNREACHABLE_CODES:
                    raise StoreUnavailable(_rpc_details(e)) from e
                if code == grpc.StatusCode.UNAUTHENTICATED and attempt == 0:
                    # The auth token expired (etcd's simple tokens live --auth-token-ttl,
                    # 5 min by default): reconnect, which authenticates again.
                    self._drop_client(index)
                    continue
                raise self._request_error(what, e) from e
        raise AssertionError("unreachable")  # pragma: no cover

    def _request_error(self, what: str, e: grpc.RpcError) -> StoreError:
        code = _rpc_code(e)
        details = _rpc_details(e)
        if "user name is empty" in details:
            return StoreError(
                f"etcd {what}: etcd requires authentication ({details}); "
                "set --etcd-username and --etcd-password"
            )
        if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.INVALID_ARGUMENT) and (
            "auth" in details or "password" in details
        ):
            return StoreError(
                f"etcd {what}: authentication failed ({details}); "
                "check --etcd-username and --etcd-password"
            )
        if code == grpc.StatusCode.PERMISSION_DENIED:
            return StoreError(
                f"etcd {what}: permission denied ({details}); grant the etcd user "
                "read-write access to the --etcd-prefix key range"
            )
        return StoreError(f"etcd {what} failed ({details})")

    # -- Store ---------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        def op(c: pyetcd.MultiEndpointEtcd3Client) -> KeyValue | None:
            resp = c.get_response(key)
            return _kv(resp.kvs[0]) if resp.kvs else None

        return self._call(f"get {key}", op)

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        def op(c: pyetcd.MultiEndpointEtcd3Client) -> tuple[list[KeyValue], int]:
            resp = c.get_prefix_response(prefix, sort_order="ascend", sort_target="key")
            return [_kv(kv) for kv in resp.kvs], int(resp.header.revision)

        return self._call(f"list {prefix}", op)

    def put(self, key: str, value: bytes, lease_id: int = 0) -> int:
        def op(c: pyetcd.MultiEndpointEtcd3Client) -> int:
            return int(c.put(key, value, lease=lease_id or None).header.revision)

        return self._call(f"put {key}", op)

    def create(self, key: str, value: bytes, lease_id: int = 0) -> int:
        def op(c: pyetcd.MultiEndpointEtcd3Client) -> int | None:
            t = c.transactions
            return _txn_revision(
                c.transaction(
                    compare=[t.create(key) == 0],
                    success=[t.put(key, value, lease=lease_id or None)],
                    failure=[],
                )
            )

        revision = self._call(f"create {key}", op)
        if revision is None:
            raise KeyExists(f"key {key} exists already")
        return revision

    def put_if_mod_revision(
        self, key: str, value: bytes, mod_revision: int, lease_id: int = 0
    ) -> int | None:
        def op(c: pyetcd.MultiEndpointEtcd3Client) -> int | None:
            t = c.transactions
            return _txn_revision(
                c.transaction(
                    compare=[t.mod(key) == mod_revision],
                    success=[t.put(key, value, lease=lease_id or None)],
                    failure=[],
                )
            )

        return self._call(f"update {key}", op)

    def delete_if_mod_revision(self, key: str, mod_revision: int) -> bool:
        def op(c: pyetcd.MultiEndpointEtcd3Client) -> bool:
            t = c.transactions
            ok, _ = c.transaction(
                compare=[t.mod(key) == mod_revision], success=[t.delete(key)], failure=[]
            )
            return bool(ok)

        return self._call(f"delete {key}", op)

    def grant_lease(self, ttl: int) -> GrantedLease:
        def op(c: pyetcd.MultiEndpointEtcd3Client) -> GrantedLease:
            lease = c.lease(ttl)
            return GrantedLease(int(lease.id), int(lease.ttl))

        return self._call("grant lease", op)

    def refresh_lease(self, lease_id: int) -> int:
        def op(c: pyetcd.MultiEndpointEtcd3Client) -> int:
            responses = list(c.refresh_lease(lease_id))
            return int(responses[0].TTL) if responses else 0

        ttl = self._call(f"refresh lease {lease_id:x}", op)
        if ttl <= 0:
            raise StoreError(f"etcd lease {lease_id:x} not found; it expired or was revoked")
        return ttl

    def revoke_lease(self, lease_id: int) -> None:
        def op(c: pyetcd.MultiEndpointEtcd3Client) -> None:
            try:
                c.revoke_lease(lease_id)
            except grpc.RpcError as e:
                if _rpc_code(e) != grpc.StatusCode.NOT_FOUND:
                    raise

        self._call(f"revoke lease {lease_id:x}", op)

    def watch_prefix(self, prefix: str, start_revision: int, stop: threading.Event) -> _EtcdWatch:
        responses: queue.Queue[Any] = queue.Queue()

        def op(c: pyetcd.MultiEndpointEtcd3Client) -> tuple[pyetcd.MultiEndpointEtcd3Client, int]:
            watch_id = c.add_watch_prefix_callback(
                prefix, responses.put, start_revision=start_revision
            )
            return c, int(watch_id)

        client, watch_id = self._call(f"watch {prefix}", op)
        return _EtcdWatch(client, watch_id, responses, prefix, stop)

    def compact(self, revision: int) -> None:
        self._call(f"compact to {revision}", lambda c: c.compact(revision))

    def close(self) -> None:
        self._closed = True
        with self._lock:
            clients = list(self._clients.values())
            self._clients.clear()
        for client in clients:
            client.close()


def _kv(kv: Any) -> KeyValue:
    return KeyValue(
        key=bytes(kv.key).decode("utf-8", "replace"),
        value=bytes(kv.value),
        mod_revision=int(kv.mod_revision),
        create_revision=int(kv.create_revision),
        lease_id=int(kv.lease),
    )


def _txn_revision(result: tuple[bool, list[Any]]) -> int | None:
    """The revision a one-put transaction wrote, or None if its compare failed."""
    succeeded, responses = result
    if not succeeded:
        return None
    return int(responses[0].response_put.header.revision)


class _EtcdWatch:
    """An open etcd watch; pyetcd's callback thread feeds ``responses``."""

    def __init__(
        self,
        client: pyetcd.MultiEndpointEtcd3Client,
        watch_id: int,
        responses: queue.Queue[Any],
        prefix: str,
        stop: threading.Event,
    ) -> None:
        self._client = client
        self._watch_id = watch_id
        self._responses = responses
        self._prefix = prefix
        self._stop = stop
        self._cancelled = threading.Event()

    def __iter__(self) -> Iterator[WatchBatch]:
        try:
            while not (self._stop.is_set() or self._cancelled.is_set()):
                try:
                    item = self._responses.get(timeout=WATCH_POLL)
                except queue.Empty:
                    continue
                batch = self._batch(item)
                if batch is not None:
                    yield batch
        finally:
            self.cancel()

    def _batch(self, item: Any) -> WatchBatch | None:
        if isinstance(item, WatchResponse):
            events = tuple(_event(e) for e in item.events)
            # Empty responses are progress notifications: nothing to report.
            return WatchBatch(events, max(e.mod_revision for e in events)) if events else None
        if isinstance(item, etcd_exc.RevisionCompactedError):
            raise RevisionCompacted(
                f"etcd watch on {self._prefix}: history before revision "
                f"{item.compacted_revision} was compacted; re-list",
                int(item.compacted_revision),
            )
        # pyetcd hands the stream's gRPC error (or None when the stream just ended).
        details = _rpc_details(item) if isinstance(item, BaseException) else "stream closed"
        raise StoreUnavailable(f"etcd watch on {self._prefix} broke ({details})")

    def cancel(self) -> None:
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        try:
            self._client.cancel_watch(self._watch_id)
        except (grpc.RpcError, etcd_exc.Etcd3Exception, ValueError) as e:
            log.debug("cancelling a watch failed error=%s", _rpc_details(e))


def _event(e: Any) -> WatchEvent:
    is_put = type(e).__name__ == "PutEvent"
    return WatchEvent(
        kind="put" if is_put else "delete",
        key=bytes(e.key).decode("utf-8", "replace"),
        value=bytes(e.value) if is_put else b"",
        mod_revision=int(e.mod_revision),
        lease_id=int(e.lease) if is_put else 0,
    )


def connect_etcd(
    settings: AgentSettings,
    timeout: float = REQUEST_TIMEOUT,
    on_error: Callable[[str], None] | None = None,
) -> EtcdStore:
    """An EtcdStore for the agent's ``--etcd-*`` flags. Connects lazily; raises ConfigError."""
    return EtcdStore(
        settings.etcd_endpoints,
        cafile=settings.etcd_cafile,
        certfile=settings.etcd_certfile,
        keyfile=settings.etcd_keyfile,
        username=settings.etcd_username,
        password=settings.etcd_password,
        timeout=timeout,
        on_error=on_error,
    )


def config_key(prefix: str) -> str:
    return f"{prefix.rstrip('/')}/config"


def subnets_prefix(prefix: str) -> str:
    return f"{prefix.rstrip('/')}/subnets/"


def put_network_config(store: Store, prefix: str, raw_json: str | bytes) -> NetworkConfig:
    """Validate net-conf.json and write it to ``<prefix>/config`` (for the lab and tests)."""
    config = parse_network_config(raw_json)
    data = raw_json.encode() if isinstance(raw_json, str) else raw_json
    store.put(config_key(prefix), data)
    return config


# ---------------------------------------------------------------------------
# Subnet manager
# ---------------------------------------------------------------------------


def _wait(stop: threading.Event, seconds: float) -> None:
    stop.wait(seconds)


class EtcdSubnetManager:
    """SubnetManager over etcd (or any Store), keeping Flannel's keys and JSON.

    ``clock`` gives unix time for lease expirations; ``sleep(stop, seconds)``
    waits between watch reconnects and must return early once ``stop`` is set.
    ``on_watch_restart(reason)`` is told each time the watch must re-list:
    "compacted" or "unavailable" (for metrics).
    """

    def __init__(
        self,
        store: Store,
        settings: AgentSettings,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[threading.Event, float], None] = _wait,
        rng: random.Random | None = None,
        on_watch_restart: Callable[[str], None] | None = None,
    ) -> None:
        self._store = store
        self._on_watch_restart = on_watch_restart
        self._prefix = settings.etcd_prefix.rstrip("/")
        self._config_key = config_key(self._prefix)
        self._subnets = subnets_prefix(self._prefix)
        self._ttl = settings.subnet_lease_ttl
        self._clock = clock
        self._sleep = sleep
        self._rng = rng or random.Random()
        self._warned: set[str] = set()
        self._warned_lock = threading.Lock()

    # -- config --------------------------------------------------------------

    def get_network_config(self) -> NetworkConfig:
        kv = self._store.get(self._config_key)
        if kv is None:
            raise ConfigError(
                f"network config not found in etcd at {self._config_key}; write net-conf.json "
                f"there (etcdctl put {self._config_key} '{{\"Network\": ...}}')"
            )
        try:
            return parse_network_config(kv.value)
        except ConfigError as e:
            raise ConfigError(f"{e} (read from etcd key {self._config_key})") from e

    # -- reading leases ------------------------------------------------------

    def list_leases(self) -> tuple[dict[str, Lease], int]:
        """Every parseable lease under ``<prefix>/subnets/``, by key, and the revision."""
        items, revision = self._store.get_prefix(self._subnets)
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
            return None
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
    ) -> Lease:
        config = self.get_network_config()
        for attempt in range(1, RACE_RETRIES + 1):
            leases, _ = self.list_leases()
            choice = choose_lease(
                config, list(leases.values()), attrs, previous_subnet, self._rng,
                pools=pools, cluster=cluster,
            )  # fmt: skip
            for stale in choice.delete:
                if self._store.delete_if_mod_revision(self._key(stale), stale.revision):
                    log.info(
                        "deleted our lease that no longer fits the network config "
                        "subnet=%s public_ip=%s network=%s",
                        stale.subnet, stale.attrs.public_ip, config.network,
                    )  # fmt: skip
            lease = self._write_choice(choice, attrs)
            if lease is not None:
                self._log_acquired(choice, lease)
                return lease
            log.info(
                "lost a race for a subnet; choosing again subnet=%s attempt=%d",
                choice.subnet, attempt,
            )  # fmt: skip
        raise StoreError(
            f"could not acquire a lease in {RACE_RETRIES} attempts: other nodes kept taking "
            "the chosen subnets first; retry, and check for many nodes starting at once"
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
                    lease.subnet, new.pool.network, attrs.public_ip,
                )  # fmt: skip
                return lease
            log.info("lost a race for a subnet; choosing again subnet=%s attempt=%d",
                     new.subnet, attempt)  # fmt: skip
        raise StoreError(
            f"could not acquire another lease in {RACE_RETRIES} attempts: other nodes kept "
            "taking the chosen subnets first; it is retried"
        )

    def _write_choice(self, choice: LeaseChoice, attrs: LeaseAttrs) -> Lease | None:
        existing = choice.existing
        # Flannel keeps a reservation (a key without an etcd lease) permanent on reuse.
        permanent = existing is not None and existing.store_lease_id is None
        key = self._subnets + subnet_to_key(choice.subnet, choice.ipv6_subnet)
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
        if revision is None:
            self._revoke_quietly(granted)
            return None
        return self._own_lease(choice.subnet, choice.ipv6_subnet, attrs, revision, granted)

    def _own_lease(
        self,
        subnet: IPv4Network,
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
                lease.subnet, lease.attrs.node_name, old.attrs.public_ip, lease.attrs.public_ip,
            )  # fmt: skip
            return
        log.info(
            "lease acquired subnet=%s public_ip=%s reason=%s expiration=%s",
            lease.subnet, lease.attrs.public_ip, choice.reason, lease.expiration,
        )  # fmt: skip

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
        (an etcd restored from an older backup), which would hang us forever.
        Exceptions raised by ``on_leases`` propagate.
        """
        backoff = Backoff()
        leases: dict[str, Lease] | None = None
        revision = 0
        while not stop.is_set():
            try:
                if leases is None:
                    leases, revision = self.list_leases()
                    on_leases(dict(leases), revision)
                stream = self._store.watch_prefix(self._subnets, revision + 1, stop)
                backoff.reset()
                for batch in stream:
                    for event in batch.events:
                        self._apply(leases, event)
                    revision = batch.revision
                    on_leases(dict(leases), revision)
            except RevisionCompacted as e:
                log.warning(
                    "lease watch fell behind a compaction; re-listing revision=%d compacted=%d",
                    revision, e.compacted_revision,
                )  # fmt: skip
                self._watch_restarted("compacted")
                leases = None
            except StoreUnavailable as e:
                delay = backoff.next()
                log.warning(
                    "lease store unavailable; re-listing after a delay delay=%.1f error=%s",
                    delay, e,
                )  # fmt: skip
                self._watch_restarted("unavailable")
                leases = None
                self._sleep(stop, delay)

    def _watch_restarted(self, reason: str) -> None:
        if self._on_watch_restart is not None:
            self._on_watch_restart(reason)

    def _apply(self, leases: dict[str, Lease], event: WatchEvent) -> None:
        suffix = event.key[len(self._subnets) :]
        if event.kind == "delete":
            leases.pop(suffix, None)
            return
        lease = self._parse(event.key, event.value, event.mod_revision, event.lease_id)
        if lease is None:
            leases.pop(suffix, None)  # a lease overwritten with garbage is gone
        else:
            leases[lease.key] = lease

    def close(self) -> None:
        self._store.close()
