"""Kubernetes mode (``--kube-subnet-mgr``): leases are Nodes, subnets are podCIDRs.

The controller-manager (``--allocate-node-cidrs``) assigns every Node a
``spec.podCIDR``; that is the node's lease. A node advertises how to reach it
with Flannel's annotations (see :mod:`flannelpy.store.kube.node`, which holds
the pure part), written with a strategic-merge PATCH of ``nodes/<name>/status``
only when something differs. Peers are the nodes annotated
``kube-subnet-manager: "true"`` with a podCIDR.

The watch is the usual list → watch from the list's resourceVersion, with
bookmarks; 410 Gone re-lists, a broken connection resumes from the last
resourceVersion after a backoff (afresh when the watch that broke had served, so an
API server restart is not waited out at an earlier outage's delays). Unlike Flannel,
a node whose podCIDR or public-ip changes is followed, and nothing waits for an
informer cache sync:
our own Node is read directly, and the list is one consistent snapshot read in
pages of raw JSON (no client models).

Every API call the code makes is in :data:`flannelpy.store.kube.api.RBAC_RULES`;
the manifest's ClusterRole is tested against it. The client is :mod:`.client`,
its error mapping :mod:`.api`, the watch's helpers :mod:`.watch`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from pathlib import Path
from typing import Any

from flannelpy.config.netconf import NetworkConfig, parse_network_config
from flannelpy.config.settings import AgentSettings
from flannelpy.errors import ConfigError, RevisionCompacted, StoreError, StoreUnavailable
from flannelpy.retry import Backoff
from flannelpy.store.kube import node as kn
from flannelpy.store.kube.client import STRATEGIC_MERGE, KubeClient, build_api_client, path
from flannelpy.store.kube.node_status import override_rollout
from flannelpy.store.kube.watch import LeaseMap, StreamCloser, decoded_events
from flannelpy.subnet.lease import Lease, LeaseAttrs
from flannelpy.subnet.manager import CallbackFailed, LeasesCallback, guarded
from flannelpy.subnet.pools import Pool
from flannelpy.subnet.validate import Rejection

log = logging.getLogger("flannelpy.store.kube.manager")

OVERRIDE_ANNOTATION = "flannelpy.io/override"  # this node's Backend, like etcd's override key

CONNECT_TIMEOUT = 5.0  # seconds
REQUEST_TIMEOUT = 15.0  # seconds for a get, a list page or a patch
WATCH_TIMEOUT_SECONDS = 300  # server-side end of one watch request (client-go: 5-10 min)
WATCH_READ_SLACK = 30.0  # seconds past the server's timeout before the read gives up
LIST_PAGE_SIZE = 500  # client-go's default page size
PODCIDR_POLL_MAX = 5.0  # seconds between reads of our Node while its podCIDR is missing
PODCIDR_LOG_EVERY = 30.0  # seconds between "pod cidr not assigned" warnings
NODES = "api/v1/nodes"


def _wait(stop: threading.Event, seconds: float) -> None:
    stop.wait(seconds)


class KubeSubnetManager:
    """SubnetManager over the Kubernetes API (Nodes and their annotations).

    ``clock`` gives unix time (condition timestamps); ``sleep(event, seconds)``
    waits and must return early once ``event`` is set. ``stop`` (optional) and
    :meth:`close` interrupt a wait for the podCIDR. ``environ`` defaults to
    ``os.environ`` (NODE_NAME, POD_NAME, POD_NAMESPACE).
    """

    def __init__(
        self,
        settings: AgentSettings,
        api_client: KubeClient | None = None,
        clock: Callable[[], float] = time.time,
        sleep: Callable[[threading.Event, float], None] = _wait,
        *,
        environ: Mapping[str, str] | None = None,
        stop: threading.Event | None = None,
        watch_timeout: int = WATCH_TIMEOUT_SECONDS,
        page_size: int = LIST_PAGE_SIZE,
    ) -> None:
        self._settings = settings
        self._keys = kn.annotation_keys(settings.kube_annotation_prefix)
        self._identity = kn.resolve_identity(
            settings.node_name, os.environ if environ is None else environ
        )
        self._owns_client = api_client is None
        self._api_client = api_client if api_client is not None else build_api_client(settings)
        self._clock = clock
        self._sleep = sleep
        self._stop = stop
        self._closed = threading.Event()
        self._watch_timeout = watch_timeout
        self._page_size = page_size
        self._name_lock = threading.Lock()
        self._node_name = self._identity.node_name
        self._config: NetworkConfig | None = None
        self._attrs: LeaseAttrs | None = None  # what the agent asked us to advertise
        self._advertised: LeaseAttrs | None = None  # what we returned for it
        # Our Node's override annotation as the node watch last saw it (None: absent).
        self.own_override: str | None = None
        self.own_override_seen = threading.Event()
        # Nodes whose override names a rollout (node -> the id and override): while any
        # does and one changed lately, the status record follows probe rounds, so the
        # rollout can verify its steps.
        self.rollout_overrides: dict[str, str] = {}
        self.rollout_changed_at = float("-inf")  # monotonic: the last change of those
        self._warned: dict[str, str] = {}

    @property
    def api_client(self) -> KubeClient:
        """The client this manager talks through (the status Lease shares it)."""
        return self._api_client

    # -- identity and config ---------------------------------------------------------------

    @property
    def node_name(self) -> str:
        """Our Node's name; with POD_NAME/POD_NAMESPACE, read from the pod once."""
        with self._name_lock:
            if self._node_name is None:
                self._node_name = self._node_of_pod()
            return self._node_name

    def _node_of_pod(self) -> str:
        namespace, pod = self._identity.pod_namespace, self._identity.pod_name
        assert namespace and pod
        what = f"get pod {namespace}/{pod}"
        doc = self._patiently(
            what,
            lambda: self._api_client.get(
                what, path("api/v1/namespaces", namespace, "pods", pod), timeout=self._timeout()
            ),
        )
        name = str((doc.get("spec") or {}).get("nodeName") or "")
        if not name:
            raise ConfigError(
                f"pod {namespace}/{pod} has no spec.nodeName yet; set NODE_NAME from the "
                "downward API (fieldRef spec.nodeName) instead"
            )
        log.info("node name from the pod node=%s pod=%s/%s", name, namespace, pod)
        return name

    def get_network_config(self) -> NetworkConfig:
        path = self._settings.net_config_path
        try:
            raw = Path(path).read_bytes()
        except OSError as e:
            raise ConfigError(
                f"cannot read net-conf.json at {path} ({e.strerror}); mount the ConfigMap's "
                "net-conf.json there or set --net-config-path"
            ) from e
        try:
            config = parse_network_config(raw)
        except ConfigError as e:
            raise ConfigError(f"{e} (read from {path})") from e
        self._config = config
        return config

    def _network_config(self) -> NetworkConfig:
        return self._config or self.get_network_config()

    # -- our Node ----------------------------------------------------------------------------

    def own_vtep_mac(self) -> str | None:
        """The VtepMAC our Node's backend-data annotation holds (from before a restart),
        so the agent can keep its VXLAN device's MAC and peers' entries stay valid."""
        return kn.own_vtep_mac(self._own_node(patient=True), self._keys)

    def node_public_ip(self) -> IPv4Address | None:
        """The ``node-public-ip`` annotation of our Node: acts as --public-ip."""
        return kn.node_public_ip(self._own_node(patient=True), self._keys)

    def node_public_ipv6(self) -> IPv6Address | None:
        """The ``node-public-ipv6`` annotation of our Node: acts as --public-ipv6."""
        return kn.node_public_ipv6(self._own_node(patient=True), self._keys)

    def _own_node(self, patient: bool) -> dict[str, Any]:
        name = self.node_name

        what = f"get node {name}"

        def get() -> dict[str, Any]:
            return self._api_client.get(what, path(NODES, name), timeout=self._timeout())

        return self._patiently(what, get) if patient else get()

    def _publish(self, node: Mapping[str, Any], attrs: LeaseAttrs) -> LeaseAttrs:
        """Patch our Node's annotations and condition where they differ from ``attrs``;
        return what we advertise (``public-ip-overwrite`` applied)."""
        advertised = kn.advertised_attrs(attrs, node, self._keys)
        if advertised.public_ip != attrs.public_ip:
            log.info(
                "advertising the address from public-ip-overwrite public_ip=%s own=%s",
                advertised.public_ip,
                attrs.public_ip,
            )
        patch = kn.status_patch(
            node,
            advertised,
            self._keys,
            self._clock(),
            set_condition=self._settings.set_node_network_unavailable,
        )
        if patch is None:
            return advertised
        name = kn.node_name(node)
        self._api_client.send(
            f"patch node {name} status",
            "PATCH",
            path(NODES, name, "status"),
            patch,
            STRATEGIC_MERGE,
            self._timeout(),
        )
        log.info("node updated node=%s wrote=%s", name, ",".join(kn.changed_keys(patch)))
        return advertised

    # -- acquire / renew ---------------------------------------------------------------------

    def acquire_lease(
        self,
        attrs: LeaseAttrs,
        previous_subnet: IPv4Network | None,
        pools: Sequence[Pool] | None = None,
        cluster: str | None = None,
        previous_ipv6_subnet: IPv6Network | None = None,
    ) -> Lease:
        """Our podCIDR as a lease, once the controller-manager has assigned it (address
        pools do not apply: the controller-manager owns pod CIDRs).

        Waits (forever, logging every PODCIDR_LOG_EVERY s) while it is not assigned:
        crash-looping would not make it come sooner. Raises ConfigError when it lies
        outside Network, StoreError when stopped or closed while waiting.
        """
        config = self._network_config()
        node, subnets = self._wait_for_pod_cidr(config)
        subnet, ipv6_subnet = subnets
        if previous_subnet is not None and previous_subnet != subnet:
            log.warning(
                "the node's pod cidr differs from the last run's subnet subnet=%s previous=%s",
                subnet,
                previous_subnet,
            )
        self._attrs = attrs
        advertised = self._advertised = self._publish(node, attrs)
        return Lease(subnet=subnet, attrs=advertised, expiration=None, ipv6_subnet=ipv6_subnet)

    def _wait_for_pod_cidr(self, config: NetworkConfig) -> tuple[dict[str, Any], Any]:
        backoff = Backoff(cap=PODCIDR_POLL_MAX)
        started = time.monotonic()
        logged_at: float | None = None
        while True:
            node = self._own_node(patient=True)
            subnets = kn.own_subnets(node, config)
            if subnets is not None:
                return node, subnets
            now = time.monotonic()
            if logged_at is None or now - logged_at >= PODCIDR_LOG_EVERY:
                logged_at = now
                log.warning(
                    "pod cidr not assigned to node %s yet; waiting for the controller-manager "
                    "(is --allocate-node-cidrs set?) waited_seconds=%.0f",
                    self.node_name,
                    now - started,
                )
            self._pause(backoff.next())

    def create_lease(self, attrs: LeaseAttrs, pools: Sequence[Pool], cluster: str | None) -> Lease:
        raise ConfigError(
            "address pools and MaxLeasesPerNode > 1 do not apply in Kubernetes mode: the "
            "controller-manager owns pod CIDRs (--cluster-cidr); use etcd mode for pools"
        )

    def release_lease(self, lease: Lease) -> bool:
        return False  # our podCIDR is the controller-manager's to take back

    def renew_lease(self, lease: Lease) -> Lease:
        """Re-check our annotations (patching only what differs) and the podCIDR.

        Raises StoreError when the podCIDR changed or went away: the lease must be
        acquired again (the watch reports the same, and the agent re-acquires).
        """
        node = self._own_node(patient=False)
        subnets = kn.own_subnets(node, self._network_config())
        had = (lease.subnet, lease.ipv6_subnet)
        if subnets is None or subnets != had:
            now = ", ".join(str(s) for s in subnets if s) if subnets else "unassigned"
            was = ", ".join(str(s) for s in had if s)
            raise StoreError(
                f"node {self.node_name}'s pod cidr is now {now}, not {was}; acquire the lease again"
            )
        # Attrs other than what we returned last are the agent's new wish (a backend
        # change); the ones we returned may carry public-ip-overwrite: keep the wish.
        if lease.attrs != self._advertised or self._attrs is None:
            self._attrs = lease.attrs
        advertised = self._advertised = self._publish(node, self._attrs)
        return replace(lease, attrs=advertised)

    # -- watch -------------------------------------------------------------------------------

    def watch_leases(self, on_leases: LeasesCallback, stop: threading.Event) -> None:
        """List, then watch from the list's resourceVersion, until ``stop`` is set.

        One callback per complete list (all pages: a partial map would make the agent
        remove routes to peers on later pages) and one per event that changes the
        lease map. 410 Gone → re-list; connection trouble → back off and resume from
        the last resourceVersion. Exceptions raised by ``on_leases`` propagate.
        """
        config = self._network_config()
        on_leases = guarded(on_leases)
        state = LeaseMap(self.node_name)
        backoff = Backoff()
        with StreamCloser(stop) as closer:
            while not stop.is_set():
                try:
                    if state.rv is None:
                        state.replace_all(*self._list(config, stop))
                        state.deliver(on_leases, always=True)
                    self._watch(state, config, on_leases, closer, stop)
                    # A watch that ends at once with nothing in it (a proxy closing it,
                    # say) must not turn into a tight reconnect loop.
                    if state.take_watch_health(time.monotonic()):
                        backoff.reset()
                    else:
                        self._sleep(stop, backoff.next())
                except RevisionCompacted as e:
                    log.warning("node list or watch is too old (410 Gone); re-listing error=%s", e)
                    state.rv = None
                except StoreError as e:
                    if stop.is_set():
                        break
                    if state.take_watch_health(time.monotonic()):
                        backoff.reset()  # it broke after serving: retry soon
                    delay = backoff.next()
                    log.warning(
                        "node watch failed; retrying after a delay delay=%.1f error=%s",
                        delay,
                        e,
                    )
                    self._sleep(stop, delay)
                except CallbackFailed as e:
                    assert e.__cause__ is not None
                    raise e.__cause__ from None
                except Exception as e:
                    # A bug or an input no parser foresaw: never the end of the watch.
                    delay = backoff.next()
                    log.exception(
                        "node watch failed; re-listing after a delay delay=%.1f error=%s", delay, e
                    )
                    state.rv = None
                    self._sleep(stop, delay)

    def _list(self, config: NetworkConfig, stop: threading.Event) -> tuple[dict[str, Lease], str]:
        """One consistent snapshot of every node's lease, read page by page."""
        by_node: dict[str, Lease] = {}
        rv: str | None = None
        token: str | None = None
        pages = 0
        while True:
            if stop.is_set():
                raise StoreError("node list interrupted: stopping")
            doc = self._list_page(token)
            pages += 1
            meta = doc.get("metadata") or {}
            rv = rv or kn.resource_version(doc)
            for node in doc.get("items") or []:
                self._note_rollout(kn.node_name(node), node)
                if kn.node_name(node) == self.node_name:  # a watch replays no ADDED for it
                    self.own_override = kn.node_annotations(node).get(OVERRIDE_ANNOTATION)
                    self.own_override_seen.set()
                lease = self._lease_of(node, config)
                if lease is not None:
                    by_node[kn.node_name(node)] = lease
            token = meta.get("continue") or None
            if token is None:
                break
        if rv is None:
            raise StoreUnavailable("kubernetes API list nodes: the answer has no resourceVersion")
        log.info("nodes listed leases=%d pages=%d resource_version=%s", len(by_node), pages, rv)
        return by_node, rv

    def _list_page(self, token: str | None) -> dict[str, Any]:
        return self._api_client.get(
            "list nodes",
            path(NODES),
            {"limit": self._page_size, "continue": token},
            timeout=self._timeout(),
        )

    def _watch(
        self,
        state: LeaseMap,
        config: NetworkConfig,
        on_leases: LeasesCallback,
        closer: StreamCloser,
        stop: threading.Event,
    ) -> int:
        """One watch request, applied event by event; returns how many events came."""
        resp = self._api_client.watch(
            "watch nodes",
            path(NODES),
            {
                "resourceVersion": state.rv,
                "allowWatchBookmarks": True,
                "timeoutSeconds": self._watch_timeout,
            },
            timeout=(CONNECT_TIMEOUT, self._watch_timeout + WATCH_READ_SLACK),
        )
        closer.attach(resp)
        state.watch_opened(time.monotonic())
        count = 0
        try:
            for event in decoded_events(resp, stop, "node watch"):
                count += 1
                self._apply(event, state, config)
                state.watch_event()  # after: an ERROR event (raised above) is no sign of health
                state.deliver(on_leases)
        finally:
            closer.detach()
            resp.close()  # a stream cut short leaves unread data: never reuse it
        return count

    def _apply(self, event: Mapping[str, Any], state: LeaseMap, config: NetworkConfig) -> None:
        kind = event.get("type")
        obj = event.get("object") or {}
        if kind == "ERROR":
            code = obj.get("code")
            message = obj.get("message") or obj.get("reason") or "no message"
            if code == 410:
                raise RevisionCompacted(f"node watch: {message} (410 Gone)", 0)
            raise StoreUnavailable(f"node watch error {code}: {message}")
        if kind in ("ADDED", "MODIFIED"):
            name = kn.node_name(obj)
            self._note_rollout(name, obj)
            if name == state.own_node:
                self.own_override = kn.node_annotations(obj).get(OVERRIDE_ANNOTATION)
                self.own_override_seen.set()
            state.put(name, self._lease_of(obj, config))
        elif kind == "DELETED":
            name = kn.node_name(obj)
            state.put(name, None)
            self._warned.pop(name, None)
            self.rollout_overrides.pop(name, None)
        state.rv = kn.resource_version(obj) or state.rv  # BOOKMARK carries only this

    def _note_rollout(self, name: str, node: Mapping[str, Any]) -> None:
        raw = kn.node_annotations(node).get(OVERRIDE_ANNOTATION)
        rollout = override_rollout(raw)
        before = self.rollout_overrides.get(name)
        if rollout:
            self.rollout_overrides[name] = f"{rollout} {raw}"
        else:
            self.rollout_overrides.pop(name, None)
        if self.rollout_overrides.get(name) != before:
            self.rollout_changed_at = time.monotonic()

    def _lease_of(self, node: Mapping[str, Any], config: NetworkConfig) -> Lease | None:
        name = kn.node_name(node)
        try:
            lease = kn.node_to_lease(node, self._keys, config)
        except ValueError as e:  # NotALease, or a value no check foresaw
            if self._warned.get(name) != str(e):
                self._warned[name] = str(e)
                log.warning("ignoring a node that is not a usable peer node=%s error=%s", name, e)
            return None
        self._warned.pop(name, None)
        return lease

    # -- plumbing ----------------------------------------------------------------------------

    def _timeout(self) -> tuple[float, float]:
        return (CONNECT_TIMEOUT, REQUEST_TIMEOUT)

    def _aborted(self) -> bool:
        return self._closed.is_set() or (self._stop is not None and self._stop.is_set())

    def _pause(self, seconds: float) -> None:
        """Sleep ``seconds``; raise StoreError at once if stopped or closed."""
        deadline = time.monotonic() + seconds
        while not self._aborted():
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._sleep(self._closed, min(left, 0.25))
        raise StoreError("the Kubernetes subnet manager was stopped while waiting")

    def _patiently(self, what: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """``fn`` (a GET) retried while the API is unreachable, for up to --startup-timeout
        seconds."""
        backoff = Backoff()
        deadline: float | None = None
        while True:
            try:
                return fn()
            except StoreUnavailable as e:
                delay = backoff.next()
                now = time.monotonic()
                deadline = deadline or now + self._settings.startup_timeout
                if now + delay > deadline:
                    raise
                log.warning(
                    "kubernetes API unavailable, retrying request=%s delay=%.1f error=%s",
                    what,
                    delay,
                    e,
                )
            self._pause(delay)

    def undecodable(self) -> dict[str, Rejection]:
        """None: a Node is read field by field, and one that is no usable peer is logged
        (``_lease_of``) and left out, as flanneld does; it has no raw value to reject."""
        return {}

    def close(self) -> None:
        self._closed.set()
        if self._owns_client:
            self._api_client.close()
