"""One etcd member over gRPC, for a node that presents a client certificate: etcd's
gateway would reach etcd with the server's own certificate (:mod:`.member`).

Requests and answers keep the JSON-shaped dicts of :class:`~.member.Member`: a request
is parsed into etcd's protobuf message (protobuf's JSON mapping is the gateway's), and
an answer read back into the same shape; a range's and a watch's key-values are read
by hand, their bytes left raw (:func:`~.member.unb64` takes both), because those are
the answers with thousands of entries. Imported only when a client certificate is
given, so other nodes never load gRPC.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import grpc
from google.protobuf import json_format
from pyetcd import etcdrpc

from flannelpy.store.etcd.connection import EtcdEndpoint, TlsFiles
from flannelpy.store.etcd.member import AuthToken, MemberError

# gRPC channel options: reconnect soon after etcd comes back (the default backoff grows
# to 120 s), and detect a silently dead peer on long-lived watch streams (etcd refuses
# keepalive pings more often than every 5 s, hence 10 s).
GRPC_OPTIONS = [
    # etcd is always reached directly: an HTTP proxy set in the environment (for image
    # pulls, say) must not carry lease traffic.
    ("grpc.enable_http_proxy", 0),
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1000),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    # A list of every lease may pass gRPC's default 4 MiB (about 13,000 leases); etcd's
    # own client takes answers of any size.
    ("grpc.max_receive_message_length", 2**31 - 1),
]

# gRPC's blocking stream iterators wait on their call's condition in slices of
# ``grpc._common.MAXIMUM_WAIT_TIMEOUT``, 0.1 s, only so that a *main* thread blocked in
# one runs its signal handlers soon (grpc issue 19464). A response, an error or a cancel
# notifies the condition, so the slice changes nothing but how often an idle stream's
# thread wakes. Our streams are read on threads of their own: 1 s. (A private constant:
# left alone when a gRPC version lacks it.)
GRPC_WAIT_SLICE = 1.0

# Unary calls: path → (stub, method, request message); what the store calls.
_UNARY = {
    "/kv/range": ("kv", "Range", etcdrpc.RangeRequest),
    "/kv/put": ("kv", "Put", etcdrpc.PutRequest),
    "/kv/txn": ("kv", "Txn", etcdrpc.TxnRequest),
    "/kv/compaction": ("kv", "Compact", etcdrpc.CompactionRequest),
    "/lease/grant": ("lease", "LeaseGrant", etcdrpc.LeaseGrantRequest),
    "/lease/revoke": ("lease", "LeaseRevoke", etcdrpc.LeaseRevokeRequest),
    "/lease/timetolive": ("lease", "LeaseTimeToLive", etcdrpc.LeaseTimeToLiveRequest),
    "/auth/authenticate": ("auth", "Authenticate", etcdrpc.AuthenticateRequest),
}


def _longer_grpc_wait_slice() -> None:
    common = getattr(grpc, "_common", None)
    current = getattr(common, "MAXIMUM_WAIT_TIMEOUT", None)
    if isinstance(current, float) and current < GRPC_WAIT_SLICE:
        common.MAXIMUM_WAIT_TIMEOUT = GRPC_WAIT_SLICE  # type: ignore[union-attr]


_longer_grpc_wait_slice()


def _error(e: grpc.RpcError) -> MemberError:
    code = e.code() if hasattr(e, "code") else None
    message = e.details() if hasattr(e, "details") else None
    number = code.value[0] if isinstance(code, grpc.StatusCode) else 2
    return MemberError(number, message or str(e))


def _as_dict(message: Any) -> dict[str, Any]:
    result: dict[str, Any] = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return result


def _kv(kv: Any) -> dict[str, Any]:
    return {
        "key": bytes(kv.key),
        "value": bytes(kv.value),
        "create_revision": kv.create_revision,
        "mod_revision": kv.mod_revision,
        "lease": kv.lease,
    }


def _range(resp: Any) -> dict[str, Any]:
    return {"header": {"revision": resp.header.revision}, "kvs": [_kv(kv) for kv in resp.kvs]}


def _watch_result(resp: Any) -> dict[str, Any]:
    return {
        "header": {"revision": resp.header.revision},
        "created": resp.created,
        "canceled": resp.canceled,
        "cancel_reason": resp.cancel_reason,
        "compact_revision": resp.compact_revision,
        "events": [
            {
                "type": "DELETE" if e.type == 1 else "PUT" if e.type == 0 else str(e.type),
                "kv": _kv(e.kv),
            }
            for e in resp.events
        ],
    }


class _WatchCall:
    """A gRPC Watch stream as a :class:`~.member.MessageStream`."""

    def __init__(self, call: Any) -> None:
        self._call = call
        self._aborted = threading.Event()

    def messages(self) -> Iterator[dict[str, Any]]:
        try:
            for resp in self._call:
                yield {"result": _watch_result(resp)}
        except grpc.RpcError as e:
            if not self._aborted.is_set():
                raise _error(e) from e
        if not self._aborted.is_set():
            raise MemberError(14, "the watch stream ended")

    def without_read_timeout(self) -> None:
        """The call has no deadline; gRPC's keepalive watches the channel."""

    def abort(self) -> None:
        self._aborted.set()
        self._call.cancel()

    def close(self) -> None:
        self.abort()


class GrpcMember:
    """One etcd member over gRPC (:class:`~.member.Member`)."""

    def __init__(
        self,
        ep: EtcdEndpoint,
        tls: TlsFiles | None,
        timeout: float,
        username: str | None = None,
        password: str | None = None,
    ) -> None:
        self.endpoint = ep
        self._timeout = timeout
        if ep.socket_path is not None:
            self._channel = grpc.insecure_channel(f"unix:{ep.socket_path}", GRPC_OPTIONS)
        elif ep.secure and tls is not None:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=tls.ca, private_key=tls.key, certificate_chain=tls.cert
            )
            self._channel = grpc.secure_channel(f"{ep.host}:{ep.port}", credentials, GRPC_OPTIONS)
        else:
            self._channel = grpc.insecure_channel(f"{ep.host}:{ep.port}", GRPC_OPTIONS)
        self._stubs = {
            "kv": etcdrpc.KVStub(self._channel),
            "lease": etcdrpc.LeaseStub(self._channel),
            "watch": etcdrpc.WatchStub(self._channel),
            "auth": etcdrpc.AuthStub(self._channel),
        }
        self.token = AuthToken(
            username, password, lambda body: self._unary("/auth/authenticate", body, ())
        )

    def _metadata(self) -> tuple[tuple[str, str], ...]:
        # A member cut off from the leader refuses at once (see the gateway's header).
        metadata: tuple[tuple[str, str], ...] = (("hasleader", "true"),)
        token = self.token.current()
        return (*metadata, ("token", token)) if token else metadata

    def forget_token(self) -> None:
        self.token.forget()

    def _unary(
        self, path: str, body: dict[str, Any], metadata: tuple[tuple[str, str], ...]
    ) -> dict[str, Any]:
        stub, method, request_type = _UNARY[path]
        request = json_format.ParseDict(body, request_type())
        try:
            resp = getattr(self._stubs[stub], method)(
                request, timeout=self._timeout, metadata=metadata
            )
        except grpc.RpcError as e:
            raise _error(e) from e
        return _range(resp) if path == "/kv/range" else _as_dict(resp)

    def call(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if path == "/lease/keepalive":  # a stream: one request, its first answer
            request = etcdrpc.LeaseKeepAliveRequest(ID=int(body["ID"]))
            try:
                answers = self._stubs["lease"].LeaseKeepAlive(
                    iter([request]), timeout=self._timeout, metadata=self._metadata()
                )
                first = next(iter(answers), None)
            except grpc.RpcError as e:
                raise _error(e) from e
            return {"result": _as_dict(first)} if first is not None else {}
        return self._unary(path, body, self._metadata())

    def stream(self, path: str, body: dict[str, Any]) -> _WatchCall:
        if path != "/watch":
            raise ValueError(f"no stream at {path}")
        request = json_format.ParseDict(body, etcdrpc.WatchRequest())
        # The request iterator stays open: a finished one would half-close the stream.
        stop = threading.Event()

        def requests() -> Iterator[Any]:
            yield request
            stop.wait()

        call = self._stubs["watch"].Watch(requests(), metadata=self._metadata())
        call.add_done_callback(lambda _: stop.set())
        return _WatchCall(call)

    def close(self) -> None:
        self._channel.close()
