"""What a failed etcd request means: whether the member could not serve it (the call
then fails over to another), the kind a metric counts it under, and the error the
operator reads.
"""

from __future__ import annotations

import grpc
from pyetcd import exceptions as etcd_exc

from flannelpy.errors import StoreError

# pyetcd raises these when the member cannot be reached in time.
UNREACHABLE = (
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


def rpc_details(error: BaseException) -> str:
    """The gRPC status text behind a pyetcd exception (pyetcd drops it)."""
    for candidate in (error, error.__cause__, error.__context__):
        if isinstance(candidate, grpc.RpcError):
            code = candidate.code() if hasattr(candidate, "code") else None
            details = candidate.details() if hasattr(candidate, "details") else None
            name = code.name if code is not None else "UNKNOWN"
            return f"{name}: {details}"
    return str(error) or type(error).__name__


def error_kind(error: BaseException) -> str:
    """A failed request's gRPC status in snake case ("permission_denied"), else "request"."""
    code = rpc_code(error.__cause__) if error.__cause__ is not None else None
    return code.name.lower() if code is not None else "request"


def unreachable(error: grpc.RpcError) -> bool:
    """Does this error say the member could not serve the call (try another one)?"""
    code = rpc_code(error)
    if code in _UNREACHABLE_CODES:
        return True
    details = (error.details() if hasattr(error, "details") else None) or ""
    return code == grpc.StatusCode.UNKNOWN and details.strip() in _UNREACHABLE_DETAILS


def rpc_code(error: BaseException) -> grpc.StatusCode | None:
    if isinstance(error, grpc.RpcError) and hasattr(error, "code"):
        code = error.code()
        return code if isinstance(code, grpc.StatusCode) else None
    return None


def request_error(what: str, e: grpc.RpcError) -> StoreError:
    """The error an operator reads for a request the member refused: what to fix."""
    code = rpc_code(e)
    details = rpc_details(e)
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
