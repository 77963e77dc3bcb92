"""What a failed etcd request means: whether the member could not serve it (the call
then fails over to another), the kind a metric counts it under, and the error the
operator reads.
"""

from __future__ import annotations

from flannelpy.errors import StoreError
from flannelpy.store.etcd.member import CODES, MemberError

_UNREACHABLE_CODES = {CODES["UNAVAILABLE"], CODES["DEADLINE_EXCEEDED"], CODES["INTERNAL"]}
# A member that cannot reach a quorum times a read out itself and answers UNKNOWN with
# Go's context error just before our own timeout fires: that member is as unreachable
# as a dead one, so the call fails over.
_UNREACHABLE_DETAILS = ("context deadline exceeded", "context canceled")


def details(error: BaseException) -> str:
    """What went wrong, for a log line or an error: the status and etcd's message."""
    if isinstance(error, MemberError):
        return f"{error.name}: {error.message}"
    return str(error) or type(error).__name__


def error_kind(error: BaseException) -> str:
    """A failed request's gRPC status in snake case ("permission_denied"), else "request"."""
    cause = error.__cause__
    return cause.name.lower() if isinstance(cause, MemberError) else "request"


def unreachable(error: MemberError) -> bool:
    """Does this error say the member could not serve the call (try another one)?"""
    if error.code in _UNREACHABLE_CODES:
        return True
    return error.code == CODES["UNKNOWN"] and error.message.strip() in _UNREACHABLE_DETAILS


def request_error(what: str, e: MemberError) -> StoreError:
    """The error an operator reads for a request the member refused: what to fix."""
    text = details(e)
    if "user name is empty" in text:
        return StoreError(
            f"etcd {what}: etcd requires authentication ({text}); "
            "set --etcd-username and --etcd-password"
        )
    if e.code in (CODES["UNAUTHENTICATED"], CODES["INVALID_ARGUMENT"]) and (
        "auth" in text or "password" in text
    ):
        return StoreError(
            f"etcd {what}: authentication failed ({text}); "
            "check --etcd-username and --etcd-password"
        )
    if e.code == CODES["PERMISSION_DENIED"]:
        return StoreError(
            f"etcd {what}: permission denied ({text}); grant the etcd user "
            "read-write access to the --etcd-prefix key range"
        )
    if e.code == CODES["UNIMPLEMENTED"]:
        return StoreError(f"etcd {what}: {e.message}")
    return StoreError(f"etcd {what} failed ({text})")
