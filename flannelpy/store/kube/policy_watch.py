"""NetworkPolicy's inputs in Kubernetes mode: NetworkPolicies, Pods and Namespaces of every
namespace, each kind listed and watched as the node watch does.

Per kind, one thread: list (pages of raw JSON, one consistent snapshot), then watch from
the list's resourceVersion with bookmarks; 410 Gone lists again (the new list replaces
the old one whole); a broken connection resumes from the last resourceVersion after a
backoff, reset by a watch that served. Each object is parsed as it arrives and only the
parsed value is kept (:class:`~flannelpy.store.policy_inputs.PolicyCache`); a change
calls ``on_change()``, which the agent coalesces into one event. On loss of the API
server the cache keeps the last objects it read, so the rules stay as they were.

The permissions (list and watch on networkpolicies, pods and namespaces) are
:data:`POLICY_RBAC_RULES`, granted by the ClusterRole of ``manifests/network-policy``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kubernetes import client as kclient

from flannelpy.errors import RevisionCompacted, StoreError, StoreUnavailable
from flannelpy.retry import Backoff
from flannelpy.store.kube.api import Forbidden, Rules, call, read_json
from flannelpy.store.kube.watch import HEALTHY_WATCH, StreamCloser, decoded_events
from flannelpy.store.policy_inputs import (
    KINDS,
    NAMESPACES,
    PODS,
    POLICIES,
    PolicyCache,
    PolicySnapshot,
)

log = logging.getLogger("flannelpy.store.kube.policy")

POLICY_RBAC_RULES: Rules = (
    ("networking.k8s.io", "networkpolicies", ("list", "watch")),
    ("", "namespaces", ("list", "watch")),
    ("", "pods", ("list", "watch")),
)
WATCH_TIMEOUT_SECONDS = 300
WATCH_READ_SLACK = 30.0
REQUEST_TIMEOUT = (5.0, 15.0)
LIST_PAGE_SIZE = 500

ListPage = Callable[[str | None], dict[str, Any]]  # continue token -> one page
OpenWatch = Callable[[str, threading.Event], Iterator[Any]]  # rv, stop -> events


@dataclass(frozen=True)
class Resource:
    kind: str  # a KINDS value
    list_page: ListPage
    open_watch: OpenWatch


def _wait(stop: threading.Event, seconds: float) -> None:
    stop.wait(seconds)


class KindWatch:
    """One kind's list and watch into the cache, until ``stop``."""

    def __init__(
        self,
        resource: Resource,
        cache: PolicyCache,
        on_change: Callable[[], None],
        sleep: Callable[[threading.Event, float], None] = lambda stop, s: _wait(stop, s),
        on_restart: Callable[[str], None] | None = None,
    ) -> None:
        self.resource = resource
        self.cache = cache
        self.on_change = on_change
        self.sleep = sleep
        self.on_restart = on_restart
        self.rv: str | None = None  # None: list before watching

    def run(self, stop: threading.Event) -> None:
        backoff = Backoff()
        kind = self.resource.kind
        while not stop.is_set():
            opened = time.monotonic()
            served = False
            try:
                if self.rv is None:
                    self.list_all(stop)
                served = self._watch(stop) > 0
            except RevisionCompacted as e:
                log.warning("%s list or watch too old (410 Gone); re-listing error=%s", kind, e)
                self.rv = None
                self._restarted("compacted")
                continue
            except StoreError as e:
                if stop.is_set():
                    return
                if isinstance(e, Forbidden):
                    e = StoreError(f"{e}; apply manifests/network-policy for its ClusterRole")
                self._restarted("unavailable")
                log.warning("%s watch failed; retrying after a delay error=%s", kind, e)
            except Exception:  # a bug or an input no parser foresaw: never the end
                log.exception("%s watch failed; re-listing after a delay", kind)
                self.rv = None
                self._restarted("error")
            if served or time.monotonic() - opened >= HEALTHY_WATCH:
                backoff.reset()
                continue
            self.sleep(stop, backoff.next())

    def _restarted(self, reason: str) -> None:
        if self.on_restart is not None:
            self.on_restart(reason)

    def list_all(self, stop: threading.Event) -> None:
        """List every object of the kind (page by page, one snapshot) into the cache."""
        items: list[Any] = []
        rv: str | None = None
        token: str | None = None
        while True:
            if stop.is_set():
                raise StoreError(f"{self.resource.kind} list interrupted: stopping")
            doc = self.resource.list_page(token)
            meta = doc.get("metadata") or {}
            rv = rv or (str(meta["resourceVersion"]) if meta.get("resourceVersion") else None)
            items += [i for i in doc.get("items") or [] if isinstance(i, dict)]
            token = meta.get("continue") or None
            if token is None:
                break
        if rv is None:
            raise StoreUnavailable(f"list {self.resource.kind}: the answer has no resourceVersion")
        self.cache.replace_all(self.resource.kind, items)
        self.rv = rv
        log.info("%s listed objects=%d resource_version=%s", self.resource.kind, len(items), rv)
        self.on_change()

    def _watch(self, stop: threading.Event) -> int:
        assert self.rv is not None
        count = 0
        for event in self.resource.open_watch(self.rv, stop):
            count += 1
            if self._apply(event if isinstance(event, dict) else {}):
                self.on_change()
        return count

    def _apply(self, event: dict[str, Any]) -> bool:
        kind, obj = event.get("type"), event.get("object")
        obj = obj if isinstance(obj, dict) else {}
        if kind == "ERROR":
            message = obj.get("message") or obj.get("reason") or "no message"
            if obj.get("code") == 410:
                raise RevisionCompacted(f"{self.resource.kind} watch: {message} (410 Gone)", 0)
            raise StoreUnavailable(f"{self.resource.kind} watch error {obj.get('code')}: {message}")
        if kind not in ("ADDED", "MODIFIED", "DELETED", "BOOKMARK"):
            raise StoreUnavailable(f"{self.resource.kind} watch sent the event type {kind!r}")
        rv = (obj.get("metadata") or {}).get("resourceVersion")
        changed = False
        if kind in ("ADDED", "MODIFIED"):
            changed = self.cache.put(self.resource.kind, obj)
        elif kind == "DELETED":
            changed = self.cache.delete(self.resource.kind, obj)
        self.rv = str(rv) if rv else self.rv
        return changed


def kube_resources(api_client: kclient.ApiClient) -> list[Resource]:
    """The three kinds over the real client, every namespace."""
    core = kclient.CoreV1Api(api_client)
    networking = kclient.NetworkingV1Api(api_client)
    methods: dict[str, Callable[..., Any]] = {
        POLICIES: networking.list_network_policy_for_all_namespaces,
        PODS: core.list_pod_for_all_namespaces,
        NAMESPACES: core.list_namespace,
    }
    return [Resource(kind, *_calls(kind, methods[kind])) for kind in KINDS]


def _calls(kind: str, method: Callable[..., Any]) -> tuple[ListPage, OpenWatch]:
    def list_page(token: str | None) -> dict[str, Any]:
        return read_json(
            f"list {kind}",
            lambda: method(
                limit=LIST_PAGE_SIZE,
                _continue=token,
                _preload_content=False,
                _request_timeout=REQUEST_TIMEOUT,
            ),
        )

    def open_watch(rv: str, stop: threading.Event) -> Iterator[Any]:
        resp: Any = call(
            f"watch {kind}",
            lambda: method(
                watch=True,
                resource_version=rv,
                allow_watch_bookmarks=True,
                timeout_seconds=WATCH_TIMEOUT_SECONDS,
                _preload_content=False,
                _request_timeout=(REQUEST_TIMEOUT[0], WATCH_TIMEOUT_SECONDS + WATCH_READ_SLACK),
            ),
        )
        with StreamCloser(stop) as closer:
            closer.attach(resp)
            try:
                yield from decoded_events(resp, stop, f"{kind} watch")
            finally:
                closer.detach()
                resp.close()
                resp.release_conn()

    return list_page, open_watch


class KubePolicySource:
    """The policy inputs of every namespace, kept by one watch thread per kind."""

    def __init__(
        self,
        resources: list[Resource],
        on_refused: Callable[[str], None] | None = None,
        on_restart: Callable[[str], None] | None = None,
    ) -> None:
        self.cache = PolicyCache(on_refused)
        self._resources = resources
        self._on_restart = on_restart

    def snapshot(self) -> PolicySnapshot:
        return self.cache.snapshot()

    def watch(self, on_change: Callable[[], None], stop: threading.Event) -> None:
        threads = [
            threading.Thread(
                target=KindWatch(r, self.cache, on_change, on_restart=self._on_restart).run,
                args=(stop,),
                name=f"policy-watch-{r.kind}",
                daemon=True,
            )
            for r in self._resources
        ]
        for thread in threads:
            thread.start()
        stop.wait()
        for thread in threads:
            thread.join(2.0)


def list_policy_inputs(api_client: kclient.ApiClient) -> PolicySnapshot:
    """Every NetworkPolicy, Pod and Namespace, listed once (``flannelpy netpol explain``)."""
    cache = PolicyCache()
    for resource in kube_resources(api_client):
        KindWatch(resource, cache, lambda: None).list_all(threading.Event())
    return cache.snapshot()
