"""CNI commands in the agent: ADD, DEL, CHECK, GC, STATUS, VERSION.

Every request ends as ``(exit code, stdout)``: a result or nothing with 0, the
spec's error JSON with 1. Nothing else escapes :meth:`CniHandler.handle`.

Ordering and locks:

* ADD acquires in this order, each step registering its undo: the address
  (IPAM), the bridge (shared, never undone), the veth pair; then the record is
  written (fsync'd) before the result is returned. A failure anywhere runs
  the undos in reverse, so nothing of a failed ADD remains.
* DEL is best effort and idempotent, and reads the record, not the current
  config: veth (by its host end), address (into cooldown), record. A missing
  namespace, link, address or record is success.
* Requests for one (container ID, ifname) are serialised by a lock per key;
  different pods run in parallel (the server gives each request a thread).
  IPAM and the bridge lock themselves.

Dual stack: a pod gets one address per family the node has a pod subnet in (IPAM's
families), IPv4 first; the result lists one ``ips`` entry per family (both on the pod
interface, index 1), each with its gateway, and per family the default route (or,
without ``isDefaultGateway``, a route to each of that family's cluster networks) via
that family's gateway. With no IPv4 subnet (``EnableIPv4`` false) a pod is IPv6-only:
no IPv4 address, no IPv4 route.

Conflist keys, as the reference bridge plugin reads them: ``hairpinMode``
(hairpin on the host port) and ``isDefaultGateway`` (the pod's default route
via the gateway; when false, only routes to the cluster networks). Both default
to true here, Flannel's delegate settings, which the shipped conflist spells out.
The plugin adds its routes with NLM_F_EXCL: a route it did not add is never
replaced, and such a conflict fails the ADD with a sentence naming the fix.

The pod's network namespace: ``CNI_NETNS`` is the identity (records, veth
names, results), and every access goes through an open descriptor. The
executable opens the path in the runtime's mount namespace and passes the
descriptor (:mod:`flannelpy.cni.server`); the path itself may name nothing, or
an empty file, in the agent's (containerd's state-dir mounts, /proc/<pid>/ns/net
of another PID namespace). Whatever arrives is verified to be a network
namespace first. Without a descriptor (an executable from before, or one that
could not open the path) the agent opens the path itself. DEL never needs the
namespace: it deletes the veth by its host end, from the record.

CHECK failures use code 999, as the reference plugins' do (the spec defines no
code for "the attachment is broken"). A pod attached before flannelpy took the node
over (Flannel's plugin, host-local's address, held by our IPAM) has no record: CHECK
checks it against the runtime's prevResult and the held address, and is refused
without a prevResult, as the reference bridge plugin refuses it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from ipaddress import ip_interface
from typing import Any

from flannelpy.cni.records import Record, RecordStore
from flannelpy.cni.spec import (
    CniError,
    Code,
    Interface,
    IPConfig,
    Request,
    Result,
    RouteEntry,
    parse_request,
    parse_result,
    render_result,
    reply_version,
    version_reply,
)
from flannelpy.dataplane.netns import NotANetns, require_netns_fd
from flannelpy.dataplane.podnames import (
    IPInterface,
    IPNetwork,
    PodRoute,
    default_route,
    gateway_of,
    host_veth_name,
    veth_owner,
)
from flannelpy.dataplane.podnet import NetnsMissing, PodInterfaceExists, PodNetwork
from flannelpy.errors import ConfigError, DataplaneError, StoreError
from flannelpy.ipam import Allocation, NodeIpam
from flannelpy.ipam.errors import IpamExhausted

log = logging.getLogger(__name__)

STORED_VERSION = "1.1.0"  # records keep results in this format; re-rendered per request
VALID_ATTACHMENTS = "cni.dev/valid-attachments"
MAX_WAIT_SECONDS = 300.0  # an ipWaitSeconds beyond this would outlast any runtime's timeout
CHECK_FAILED = Code.INTERNAL
_BRIDGE_NAME = re.compile(r"^[^/:\s]{1,15}$")

Key = tuple[str, str]  # (container_id, ifname): what IPAM and the runtime key on


@dataclass(frozen=True)
class CniSettings:
    """What the agent tells the CNI handler; every field with its unit."""

    mtu_provider: Callable[[], int | None]  # the overlay MTU in bytes; None: not known yet
    ready: Callable[[], bool] = lambda: True  # lease held and data plane programmed
    bridge: str = "cni0"  # the CNI config key "bridge" overrides it
    hairpin: bool = True  # a pod reaches itself through a service IP (hairpin mode on its port)
    default_gateway: bool = True  # default of the config key isDefaultGateway
    # The cluster's networks (one per family), routed via the gateway of their family
    # when isDefaultGateway is false.
    cluster_networks: Callable[[], Sequence[IPNetwork]] = lambda: ()
    cooldown_seconds: float = 30.0  # default of the config key ipCooldownSeconds
    wait_seconds: float = 0.0  # default of the config key ipWaitSeconds


def open_netns_path(path: str) -> int:
    """CNI_NETNS opened by the agent itself (an executable that passed no fd).
    O_NONBLOCK: a FIFO there must not hang a worker (no effect on a namespace)."""
    return os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)


class KeyLocks:
    """One lock per key, created on demand and dropped when nobody holds or waits."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._locks: dict[Hashable, list[Any]] = {}  # key -> [lock, users]

    @contextmanager
    def hold(self, key: Hashable) -> Iterator[None]:
        with self._guard:
            entry = self._locks.setdefault(key, [threading.Lock(), 0])
            entry[1] += 1
        entry[0].acquire()
        try:
            yield
        finally:
            entry[0].release()
            with self._guard:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._locks[key]


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


class CniHandler:
    def __init__(
        self,
        ipam: NodeIpam,
        pods: PodNetwork,
        records: RecordStore,
        settings: CniSettings,
        open_netns: Callable[[str], int] = open_netns_path,
        require_netns: Callable[[int], None] = require_netns_fd,
    ) -> None:
        self.ipam = ipam
        self.pods = pods
        self.records = records
        self.settings = settings
        self.open_netns = open_netns  # a path -> an fd the handler closes; raises OSError
        self.require_netns = require_netns  # raises NotANetns unless the fd is a netns
        self.locks = KeyLocks()

    # -- entry point

    def handle(
        self, env: Mapping[str, str], stdin: bytes, netns_fd: int | None = None
    ) -> tuple[int, bytes]:
        """One request. ``netns_fd``: CNI_NETNS as the executable opened it, or None;
        the caller keeps it and closes it afterwards."""
        version = reply_version(stdin)
        try:
            req = parse_request(env, stdin)
            version = req.cni_version
            return 0, self._dispatch(req, netns_fd)
        except CniError as e:
            log.info(
                "CNI request refused command=%s code=%s msg=%s",
                env.get("CNI_COMMAND"),
                e.code,
                e.msg,
            )
            return 1, e.to_json(version)
        except Exception as e:
            log.exception("CNI request failed command=%s", env.get("CNI_COMMAND"))
            err = CniError(Code.INTERNAL, f"the flannelpy agent failed unexpectedly: {e}")
            return 1, err.to_json(version)

    def _dispatch(self, req: Request, netns_fd: int | None = None) -> bytes:
        command = req.command
        if command == "ADD":
            with self._pod_netns(req, netns_fd) as fd:
                return self.add(req, fd)
        if command == "DEL":
            with self._pod_netns(req, netns_fd, required=False) as maybe_fd:
                self.delete(req, maybe_fd)
            return b""
        if command == "CHECK":
            with self._pod_netns(req, netns_fd) as fd:
                self.check(req, fd)
            return b""
        if command == "GC":
            self.gc(req)
            return b""
        if command == "STATUS":
            self.status()
            return b""
        if command == "VERSION":
            return version_reply(req.cni_version)
        raise CniError(Code.INVALID_ENVIRONMENT, f"unknown CNI_COMMAND {command!r}")

    # -- ADD

    def add(self, req: Request, netns_fd: int | None = None) -> bytes:
        """ADD into the namespace ``netns_fd`` (verified by the caller, see _pod_netns;
        None: PodNetwork opens CNI_NETNS)."""
        if not self.settings.ready():
            raise CniError(
                Code.TRY_AGAIN_LATER,
                "the flannelpy agent has no subnet lease or data plane yet; try again later",
            )
        bridge = self._bridge(req)
        cooldown = self._seconds(req, "ipCooldownSeconds", self.settings.cooldown_seconds)
        wait = self._seconds(req, "ipWaitSeconds", self.settings.wait_seconds)
        if wait > MAX_WAIT_SECONDS:
            raise CniError(
                Code.INVALID_NETWORK_CONFIG,
                f"ipWaitSeconds must be at most {MAX_WAIT_SECONDS:g}, got {wait:g}",
            )
        mtu = self._mtu()
        plumb = _Plumbing(
            self._flag(req, "hairpinMode", self.settings.hairpin),
            self._destinations(req, self.ipam.families() or [4]),
        )
        key = (req.container_id, req.ifname)
        with self.locks.hold(key), _cni_errors():
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
            self.pods.delete_host_veth(existing.host_veth, _owner(existing))
        had = self.ipam.find_all(cid, ifname)
        allocs = self.ipam.allocate_all(cid, ifname, cooldown=cooldown, wait=wait)
        if not had:
            undo.push("release addresses", lambda: self.ipam.release(cid, ifname))
        index = self.pods.ensure_bridge(self._gateways(allocs), mtu, bridge)
        host = host_veth_name(req.netns, cid, ifname)
        owner = veth_owner(req.netns, cid, ifname)
        routes = pod_routes(allocs, plumb.destinations)
        link = self.pods.add_pod(
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
        )
        undo.push("delete veth", lambda: self.pods.delete_host_veth(host, owner))
        result = build_result(
            req.cni_version, link.host_veth, link.host_mac, link.ifname, link.pod_mac,
            req.netns, allocs, routes, _dns(req.config),
        )  # fmt: skip
        stored = json.loads(render_result(result, STORED_VERSION))
        self.records.write(
            Record(
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
        )
        return result

    def _still_there(self, record: Record, req: Request) -> bool:
        """An earlier ADD's record still describes a live attachment in this namespace."""
        if record.netns != req.netns:
            return False
        allocs = self.ipam.find_all(req.container_id, req.ifname)
        if tuple(a.interface for a in allocs) != record.addresses:
            return False
        return self.pods.link(record.host_veth) is not None

    def _gateways(self, allocs: Sequence[Allocation]) -> list[IPInterface]:
        """The gateway of every lease that has or may get pods, these allocations' first
        (the first one also names the bridge's MAC when the bridge is created)."""
        gateways = [gateway_of(a.subnet) for a in allocs]
        for acc in self.ipam.accounting():
            gw = gateway_of(acc.subnet)
            if gw not in gateways:
                gateways.append(gw)
        return gateways

    # -- DEL

    def delete(self, req: Request, netns_fd: int | None = None) -> None:
        """DEL; ``netns_fd`` (the pod's namespace, if it could be opened) is only needed
        when there is no record to find the veth by."""
        key = (req.container_id, req.ifname)
        with self.locks.hold(key):
            record = self.records.read(req.network_name, *key)
            with _cni_errors():
                pod_ns = (req.netns, netns_fd) if netns_fd is not None else None
                self._teardown(record, pod_ns, *key)
                self.records.delete(req.network_name, *key)

    def _teardown(
        self,
        record: Record | None,
        pod_ns: tuple[str, int] | None,
        container_id: str,
        ifname: str,
    ) -> None:
        """Veth first, then the address: an address is never free while a veth holds it.
        ``pod_ns``: (CNI_NETNS, its fd), to look inside when there is no record."""
        if record is not None:
            self.pods.delete_host_veth(record.host_veth, _owner(record))
        elif pod_ns is not None:
            self.pods.delete_in_netns(pod_ns[0], ifname, netns_fd=pod_ns[1])
        self.ipam.release(container_id, ifname)

    # -- CHECK

    def check(self, req: Request, netns_fd: int | None = None) -> None:
        key = (req.container_id, req.ifname)
        with self.locks.hold(key):
            record = self.records.read(req.network_name, *key)
            if record is None and self._held_addresses(*key):
                problems = self._check_held(req, netns_fd)
            elif record is None:
                raise CniError(
                    Code.UNKNOWN_CONTAINER,
                    f"network {req.network_name} has no attachment for container"
                    f" {req.container_id} interface {req.ifname}; run ADD first",
                )
            else:
                problems = self._check_record(req, record, netns_fd)
        if problems:
            raise CniError(CHECK_FAILED, "; ".join(problems))

    def _check_record(self, req: Request, record: Record, netns_fd: int | None) -> list[str]:
        problems = []
        if record.netns != req.netns:
            problems.append(f"the attachment was made in {record.netns}, not {req.netns}")
        assigned = {a.interface for a in self.ipam.find_all(req.container_id, req.ifname)}
        for address in record.addresses:
            if address not in assigned:
                problems.append(f"IPAM no longer assigns {address} to this container")
        families = [a.version for a in record.addresses]
        destinations = self._destinations(req, families)
        routes = [
            (dst, gw)
            for address, gw in zip(record.addresses, record.gateways, strict=True)
            for dst in destinations
            if dst.version == address.version
        ]
        with _cni_errors():
            problems += self.pods.check_pod(
                req.netns,
                req.ifname,
                record.host_veth,
                record.bridge,
                record.addresses,
                routes,
                self.settings.mtu_provider(),
                netns_fd=netns_fd,
            )
        return problems

    def _held_addresses(self, container_id: str, ifname: str) -> list[IPInterface]:
        """The addresses (one per family) a pod made before a migration holds (host-local
        gave them; the agent holds them, see NodeIpam.hold_foreign), with their lease's
        prefix; [] when it holds none or IPAM assigned it addresses itself."""
        if self.ipam.find(container_id, ifname) is not None:
            return []
        ips = [
            e.ip for e in self.ipam.host_local_entries()
            if (e.container_id, e.ifname) == (container_id, ifname)
        ]  # fmt: skip
        subnets = [a.subnet for a in self.ipam.accounting()]
        held: list[IPInterface] = []
        for ip in ips:
            subnet = next((s for s in subnets if ip in s), None)
            if subnet is not None:
                held.append(ip_interface((ip, subnet.prefixlen)))
        return held

    def _check_held(self, req: Request, netns_fd: int | None) -> list[str]:
        """CHECK of a pod the previous plugin (Flannel's, delegating to bridge and
        host-local) attached: no record of ours, but the held address and the runtime's
        prevResult (the spec has the plugin consult it) say what to expect. Its host veth
        has the bridge plugin's name, known only from the prevResult."""
        held = self._held_addresses(req.container_id, req.ifname)
        assert held  # checked by the caller, under the key's lock
        if req.prev_result is None:
            raise CniError(
                CHECK_FAILED,
                f"container {req.container_id} was attached before flannelpy took the node"
                " over and CHECK carries no prevResult to check it against; pass the"
                " cached ADD result as prevResult",
            )
        with _cni_errors():
            prev = parse_result(req.prev_result, req.cni_version)
        bridge = self._bridge(req)
        problems = []
        host = next((i.name for i in prev.interfaces if not i.sandbox and i.name != bridge), None)
        sandbox = next((i.sandbox for i in prev.interfaces if i.sandbox), req.netns)
        if sandbox != req.netns:
            problems.append(f"the attachment was made in {sandbox}, not {req.netns}")
        named = {ip_interface(ip.address) for ip in prev.ips}  # parse_result checked them
        for address in held:
            if address not in named:
                shown = ", ".join(ip.address for ip in prev.ips) or "no address"
                problems.append(f"prevResult names {shown}, but IPAM holds {address} for it")
        if host is None:
            problems.append(f"prevResult names no host veth on {bridge}")
            return problems
        gateways = {a.version: gateway_of(a.network).ip for a in held}
        destinations = self._destinations(req, sorted(gateways))
        routes = [(dst, gateways[dst.version]) for dst in destinations]
        with _cni_errors():
            problems += self.pods.check_pod(
                req.netns,
                req.ifname,
                host,
                bridge,
                held,
                routes,
                self.settings.mtu_provider(),
                netns_fd=netns_fd,
            )
        return problems

    # -- GC and start-up clean-up

    def gc(self, req: Request) -> None:
        """CNI GC: drop every attachment of this network the runtime no longer lists."""
        valid = _valid_attachments(req.config)
        for record in self.records.list(req.network_name):
            key = (record.container_id, record.ifname)
            if key not in valid:
                self._forget(record.network, key)
        for alloc in self.ipam.allocations():
            key = (alloc.container_id, alloc.ifname)
            if key not in valid:
                self._release_orphan(key)

    def gc_dead(self, exists: Callable[[str], bool] | None = None) -> list[Key]:
        """At agent start: forget attachments whose pod is gone, and release
        addresses no record explains (an ADD that died half-way). Run it before
        the server accepts requests. Returns the keys released.

        A pod is gone when its host veth is: the kernel deletes a veth pair with
        the namespace holding one end. Its CNI_NETNS path tells nothing, because
        the agent need not see the runtime's mounts. ``exists(netns)`` replaces
        that test (unit tests without a kernel)."""
        released: list[Key] = []
        for path, why in self.records.unreadable():
            # Its pod may be alive: releasing would hand its address out twice.
            log.error(
                "CNI record unreadable, its address is kept until a DEL path=%s reason=%s;"
                " restore or remove the file once the pod is known to be gone", path, why,
            )  # fmt: skip
        for record in self.records.list():
            alive = (
                exists(record.netns)
                if exists is not None
                else self.pods.link(record.host_veth) is not None
            )
            if not alive:
                key = (record.container_id, record.ifname)
                if self._forget(record.network, key):
                    released.append(key)
        for alloc in self.ipam.allocations():
            key = (alloc.container_id, alloc.ifname)
            if self._release_orphan(key):
                released.append(key)
        if released:
            log.info("released addresses of gone pods count=%d", len(released))
        return released

    def _forget(self, network: str, key: Key) -> bool:
        with self.locks.hold(key):
            record = self.records.read(network, *key)
            if record is None:
                return False
            try:
                self._teardown(record, None, *key)
            except (DataplaneError, StoreError, OSError) as e:
                log.warning("GC could not remove an attachment key=%s reason=%s", key, e)
                return False
            self.records.delete(network, *key)
            return True

    def _release_orphan(self, key: Key) -> bool:
        """Release ``key``'s address if no network has a record for it (checked under
        the key's lock, so an ADD in flight is waited for, then seen)."""
        with self.locks.hold(key):
            # present, not read: an unreadable record still holds its address.
            if any(self.records.present(n, *key) for n in self.records.networks()):
                return False
            return self.ipam.release(*key) is not None

    # -- STATUS

    def status(self) -> None:
        if not self.settings.ready():
            raise CniError(
                Code.NOT_AVAILABLE,
                "the flannelpy agent is not ready: it has no subnet lease or its data plane"
                " is not programmed yet",
            )

    # -- request checks

    @contextmanager
    def _pod_netns(
        self, req: Request, netns_fd: int | None, required: bool = True
    ) -> Iterator[int | None]:
        """CNI_NETNS as an fd verified to be a network namespace: the one passed, else
        the path opened here (and closed after). Refusals are code 4, "invalid
        necessary environment variables" (CNI spec, "Error codes"): CNI_NETNS names
        no network namespace. Not ``required`` (DEL): None instead of an error."""
        opened = None  # the fd opened here from the path, closed on the way out
        if netns_fd is None and req.netns:
            try:
                opened = self.open_netns(req.netns)
            except OSError as e:
                if not required:
                    yield None
                    return
                raise CniError(
                    Code.INVALID_ENVIRONMENT,
                    f"CNI_NETNS {req.netns} cannot be opened ({e.strerror}); pass the path of"
                    " the container's network namespace",
                ) from e
        fd = netns_fd if netns_fd is not None else opened
        try:
            if fd is not None:
                try:
                    self.require_netns(fd)
                except NotANetns as e:
                    if required:
                        why = _not_a_netns(req, e, opened)
                        raise CniError(Code.INVALID_ENVIRONMENT, why) from e
                    fd = None
            yield fd  # None: DEL without a usable CNI_NETNS (parse_request demands it elsewhere)
        finally:
            if opened is not None:
                os.close(opened)

    def _bridge(self, req: Request) -> str:
        name = req.config.get("bridge", self.settings.bridge)
        if not isinstance(name, str) or not _BRIDGE_NAME.match(name) or len(name.encode()) > 15:
            raise CniError(
                Code.INVALID_NETWORK_CONFIG,
                f'"bridge" must be an interface name of 1 to 15 bytes, got {name!r}',
            )
        return name

    @staticmethod
    def _flag(req: Request, key: str, default: bool) -> bool:
        value = req.config.get(key, default)
        if not isinstance(value, bool):
            raise CniError(
                Code.INVALID_NETWORK_CONFIG, f"{key} must be true or false, got {json.dumps(value)}"
            )
        return value

    def _destinations(self, req: Request, families: Sequence[int]) -> tuple[IPNetwork, ...]:
        """What the pod routes via its gateways, for each of ``families``: everything, or
        the cluster's networks of that family."""
        if self._flag(req, "isDefaultGateway", self.settings.default_gateway):
            return tuple(default_route(f) for f in families)
        networks = tuple(self.settings.cluster_networks())
        missing = [f for f in families if not any(n.version == f for n in networks)]
        if missing:
            raise CniError(
                Code.TRY_AGAIN_LATER,
                f"the flannelpy agent does not know the IPv{missing[0]} cluster network yet;"
                " try again later",
            )
        return tuple(n for n in networks if n.version in families)

    @staticmethod
    def _seconds(req: Request, key: str, default: float) -> float:
        value = req.config.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            raise CniError(
                Code.INVALID_NETWORK_CONFIG,
                f"{key} must be a number of seconds >= 0, got {json.dumps(value)}",
            )
        return float(value)

    def _mtu(self) -> int:
        mtu = self.settings.mtu_provider()
        if not mtu:
            raise CniError(
                Code.TRY_AGAIN_LATER,
                "the flannelpy agent does not know the overlay MTU yet; try again later",
            )
        return mtu


# --- helpers -----------------------------------------------------------------------


@dataclass(frozen=True)
class _Plumbing:
    """The pod's plumbing options, read from the conflist once per ADD."""

    hairpin: bool
    destinations: tuple[IPNetwork, ...]  # routed via the gateway of their family


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


def _owner(record: Record) -> str:
    """The alias ADD gave the record's host veth: a delete spares any other pod's."""
    return veth_owner(record.netns, record.container_id, record.ifname)


@contextmanager
def _cni_errors() -> Iterator[None]:
    """Turn our failures into spec errors; anything unexpected passes through (handle()
    reports it as code 999 and logs the traceback)."""
    try:
        yield
    except CniError:
        raise
    except Exception as e:
        mapped = _as_cni_error(e)
        if mapped is None:
            raise
        raise mapped from e


def _as_cni_error(e: BaseException) -> CniError | None:
    if isinstance(e, IpamExhausted):
        if e.accounting:
            hint = "ipWaitSeconds in the network config lets ADD wait for a cooling address"
        else:  # nothing to wait for: no lease of this node takes new pods
            hint = (
                "the agent's log says why it holds no lease that takes new pods "
                "(e.g. every pool is drained or full: flannelpy pools list)"
            )
        return CniError(Code.NO_ADDRESS, str(e), hint)
    if isinstance(e, NetnsMissing | PodInterfaceExists):
        return CniError(Code.INVALID_ENVIRONMENT, str(e))
    if isinstance(e, ConfigError):
        return CniError(Code.INVALID_NETWORK_CONFIG, str(e))
    if isinstance(e, StoreError):
        return CniError(Code.IO_FAILURE, f"the node's IPAM state cannot be used: {e}")
    if isinstance(e, OSError):
        return CniError(Code.IO_FAILURE, f"the flannelpy agent cannot write its state: {e}")
    if isinstance(e, DataplaneError):
        return CniError(Code.INTERNAL, str(e))
    return None


def _valid_attachments(config: Mapping[str, Any]) -> set[Key]:
    raw = config.get(VALID_ATTACHMENTS)
    if not isinstance(raw, list) or not all(
        isinstance(a, dict)
        and isinstance(a.get("containerID"), str)
        and isinstance(a.get("ifname"), str)
        for a in raw
    ):
        raise CniError(
            Code.INVALID_NETWORK_CONFIG,
            f'GC needs "{VALID_ATTACHMENTS}": a list of {{"containerID", "ifname"}} objects',
        )
    return {(a["containerID"], a["ifname"]) for a in raw}


def _dns(config: Mapping[str, Any]) -> dict[str, Any]:
    dns = config.get("dns")
    return dict(dns) if isinstance(dns, dict) else {}


def _not_a_netns(req: Request, error: Exception, opened: int | None) -> str:
    if opened is None:  # the executable passed it
        return (
            f"CNI_NETNS {req.netns} is not a network namespace ({error}); pass the path of the"
            " container's network namespace"
        )
    # An executable that predates passing the fd, in a mount namespace the agent does
    # not share: the path shows the agent something else.
    return (
        f"CNI_NETNS {req.netns} is not a network namespace where the flannelpy agent looks"
        f" ({error}); install the current flannelpy-cni on this node (it passes the namespace"
        " itself) or mount the runtime's namespace directory into the agent"
    )
