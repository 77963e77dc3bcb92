"""The rollout's reads and writes in Kubernetes mode, over the API server.

Where each thing lives (all bounded: one object per node, or one in all):

- the network config: the ``net-conf.json`` key of the flannelpy ConfigMap (the
  agents read it as the kubelet projects it);
- a node's override: its Node's ``flannelpy.io/override`` annotation (what the agent
  already follows, from the node watch it runs anyway);
- a node's status: its Lease in the flannelpy namespace
  (:mod:`flannelpy.store.kube.node_status`), which no agent watches;
- the rollout record: the ``rollout.json`` key of the ConfigMap ``flannelpy-rollout``
  in the same namespace, replaced only with its resourceVersion (a compare-and-swap,
  as in etcd). Agents never read it: an override a rollout writes is checked against
  the policy on the node, like any other.

The cordon (:mod:`flannelpy.rollout.cordon`) patches the Node. The driver runs with
the operator's credentials (their kubeconfig), not the agents' ServiceAccount.

The driver looks at every node about once a second while it waits for a step: the
Nodes and the status Leases are each listed once, then watched (:mod:`.kube.mirror`),
so a look costs the API server nothing and a step costs it the same at 5 nodes or
5,000. The record and the config, one object each, are read afresh every look.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping
from typing import Any

from flannelpy.config.netconf import NetworkConfig, parse_network_config
from flannelpy.control.records import NodeOverride, NodeStatus
from flannelpy.errors import ConfigError, StoreError
from flannelpy.rollout.backends import rewrite_backend
from flannelpy.rollout.cordon import cordon_patch, uncordon_patch
from flannelpy.rollout.record import RolloutRecord
from flannelpy.rollout.storage import ConfigDoc, NodesSnapshot
from flannelpy.store.kube import node as kn
from flannelpy.store.kube.api import Conflict, NotFound, rv_number
from flannelpy.store.kube.client import MERGE_PATCH, KubeClient, path
from flannelpy.store.kube.kind_watch import Resource, list_and_watch
from flannelpy.store.kube.manager import OVERRIDE_ANNOTATION
from flannelpy.store.kube.mirror import Mirrored
from flannelpy.store.kube.node_status import (
    DEFAULT_NAMESPACE,
    STATUS_LABEL,
    NodeSummary,
    parse_leases,
)
from flannelpy.subnet.lease import Lease

CONFIG_MAP = "kube-flannelpy-cfg"  # the manifests' ConfigMap and key
NET_CONF_KEY = "net-conf.json"
RECORD_CONFIG_MAP = "flannelpy-rollout"
RECORD_KEY = "rollout.json"
NODES = "api/v1/nodes"
TIMEOUT = (5.0, 15.0)
CONFIG_PROPAGATION = 180.0  # seconds for every agent to read the new net-conf.json
CAS_RETRIES = 5
FORBIDDEN_HINT = (
    "the driver's kubeconfig must allow list and watch on nodes, and on leases in the "
    "agents' namespace"
)


def _fresh_backend(summary: NodeSummary, backend: Mapping[str, Any]) -> bool:
    return summary.config_backend is not None and dict(summary.config_backend) == json.loads(
        json.dumps(dict(backend), sort_keys=True)
    )


def _unless_conflict(send: Callable[[], dict[str, Any]]) -> dict[str, Any] | None:
    """Send one write and return the object as written; None when the server answers 409
    Conflict (the body named an older resourceVersion), so the caller re-reads and tries
    again."""
    try:
        return send()
    except Conflict:
        return None


def kube_resources(client: KubeClient, namespace: str) -> tuple[Resource, Resource]:
    """The Nodes, and the status Leases in ``namespace``, over the real client."""
    leases = path("apis/coordination.k8s.io/v1/namespaces", namespace, "leases")
    return (
        Resource("nodes", *list_and_watch(client, "nodes", path(NODES))),
        Resource(
            "leases",
            *list_and_watch(
                client, f"leases in {namespace}", leases, {"labelSelector": f"{STATUS_LABEL}=true"}
            ),
        ),
    )


class KubeRolloutStore:
    def __init__(
        self,
        client: KubeClient,
        annotation_prefix: str,
        namespace: str = DEFAULT_NAMESPACE,
        config_map: str = CONFIG_MAP,
        sleep: Callable[[float], None] = time.sleep,
        monotonic: Callable[[], float] = time.monotonic,
        resources: tuple[Resource, Resource] | None = None,
    ) -> None:
        """``resources``: how the Nodes and the status Leases are listed and watched
        (default: over ``client``)."""
        self._client = client
        self._keys = kn.annotation_keys(annotation_prefix)
        self.namespace, self.config_map = namespace, config_map
        self.record_key = f"ConfigMap {namespace}/{RECORD_CONFIG_MAP}"
        self.config_key = f"ConfigMap {namespace}/{config_map} ({NET_CONF_KEY})"
        self._sleep, self._monotonic = sleep, monotonic
        self.summaries: dict[str, NodeSummary] = {}  # as last read
        nodes, leases = resources or kube_resources(client, namespace)
        self._nodes = Mirrored(nodes, FORBIDDEN_HINT)
        self._leases = Mirrored(leases, FORBIDDEN_HINT)

    def close(self) -> None:
        """Stop the watches."""
        self._nodes.close()
        self._leases.close()

    # -- reading ------------------------------------------------------------------

    def _config_maps(self, *name: str) -> str:
        return path("api/v1/namespaces", self.namespace, "configmaps", *name)

    def _read_or_none(self, what: str, url: str) -> dict[str, Any] | None:
        """GET one object; None when it does not exist, which every caller treats as its
        own answer (no record yet, a node gone)."""
        try:
            return self._client.get(f"get {what}", url, timeout=TIMEOUT)
        except NotFound:
            return None

    def _config_map(self, name: str) -> dict[str, Any] | None:
        return self._read_or_none(f"configmap {self.namespace}/{name}", self._config_maps(name))

    def read_config(self) -> ConfigDoc:
        cm = self._config_map(self.config_map)
        text = ((cm or {}).get("data") or {}).get(NET_CONF_KEY)
        if not isinstance(text, str):
            raise ConfigError(
                f"{self.config_key} is missing; apply manifests/ (or give "
                "--kube-namespace / --kube-config-map)"
            )
        assert cm is not None
        try:
            config = parse_network_config(text)
        except ConfigError as e:
            raise ConfigError(f"{e} (in {self.config_key})") from e
        return ConfigDoc(text.encode(), rv_number(kn.resource_version(cm)), config)

    def read_nodes(self) -> NodesSnapshot:
        nodes = self._nodes.objects()
        snap = NodesSnapshot(present=frozenset(nodes))
        for name, node in nodes.items():
            raw = kn.node_annotations(node).get(OVERRIDE_ANNOTATION)
            if raw:
                try:
                    snap.overrides[name] = NodeOverride.from_json(raw)
                except ValueError as e:
                    snap.errors[f"node {name} annotation {OVERRIDE_ANNOTATION}"] = str(e)
        summaries, errors = parse_leases({"items": list(self._leases.objects().values())})
        snap.errors.update(errors)
        self.summaries = {}
        for name, summary in summaries.items():
            if name not in nodes:
                continue  # a Lease outliving its Node: not a node to roll out
            try:
                status = NodeStatus.from_json(summary.status_json)
            except ValueError as e:
                snap.errors[f"lease {name}/status"] = str(e)
                continue
            if status.node != name:
                snap.errors[f"lease {name}/status"] = f"holds the status of {status.node!r}"
                continue
            snap.statuses[name] = status
            self.summaries[name] = summary
        return snap

    def read_leases(self) -> list[Lease]:
        """Every Node's lease as its annotations make it (flanneld's nodes included)."""
        config = self.read_config().config
        leases = []
        for node in self._nodes.objects().values():
            try:
                lease = kn.node_to_lease(node, self._keys, config)
            except ValueError:
                continue  # the agents report it
            if lease is not None:
                leases.append(lease)
        return leases

    def read_record(self) -> tuple[RolloutRecord | None, int]:
        cm = self._config_map(RECORD_CONFIG_MAP)
        if cm is None:
            return None, 0
        raw = (cm.get("data") or {}).get(RECORD_KEY)
        revision = rv_number(kn.resource_version(cm))
        if not raw:
            return None, revision
        try:
            return RolloutRecord.from_json(raw), revision
        except ValueError as e:
            raise StoreError(
                f"{e} ({self.record_key}); if no rollout is running, delete the ConfigMap"
            ) from e

    # -- writing ------------------------------------------------------------------

    def put_record(self, record: RolloutRecord, mod_revision: int) -> int | None:
        """Write the record if its ConfigMap still has ``mod_revision`` (0: none); the new
        revision, or None when someone else wrote it first."""
        body: Any = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {
                "name": RECORD_CONFIG_MAP,
                "namespace": self.namespace,
                "labels": {"app.kubernetes.io/name": "flannelpy"},
            },
            "data": {RECORD_KEY: record.to_json()},
        }
        if mod_revision:
            body["metadata"]["resourceVersion"] = str(mod_revision)

        what = f"write {self.record_key}"
        try:
            if mod_revision:
                url = self._config_maps(RECORD_CONFIG_MAP)
                written = self._client.send(what, "PUT", url, body, timeout=TIMEOUT)
            else:
                written = self._client.send(
                    what, "POST", self._config_maps(), body, timeout=TIMEOUT
                )
        except (Conflict, NotFound):  # changed, created or removed meanwhile
            return None
        return rv_number(kn.resource_version(written)) or 1

    def _node(self, name: str) -> dict[str, Any] | None:
        return self._read_or_none(f"node {name}", path(NODES, name))

    def _patch_node(self, name: str, patch: Mapping[str, Any]) -> bool:
        """Merge-patch a Node; False on a conflict (the patch named an older
        resourceVersion). The next look reads the Node as written."""
        body: Any = dict(patch)
        written = _unless_conflict(
            lambda: self._client.send(
                f"patch node {name}", "PATCH", path(NODES, name), body, MERGE_PATCH, TIMEOUT
            )
        )
        if written is None:
            return False
        self._nodes.wrote(written)
        return True

    def write_override(self, node: str, override: NodeOverride) -> None:
        self._patch_node(
            node, {"metadata": {"annotations": {OVERRIDE_ANNOTATION: override.to_json()}}}
        )

    def delete_override(self, node: str, generation: int | None = None) -> bool:
        """Remove ``node``'s override (only while it has ``generation``, when given);
        False when there is none. The patch carries the Node's resourceVersion, so an
        override written meanwhile is not removed unseen."""
        for _ in range(CAS_RETRIES):
            obj = self._node(node)
            raw = kn.node_annotations(obj).get(OVERRIDE_ANNOTATION) if obj else None
            if not raw or obj is None:
                return False
            if generation is not None:
                try:
                    if NodeOverride.from_json(raw).generation != generation:
                        return False
                except ValueError:
                    return False
            patch = {
                "metadata": {
                    "annotations": {OVERRIDE_ANNOTATION: None},
                    "resourceVersion": kn.resource_version(obj),
                }
            }
            if self._patch_node(node, patch):
                return True
        raise StoreError(
            f"node {node}'s override kept changing while being deleted; run the command again"
        )

    def write_config_backend(self, backend: Mapping[str, Any]) -> NetworkConfig:
        """Put ``backend`` into the ConfigMap's net-conf.json (every other key as written,
        compare-and-swapped), then wait until every node's status says its agent reads it:
        only then may the overrides go, or a node would fall back to the old Backend."""
        written = self._swap_config(backend)
        deadline = self._monotonic() + CONFIG_PROPAGATION
        while True:
            self.read_nodes()
            behind = sorted(n for n, s in self.summaries.items() if not _fresh_backend(s, backend))
            if not behind:
                return written
            if self._monotonic() > deadline:
                raise StoreError(
                    f"{', '.join(behind)} still read{'s' if len(behind) == 1 else ''} the old "
                    f"net-conf.json {CONFIG_PROPAGATION:g} s after {self.config_key} changed; "
                    "once the kubelet updates it there, run flannelpy rollout resume"
                )
            self._sleep(1.0)

    def _swap_config(self, backend: Mapping[str, Any]) -> NetworkConfig:
        for _ in range(CAS_RETRIES):
            doc = self.read_config()
            data, config, changed = rewrite_backend(doc.raw, backend)
            if not changed:
                return config  # already there (a resumed step)
            patch = {
                "metadata": {"resourceVersion": str(doc.mod_revision)},
                "data": {NET_CONF_KEY: data},
            }
            body: Any = patch

            if self._patch_config(body) is not None:
                return config
        raise StoreError(
            f"{self.config_key} kept changing while the rollout wrote its "
            "Backend; run flannelpy rollout resume"
        )

    def _patch_config(self, body: Any) -> dict[str, Any] | None:
        return _unless_conflict(
            lambda: self._client.send(
                f"patch {self.config_key}",
                "PATCH",
                self._config_maps(self.config_map),
                body,
                MERGE_PATCH,
                TIMEOUT,
            )
        )

    # -- the cordon ------------------------------------------------------------------

    def cordon(self, node: str, rollout: str) -> bool:
        """Cordon ``node`` and take it out of external load balancers; False when this
        rollout (or one before, unfinished) already had."""
        obj = self._node(node)
        if obj is None:
            raise StoreError(f"node {node} is gone; it cannot be cordoned")
        try:
            patch = cordon_patch(obj, rollout)
        except ValueError as e:
            raise StoreError(f"node {node}: {e}") from e
        if patch is None:
            return False
        return self._patch_node(node, patch)

    def uncordon(self, node: str) -> bool:
        """Undo what a rollout's cordon set on ``node``; False when there was nothing."""
        obj = self._node(node)
        if obj is None:
            return False
        try:
            patch = uncordon_patch(obj)
        except ValueError as e:
            raise StoreError(f"node {node}: {e}") from e
        if patch is None:
            return False
        return self._patch_node(node, patch)
