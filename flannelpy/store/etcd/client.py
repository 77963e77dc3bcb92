"""etcd mode's store adapter: pyetcd behind the :class:`~flannelpy.store.etcd.kv.Store`
protocol.

:class:`EtcdStore` adds failover between endpoints, TLS, auth and timeouts, and
maps gRPC errors to ours. It and its helpers (:mod:`~flannelpy.store.etcd.connection`
reaches a member, :mod:`~flannelpy.store.etcd.rpc_errors` reads its failures,
:mod:`~flannelpy.store.etcd.watch` holds an open watch) are the only modules of etcd
mode that import gRPC. The keys it is used with are :mod:`flannelpy.subnet.keys`'; the
SubnetManager over it is :mod:`flannelpy.store.etcd.manager`.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
import pyetcd
from pyetcd import exceptions as etcd_exc

from flannelpy.config.settings import AgentSettings
from flannelpy.errors import (
    ConfigError,
    KeyExists,
    RevisionCompacted,
    StoreError,
    StoreUnavailable,
)
from flannelpy.store.etcd import connection
from flannelpy.store.etcd.kv import GrantedLease, KeyValue
from flannelpy.store.etcd.rpc_errors import (
    UNREACHABLE,
    error_kind,
    request_error,
    rpc_code,
    rpc_details,
    unreachable,
)
from flannelpy.store.etcd.watch import EtcdWatch

log = logging.getLogger("flannelpy.store.etcd.client")

REQUEST_TIMEOUT = 5.0  # seconds per etcd request, so a dead member never hangs a call
TLS_CHECK_INTERVAL = 1.0  # seconds between looks at the TLS files' mtimes

T = TypeVar("T")


class EtcdStore:
    """:class:`~flannelpy.store.etcd.kv.Store` over etcd v3 (pyetcd), with failover.

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
        self._endpoints = connection.parse_endpoints(endpoints)
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
            flag
            for flag, path in (
                ("--etcd-cafile", cafile),
                ("--etcd-certfile", certfile),
                ("--etcd-keyfile", keyfile),
            )
            if path is not None
        ]
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
            self._tls_seen = connection.stat_files(self._tls_files)
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
        return connection.load_credentials(*self._tls_files)

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
        seen = connection.stat_files(self._tls_files)
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
        client = connection.open_client(
            self._endpoints[index], self._credentials, self._timeout, self._username, self._password
        )
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
                self._report(error_kind(e))
                raise
            with self._lock:
                previous, self._current = self._current, index
            if index != previous:
                # Logged once per move (not per thread): it tells which member the node
                # depends on now.
                log.warning(
                    "etcd requests moved to another endpoint from=%s to=%s",
                    self._endpoints[previous].url,
                    self._endpoints[index].url,
                )
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
            except UNREACHABLE as e:
                raise StoreUnavailable(rpc_details(e)) from e
            except etcd_exc.RevisionCompactedError as e:
                # A watch created from a compacted revision: the caller re-lists.
                raise RevisionCompacted(
                    f"etcd {what}: history before revision {e.compacted_revision} was "
                    "compacted; re-list",
                    int(e.compacted_revision),
                ) from e
            except grpc.RpcError as e:
                if unreachable(e):
                    raise StoreUnavailable(rpc_details(e)) from e
                code = rpc_code(e)
                if code == grpc.StatusCode.UNAUTHENTICATED and attempt == 0:
                    # The auth token expired (etcd's simple tokens live --auth-token-ttl,
                    # 5 min by default): reconnect, which authenticates again.
                    self._drop_client(index)
                    continue
                raise request_error(what, e) from e
        raise AssertionError("unreachable")  # pragma: no cover

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
                if rpc_code(e) != grpc.StatusCode.NOT_FOUND:
                    raise

        self._call(f"revoke lease {lease_id:x}", op)

    def lease_remaining(self, lease_id: int) -> int | None:
        def op(c: pyetcd.MultiEndpointEtcd3Client) -> int | None:
            ttl = int(c.get_lease_info(lease_id).TTL)
            return None if ttl < 0 else ttl  # etcd answers -1 for a lease it does not have

        return self._call(f"lease time-to-live {lease_id:x}", op)

    def watch_prefix(self, prefix: str, start_revision: int, stop: threading.Event) -> EtcdWatch:
        responses: queue.Queue[Any] = queue.Queue()

        def op(c: pyetcd.MultiEndpointEtcd3Client) -> tuple[pyetcd.MultiEndpointEtcd3Client, int]:
            watch_id = c.add_watch_prefix_callback(
                prefix, responses.put, start_revision=start_revision
            )
            return c, int(watch_id)

        client, watch_id = self._call(f"watch {prefix}", op)
        return EtcdWatch(client, watch_id, responses, prefix, stop)

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
