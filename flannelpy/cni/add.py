"""CNI ADD: a pod's address, its veth pair on the bridge, its routes, the record of it,
and the result the runtime gets.

ADD acquires in this order, each step registering its undo: the address (IPAM), the
record, the bridge (shared, never undone), the veth pair. The record is known before the
veth exists (its MACs are chosen first), so a worker thread makes IPAM's change
durable (the batch holding it: the pool file and its directory's fsync, shared with the
ADDs and DELs of the moment) and then writes the record (fsync'd) while the pod is
plumbed, and the result is returned only once both are durable: the disk's time and the
netlink work overlap instead of adding up. A record whose
veth was never made (a crash in between) is what the start-up GC removes, as one whose
pod is gone. A failure anywhere runs the undos in reverse, so nothing of a failed ADD
remains. An ADD repeated for a live attachment returns the recorded result.

Dual stack: a pod gets one address per family the node has a pod subnet in (IPAM's
families), IPv4 first; the result lists one ``ips`` entry per family (both on the pod
interface, index 1), each with its gateway, and per family the default route (or,
without ``isDefaultGateway``, a route to each of that family's cluster networks) via
that family's gateway. With no IPv4 subnet (``EnableIPv4`` false) a pod is IPv6-only:
no IPv4 address, no IPv4 route.

The plugin adds its routes with NLM_F_EXCL: a route it did not add is never replaced,
and such a conflict fails the ADD with a sentence naming the fix.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

from flannelpy.cni import netconf
from flannelpy.cni.context import CommandContext
from flannelpy.cni.failures import cni_errors
from flannelpy.cni.records import Record, RecordStore, Staged
from flannelpy.cni.spec import (
    CniError,
    Code,
    Interface,
    IPConfig,
    Request,
    Result,
    RouteEntry,
    parse_result,
    render_result,
)
from flannelpy.cni.teardown import record_owner
from flannelpy.cni.workers import Workers
from flannelpy.dataplane.podnames import (
    IPInterface,
    IPNetwork,
    PodRoute,
    gateway_of,
    host_veth_name,
    pod_mac,
    random_mac,
    veth_owner,
)
from flannelpy.dataplane.podnet import PodLink
from flannelpy.ipam import Accounting, Allocation

# The handler's logger: these lines are the CNI handler's, as before the split.
log = logging.getLogger("flannelpy.cni.handler")

STORED_VERSION = "1.1.0"  # records keep results in this format; re-rendered per request


class Undo:
    """Undo actions of a half-done ADD, run newest first; their own failures are logged."""

    def __init__(self) -> None:
        self._actions: list[tuple[str, Callable[[], object]]] = []

    def push(self, what: str, action: Callable[[], object]) -> None:
        self._actions.append((what, action))

    def run(self) -> None:
        while self._actions:
            what, action = self._actions.pop()
            try:
                action()
            except Exception as e:
                log.error("could not undo a failed ADD step=%s reason=%s", what, e)


@dataclass(frozen=True)
class _Plumbing:
    """The pod's plumbing options, read from the conflist once per ADD."""

    hairpin: bool
    destinations: tuple[IPNetwork, ...]  # routed via the gateway of their family


class AddCommand(CommandContext):
    def add(self, req: Request, netns_fd: int | None = None) -> bytes:
        """ADD into the namespace ``netns_fd`` (verified by the caller, see
        CniHandler._pod_netns; None: PodNetwork opens CNI_NETNS)."""
        if not self.settings.ready():
            raise CniError(
                Code.TRY_AGAIN_LATER,
                "the flannelpy agent has no subnet lease or data plane yet; try again later",
            )
        bridge = netconf.bridge_name(req, self.settings)
        cooldown = netconf.cooldown_seconds(req, self.settings)
        wait = netconf.wait_seconds(req, self.settings)
        mtu = self._mtu()
        plumb = _Plumbing(
            netconf.flag(req, "hairpinMode", self.settings.hairpin),
            netconf.destinations(req, self.settings, self.ipam.families() or [4]),
        )
        key = (req.container_id, req.ifname)
        with self.locks.hold(key), cni_errors():
            existing = self.records.read(req.network_name, *key)
            if existing is not None and self._still_there(existing, req):
                return render_result(parse_result(existing.result, STORED_VERSION), req.cni_version)
            undo = Undo()
            try:
                result = self._add_steps(
                    req, netns_fd, existing, bridge, mtu, cooldown, wait, undo, plumb
                )
            except BaseException:
                undo.run()
                raise
        return render_result(result, req.cni_version)

    def _add_steps(
        self,
        req: Request,
        netns_fd: int | None,
        existing: Record | None,
        bridge: str,
        mtu: int,
        cooldown: float,
        wait: float,
        undo: Undo,
        plumb: _Plumbing,
    ) -> Result:
        cid, ifname = req.container_id, req.ifname
        if existing is not None:  # its veth is gone or it was for another namespace
            self.pods.delete_host_veth(existing.host_veth, record_owner(existing))
        had = self.ipam.find_all(cid, ifname)
        # Before the allocation: once it is made, IPAM's lock is its batch's while that
        # is written, and the pod's plumbing must not wait for the disk.
        leases = self.ipam.accounting()
        allocs, commit_ipam = self.ipam.allocate_all_deferred(
            cid, ifname, cooldown=cooldown, wait=wait
        )
        # Whatever fails before the record's writer commits it, IPAM's batch must still be
        # written: until then IPAM keeps its directory's file lock. Run last of the undos.
        undo.push("write IPAM's batch", commit_ipam)
        if not had:
            undo.push("release addresses", lambda: self.ipam.release(cid, ifname))
        host = host_veth_name(req.netns, cid, ifname)
        owner = veth_owner(req.netns, cid, ifname)
        routes = pod_routes(allocs, plumb.destinations)
        link = PodLink(host, random_mac(), ifname, pod_mac(allocs[0].interface.ip))
        result = build_result(
            req.cni_version,
            link.host_veth,
            link.host_mac,
            link.ifname,
            link.pod_mac,
            req.netns,
            allocs,
            routes,
            netconf.dns(req.config),
        )
        stored = json.loads(render_result(result, STORED_VERSION))
        record = Record(
            network=req.network_name,
            container_id=cid,
            ifname=ifname,
            netns=req.netns,
            host_veth=host,
            bridge=bridge,
            addresses=tuple(a.interface for a in allocs),
            gateways=tuple(a.gateway for a in allocs),
            result=stored,
        )
        # IPAM's batch, then the record: durable in that order, beside the plumbing.
        writing = Background(
            self.writers, _commit_then_write, self.writers, commit_ipam, self.records, record
        )
        undo.push("delete record", lambda: _forget_record(writing, self.records, record))
        index = self.pods.ensure_bridge(_gateways(allocs, leases), mtu, bridge)
        self.pods.add_pod(
            req.netns,
            ifname,
            host,
            index,
            [a.interface for a in allocs],
            routes,
            mtu,
            plumb.hairpin,
            owner=owner,
            netns_fd=netns_fd,
            host_mac=link.host_mac,
        )
        undo.push("delete veth", lambda: self.pods.delete_host_veth(host, owner))
        writing.result()  # durable before the runtime hears of the pod
        return result

    def _still_there(self, record: Record, req: Request) -> bool:
        """An earlier ADD's record still describes a live attachment in this namespace."""
        if record.netns != req.netns:
            return False
        allocs = self.ipam.find_all(req.container_id, req.ifname)
        if tuple(a.interface for a in allocs) != record.addresses:
            return False
        return self.pods.link(record.host_veth) is not None

    def _mtu(self) -> int:
        mtu = self.settings.mtu_provider()
        if not mtu:
            raise CniError(
                Code.TRY_AGAIN_LATER,
                "the flannelpy agent does not know the overlay MTU yet; try again later",
            )
        return mtu


class Background:
    """``fn(*args)`` at once on a thread of ``workers`` (no bound: a burst of ADDs writes
    all its records at once, their fsyncs overlapping); ``result()`` waits for it and
    raises what it raised. Without a thread to be had, it runs here and now."""

    def __init__(self, workers: Workers, fn: Callable[..., object], *args: object) -> None:
        self._error: BaseException | None = None
        self._value: object = None
        self._done = threading.Event()
        try:
            workers.submit(lambda: self._run(fn, args))
        except RuntimeError:  # "can't start new thread"
            self._run(fn, args)

    def _run(self, fn: Callable[..., object], args: tuple[object, ...]) -> None:
        try:
            self._value = fn(*args)
        except BaseException as e:  # handed to result()
            self._error = e
        finally:
            self._done.set()

    def result(self) -> object:
        """What ``fn`` returned, once it has; raises what it raised."""
        self._done.wait()
        if self._error is not None:
            raise self._error
        return self._value


def _commit_then_write(
    workers: Workers, commit_ipam: Callable[[], None], records: RecordStore, record: Record
) -> None:
    """IPAM's change durable, then the record: staged (its content fsync'd) beside IPAM's
    batch, published (renamed, its directory fsync'd) only once the batch is done, so a
    record is never durable before the address it names."""
    staging = Background(workers, records.stage, record)
    try:
        commit_ipam()
    except BaseException:
        with contextlib.suppress(Exception):
            records.discard(cast(Staged, staging.result()))
        raise
    records.publish(cast(Staged, staging.result()))


def _forget_record(writing: Background, records: RecordStore, record: Record) -> None:
    """Undo of the record: once its write is over (a delete before it would be undone
    by the rename), whether or not the write succeeded."""
    with contextlib.suppress(Exception):
        writing.result()
    records.delete(*record.key)


def _gateways(allocs: Sequence[Allocation], leases: Sequence[Accounting]) -> list[IPInterface]:
    """The gateway of every lease that has or may get pods (``leases``: IPAM's accounting),
    these allocations' first (the first one also names the bridge's MAC when the bridge is
    created)."""
    gateways = [gateway_of(a.subnet) for a in allocs]
    for acc in leases:
        gw = gateway_of(acc.subnet)
        if gw not in gateways:
            gateways.append(gw)
    return gateways


def pod_routes(allocs: Sequence[Allocation], destinations: Sequence[IPNetwork]) -> list[PodRoute]:
    """(destination, gateway) per destination, via the gateway of its family's address."""
    gateways = {a.family: a.gateway for a in allocs}
    return [(dst, gateways[dst.version]) for dst in destinations if dst.version in gateways]


def build_result(
    cni_version: str,
    host_veth: str,
    host_mac: str,
    ifname: str,
    pod_mac: str,
    netns: str,
    allocs: Sequence[Allocation],
    routes: Sequence[PodRoute],
    dns: dict[str, Any],
) -> Result:
    """The ADD result: the host end and the pod interface, one ``ips`` entry per family
    (IPv4 first) on the pod interface with its gateway, and the pod's routes."""
    return Result(
        cni_version=cni_version,
        interfaces=(
            Interface(name=host_veth, mac=host_mac),
            Interface(name=ifname, mac=pod_mac, sandbox=netns),
        ),
        ips=tuple(
            IPConfig(address=str(a.interface), gateway=str(a.gateway), interface=1) for a in allocs
        ),
        routes=tuple(RouteEntry(dst=str(dst), gw=str(gw)) for dst, gw in routes),
        dns=dns,
    )
