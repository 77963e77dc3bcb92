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

from flannelpy.errors import StoreError
from flannelpy.store.kube.api import NotFound
from flannelpy.store.kube.client import MERGE_PATCH, KubeClient, path
from flannelpy.store.kube.event_series import (
    NAMESPACE,
    EventSeries,
    EventSpec,
    Write,
    create_body,
    series_patch,
)

log = logging.getLogger("flannelpy.store.kube.events")

EVENTS = f"apis/events.k8s.io/v1/namespaces/{NAMESPACE}/events"
TIMEOUT = (5.0, 15.0)  # seconds: connect, then the whole request


class NodeEvents:
    """Events about the Node ``node()`` names. Thread-safe: the agent's loop records,
    the control watch flushes."""

    def __init__(
        self,
        client: KubeClient,
        node: Callable[[], str],
        clock: Callable[[], float] = time.time,
        series: EventSeries | None = None,
    ) -> None:
        self._client = client
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
                doc = self._client.send("create event", "POST", path(EVENTS), body, timeout=TIMEOUT)
            except StoreError:
                self._series.gone(write.spec)
                raise
            name = (doc.get("metadata") or {}).get("name")
            self._series.created(write.spec, str(name or body["metadata"]["name"]), now)
            return
        assert write.name is not None
        name = write.name
        try:
            self._client.send(
                "patch event",
                "PATCH",
                path(EVENTS, name),
                series_patch(write),
                MERGE_PATCH,
                timeout=TIMEOUT,
            )
        except NotFound:
            # Expired on the server (--event-ttl): this occurrence starts a new Event.
            self._series.gone(write.spec)
            again = self._series.observe(write.spec, now)
            if again is not None:
                self._send(again, now)
            return
        except StoreError:
            self._series.failed(write, now)
            raise
        self._series.patched(write, now)
