"""etcd mode's store adapter: pyetcd behind the :class:`~flannelpy.subnet.etcd.kv.Store`
protocol.

:class:`EtcdStore` adds failover between endpoints, TLS, auth and timeouts, and
maps gRPC errors to ours; it is the only module of etcd mode that imports gRPC.
The keys it is used with are :mod:`flannelpy.subnet.keys`'; the SubnetManager
over it is :mod:`flannelpy.subnet.etcd.manager`.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar
from urllib.parse import urlsplit

import grpc
import pyetcd
from pyetcd import etcdrpc
from pyetcd import exceptions as etcd_exc
from pyetcd.watch import Watcher, WatchResponse

from flannelpy.config.settings import AgentSettings
from flannelpy.errors import (
    ConfigError,
    KeyExists,
    RevisionCompacted,
    StoreError,
    StoreUnavailable,
)
from flannelpy.subnet.etcd.kv import GrantedLease, KeyValue, WatchBatch, WatchEvent

log = logging.getLogger("flannelpy.subnet.etcd.client")

REQUEST_TIMEOUT = 5.0  # seconds per etcd request, so a dead member never hangs a call
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
# A member that cannot reach a quorum times a read out itself and answers UNKNOWN with
# Go's context error (the client's deadline travels to it) just before our own deadline
# fires: that member is as unreachable as a dead one, so the call fails over.
_UNREACHABLE_DETAILS = ("context deadline exceeded", "context canceled")

# Every call carries etcd's "hasleader" metadata: a member cut off from the leader
# then refuses it at once with "no leader" (UNAVAILABLE, so the call fails over),
# rather than holding a read until the request timeout, and cancels open watches
# instead of serving a frozen world; the watch then moves to another endpoint.
_REQUIRE_LEADER = (("hasleader", "true"),)
TLS_CHECK_INTERVAL = 1.0  # seconds between looks at the TLS files' mtimes

T = TypeVar("T")


class _Client(pyetcd.MultiEndpointEtcd3Client):  # type: ignore[misc]
    """pyetcd's client, whose calls and watches all require a leader.

    pyetcd passes ``self.metadata`` with every call and sets it to the auth token
    after authenticating; the property keeps the leader requirement beside it.
    """

    _base_metadata: tuple[tuple[str, str], ...] = ()

    @property
    def metadata(self) -> tuple[tuple[str, str], ...]:
        return self._base_metadata + _REQUIRE_LEADER

    @metadata.setter
    def metadata(self, value: Sequence[tuple[str, str]] | None) -> None:
        self._base_metadata = tuple(value or ())

    def get_watcher(self) -> Watcher:
        return Watcher(
            etcdrpc.WatchStub(self.channel),
            timeout=self.timeout,
            call_credentials=self.call_credentials,
            metadata=self.metadata,
        )


class _SocketEndpoint(pyetcd.Endpoint):  # type: ignore[misc]
    """pyetcd's endpoint on a gRPC target of its own: a unix socket (pyetcd dials
    host:port only)."""

    def __init__(self, target: str, opts: Sequence[tuple[str, Any]]) -> None:
        self._target = target
        super().__init__(target, 0, secure=False, time_retry=0, opts=opts)
        self.netloc = target

    def _mkchannel(self, opts: Sequence[tuple[str, Any]]) -> grpc.Channel:
        return grpc.insecure_channel(self._target, options=opts)


@dataclass(frozen=True)
class _Endpoint:
    url: str
    host: str
    port: int
    secure: bool
    socket_target: str | None = None  # a unix socket's gRPC target, else None


def unix_target(url: str) -> str:
    """etcd's Go client's reading of a ``unix://`` endpoint, as a gRPC target:
    ``unix:///run/etcd.sock`` is an absolute path, ``unix://etcd.sock`` and
    ``unix:etcd.sock`` are relative to the working directory."""
    if url.startswith("unix:///"):
        return url
    return "unix:" + url.removeprefix("unix://").removeprefix("unix:")


def parse_endpoints(urls: Sequence[str]) -> list[_Endpoint]:
    """``http://127.0.0.1:2379`` → host, port, TLS or not; ``unix://path`` → a socket.
    Raises ConfigError."""
    endpoints = []
    for raw in urls:
        url = raw.strip()
        if url.startswith("unix:") and unix_target(url) not in ("unix:", "unix:///"):
            endpoints.append(_Endpoint(url, "", 0, False, unix_target(url)))
            continue
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


def _stat_files(paths: Sequence[str | None]) -> tuple[tuple[int, int] | None, ...]:
    """Each file's (mtime_ns, size), None where absent: what tells a rotation."""
    return tuple(_signature(path) for path in paths)


def _signature(path: str | None) -> tuple[int, int] | None:
    try:
        st = os.stat(path) if path is not None else None
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size) if st is not None else None


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


def _unreachable(error: grpc.RpcError) -> bool:
    """Does this error say the member could not serve the call (try another one)?"""
    code = _rpc_code(error)
    if code in _UNREACHABLE_CODES:
        return True
    details = (error.details() if hasattr(error, "details") else None) or ""
    return code == grpc.StatusCode.UNKNOWN and details.strip() in _UNREACHABLE_DETAILS


def _rpc_code(error: BaseException) -> grpc.StatusCode | None:
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        code = error.code()
        return code if isinstance(code, grpc.StatusCode) else None
    return None


class EtcdStore:
    """:class:`~flannelpy.subnet.etcd.kv.Store` over etcd v3 (pyetcd), with failover.

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
        tls_flags = [
            flag for flag, path in (("--etcd-cafile", cafile), ("--etcd-certfile", certfile),
                                    ("--etcd-keyfile", keyfile)) if path is not None
        ]  # fmt: skip
        if tls_flags and not any(ep.secure for ep in self._endpoints):
            raise ConfigError(
                f"{' and '.join(tls_flags)} given, but every --etcd-endpoints URL is "
                f"plain http:// ({', '.join(ep.url for ep in self._endpoints)}); write the "
                "endpoints as https://, or drop the TLS flags"
            )
        self._tls_files = (cafile, keyfile, certfile)
        self._tls_seen: tuple[tuple[int, int] | None, ...] = ()
        self._tls_checked = 0.0
        self._credentials: grpc.ChannelCredentials | None = None
        if any(ep.secure for ep in self._endpoints):
            self._tls_seen = _stat_files(self._tls_files)
            self._credentials = self._load_credentials()
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

    def _load_credentials(self) -> grpc.ChannelCredentials:
        cafile, keyfile, certfile = self._tls_files
        return grpc.ssl_channel_credentials(
            root_certificates=_read(cafile, "--etcd-cafile"),
            private_key=_read(keyfile, "--etcd-keyfile"),
            certificate_chain=_read(certfile, "--etcd-certfile"),
        )

    def _reload_tls(self) -> None:
        """Rotation without restart: once the TLS files change, every channel is closed
        (its watches end; their owners re-make them) and new ones use the new files."""
        if self._credentials is None:
            return
        now = time.monotonic()
        with self._lock:
            if now - self._tls_checked < TLS_CHECK_INTERVAL:
                return
            self._tls_checked = now
        seen = _stat_files(self._tls_files)
        if seen == self._tls_seen:
            return
        try:
            credentials = self._load_credentials()
        except ConfigError as e:
            log.warning("etcd TLS files changed but are unreadable; keeping the old error=%s", e)
            return  # mid-rotation, say: the next look reads them again
        with self._lock:
            self._tls_seen = seen
            self._credentials = credentials
            clients = list(self._clients.values())
            self._clients.clear()
        log.info("etcd TLS files changed; reconnecting with them")
        for client in clients:
            client.close()

    # -- connection handling -------------------------------------------------

    def _client(self, index: int) -> pyetcd.MultiEndpointEtcd3Client:
        with self._lock:
            client = self._clients.get(index)
        if client is not None:
            return client
        ep = self._endpoints[index]
        # time_retry=0: never let pyetcd park an endpoint as failed; we pick endpoints.
        if ep.socket_target is not None:
            endpoint = _SocketEndpoint(ep.socket_target, _GRPC_OPTIONS)
        else:
            endpoint = pyetcd.Endpoint(
                ep.host, ep.port, secure=ep.secure,
                creds=self._credentials if ep.secure else None,
                time_retry=0, opts=_GRPC_OPTIONS,
            )  # fmt: skip
        try:
            # With a user, the constructor authenticates (one request) to get a token.
            client = _Client(
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
        self._reload_tls()
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
                previous, self._current = self._current, index
            if index != previous:
                # Logged once per move (not per thread): it tells which member the node
                # depends on now.
                log.warning(
                    "etcd requests moved to another endpoint from=%s to=%s",
                    self._endpoints[previous].url, self._endpoints[index].url,
                )  # fmt: skip
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
            except etcd_exc.RevisionCompactedError as e:
                # A watch created from a compacted revision: the caller re-lists.
                raise RevisionCompacted(
                    f"etcd {what}: history before revision {e.compacted_revision} was "
                    "compacted; re-list",
                    int(e.compacted_revision),
                ) from e
            except grpc.RpcError as e:
                if _unreachable(e):
                    raise StoreUnavailable(_rpc_details(e)) from e
                code = _rpc_code(e)
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

    def lease_remaining(self, lease_id: int) -> int | None:
        def op(c: pyetcd.MultiEndpointEtcd3Client) -> int | None:
            ttl = int(c.get_lease_info(lease_id).TTL)
            return None if ttl < 0 else ttl  # etcd answers -1 for a lease it does not have

        return self._call(f"lease time-to-live {lease_id:x}", op)

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
