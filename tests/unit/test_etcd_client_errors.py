"""How the etcd adapter classifies gRPC failures and what every call carries (no etcd):
an error that says "this member could not serve it" fails over; anything else is ours
to report (issue 12, item 7)."""

from __future__ import annotations

import grpc
import pyetcd
import pytest

from flannelpy.errors import StoreError
from flannelpy.store.etcd import client, connection, rpc_errors


class _RpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@pytest.mark.parametrize(
    ("code", "details"),
    [
        (grpc.StatusCode.UNAVAILABLE, "etcdserver: no leader"),
        (grpc.StatusCode.UNAVAILABLE, "etcdserver: request timed out"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"),
        # A member without a quorum times the read out itself, a moment before we do.
        (grpc.StatusCode.UNKNOWN, "context deadline exceeded"),
        (grpc.StatusCode.UNKNOWN, "context canceled"),
    ],
)
def test_a_member_that_could_not_serve_the_call_counts_as_unreachable(
    code: grpc.StatusCode, details: str
) -> None:
    assert rpc_errors.unreachable(_RpcError(code, details))


@pytest.mark.parametrize(
    ("code", "details"),
    [
        (grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied"),
        (grpc.StatusCode.INVALID_ARGUMENT, "etcdserver: requested lease not found"),
        (grpc.StatusCode.UNKNOWN, "some other failure: context deadline exceeded by a bug"),
    ],
)
def test_other_errors_are_not_an_outage(code: grpc.StatusCode, details: str) -> None:
    assert not rpc_errors.unreachable(_RpcError(code, details))


def test_every_call_requires_a_leader_beside_the_auth_token() -> None:
    endpoint = pyetcd.Endpoint("127.0.0.1", 1, secure=False, time_retry=0)
    c = connection.LeaderClient(endpoints=[endpoint], timeout=1.0)
    try:
        assert c.metadata == (("hasleader", "true"),)
        c.metadata = (("token", "t"),)  # what pyetcd sets after authenticating
        assert c.metadata == (("token", "t"), ("hasleader", "true"))
        assert c.get_watcher()._metadata == c.metadata
    finally:
        c.close()


def test_a_call_fails_over_past_a_member_that_timed_out_and_logs_the_move_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nothing listens on these ports: the first member "answers" with the error a member
    without quorum gives; the second serves the call."""
    store = client.EtcdStore(["http://127.0.0.1:9", "http://127.0.0.1:10"], timeout=1.0)
    first = store.endpoints[0].rsplit("/", 1)[-1]

    def call(c: pyetcd.MultiEndpointEtcd3Client) -> str:
        if first in c.endpoints:
            raise _RpcError(grpc.StatusCode.UNKNOWN, "context deadline exceeded")
        return next(iter(c.endpoints))

    try:
        with caplog.at_level("WARNING", logger="flannelpy.store.etcd.client"):
            assert store._call("get /k", call) == "127.0.0.1:10"
            assert store._call("get /k", call) == "127.0.0.1:10"  # stays on the second
        moves = [r.getMessage() for r in caplog.records if "moved" in r.getMessage()]
        assert moves == [
            "etcd requests moved to another endpoint from=http://127.0.0.1:9 to=http://127.0.0.1:10"
        ]
    finally:
        store.close()


def test_an_error_that_is_not_an_outage_does_not_fail_over() -> None:
    store = client.EtcdStore(["http://127.0.0.1:9", "http://127.0.0.1:10"], timeout=1.0)
    served: list[str] = []

    def call(c: pyetcd.MultiEndpointEtcd3Client) -> None:
        served.append(next(iter(c.endpoints)))
        raise _RpcError(grpc.StatusCode.PERMISSION_DENIED, "etcdserver: permission denied")

    try:
        with pytest.raises(StoreError, match="permission denied"):
            store._call("get /k", call)
        assert served == ["127.0.0.1:9"]
    finally:
        store.close()
