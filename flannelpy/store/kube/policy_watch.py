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
from collections.abc import Callable

from flannelpy.store.kube.api import Rules
from flannelpy.store.kube.client import KubeClient
from flannelpy.store.kube.kind_watch import KindWatch, Resource, list_and_watch
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
FORBIDDEN_HINT = "apply manifests/network-policy for its ClusterRole"


# Each kind's collection across every namespace.
PATHS = {
    POLICIES: "/apis/networking.k8s.io/v1/networkpolicies",
    PODS: "/api/v1/pods",
    NAMESPACES: "/api/v1/namespaces",
}


def kube_resources(client: KubeClient) -> list[Resource]:
    """The three kinds over the real client, every namespace."""
    return [Resource(kind, *list_and_watch(client, kind, PATHS[kind])) for kind in KINDS]


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
                target=KindWatch(
                    r,
                    self.cache,
                    on_change,
                    on_restart=self._on_restart,
                    log=log,
                    forbidden_hint=FORBIDDEN_HINT,
                ).run,
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


def list_policy_inputs(client: KubeClient) -> PolicySnapshot:
    """Every NetworkPolicy, Pod and Namespace, listed once (``flannelpy netpol explain``)."""
    cache = PolicyCache()
    for resource in kube_resources(client):
        KindWatch(resource, cache, lambda: None, log=log).list_all(threading.Event())
    return cache.snapshot()
