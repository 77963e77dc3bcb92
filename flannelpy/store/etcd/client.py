"""etcd mode's store adapter: etcd v3 over its JSON gateway behind the
:class:`~flannelpy.store.etcd.kv.Store` protocol.

:class:`EtcdStore` adds failover between endpoints, TLS, auth and timeouts, and maps
etcd's refusals to our errors. It and its helpers (:mod:`~flannelpy.store.etcd.gateway`
speaks to one member, :mod:`~flannelpy.store.etcd.connection` reads the endpoints and
TLS files, :mod:`~flannelpy.store.etcd.rpc_errors` reads a failure,
:mod:`~flannelpy.store.etcd.watch` holds an open watch) are the only modules of etcd mode
that reach etcd. The keys it is used with are :mod:`flannelpy.subnet.keys`'; the
SubnetManager over it is :mod:`flannelpy.store.etcd.manager`.
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from flannelpy.config.settings import ETCD_TRANSPORTS, AgentSettings
from flannelpy.errors import (
    ConfigError,
    KeyExists,
    StoreError,
    StoreUnavailable,
)
from flannelpy.store.etcd import connection
from flannelpy.store.etcd.gateway import GatewayMember
from flannelpy.store.etcd.kv import GrantedLease, KeyValue
from flannelpy.store.etcd.member import CODES, Member, MemberError, b64, number, prefix_end, unb64
from flannelpy.store.etcd.rpc_errors import details, error_kind, request_error, unreachable
from flannelpy.store.etcd.watch import EtcdWatch
from flannelpy.store.http import UNREACHABLE

log = logging.getLogger("flannelpy.store.etcd.client")

REQUEST_TIMEOUT = 5.0  # seconds per etcd request, so a dead member never hangs a call
TLS_CHECK_INTERVAL = 1.0  # seconds between looks at the TLS files' mtimes

T = TypeVar("T")


class EtcdStore:
    """:class:`~flannelpy.store.etcd.kv.Store` over etcd v3, with failover.

    Requests go to one endpoint until it fails to answer, then to the next;
    only when every endpoint failed does a call raise StoreUnavailable. Members
    are connected lazily, so constructing this never blocks.
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
        transport: str = "auto",
    ) -> None:
        self._endpoints = connection.parse_endpoints(endpoints)
        # Told the kind of every failed request, for metrics: "unavailable" (no
        # endpoint answered) or etcd's gRPC status in snake case ("permission_denied").
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
        # A client certificate names the node to etcd, which only gRPC carries (the
        # gateway presents the server's own certificate): such a node goes over gRPC.
        if transport not in ETCD_TRANSPORTS:
            raise ConfigError(
                f"--etcd-transport {transport!r} is not a transport; give one of "
                f"{', '.join(ETCD_TRANSPORTS)}"
            )
        if transport == "auto":
            transport = "grpc" if certfile is not None else "gateway"
        self.transport = transport
        self._broken: tuple[type[BaseException], ...] = (
            () if self.transport == "grpc" else UNREACHABLE
        )
        self._tls_files = (cafile, keyfile, certfile)
        self._tls_seen: tuple[tuple[int, int] | None, ...] = ()
        self._tls_checked = 0.0
        # The files as read, and the gateway's SSL context made of them (its CA only).
        self._tls: tuple[connection.TlsFiles, ssl.SSLContext] | None = None
        if any(ep.secure for ep in self._endpoints):
            self._tls_seen = connection.stat_files(self._tls_files)
            self._tls = self._load_tls()
        self._username = username
        self._password = password
        self._timeout = timeout
        self._lock = threading.Lock()
        self._members: dict[int, Member] = {}
        self._current = 0
        self._closed = False

    @property
    def endpoints(self) -> list[str]:
        return [ep.url for ep in self._endpoints]

    def _load_tls(self) -> tuple[connection.TlsFiles, ssl.SSLContext]:
        """The TLS files, and the CA read into an SSL context, which checks it as far as
        it can be before a connection. Raises ConfigError."""
        files = connection.read_tls_files(*self._tls_files)
        cadata = files.ca.decode("ascii", "replace") if files.ca is not None else None
        try:
            return files, ssl.create_default_context(cadata=cadata)
        except (ValueError, ssl.SSLError) as e:
            raise ConfigError(
                f"--etcd-cafile: {self._tls_files[0]} holds no PEM certificate ({e}); "
                "give the CA that signed etcd's certificate"
            ) from e

    def _reload_tls(self) -> None:
        """Rotation without restart: once the TLS files change, every member's connections
        are closed (its watches end; their owners re-make them) and new ones use the new
        files."""
        if self._tls is None:
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
            tls = self._load_tls()
        except ConfigError as e:
            log.warning("etcd TLS files changed but are unreadable; keeping the old error=%s", e)
            return  # mid-rotation, say: the next look reads them again
        with self._lock:
            self._tls_seen = seen
            self._tls = tls
            members = list(self._members.values())
            self._members.clear()
        log.info("etcd TLS files changed; reconnecting with them")
        for member in members:
            member.close()

    # -- connection handling -------------------------------------------------

    def _member(self, index: int) -> Member:
        with self._lock:
            member = self._members.get(index)
            if member is None:
                member = self._open(self._endpoints[index])
                self._members[index] = member
            return member

    def _open(self, ep: connection.EtcdEndpoint) -> Member:
        if self.transport == "grpc":
            from flannelpy.store.etcd.grpc_member import GrpcMember

            files = self._tls[0] if self._tls is not None else None
            return GrpcMember(ep, files, self._timeout, self._username, self._password)
        context = self._tls[1] if self._tls is not None else None
        return GatewayMember(ep, context, self._timeout, self._username, self._password)

    def _call(self, what: str, fn: Callable[[Member], T]) -> T:
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

    def _call_one(self, index: int, what: str, fn: Callable[[Member], T]) -> T:
        for attempt in range(2):
            member = self._member(index)
            try:
                return fn(member)
            except self._broken as e:
                raise StoreUnavailable(details(e)) from e
            except MemberError as e:
                if unreachable(e):
                    raise StoreUnavailable(details(e)) from e
                if e.code == CODES["UNAUTHENTICATED"] and attempt == 0:
                    # The auth token expired (etcd's simple tokens live --auth-token-ttl,
                    # 5 min by default), or etcd restarted and forgot it: take a new one.
                    member.forget_token()
                    continue
                raise request_error(what, e) from e
        raise AssertionError("unreachable")  # pragma: no cover

    # -- Store ---------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        def op(m: Member) -> KeyValue | None:
            kvs = m.call("/kv/range", {"key": b64(key)}).get("kvs") or []
            return _kv(kvs[0]) if kvs else None

        return self._call(f"get {key}", op)

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        def op(m: Member) -> tuple[list[KeyValue], int]:
            raw = prefix.encode()
            doc = m.call(
                "/kv/range",
                {
                    "key": b64(raw),
                    "range_end": b64(prefix_end(raw)),
                    "sort_order": "ASCEND",
                    "sort_target": "KEY",
                },
            )
            return [_kv(kv) for kv in doc.get("kvs") or []], _revision(doc)

        return self._call(f"list {prefix}", op)

    def put(self, key: str, value: bytes, lease_id: int = 0) -> int:
        return self._call(
            f"put {key}", lambda m: _revision(m.call("/kv/put", _put(key, value, lease_id)))
        )

    def create(self, key: str, value: bytes, lease_id: int = 0) -> int:
        compare = {"target": "CREATE", "key": b64(key), "create_revision": 0, "result": "EQUAL"}
        revision = self._call(
            f"create {key}", lambda m: _txn_revision(m, compare, key, value, lease_id)
        )
        if revision is None:
            raise KeyExists(f"key {key} exists already")
        return revision

    def put_if_mod_revision(
        self, key: str, value: bytes, mod_revision: int, lease_id: int = 0
    ) -> int | None:
        compare = {
            "target": "MOD",
            "key": b64(key),
            "mod_revision": str(mod_revision),
            "result": "EQUAL",
        }
        return self._call(
            f"update {key}", lambda m: _txn_revision(m, compare, key, value, lease_id)
        )

    def delete_if_mod_revision(self, key: str, mod_revision: int) -> bool:
        def op(m: Member) -> bool:
            doc = m.call(
                "/kv/txn",
                {
                    "compare": [
                        {
                            "target": "MOD",
                            "key": b64(key),
                            "mod_revision": str(mod_revision),
                            "result": "EQUAL",
                        }
                    ],
                    "success": [{"request_delete_range": {"key": b64(key)}}],
                },
            )
            return bool(doc.get("succeeded"))

        return self._call(f"delete {key}", op)

    def grant_lease(self, ttl: int) -> GrantedLease:
        def op(m: Member) -> GrantedLease:
            doc = m.call("/lease/grant", {"TTL": ttl})
            if doc.get("error"):  # etcd 3.4 reports some refusals in the answer itself
                raise MemberError(CODES["UNKNOWN"], str(doc["error"]))
            return GrantedLease(number(doc, "ID"), number(doc, "TTL"))

        return self._call("grant lease", op)

    def refresh_lease(self, lease_id: int) -> int:
        def op(m: Member) -> int:
            # LeaseKeepAlive is a stream; the gateway sends one request and reads one answer.
            doc = m.call("/lease/keepalive", {"ID": str(lease_id)})
            result = doc.get("result")
            return number(result, "TTL") if isinstance(result, dict) else 0

        ttl = self._call(f"refresh lease {lease_id:x}", op)
        if ttl <= 0:
            raise StoreError(f"etcd lease {lease_id:x} not found; it expired or was revoked")
        return ttl

    def revoke_lease(self, lease_id: int) -> None:
        def op(m: Member) -> None:
            try:
                m.call("/lease/revoke", {"ID": str(lease_id)})
            except MemberError as e:
                if e.code != CODES["NOT_FOUND"]:
                    raise

        self._call(f"revoke lease {lease_id:x}", op)

    def lease_remaining(self, lease_id: int) -> int | None:
        def op(m: Member) -> int | None:
            ttl = number(m.call("/lease/timetolive", {"ID": str(lease_id)}), "TTL")
            return None if ttl < 0 else ttl  # etcd answers -1 for a lease it does not have

        return self._call(f"lease time-to-live {lease_id:x}", op)

    def watch_prefix(self, prefix: str, start_revision: int, stop: threading.Event) -> EtcdWatch:
        raw = prefix.encode()
        request = {
            "create_request": {
                "key": b64(raw),
                "range_end": b64(prefix_end(raw)),
                "start_revision": str(start_revision),
            }
        }
        return self._call(
            f"watch {prefix}",
            lambda m: EtcdWatch(m.stream("/watch", request), prefix, stop, self._broken),
        )

    def compact(self, revision: int) -> None:
        self._call(
            f"compact to {revision}",
            lambda m: m.call("/kv/compaction", {"revision": str(revision)}),
        )

    def close(self) -> None:
        self._closed = True
        with self._lock:
            members = list(self._members.values())
            self._members.clear()
        for member in members:
            member.close()


def _kv(kv: Any) -> KeyValue:
    return KeyValue(
        key=unb64(kv.get("key")).decode("utf-8", "replace"),
        value=unb64(kv.get("value")),
        mod_revision=number(kv, "mod_revision"),
        create_revision=number(kv, "create_revision"),
        lease_id=number(kv, "lease"),
    )


def _revision(doc: dict[str, Any]) -> int:
    header = doc.get("header")
    return number(header, "revision") if isinstance(header, dict) else 0


def _put(key: str, value: bytes, lease_id: int) -> dict[str, Any]:
    request: dict[str, Any] = {"key": b64(key), "value": b64(value)}
    if lease_id:
        request["lease"] = str(lease_id)
    return request


def _txn_revision(
    m: Member, compare: dict[str, Any], key: str, value: bytes, lease_id: int
) -> int | None:
    """One put behind one compare: the revision it wrote, or None if the compare failed."""
    doc = m.call(
        "/kv/txn", {"compare": [compare], "success": [{"request_put": _put(key, value, lease_id)}]}
    )
    if not doc.get("succeeded"):
        return None
    responses = doc.get("responses") or [{}]
    put = responses[0].get("response_put") if isinstance(responses[0], dict) else None
    return _revision(put) if isinstance(put, dict) else _revision(doc)


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
        transport=settings.etcd_transport,
    )
