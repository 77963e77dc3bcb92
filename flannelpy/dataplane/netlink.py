"""The real :class:`~flannelpy.dataplane.kernel.Kernel`: rtnetlink in the caller's namespace.

:class:`NetlinkKernel` holds what the calls share (our route protocol, the route shape
to adopt) and leaves the work to one module per concept:

* :mod:`~flannelpy.dataplane.netlink_observe`: what the kernel holds of ours;
* :mod:`~flannelpy.dataplane.netlink_apply`: writing changes (through
  :mod:`flannelpy.dataplane.nlbatch`: one request at a time for the few links and
  addresses, batched for the thousands of neighbours, FDB entries and routes of a big
  cluster);
* :mod:`~flannelpy.dataplane.netlink_events`: the notifications that call for a pass;
* :mod:`~flannelpy.dataplane.netlink_host`: the underlay, the routes not ours, sysctls.

Every call opens its own sockets in the calling thread's network namespace and
closes them before returning, so one ``NetlinkKernel`` may be shared by threads,
and a thread that entered a namespace (``netns.run_in_netns``, ``ip netns
exec``) programs that namespace.

Of these modules only ``netlink_apply`` imports pyroute2.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

from flannelpy.dataplane import (
    ethtool,
    netlink_apply,
    netlink_events,
    netlink_host,
    netlink_observe,
)
from flannelpy.dataplane import nlbatch as nl
from flannelpy.dataplane.adopt import FlannelRouteShape
from flannelpy.dataplane.kernel import ApplyResult, ForeignRoute
from flannelpy.dataplane.state import ROUTE_PROTOCOL, Changes, ObservedState


class NetlinkKernel:
    """Kernel adapter for the network namespace of the calling thread.

    Stateless between calls but for ``adopt_routes`` and the deletions the watch awaits
    (kept under a lock): safe to share between threads, and callable from a thread that
    runs an asyncio loop (apply then hops to a helper thread).
    Routes are tagged with ``route_protocol``; MACs are reported in lower case.
    """

    def __init__(
        self, route_protocol: int = ROUTE_PROTOCOL, watch_buffer: int = nl.SOCKET_BUFFER
    ) -> None:
        self.protocol = route_protocol
        self.watch_buffer = watch_buffer  # bytes; small only in tests that provoke ENOBUFS
        self.adopt: FlannelRouteShape | None = None  # observe reports such routes too
        # Our own deletions, which the watch does not report as news.
        self.own_deletions = netlink_events.OwnDeletions()

    def adopt_routes(self, shape: FlannelRouteShape) -> None:
        self.adopt = shape

    # -- reading

    # Calls that need none of the adapter's state are the modules' functions.
    find_underlay = staticmethod(netlink_host.find_underlay)
    link_mac = staticmethod(netlink_observe.link_mac)

    def survey(self, ignore_devices: Iterable[str]) -> list[ForeignRoute]:
        return netlink_host.survey(self.protocol, ignore_devices)

    def observe(
        self,
        link_names: Iterable[str],
        owned_devices: Iterable[str],
        expected: ObservedState | None = None,
    ) -> ObservedState:
        return netlink_observe.observe(
            link_names, owned_devices, self.protocol, self.adopt, expected
        )

    # -- writing

    def apply(self, changes: Changes) -> ApplyResult:
        return netlink_apply.apply(changes, self.protocol, self.adopt, self.own_deletions)

    set_sysctl = staticmethod(netlink_host.set_sysctl)
    set_tx_checksum = staticmethod(ethtool.set_tx_checksum)

    # -- listening

    def watch(self, on_event: Callable[[str], None], stop: threading.Event) -> None:
        netlink_events.watch(
            on_event, stop, self.protocol, self.watch_buffer, self.own_deletions.consume
        )
