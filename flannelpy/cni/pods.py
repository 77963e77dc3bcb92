"""The agent's CNI side: node IPAM, the pod bridge, the socket the executable calls, and
the listeners told of every pod attached or detached (the kernel counters keep a pod's
namespace open while it lives)."""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from ipaddress import IPv4Interface, IPv4Network, IPv6Interface, IPv6Network
from typing import TYPE_CHECKING, Protocol

from flannelpy.config.settings import AgentSettings
from flannelpy.errors import StoreError
from flannelpy.observe.metrics import AgentMetrics

if TYPE_CHECKING:
    from flannelpy.cni.context import Deferred
    from flannelpy.ipam.manager import NodeIpam

log = logging.getLogger("flannelpy.cni.pods")

# The node's pod subnets are given in one sequence, both families mixed; pods get
# one address per family present (no IPv4 subnet: IPv6-only pods).
PodSubnet = IPv4Network | IPv6Network
# Told of each CNI request answered with success, once the answer is sent: its CNI_*
# environment, its stdin, the pod namespace's descriptor if the executable passed one
# (valid during the call only)
# and the answer (ADD: the result, with the pod's addresses).
PodListener = Callable[[Mapping[str, str], bytes, "int | None", bytes], None]


class PodSide(Protocol):
    """What the writer needs of the CNI side (PodAttachments, or a fake in tests)."""

    @property
    def ipam(self) -> NodeIpam: ...

    def use_leases(
        self, subnets: Sequence[PodSubnet], serving: Sequence[PodSubnet] | None = None
    ) -> None: ...

    def remove_gateway(self, gateway: IPv4Interface | IPv6Interface) -> None: ...

    def add_listener(self, listener: PodListener) -> None: ...

    def start(self) -> None: ...

    def serving(self) -> tuple[bool, str]: ...

    def stop(self) -> None: ...


class PodAttachments:
    """Node IPAM, the pod bridge and the CNI server, built on first use of the host."""

    def __init__(
        self,
        settings: AgentSettings,
        mtu: Callable[[], int],
        ready: Callable[[], bool],
        metrics: AgentMetrics,
        cluster_networks: PodSubnet | Sequence[PodSubnet] | None,
        ipv6_network: IPv6Network | None = None,
    ) -> None:
        """``cluster_networks``: the cluster's network of each enabled family, or the
        IPv4 one (None: none) with ``ipv6_network`` beside it."""
        from flannelpy.cni.context import CniSettings
        from flannelpy.cni.handler import CniHandler
        from flannelpy.cni.records import RecordStore
        from flannelpy.cni.server import CniServer
        from flannelpy.dataplane.podnet import PodNetwork
        from flannelpy.ipam.manager import NodeIpam

        self._mtu = mtu
        # Where host-local kept the addresses of pods a Flannel before us made on this node.
        self._host_local_dir = settings.host_local_dir or None
        self._ipam = NodeIpam(
            os.path.join(settings.state_dir, "ipam"), host_local_dir=self._host_local_dir
        )
        self.pods = PodNetwork()
        records = RecordStore(os.path.join(settings.state_dir, "cni"))
        # A pod without a default route routes the cluster networks via its gateways, as
        # Flannel's plugin does with FLANNEL_NETWORK and FLANNEL_IPV6_NETWORK.
        if cluster_networks is None:
            given: tuple[PodSubnet, ...] = ()
        elif isinstance(cluster_networks, IPv4Network | IPv6Network):
            given = (cluster_networks,)
        else:
            given = tuple(cluster_networks)
        networks = given + ((ipv6_network,) if ipv6_network is not None else ())
        if any(n.version == 6 for n in networks):
            log.info(
                "pods get IPv6 addresses; warm capacity (MinFreeAddresses) counts IPv4"
                " leases only, as a node's IPv6 subnet cannot run dry"
            )
        self.handler = CniHandler(
            self._ipam,
            self.pods,
            records,
            CniSettings(mtu_provider=mtu, ready=ready, cluster_networks=lambda: networks),
        )
        self.socket_path = os.path.join(settings.run_dir, "cni.sock")
        self._metrics = metrics
        self._listeners: list[PodListener] = []
        # What a request's handling left for after its reply (a DEL's release), kept per
        # thread: the server runs the handler and then ``_after_reply`` on one thread.
        self._deferred = threading.local()
        self.server = CniServer(self.socket_path, self._handle, after_reply=self._after_reply)
        self._started = False

    @property
    def ipam(self) -> NodeIpam:
        return self._ipam

    def _handle(
        self, env: Mapping[str, str], stdin: bytes, netns_fd: int | None = None
    ) -> tuple[int, bytes]:
        started = time.monotonic()
        deferred: Deferred = []
        try:
            exit_code, out = self.handler.handle(env, stdin, netns_fd, deferred)
            code = 0
            if exit_code:
                try:
                    code = int(json.loads(out).get("code", 999))
                except (ValueError, AttributeError):
                    code = 999
            command = env.get("CNI_COMMAND", "?")
            self._metrics.cni_request(command, code, time.monotonic() - started)
        except BaseException:
            _run_deferred(deferred)  # no reply will follow: finish it now
            raise
        self._deferred.work = deferred
        return exit_code, out

    def _after_reply(
        self,
        env: Mapping[str, str],
        stdin: bytes,
        netns_fd: int | None,
        exit_code: int,
        out: bytes,
    ) -> None:
        """The server runs this once the runtime has its answer (or its sending failed),
        the namespace's descriptor still open: what the handler left (a DEL's release)
        and the listeners' work (the counters enter the pod's namespace) are not part of
        the request's latency."""
        deferred: Deferred = self._deferred.__dict__.pop("work", [])
        _run_deferred(deferred)
        if exit_code != 0:
            return
        for listener in self._listeners:
            try:
                listener(env, stdin, netns_fd, out)
            except Exception as e:  # a CNI request never fails on a listener
                log.warning("a pod listener failed on a CNI request error=%s", e)

    def add_listener(self, listener: PodListener) -> None:
        """Tell ``listener`` of every CNI request answered with success from now on, once
        its answer is sent."""
        self._listeners.append(listener)

    def use_leases(
        self, subnets: Sequence[PodSubnet], serving: Sequence[PodSubnet] | None = None
    ) -> None:
        """Allocate from ``serving`` (default: all), in the order of ``subnets`` (the node's
        pod subnets of every enabled family); the bridge carries each one's gateway from
        now on, so the node has an address in a lease before the first pod lands there."""
        from flannelpy.dataplane.podnames import gateway_of

        self._ipam.set_leases(subnets, serving)
        self._hold_host_local(subnets)
        self.pods.ensure_bridge([gateway_of(net) for net in subnets], self._mtu())

    def _hold_host_local(self, subnets: Sequence[PodSubnet]) -> None:
        """Hold the addresses host-local gave pods that still run here (before the CNI
        server answers: a new pod must not get one of them)."""
        if self._host_local_dir is None:
            return
        from flannelpy.ipam import hostlocal

        try:
            found = hostlocal.within(hostlocal.read_dir(self._host_local_dir), subnets)
        except OSError as e:
            raise StoreError(
                f"cannot read host-local's data dir {self._host_local_dir} ({e.strerror}); "
                "make it readable, or pass --host-local-dir= to skip the import"
            ) from e
        held = self._ipam.hold_foreign(found)
        if held:
            log.info(
                "holding addresses host-local gave pods on this node count=%d dir=%s",
                len(held),
                self._host_local_dir,
            )

    def remove_gateway(self, gateway: IPv4Interface | IPv6Interface) -> None:
        self.pods.remove_gateway(gateway)

    def start(self) -> None:
        released = self.handler.gc_dead()
        if released:
            log.info("released addresses of pods that are gone count=%d", len(released))
        self.server.start()
        self._started = True
        log.info("CNI server listening socket=%s", self.socket_path)

    def serving(self) -> tuple[bool, str]:
        """For /healthz: the CNI server accepts on its socket (trivially true before
        start, while the agent still waits for its lease)."""
        if not self._started:
            return True, "ok"
        return self.server.alive()

    def stop(self) -> None:
        if self._started:
            self.server.stop()
            self._started = False


def _run_deferred(deferred: Deferred) -> None:
    """Run what a request left for after its reply; a failure is logged (the runtime has
    its answer): a release that failed keeps its address, and the record that explains it,
    until the runtime's GC or the agent's start-up GC releases it."""
    for work in deferred:
        try:
            work()
        except Exception as e:
            log.error(
                "a CNI request's work after its reply failed; the address stays assigned"
                " until a GC releases it error=%s",
                e,
            )
