"""The Kubernetes API client of Kubernetes mode: built as Flannel builds it, errors mapped
to ours, answers read as raw JSON (no client models: a list of thousands of Nodes
decodes several times faster).
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import urlsplit

import urllib3
from kubernetes import client as kclient
from kubernetes import config as kconfig
from kubernetes.client.exceptions import ApiException

from flannelpy.config.settings import AgentSettings
from flannelpy.errors import ConfigError, RevisionCompacted, StoreError, StoreUnavailable

T = TypeVar("T")

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


class Forbidden(StoreError):
    """The API server refused a call (403): the ServiceAccount lacks a permission."""


def _rules_text(rules: Rules) -> str:
    return "; ".join(
        f"{res}{'.' + group if group else ''}: {','.join(verbs)}" for group, res, verbs in rules
    )


def build_api_client(settings: AgentSettings) -> kclient.ApiClient:
    """An ApiClient as Flannel builds one: ``--kubeconfig-file`` (with
    ``--kube-api-url`` overriding its server), else ``--kube-api-url`` alone with no
    credentials, else the in-cluster service account. Raises ConfigError."""
    cfg = kclient.Configuration()
    url = settings.kube_api_url
    if url is not None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ConfigError(
                f"--kube-api-url {url!r} is not a URL; write it like https://10.96.0.1:443"
            )
    if settings.kubeconfig_file:
        try:
            kconfig.load_kube_config(
                config_file=settings.kubeconfig_file,
                client_configuration=cfg,
                persist_config=False,
            )
        except (kconfig.ConfigException, OSError, ValueError, TypeError) as e:
            raise ConfigError(
                f"--kubeconfig-file {settings.kubeconfig_file}: cannot load it ({e}); "
                "point it at a valid kubeconfig"
            ) from e
        if url:
            _override_host(cfg, url.rstrip("/"))
    elif url:
        cfg.host = url.rstrip("/")
    else:
        try:
            kconfig.load_incluster_config(client_configuration=cfg)
        except kconfig.ConfigException as e:
            raise ConfigError(
                f"not running in a pod with a service account ({e}); give "
                "--kubeconfig-file or --kube-api-url"
            ) from e
    # TCP keepalive (client-go's timings): a watch on a silently dead connection
    # would otherwise wait for its read timeout.
    cfg.keep_alive = True
    # One quick retry covers a pooled connection the server closed; longer outages
    # are retried by our own backoff, which logs one line per attempt.
    cfg.retries = 1
    return kclient.ApiClient(cfg)


def _override_host(cfg: kclient.Configuration, host: str) -> None:
    """Set the server, also across the kubeconfig loader's token refresh hook, which
    copies the kubeconfig's server back before every request."""
    cfg.host = host
    refresh = cfg.refresh_api_key_hook
    if refresh is None:
        return

    def refresh_keeping_host(c: kclient.Configuration) -> None:
        refresh(c)
        c.host = host

    cfg.refresh_api_key_hook = refresh_keeping_host


def _status_message(e: ApiException) -> str:
    try:
        doc = json.loads(e.body or "")
    except (TypeError, ValueError):
        doc = None
    if isinstance(doc, dict) and doc.get("message"):
        return str(doc["message"])
    return str(e.reason or "").strip() or f"HTTP {e.status}"


def api_error(what: str, e: ApiException) -> StoreError:
    status = int(e.status or 0)
    message = _status_message(e)
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
        return StoreError(f"kubernetes API {what}: not found ({message})")
    return StoreError(f"kubernetes API {what} failed: HTTP {status} ({message})")


# Raised by urllib3 and the socket layer when the API server cannot be reached.
UNREACHABLE = (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError)


def call(what: str, fn: Callable[[], T]) -> T:
    try:
        return fn()
    except ApiException as e:
        raise api_error(what, e) from e
    except UNREACHABLE as e:
        raise StoreUnavailable(
            f"kubernetes API {what}: cannot reach the API server ({e}); check "
            "--kube-api-url / --kubeconfig-file and the network"
        ) from e


def read_json(what: str, fn: Callable[[], Any]) -> dict[str, Any]:
    """Call an API method with ``_preload_content=False`` and decode its JSON body."""

    def op() -> bytes:
        resp = fn()
        try:
            return bytes(resp.data)
        finally:
            resp.release_conn()

    raw = call(what, op)
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise StoreUnavailable(f"kubernetes API {what}: the answer is not JSON ({e})") from e
    if not isinstance(doc, dict):
        raise StoreUnavailable(f"kubernetes API {what}: the answer is not a JSON object")
    return doc


def rv_number(rv: str | None) -> int:
    # resourceVersions are opaque strings; in practice etcd revisions.
    return int(rv) if rv and rv.isdigit() else 0
