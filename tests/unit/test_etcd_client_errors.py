"""How the etcd adapter classifies a member's refusals and what every call carries (no
etcd): an error that says "this member could not serve it" fails over; anything else is
ours to report (issue 12, item 7)."""

from __future__ import annotations

import pytest

from flannelpy.errors import StoreError
from flannelpy.store.etcd import client, connection, rpc_errors
from flannelpy.store.etcd.gateway import GatewayMember
from flannelpy.store.etcd.member import CODES, Member, MemberError


@pytest.mark.parametrize(
    ("code", "details"),
    [
        ("UNAVAILABLE", "etcdserver: no leader"),
        ("UNAVAILABLE", "etcdserver: request timed out"),
        ("DEADLINE_EXCEEDED", "Deadline Exceeded"),
        # A member without a quorum times the read out itself, a moment before we do.
        ("UNKNOWN", "context deadline exceeded"),
        ("UNKNOWN", "context canceled"),
    ],
)
def test_a_member_that_could_not_serve_the_call_counts_as_unreachable(
    code: str, details: str
) -> None:
    assert rpc_errors.unreachable(MemberError(CODES[code], details))


@pytest.mark.parametrize(
    ("code", "details"),
    [
        ("PERMISSION_DENIED", "etcdserver: permission denied"),
        ("INVALID_ARGUMENT", "etcdserver: requested lease not found"),
        ("UNKNOWN", "some other failure: context deadline exceeded by a bug"),
    ],
)
def test_other_errors_are_not_an_outage(code: str, details: str) -> None:
    assert not rpc_errors.unreachable(MemberError(CODES[code], details))


def test_every_gateway_call_requires_a_leader_beside_the_auth_token() -> None:
    (endpoint,) = connection.parse_endpoints(["http://127.0.0.1:1"])
    anonymous = GatewayMember(endpoint, None, 1.0)
    user = GatewayMember(endpoint, None, 1.0, "root", "pw")
    user.token.set("t")  # what authenticating sets
    try:
        assert anonymous._headers()["Grpc-Metadata-Hasleader"] == "true"
        assert "Authorization" not in anonymous._headers()
        assert user._headers()["Grpc-Metadata-Hasleader"] == "true"
        assert user._headers()["Authorization"] == "t"
    finally:
        anonymous.close()
        user.close()


def test_every_grpc_call_requires_a_leader_beside_the_auth_token() -> None:
    from flannelpy.store.etcd.grpc_member import GrpcMember

    (endpoint,) = connection.parse_endpoints(["http://127.0.0.1:1"])
    member = GrpcMember(endpoint, None, 1.0, "root", "pw")
    member.token.set("t")
    try:
        assert member._metadata() == (("hasleader", "true"), ("token", "t"))
    finally:
        member.close()


def test_a_call_fails_over_past_a_member_that_timed_out_and_logs_the_move_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nothing listens on these ports: the first member "answers" with the error a member
    without quorum gives; the second serves the call."""
    store = client.EtcdStore(["http://127.0.0.1:9", "http://127.0.0.1:10"], timeout=1.0)

    def call(m: Member) -> str:
        url = m.endpoint.url  # type: ignore[attr-defined]
        if url.endswith(":9"):
            raise MemberError(CODES["UNKNOWN"], "context deadline exceeded")
        return str(url)

    try:
        with caplog.at_level("WARNING", logger="flannelpy.store.etcd.client"):
            assert store._call("get /k", call) == "http://127.0.0.1:10"
            assert store._call("get /k", call) == "http://127.0.0.1:10"  # stays on the second
        moves = [r.getMessage() for r in caplog.records if "moved" in r.getMessage()]
        assert moves == [
            "etcd requests moved to another endpoint from=http://127.0.0.1:9 to=http://127.0.0.1:10"
        ]
    finally:
        store.close()


def test_an_error_that_is_not_an_outage_does_not_fail_over() -> None:
    store = client.EtcdStore(["http://127.0.0.1:9", "http://127.0.0.1:10"], timeout=1.0)
    served: list[str] = []

    def call(m: Member) -> None:
        served.append(m.endpoint.url)  # type: ignore[attr-defined]
        raise MemberError(CODES["PERMISSION_DENIED"], "etcdserver: permission denied")

    try:
        with pytest.raises(StoreError, match="permission denied"):
            store._call("get /k", call)
        assert served == ["http://127.0.0.1:9"]
    finally:
        store.close()


def test_a_server_without_the_gateway_is_an_error_naming_both_fixes() -> None:
    error = rpc_errors.request_error("get /k", _gateway_404())
    assert "--enable-grpc-gateway" in str(error) and "--etcd-transport=grpc" in str(error)


def _gateway_404() -> MemberError:
    from flannelpy.store.etcd import gateway

    return gateway._error_of(404, b"404 page not found\n")


@pytest.mark.parametrize(
    ("body", "code", "message"),
    [
        # A request's refusal, and a stream's last message.
        (
            b'{"error":"etcdserver: no leader","code":14,"message":"etcdserver: no leader"}',
            "UNAVAILABLE",
            "etcdserver: no leader",
        ),
        (
            b'{"error":{"grpc_code":7,"http_code":403,"message":"etcdserver: permission denied"}}',
            "PERMISSION_DENIED",
            "etcdserver: permission denied",
        ),
    ],
)
def test_the_gateways_error_bodies_carry_etcds_status(body: bytes, code: str, message: str) -> None:
    from flannelpy.store.etcd import gateway

    error = gateway._error_of(503, body)
    assert (error.name, error.message) == (code, message)


def test_an_error_without_json_is_read_from_the_http_status() -> None:
    from flannelpy.store.etcd import gateway

    assert gateway._error_of(503, b"upstream down").name == "UNAVAILABLE"
    assert gateway._error_of(401, b"").name == "UNAUTHENTICATED"


def test_the_transport_is_the_gateway_unless_asked_or_given_a_client_certificate() -> None:
    # With --etcd-certfile it is gRPC: tests/integration/test_etcd_manager.py, TLS.
    assert client.EtcdStore(["http://127.0.0.1:9"]).transport == "gateway"
    assert client.EtcdStore(["http://127.0.0.1:9"], transport="grpc").transport == "grpc"
    with pytest.raises(Exception, match="--etcd-transport 'http' is not a transport"):
        client.EtcdStore(["http://127.0.0.1:9"], transport="http")
