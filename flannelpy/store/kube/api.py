"""Kubernetes mode's contract with the API server: the permissions every call needs, and
how an answer that is no success becomes one of our errors. The client itself is
:mod:`.client`; how it finds the server and its credentials, :mod:`.kubeconfig`.
"""

from __future__ import annotations

import json

from flannelpy.errors import RevisionCompacted, StoreError, StoreUnavailable
from flannelpy.store import http as http_layer

# (apiGroup, resource, verbs): exactly what Kubernetes mode calls (see manager.py), in two
# scopes. "" is the core group.
Rules = tuple[tuple[str, str, tuple[str, ...]], ...]
# The ClusterRole's: in every namespace (pods and Events are namespaced, but the agent's
# pod and its Node's Events are not in a namespace known in advance).
RBAC_RULES: Rules = (
    ("", "pods", ("get",)),
    ("", "nodes", ("get", "list", "watch")),
    ("", "nodes/status", ("patch",)),
    # Events about our Node (forced and blocked changes), as series (events.py).
    ("events.k8s.io", "events", ("create", "patch")),
)
# The Role's, in the agents' own namespace only: cluster-wide, leases would let an agent
# rewrite every node's kube-node-lease heartbeat and every controller's leader election.
NAMESPACED_RBAC_RULES: Rules = (
    # This node's status record: its own Lease (node_status.py).
    ("coordination.k8s.io", "leases", ("create", "patch")),
)

# Raised by urllib3 and the socket layer when the API server cannot be reached.
UNREACHABLE = http_layer.UNREACHABLE


class Forbidden(StoreError):
    """The API server refused a call (403): the ServiceAccount lacks a permission."""


class NotFound(StoreError):
    """The object does not exist (404)."""


class Conflict(StoreError):
    """A write named an older resourceVersion, or created what exists (409)."""


def _rules_text(rules: Rules) -> str:
    return "; ".join(
        f"{res}{'.' + group if group else ''}: {','.join(verbs)}" for group, res, verbs in rules
    )


def status_message(status: int, reason: str, body: bytes) -> str:
    """The Status object's message, else the HTTP reason."""
    try:
        doc = json.loads(body or b"")
    except (TypeError, ValueError):
        doc = None
    if isinstance(doc, dict) and doc.get("message"):
        return str(doc["message"])
    return reason.strip() or f"HTTP {status}"


def api_error(what: str, status: int, reason: str = "", body: bytes = b"") -> StoreError:
    message = status_message(status, reason, body)
    if status == 410:
        return RevisionCompacted(f"kubernetes API {what}: {message} (410 Gone); re-list", 0)
    if status == 0 or status == 429 or status >= 500:
        return StoreUnavailable(f"kubernetes API {what}: {message}")
    if status == 401:
        return StoreError(
            f"kubernetes API {what}: unauthorized ({message}); check the ServiceAccount "
            "token or --kubeconfig-file"
        )
    if status == 403:
        return Forbidden(
            f"kubernetes API {what}: forbidden ({message}); the agent's ClusterRole must "
            f"allow {_rules_text(RBAC_RULES)}, and its Role in its own namespace "
            f"{_rules_text(NAMESPACED_RBAC_RULES)}"
        )
    if status == 404:
        return NotFound(f"kubernetes API {what}: not found ({message})")
    if status == 409:
        return Conflict(f"kubernetes API {what} failed: HTTP 409 ({message})")
    return StoreError(f"kubernetes API {what} failed: HTTP {status} ({message})")


def rv_number(rv: str | None) -> int:
    # resourceVersions are opaque strings; in practice etcd revisions.
    return int(rv) if rv and rv.isdigit() else 0
