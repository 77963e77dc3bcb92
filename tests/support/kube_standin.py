"""A small stand-in for the Kubernetes API server: Nodes, Pod GET and Event create for
the real client.

No API server can run on the test machines, so Kubernetes mode is tested
against this. It keeps what the subnet manager relies on faithful:

- resourceVersions: one counter for every kind (etcd's revision), bumped by every
  write; a write that changes nothing bumps nothing, as in the real server.
- ``GET /api/v1/nodes``: a list with ``metadata.resourceVersion``; ``limit`` +
  ``continue`` pages of one consistent snapshot; a continue token older than the
  compaction point is answered 410 ``Expired``.
- ``GET /api/v1/nodes?watch=1&resourceVersion=..&allowWatchBookmarks=true&timeoutSeconds=..``:
  chunked JSON lines (ADDED / MODIFIED / DELETED / BOOKMARK / ERROR) replayed
  from ``resourceVersion`` and then live; a version older than the compaction
  point gets an ERROR event with code 410 (or, with ``gone_as="status"``, an
  HTTP 410 answer); no or "0" resourceVersion starts with synthetic ADDED events.
- ``GET /api/v1/nodes/<name>``, ``GET /api/v1/namespaces/<ns>/pods/<name>``.
- ``PATCH /api/v1/nodes/<name>/status`` with ``application/strategic-merge-patch+json``
  (conditions and addresses merge by ``type``) or ``application/merge-patch+json``;
  like the real status subresource it ignores changes to ``spec``.
- ``PATCH /api/v1/nodes/<name>`` with the same two patch types (``kubectl annotate``
  sends a merge patch of ``metadata.annotations``); like the real Node strategy it
  ignores changes to ``status``. Both PATCHes honour a ``metadata.resourceVersion``
  precondition (409 Conflict) and produce a MODIFIED watch event when they change
  something.
- ``POST /api/v1/namespaces/<ns>/events``: 201 with the created Event (``generateName``
  gets 5 random characters, as the API server's name generator does); the v1
  validation for events without ``reportingController``: the namespace in the body,
  if any, must be the path's, an event about a cluster-scoped object (no
  ``involvedObject.namespace``, e.g. a Node) lives in ``default``, else in the
  object's namespace (422 Invalid otherwise). Events are not watched here.

Controls for tests: add_node, set_pod_cidr, set_annotations, delete_node,
add_pod, compact, inject_watch_410, set_unreachable (listener closed, open
connections cut), ``requests`` (every request seen) and ``events`` (every Event
created).
"""

from __future__ import annotations

import base64
import contextlib
import copy
import json
import random
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple
from urllib.parse import parse_qs, urlsplit

Json = dict[str, Any]

STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
# The API server's generateName suffix: 5 characters from an alphabet without vowels.
_NAME_ALPHABET = "bcdfghjklmnpqrstvwxz2456789"
# patchMergeKey of the Node lists a strategic-merge patch merges instead of replacing.
_MERGE_KEYS = {
    ("status", "conditions"): "type",
    ("status", "addresses"): "type",
    ("spec", "taints"): "key",
}


class Request(NamedTuple):
    method: str
    path: str  # without the query string
    content_type: str | None
    query: Mapping[str, str]
    body: bytes = b""  # PATCH bodies
    authorization: str | None = None  # the Authorization header, if any

    @property
    def rbac(self) -> tuple[str, str, str]:
        """(apiGroup, resource, verb) as the API server's authorizer sees this request."""
        parts = [p for p in self.path.split("/") if p]
        if parts[:2] != ["api", "v1"]:
            return ("?", self.path, self.method.lower())
        rest = parts[2:]
        if rest[:1] == ["namespaces"] and len(rest) >= 3:
            rest = rest[2:]
        resource = rest[0] if rest else ""
        if len(rest) >= 3:
            resource += "/" + rest[2]
        verb = {
            "GET": "get",
            "PATCH": "patch",
            "PUT": "update",
            "POST": "create",
            "DELETE": "delete",
        }.get(self.method, self.method.lower())
        if self.method == "GET" and len(rest) == 1:
            verb = "watch" if _truthy(self.query.get("watch")) else "list"
        return ("", resource, verb)


def _truthy(value: str | None) -> bool:
    return (value or "").lower() in ("1", "true", "t", "yes")


def _status(code: int, reason: str, message: str) -> Json:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def strategic_merge(original: Json, patch: Mapping[str, Any], path: tuple[str, ...] = ()) -> Json:
    """Kubernetes' strategic merge for the Node fields we need: maps merge, null
    deletes, lists with a patchMergeKey merge by it, other lists are replaced."""
    result = copy.deepcopy(original)
    for key, value in patch.items():
        here = (*path, key)
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = strategic_merge(result[key], value, here)
        elif isinstance(value, list) and here in _MERGE_KEYS:
            result[key] = _merge_list(result.get(key) or [], value, _MERGE_KEYS[here], here)
        else:
            result[key] = copy.deepcopy(value)
    return result


def _merge_list(
    have: list[Json], patch: list[Json], merge_key: str, path: tuple[str, ...]
) -> list[Json]:
    out = copy.deepcopy(have)
    for item in patch:
        index = next(
            (i for i, old in enumerate(out) if old.get(merge_key) == item.get(merge_key)), None
        )
        if item.get("$patch") == "delete":
            if index is not None:
                out.pop(index)
        elif index is None:
            out.append(copy.deepcopy(item))
        else:
            out[index] = strategic_merge(out[index], item, path)
    return out


def json_merge(original: Json, patch: Mapping[str, Any]) -> Json:
    """RFC 7386 merge patch: maps merge, null deletes, lists are replaced."""
    result = copy.deepcopy(original)
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        elif isinstance(value, dict) and isinstance(result.get(key), dict):
            result[key] = json_merge(result[key], value)
        else:
            result[key] = copy.deepcopy(value)
    return result


@dataclass
class _Event:
    rv: int
    type: str
    obj: Json


class _HttpError(Exception):
    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.status = _status(code, reason, message)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    standin: KubeStandin


class KubeStandin:
    """The API server stand-in, serving in threads on ``host:port`` (0: a free port)."""

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        bookmark_interval: float = 1.0,
        gone_as: str = "event",
        max_watch_seconds: float = 60.0,
    ) -> None:
        assert gone_as in ("event", "status")
        self.host = host
        self.port = port
        self.bookmark_interval = bookmark_interval
        self.gone_as = gone_as
        self.max_watch_seconds = max_watch_seconds
        self._cond = threading.Condition(threading.RLock())
        self._rv = 100
        self._nodes: dict[str, Json] = {}
        self._pods: dict[tuple[str, str], Json] = {}
        self._events: dict[tuple[str, str], Json] = {}  # (namespace, name) -> Event
        self._history: list[_Event] = []
        self._compacted = 0
        self._gone_epoch = 0
        self._snapshots: dict[str, tuple[int, list[Json]]] = {}
        self._requests: list[Request] = []
        self._conns: set[socket.socket] = set()
        self._watches = 0
        self._unreachable = False
        self._closing = False
        self._server: _Server | None = None
        # Called (in the handler thread, before the answer) with every request: lets
        # a test act at an exact point, e.g. compact between two list pages.
        self.before_request: Callable[[Request], object] | None = None
        self._thread: threading.Thread | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> KubeStandin:
        self._listen()
        return self

    def _listen(self) -> None:
        server = _Server((self.host, self.port), _Handler)
        server.standin = self
        self.port = server.server_address[1]
        self._server = server
        self._thread = threading.Thread(
            target=server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name=f"kube-standin-{self.port}",
            daemon=True,
        )
        self._thread.start()

    def _unlisten(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()
        with self._cond:
            conns = list(self._conns)
            self._cond.notify_all()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        with self._cond:
            self._closing = True
        self._unlisten()

    def __enter__(self) -> KubeStandin:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    # -- controls ----------------------------------------------------------------------------

    def add_node(
        self,
        name: str,
        pod_cidr: str | None = None,
        annotations: Mapping[str, str] | None = None,
        internal_ip: str | None = None,
    ) -> Json:
        with self._cond:
            assert name not in self._nodes, f"node {name} exists"
            node: Json = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {
                    "name": name,
                    "uid": str(uuid.uuid4()),
                    "creationTimestamp": _now(),
                    "labels": {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"},
                    "annotations": dict(annotations or {}),
                },
                "spec": {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]} if pod_cidr else {},
                "status": {
                    "conditions": [
                        {
                            "type": "Ready",
                            "status": "True",
                            "reason": "KubeletReady",
                            "lastHeartbeatTime": _now(),
                            "lastTransitionTime": _now(),
                        },
                    ],
                    "addresses": (
                        [{"type": "InternalIP", "address": internal_ip}] if internal_ip else []
                    ),
                },
            }
            return self._commit("ADDED", node)

    def set_pod_cidr(self, name: str, pod_cidr: str | None) -> Json:
        def change(node: Json) -> None:
            node["spec"] = {"podCIDR": pod_cidr, "podCIDRs": [pod_cidr]} if pod_cidr else {}

        return self._modify(name, change)

    def set_annotations(self, name: str, values: Mapping[str, str | None]) -> Json:
        """Set annotations; a None value removes one."""

        def change(node: Json) -> None:
            notes = node["metadata"].setdefault("annotations", {})
            for key, value in values.items():
                if value is None:
                    notes.pop(key, None)
                else:
                    notes[key] = value

        return self._modify(name, change)

    def delete_node(self, name: str) -> None:
        with self._cond:
            node = self._nodes.pop(name)
            self._rv += 1
            node["metadata"]["resourceVersion"] = str(self._rv)
            self._record("DELETED", node)

    def add_pod(self, namespace: str, name: str, node_name: str | None) -> None:
        with self._cond:
            self._pods[(namespace, name)] = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4())},
                "spec": {"nodeName": node_name} if node_name else {},
            }

    def node(self, name: str) -> Json | None:
        with self._cond:
            node = self._nodes.get(name)
            return copy.deepcopy(node) if node else None

    @property
    def events(self) -> list[Json]:
        """Every Event created so far, in creation order."""
        with self._cond:
            return [copy.deepcopy(e) for e in self._events.values()]

    @property
    def resource_version(self) -> int:
        with self._cond:
            return self._rv

    def compact(self) -> int:
        """Forget history up to now: a watch or continue token from an older
        resourceVersion is answered 410 Gone. Returns the compaction point."""
        with self._cond:
            self._compacted = self._rv
            return self._compacted

    def inject_watch_410(self, then: Callable[[], object] | None = None) -> None:
        """End every open watch with an ERROR 410 event. ``then`` runs atomically
        with it, before any stream can send another event: a change made there is
        never delivered on the old streams, so only a re-list can see it."""
        with self._cond:
            self._gone_epoch += 1
            if then is not None:
                then()
            self._cond.notify_all()

    def set_unreachable(self, unreachable: bool) -> None:
        """True: close the listener (new connections are refused) and cut every open
        connection. False: listen again on the same port."""
        with self._cond:
            if unreachable == self._unreachable:
                return
            self._unreachable = unreachable
        if unreachable:
            self._unlisten()
        else:
            self._listen()

    @property
    def requests(self) -> list[Request]:
        with self._cond:
            return list(self._requests)

    def clear_requests(self) -> None:
        with self._cond:
            self._requests.clear()

    @property
    def active_watches(self) -> int:
        with self._cond:
            return self._watches

    def rbac_usage(self) -> set[tuple[str, str, str]]:
        """Every (apiGroup, resource, verb) the requests so far needed."""
        return {r.rbac for r in self.requests}

    # -- state -------------------------------------------------------------------------------

    def _modify(self, name: str, change: Callable[[Json], None]) -> Json:
        with self._cond:
            node = copy.deepcopy(self._nodes[name])
            change(node)
            return self._commit("MODIFIED", node)

    def _commit(self, kind: str, node: Json) -> Json:
        """Store a node; bump the resourceVersion and record an event if it changed."""
        name = node["metadata"]["name"]
        old = self._nodes.get(name)
        if old is not None and _without_rv(old) == _without_rv(node):
            return copy.deepcopy(old)
        self._rv += 1
        node["metadata"]["resourceVersion"] = str(self._rv)
        self._nodes[name] = node
        self._record(kind, node)
        return copy.deepcopy(node)

    def _record(self, kind: str, node: Json) -> None:
        # History is never dropped (tests are short): compaction only refuses new
        # watches from before it, as etcd does; open watches keep streaming.
        self._history.append(_Event(self._rv, kind, copy.deepcopy(node)))
        self._cond.notify_all()

    # -- request handling (called from handler threads) ---------------------------------------

    def _log_request(self, request: Request) -> None:
        with self._cond:
            self._requests.append(request)

    def _get_node(self, name: str) -> Json:
        with self._cond:
            node = self._nodes.get(name)
            if node is None:
                raise _HttpError(404, "NotFound", f'nodes "{name}" not found')
            return copy.deepcopy(node)

    def _get_pod(self, namespace: str, name: str) -> Json:
        with self._cond:
            pod = self._pods.get((namespace, name))
            if pod is None:
                raise _HttpError(404, "NotFound", f'pods "{name}" not found')
            return copy.deepcopy(pod)

    def _list_nodes(self, query: Mapping[str, str]) -> Json:
        limit = int(query.get("limit") or 0)
        token = query.get("continue") or ""
        with self._cond:
            if token:
                snap_id, offset = _decode_token(token)
                if snap_id not in self._snapshots:
                    raise _HttpError(400, "BadRequest", "invalid continue token")
                list_rv, items = self._snapshots[snap_id]
                if list_rv < self._compacted:
                    raise _HttpError(
                        410,
                        "Expired",
                        "The provided continue parameter is too old to display a consistent "
                        "list result. You can start a new list without the continue parameter.",
                    )
            else:
                snap_id, offset = uuid.uuid4().hex, 0
                list_rv = self._rv
                items = [copy.deepcopy(self._nodes[n]) for n in sorted(self._nodes)]
                self._snapshots[snap_id] = (list_rv, items)
        end = offset + limit if limit else len(items)
        meta: Json = {"resourceVersion": str(list_rv)}
        if end < len(items):
            meta["continue"] = _encode_token(snap_id, end)
            meta["remainingItemCount"] = len(items) - end
        return {
            "kind": "NodeList",
            "apiVersion": "v1",
            "metadata": meta,
            "items": items[offset:end],
        }

    def _patch_node(self, name: str, content_type: str, body: bytes, status: bool) -> Json:
        """PATCH the Node (``status``: its status subresource). Each side keeps the other's
        part: the status subresource ignores ``spec``, the Node itself ``status``."""
        patch = _json_object(body, "the patch")
        with self._cond:
            node = self._get_node(name)
            want_rv = (patch.get("metadata") or {}).get("resourceVersion")
            if want_rv is not None and want_rv != node["metadata"]["resourceVersion"]:
                raise _HttpError(409, "Conflict", "the object has been modified; retry")
            merged = (strategic_merge if content_type == STRATEGIC else json_merge)(node, patch)
            kept = "spec" if status else "status"
            if kept in node:
                merged[kept] = node[kept]
            else:
                merged.pop(kept, None)
            merged.setdefault("metadata", {})
            for field in ("name", "uid", "creationTimestamp"):
                merged["metadata"][field] = node["metadata"][field]
            merged["metadata"]["resourceVersion"] = node["metadata"]["resourceVersion"]
            return self._commit("MODIFIED", merged)

    def _create_event(self, namespace: str, body: bytes) -> Json:
        event = _json_object(body, "the Event")
        if event.get("kind", "Event") != "Event" or event.get("apiVersion", "v1") != "v1":
            raise _HttpError(
                400,
                "BadRequest",
                f"the body is a {event.get('apiVersion')}/{event.get('kind')}, not a v1 Event",
            )
        meta = event.setdefault("metadata", {})
        if meta.get("namespace", namespace) != namespace:
            raise _HttpError(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on "
                "the request",
            )
        involved = event.get("involvedObject") or {}
        involved_ns = involved.get("namespace") or ""
        if (involved_ns and involved_ns != namespace) or (
            not involved_ns and namespace != "default"
        ):
            raise _HttpError(
                422,
                "Invalid",
                f'Event "{meta.get("name") or meta.get("generateName") or ""}" is invalid: '
                f"involvedObject.namespace: Invalid value: {involved_ns!r}: does not match "
                "event.namespace",
            )
        with self._cond:
            name = meta.get("name") or ""
            if not name:
                if not meta.get("generateName"):
                    raise _HttpError(
                        422,
                        "Invalid",
                        'Event "" is invalid: metadata.name: Required value: name or '
                        "generateName is required",
                    )
                name = meta["generateName"] + "".join(random.choices(_NAME_ALPHABET, k=5))
            if (namespace, name) in self._events:
                raise _HttpError(409, "AlreadyExists", f'events "{name}" already exists')
            self._rv += 1  # one revision counter across kinds, as etcd's
            event.update({"apiVersion": "v1", "kind": "Event"})
            meta.update(
                {
                    "name": name,
                    "namespace": namespace,
                    "uid": str(uuid.uuid4()),
                    "resourceVersion": str(self._rv),
                    "creationTimestamp": _now(),
                }
            )
            self._events[(namespace, name)] = event
            return copy.deepcopy(event)

    def _watch_start(self, query: Mapping[str, str]) -> tuple[int, list[Json], int]:
        """(position, first events, gone epoch) for a new watch; raises _HttpError."""
        rv_text = query.get("resourceVersion") or ""
        with self._cond:
            epoch = self._gone_epoch
            if rv_text in ("", "0"):
                first = [
                    {"type": "ADDED", "object": copy.deepcopy(self._nodes[n])}
                    for n in sorted(self._nodes)
                ]
                return self._rv, first, epoch
            if not rv_text.isdigit():
                raise _HttpError(400, "BadRequest", f"invalid resourceVersion {rv_text!r}")
            start = int(rv_text)
            if start < self._compacted:
                message = f"too old resource version: {start} ({self._compacted})"
                if self.gone_as == "status":
                    raise _HttpError(410, "Expired", message)
                return start, [{"type": "ERROR", "object": _status(410, "Expired", message)}], -1
            return start, [], epoch

    def _watch_next(
        self, position: int, epoch: int, deadline: float, bookmarks: bool, last_sent: float
    ) -> tuple[list[Json], int, bool]:
        """Block for the next events: (events, new position, end of stream)."""
        with self._cond:
            while True:
                if self._unreachable or self._closing:
                    raise ConnectionAbortedError("stand-in unreachable")
                if epoch != self._gone_epoch:
                    message = "watch closed: too old resource version (injected)"
                    return (
                        [{"type": "ERROR", "object": _status(410, "Expired", message)}],
                        position,
                        True,
                    )
                fresh = [e for e in self._history if e.rv > position]
                if fresh:
                    events = [{"type": e.type, "object": copy.deepcopy(e.obj)} for e in fresh]
                    return events, fresh[-1].rv, False
                now = time.monotonic()
                if now >= deadline:
                    return [], position, True
                wake = deadline
                if bookmarks:
                    due = last_sent + self.bookmark_interval
                    if now >= due:
                        mark = {
                            "kind": "Node",
                            "apiVersion": "v1",
                            "metadata": {"resourceVersion": str(self._rv)},
                        }
                        return [{"type": "BOOKMARK", "object": mark}], self._rv, False
                    wake = min(wake, due)
                self._cond.wait(max(0.0, wake - now))

    def _track(self, conn: socket.socket, add: bool) -> None:
        with self._cond:
            if add:
                self._conns.add(conn)
            else:
                self._conns.discard(conn)

    def _watch_counter(self, delta: int) -> None:
        with self._cond:
            self._watches += delta


def _json_object(body: bytes, what: str) -> Json:
    try:
        doc = json.loads(body)
    except ValueError as e:
        raise _HttpError(400, "BadRequest", f"invalid JSON in {what}: {e}") from e
    if not isinstance(doc, dict):
        raise _HttpError(400, "BadRequest", f"{what} must be a JSON object")
    return doc


def _without_rv(node: Json) -> Json:
    clone = copy.deepcopy(node)
    clone["metadata"].pop("resourceVersion", None)
    return clone


def _encode_token(snap_id: str, offset: int) -> str:
    raw = json.dumps({"snapshot": snap_id, "offset": offset}).encode()
    return base64.urlsafe_b64encode(raw).decode()


def _decode_token(token: str) -> tuple[str, int]:
    try:
        doc = json.loads(base64.urlsafe_b64decode(token.encode()))
        return str(doc["snapshot"]), int(doc["offset"])
    except (ValueError, KeyError, TypeError) as e:
        raise _HttpError(400, "BadRequest", "invalid continue token") from e


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:
        pass  # keep test output clean

    def setup(self) -> None:
        super().setup()
        self.server.standin._track(self.connection, True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.standin._track(self.connection, False)

    @property
    def standin(self) -> KubeStandin:
        return self.server.standin

    def _parse(self, body: bytes = b"") -> tuple[list[str], dict[str, str]]:
        parts = urlsplit(self.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query, keep_blank_values=True).items()}
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip() or None
        auth = self.headers.get("Authorization")
        request = Request(self.command, parts.path, content_type, query, body, auth)
        self.standin._log_request(request)
        hook = self.standin.before_request
        if hook is not None:
            hook(request)
        return [p for p in parts.path.split("/") if p], query

    def _send_json(self, code: int, doc: Json) -> None:
        body = json.dumps(doc).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _run(self, fn: Callable[[], Json | None], code: int = 200) -> None:
        try:
            doc = fn()
        except _HttpError as e:
            self._send_json(int(e.status["code"]), e.status)
            return
        except (ConnectionError, OSError):
            self.close_connection = True
            return
        if doc is not None:
            self._send_json(code, doc)

    def _body(self) -> bytes:
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))

    def do_GET(self) -> None:
        parts, query = self._parse()

        def route() -> Json | None:
            match parts:
                case ["api", "v1", "nodes"]:
                    if _truthy(query.get("watch")):
                        self._stream_watch(query)
                        return None
                    return self.standin._list_nodes(query)
                case ["api", "v1", "nodes", name]:
                    return self.standin._get_node(name)
                case ["api", "v1", "namespaces", namespace, "pods", name]:
                    return self.standin._get_pod(namespace, name)
            raise _HttpError(404, "NotFound", f"the server could not find {self.path}")

        self._run(route)

    def do_PATCH(self) -> None:
        body = self._body()
        parts, _ = self._parse(body)
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()

        def route() -> Json:
            match parts:
                case ["api", "v1", "nodes", name, *sub] if sub in ([], ["status"]):
                    if content_type not in (STRATEGIC, MERGE):
                        raise _HttpError(
                            415,
                            "UnsupportedMediaType",
                            f"the stand-in does not implement {content_type!r} patches",
                        )
                    return self.standin._patch_node(name, content_type, body, status=bool(sub))
            raise _HttpError(405, "MethodNotAllowed", f"PATCH {self.path} is not served")

        self._run(route)

    def do_POST(self) -> None:
        body = self._body()
        parts, _ = self._parse(body)
        content_type = (self.headers.get("Content-Type") or "").split(";")[0].strip()

        def route() -> Json:
            match parts:
                case ["api", "v1", "namespaces", namespace, "events"]:
                    # No Content-Type is read as JSON, the server's first serializer
                    # (the generated client sends none on create).
                    if content_type not in ("", "application/json"):
                        raise _HttpError(
                            415,
                            "UnsupportedMediaType",
                            f"the stand-in does not implement {content_type!r} bodies",
                        )
                    return self.standin._create_event(namespace, body)
            raise _HttpError(405, "MethodNotAllowed", f"POST {self.path} is not served")

        self._run(route, code=201)

    def _stream_watch(self, query: Mapping[str, str]) -> None:
        standin = self.standin
        position, first, epoch = standin._watch_start(query)  # may raise _HttpError
        timeout = float(query.get("timeoutSeconds") or standin.max_watch_seconds)
        bookmarks = _truthy(query.get("allowWatchBookmarks"))
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        standin._watch_counter(+1)
        try:
            self._stream(first, position, epoch, time.monotonic() + timeout, bookmarks)
        finally:
            standin._watch_counter(-1)

    def _stream(
        self, first: list[Json], position: int, epoch: int, deadline: float, bookmarks: bool
    ) -> None:
        self._write_events(first)
        last_sent = time.monotonic()
        ended = epoch < 0  # a 410 already sent
        while not ended:
            events, position, ended = self.standin._watch_next(
                position, epoch, deadline, bookmarks, last_sent
            )
            if events:
                self._write_events(events)
                last_sent = time.monotonic()
        self.wfile.write(b"0\r\n\r\n")
        self.wfile.flush()

    def _write_events(self, events: list[Json]) -> None:
        for event in events:
            line = json.dumps(event).encode() + b"\n"
            self.wfile.write(b"%x\r\n%s\r\n" % (len(line), line))
        self.wfile.flush()
