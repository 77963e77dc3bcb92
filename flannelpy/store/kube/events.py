"""Kubernetes Events about this node's Node (events.k8s.io/v1): a thin adapter that sends
what :mod:`flannelpy.store.kube.event_series` decides (create, or patch a series).

``kubectl get events`` and ``kubectl describe node`` show them. The ClusterRole needs
``create`` and ``patch`` on ``events.events.k8s.io`` (see api.RBAC_RULES).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client as kclient
from kubernetes.client.exceptions import ApiException

from flannelpy.errors import StoreError
from flannelpy.store.kube.api import read_json
from flannelpy.store.kube.event_series import (
    NAMESPACE,
    EventSeries,
    EventSpec,
    Write,
    create_body,
    series_patch,
)

log = logging.getLogger("flannelpy.store.kube.events")

MERGE_PATCH = "application/merge-patch+json"
TIMEOUT = (5.0, 15.0)  # seconds: connect, then the whole request


class NodeEvents:
    """Events about the Node ``node()`` names. Thread-safe: the agent's loop records,
    the control watch flushes."""

    def __init__(
        self,
        api_client: kclient.ApiClient,
        node: Callable[[], str],
        clock: Callable[[], float] = time.time,
        series: EventSeries | None = None,
    ) -> None:
        self._api = kclient.EventsV1Api(api_client)
        self._node = node
        self._clock = clock
        self._series = series if series is not None else EventSeries()
        self._lock = threading.Lock()

    def record(self, spec: EventSpec) -> None:
        """One occurrence: a new Event, a series patch, or only a count for the next
        flush. Raises StoreError when the write fails (a failed patch is retried by the
        next flush, a failed create by the next occurrence)."""
        with self._lock:
            now = self._clock()
            write = self._series.observe(spec, now)
            if write is not None:
                self._send(write, now)

    def flush(self) -> None:
        """Send the series counts that are due; a failure is logged and retried later."""
        with self._lock:
            now = self._clock()
            for write in self._series.flush(now):
                try:
                    self._send(write, now)
                except StoreError as e:
                    log.warning(
                        "could not update the Event series reason=%s: %s", write.spec.reason, e
                    )

    def _send(self, write: Write, now: float) -> None:
        if write.op == "create":
            node = self._node()
            body: Any = create_body(node, f"flannelpy-{node}", write.spec, write.at)
            try:
                doc = read_json(
                    "create event",
                    lambda: self._api.create_namespaced_event(
                        NAMESPACE, body, _preload_content=False, _request_timeout=TIMEOUT
                    ),
                )
            except StoreError:
                self._series.gone(write.spec)
                raise
            name = (doc.get("metadata") or {}).get("name")
            self._series.created(write.spec, str(name or body["metadata"]["name"]), now)
            return
        assert write.name is not None
        name = write.name
        try:
            read_json(
                "patch event",
                lambda: self._api.patch_namespaced_event(
                    name,
                    NAMESPACE,
                    series_patch(write),
                    _content_type=MERGE_PATCH,
                    _preload_content=False,
                    _request_timeout=TIMEOUT,
                ),
            )
        except StoreError as e:
            if not (isinstance(e.__cause__, ApiException) and e.__cause__.status == 404):
                self._series.failed(write, now)
                raise
            # Expired on the server (--event-ttl): this occurrence starts a new Event.
            self._series.gone(write.spec)
            again = self._series.observe(write.spec, now)
            if again is not None:
                self._send(again, now)
            return
        self._series.patched(write, now)
