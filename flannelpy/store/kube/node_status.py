"""Kubernetes mode: each node's status as one ``coordination.k8s.io`` Lease.

The etcd mode's status record (``flannelpy.control.records.NodeStatus``) lives
in Kubernetes mode as a Lease named after the node in the flannelpy namespace, the
record in its ``flannelpy.io/status`` annotation. No agent watches or lists these
Leases: only ``flannelpy rollout`` (and an operator's kubectl) reads them, so a write
costs one request and no watch events, instead of one event for every node as an
annotation on the Node would.

The API server is a budget the whole cluster shares: the record is fixed-size
(:func:`encode_summary` cuts it to :data:`MAX_SUMMARY_BYTES` whatever the node holds),
written at once on a change but never twice within :data:`MIN_WRITE_GAP` seconds, and
otherwise at most every :data:`HEARTBEAT_SECONDS` (:class:`WriteLimiter`). The agent
needs ``create`` and ``patch`` on leases in its own namespace only (a Role, not the
ClusterRole; a merge patch needs no ``get``); readers ``list`` and ``watch`` them.
Refused (403), the agent says once which permission is missing, runs on without its
record and tries again every :data:`FORBIDDEN_RETRY_SECONDS`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from flannelpy.errors import StoreError
from flannelpy.store.kube.api import Forbidden, NotFound
from flannelpy.store.kube.client import MERGE_PATCH, KubeClient, path

log = logging.getLogger("flannelpy.kube.status")

STATUS_ANNOTATION = "flannelpy.io/status"
CONFIG_BACKEND_KEY = "ConfigBackend"  # the Backend of the net-conf.json the agent reads
STATUS_LABEL = "flannelpy.io/node-status"  # marks our Leases among others in the namespace
DEFAULT_NAMESPACE = "kube-flannelpy"  # the manifests'; the DaemonSet sets POD_NAMESPACE
SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"

MAX_SUMMARY_BYTES = 4096  # whatever the cluster size: the record is cut to fit
MAX_LIST = 8  # subnets and underlay networks named
MAX_TEXT = 400  # characters of a blocked change's sentence
MAX_CONFIG_BACKEND = 512  # bytes of the config's Backend kept (else left out)
MIN_WRITE_GAP = 2.0  # seconds between two writes, however often things change
HEARTBEAT_SECONDS = 300.0  # an unchanged record is rewritten this often, no more
LEASE_DURATION = int(HEARTBEAT_SECONDS * 2)  # a reader may call older records stale
FORBIDDEN_RETRY_SECONDS = 60.0  # a refused write waits for an operator: retry this often
LEASES = "leases.coordination.k8s.io"


# ---------------------------------------------------------------------------
# The pure part
# ---------------------------------------------------------------------------


def _cut(text: Any, limit: int) -> Any:
    if not isinstance(text, str) or len(text) <= limit:
        return text
    return text[: limit - 1] + "…"


def _dumps(doc: Mapping[str, Any]) -> str:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=False)


def _no_failing_names(doc: dict[str, Any]) -> None:
    if isinstance(doc.get("ProbeSummary"), dict):
        doc["ProbeSummary"]["FailingPeers"] = []


def _no_config_backend(doc: dict[str, Any]) -> None:
    doc.pop(CONFIG_BACKEND_KEY, None)


def _no_lists(doc: dict[str, Any]) -> None:
    subnets = doc.get("Subnets")
    doc["UnderlayNetworks"], doc["Blocked"] = [], None
    doc["Subnets"] = subnets[:1] if isinstance(subnets, list) else []


def _short_names(doc: dict[str, Any]) -> None:
    for key in ("Node", "PublicIP"):
        doc[key] = _cut(doc.get(key), 253)
    doc["Subnets"] = []


# What goes, in turn, while the record is over its bound.
_SHEDDING: tuple[Callable[[dict[str, Any]], None], ...] = (
    _no_failing_names,
    _no_config_backend,
    _no_lists,
    _short_names,
)


def encode_summary(status_json: str, config_backend: Mapping[str, Any] | None = None) -> str:
    """The status record (``NodeStatus.to_json()``) as the Lease holds it: at most
    :data:`MAX_SUMMARY_BYTES` bytes, with the config's Backend when that is small.

    Lists are cut to :data:`MAX_LIST` entries and a blocked change's texts to
    :data:`MAX_TEXT` characters; while it is still too large (long names), the failing
    peers named go (their count stays), then the config's Backend, then the lists.
    What a rollout reads (backend, generation, readiness, probe counts) stays.
    """
    doc: dict[str, Any] = json.loads(status_json)
    for key in ("UnderlayNetworks", "Subnets"):
        if isinstance(doc.get(key), list):
            doc[key] = doc[key][:MAX_LIST]
    blocked = doc.get("Blocked")
    if isinstance(blocked, dict):
        for key in ("Change", "Sentence"):
            blocked[key] = _cut(blocked.get(key), MAX_TEXT)
    if config_backend is not None:
        backend = json.loads(json.dumps(dict(config_backend), sort_keys=True))
        if len(_dumps(backend).encode()) <= MAX_CONFIG_BACKEND:
            doc[CONFIG_BACKEND_KEY] = backend
    text = _dumps(doc)
    for shed in _SHEDDING:
        if len(text.encode()) <= MAX_SUMMARY_BYTES:
            break
        shed(doc)
        text = _dumps(doc)
    return text


def decode_summary(raw: str) -> tuple[str, Mapping[str, Any] | None]:
    """A Lease's record: the status JSON (for ``NodeStatus.from_json``) and the config's
    Backend it names. Raises ValueError naming what is wrong (another machine wrote it)."""
    if len(raw.encode()) > MAX_SUMMARY_BYTES * 2:
        raise ValueError(f"the status record is {len(raw)} bytes, over its bound")
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise ValueError(f"the status record is not JSON: {e}") from e
    if not isinstance(doc, dict):
        raise ValueError("the status record must be a JSON object")
    backend = doc.get(CONFIG_BACKEND_KEY)
    return raw, backend if isinstance(backend, dict) else None


def _content(text: str) -> str:
    """The summary without its write time: what counts as a change."""
    doc = json.loads(text)
    doc.pop("At", None)
    return json.dumps(doc, sort_keys=True)


class WriteLimiter:
    """When to write: a change at once, unless the last write is under ``min_gap``
    seconds old; the same content again only after ``heartbeat`` seconds. Times are
    monotonic seconds."""

    def __init__(
        self, min_gap: float = MIN_WRITE_GAP, heartbeat: float = HEARTBEAT_SECONDS
    ) -> None:
        self.min_gap, self.heartbeat = min_gap, heartbeat
        self._last_at: float | None = None
        self._last_content: str | None = None

    def due(self, now: float, text: str) -> bool:
        if self._last_at is None:
            return True
        gap = now - self._last_at
        if _content(text) != self._last_content:
            return gap >= self.min_gap
        return gap >= self.heartbeat

    def wrote(self, now: float, text: str) -> None:
        self._last_at, self._last_content = now, _content(text)


def lease_body(node: str, namespace: str, text: str, now: datetime) -> dict[str, Any]:
    stamp = now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return {
        "apiVersion": "coordination.k8s.io/v1",
        "kind": "Lease",
        "metadata": {
            "name": node,
            "namespace": namespace,
            "labels": {STATUS_LABEL: "true", "app.kubernetes.io/name": "flannelpy"},
            "annotations": {STATUS_ANNOTATION: text},
        },
        "spec": {
            "holderIdentity": node,
            "leaseDurationSeconds": LEASE_DURATION,
            "renewTime": stamp,
        },
    }


@dataclass(frozen=True)
class NodeSummary:
    """One node's Lease as a reader sees it."""

    status_json: str  # for NodeStatus.from_json
    config_backend: Mapping[str, Any] | None  # the Backend its net-conf.json holds


def parse_leases(doc: Mapping[str, Any]) -> tuple[dict[str, NodeSummary], dict[str, str]]:
    """A Lease list: each node's record, and why a Lease could not be read."""
    found: dict[str, NodeSummary] = {}
    errors: dict[str, str] = {}
    for item in doc.get("items") or []:
        meta = (item.get("metadata") or {}) if isinstance(item, dict) else {}
        name = str(meta.get("name") or "")
        raw = (meta.get("annotations") or {}).get(STATUS_ANNOTATION)
        if not name or not isinstance(raw, str):
            continue
        try:
            found[name] = NodeSummary(*decode_summary(raw))
        except ValueError as e:
            errors[f"lease {name}/status"] = str(e)
    return found, errors


def override_rollout(raw: str | None) -> str | None:
    """The rollout an override annotation names, if it parses and names one."""
    if not raw or len(raw) > MAX_SUMMARY_BYTES:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    rollout = doc.get("Rollout") if isinstance(doc, dict) else None
    return rollout if isinstance(rollout, str) and rollout else None


def forbidden_sentence(verb: str, namespace: str) -> str:
    """What a refused Lease write logs: the missing permission and where to grant it."""
    return (
        f"status Lease not written: the ServiceAccount may not {verb} {LEASES} in namespace "
        f"{namespace}; bind it to a Role there granting create and patch on leases (the "
        f"Role flannelpy of manifests/kube-flannelpy.yml); the agent runs on without its "
        f"status record and retries every {FORBIDDEN_RETRY_SECONDS:g} s"
    )


def agent_namespace(environ: Mapping[str, str], read: Callable[[str], str]) -> str:
    """POD_NAMESPACE (the DaemonSet sets it), else the ServiceAccount's, else ours."""
    if environ.get("POD_NAMESPACE"):
        return environ["POD_NAMESPACE"]
    try:
        return read(SA_NAMESPACE_FILE).strip() or DEFAULT_NAMESPACE
    except OSError:
        return DEFAULT_NAMESPACE


# ---------------------------------------------------------------------------
# The side effects
# ---------------------------------------------------------------------------


class StatusDeferred(StoreError):
    """Not written now (the write rate limit); the publisher tries again later."""


class LeaseForbidden(Forbidden):
    """The API server refused a Lease write (403); ``verb`` is the call refused."""

    def __init__(self, message: str, verb: str) -> None:
        super().__init__(message)
        self.verb = verb


class LeasePublisher:
    """The agent's side: write our Lease when :class:`WriteLimiter` allows."""

    def __init__(
        self,
        client: KubeClient,
        namespace: str,
        monotonic: Callable[[], float] = time.monotonic,
        limiter: WriteLimiter | None = None,
    ) -> None:
        self._client = client
        self._namespace = namespace
        self._monotonic = monotonic
        self._limiter = limiter or WriteLimiter()
        self._lock = threading.Lock()
        self._warned: str | None = None
        self._forbidden_at: float | None = None  # the last refused write
        self._told_forbidden = False  # said once until a write succeeds again
        self.writes = 0

    def publish(
        self, node: str, status_json: str, config_backend: Mapping[str, Any] | None
    ) -> None:
        """Write ``status_json`` (``NodeStatus.to_json()``); StatusDeferred when the
        rate limit holds it back (the caller publishes again on its next tick)."""
        text = encode_summary(status_json, config_backend)
        with self._lock:
            now = self._monotonic()
            if not self._limiter.due(now, text):
                raise StatusDeferred(
                    f"status Lease written less than {self._limiter.min_gap:g} s ago"
                )
            refused = self._forbidden_at
            if refused is not None and now - refused < FORBIDDEN_RETRY_SECONDS:
                raise StatusDeferred(
                    f"status Lease write refused (403) less than {FORBIDDEN_RETRY_SECONDS:g} s ago"
                )
            try:
                self._write(node, text)
            except LeaseForbidden as e:
                self._forbidden_at = now
                if not self._told_forbidden:  # RBAC stays wrong until an operator acts
                    self._told_forbidden = True
                    log.warning("%s", forbidden_sentence(e.verb, self._namespace))
                log.debug("status Lease refused: %s", e)
                raise
            except StoreError as e:
                if str(e) != self._warned:  # once per cause: it is retried every tick
                    self._warned = str(e)
                    log.warning("status Lease not written; retrying error=%s", e)
                raise
            self._warned, self._forbidden_at, self._told_forbidden = None, None, False
            self._limiter.wrote(now, text)
            self.writes += 1

    def _write(self, node: str, text: str) -> None:
        body: Any = lease_body(node, self._namespace, text, datetime.now(UTC))
        timeout = (5.0, 10.0)
        leases = f"apis/coordination.k8s.io/v1/namespaces/{self._namespace}/leases"
        what = f"lease {self._namespace}/{node}"
        verb = "patch"
        try:
            try:
                self._client.send(
                    f"patch {what}", "PATCH", path(leases, node), body, MERGE_PATCH, timeout
                )
            except NotFound:  # the first write on this node: create it
                verb = "create"
                self._client.send(f"create {what}", "POST", path(leases), body, timeout=timeout)
        except Forbidden as e:
            raise LeaseForbidden(str(e), verb) from e
