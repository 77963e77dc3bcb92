"""TCP retransmissions and drops by reason, from the kernel's own counters.

Read at scrape time, in the node's namespace and in every pod's:

- ``/proc/net/snmp`` (per namespace): ``Tcp: OutSegs RetransSegs``, ``Ip: InNoRoutes
  OutNoRoutes FragFails``, ``Icmp: OutDestUnreachs``;
- ``/proc/net/netstat`` (node): ``TcpExt: IPReversePathFilter``;
- ``/proc/net/stat/arp_cache`` (node): ``unresolved_discards``, packets dropped while
  their neighbour did not resolve. The kernel keeps neighbour statistics per table,
  not per namespace, shows this file only in the initial namespace (where an agent
  with ``hostNetwork`` runs) and leaves the counter out of netlink's NDTA_STATS (what
  ``ip -s ntable`` prints): in any other namespace the reason is absent;
- ``/proc/net/stat/nf_conntrack`` (node): ``insert_failed``. Without the conntrack
  module the file is absent and so is the reason (absent, not zero).

Drop reasons (``flannelpy_kernel_drops_total{scope, reason}``):

- ``no_route``: Ip InNoRoutes + OutNoRoutes, forwarded or local packets no route matched;
- ``frag_needed``: Ip FragFails, too big for the next hop with DF set (the kernel answers
  with ICMP "fragmentation needed");
- ``neighbour_unresolved``: unresolved_discards, dropped while waiting for ARP;
- ``rp_filter``: TcpExt IPReversePathFilter, refused by the reverse-path filter;
- ``conntrack_insert_failed``: packets whose conntrack entry could not be inserted.

ICMP destination-unreachable messages sent (``Icmp OutDestUnreachs``, the same count
as ``IcmpMsg OutType3``) are exported on their own: the kernel counts them by type,
not by code, so "fragmentation needed" (code 4) cannot be told from "port
unreachable" (code 3) there, and adding them to the drops would count a FragFails
twice.

Pods: at a successful ADD the agent has the pod namespace's descriptor (the CNI
executable opens ``CNI_NETNS`` in the runtime's mount namespace and passes it; the
DaemonSet mounts no netns directory, so the agent often cannot open that path
itself). It then opens the namespace's ``snmp`` table once, from a thread inside the
namespace, and keeps that table open, not the namespace descriptor: a ``pread`` at
offset 0 regenerates it, so a scrape costs one system call per pod and never enters
a namespace. The set of live pods is the CNI records; a table is closed at DEL, or
when its record goes (GC), and at most :data:`MAX_HELD` are held. Pods added before
the agent started (no descriptor) are opened through the path their record names
when it is visible (the lab, an agent on the host) and counted as unreadable
otherwise. An open ``/proc/net`` file holds its namespace: a table opened through a
path is closed as soon as the path is gone or names another namespace (one ``stat``
per scrape), so it never keeps a namespace alive past the runtime's own reference;
one adopted at ADD lives until DEL or GC, as the attachment itself does. Summed
totals are accumulated from deltas, so they stay monotonic when pods go; what a pod
counted after the last scrape is lost.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from flannelpy.dataplane.netns import run_in_netns, visiting_netns

log = logging.getLogger("flannelpy.observe.kernel_counters")

DROP_REASONS = (
    "no_route",
    "frag_needed",
    "neighbour_unresolved",
    "rp_filter",
    "conntrack_insert_failed",
)
TCP_SENT = "tcp_sent"
TCP_RETRANSMITTED = "tcp_retransmitted"
ICMP_UNREACHABLE_SENT = "icmp_unreachable_sent"
SCOPES = ("node", "pods")

PROC_NET = "/proc/thread-self/net"  # the calling thread's namespace (/proc/net is the process's)
READ_SIZE = 65536
RELIST_SECONDS = 30.0  # CNI records are re-read at least this often


# ---------------------------------------------------------------------------
# Pure parsing
# ---------------------------------------------------------------------------


def parse_proc_table(text: str) -> dict[str, dict[str, int]]:
    """``/proc/net/snmp`` or ``/proc/net/netstat``: pairs of lines ``Proto: names`` and
    ``Proto: values``. Returns {proto: {name: value}}; a malformed pair is skipped, so a
    kernel adding fields or a torn read never raises."""
    tables: dict[str, dict[str, int]] = {}
    header: tuple[str, list[str]] | None = None
    for line in text.splitlines():
        proto, sep, rest = line.partition(":")
        if not sep:
            header = None
            continue
        words = rest.split()
        if header is None or header[0] != proto:
            header = (proto, words)
            continue
        names = header[1]
        header = None
        if len(names) != len(words):
            continue
        values: dict[str, int] = {}
        for name, word in zip(names, words, strict=True):
            try:
                values[name] = int(word)
            except ValueError:
                continue
        tables.setdefault(proto, {}).update(values)
    return tables


def parse_stat_table(text: str) -> dict[str, int]:
    """``/proc/net/stat/<table>``: a header of names, then one line of hexadecimal values
    per CPU; returns every column summed over the CPUs (``entries`` is a global gauge
    repeated per line and is left out). Lines of the wrong width are skipped."""
    lines = text.split("\n")
    names = lines[0].split() if lines else []
    totals = dict.fromkeys(names, 0)
    for line in lines[1:]:
        words = line.split()
        if len(words) != len(names):
            continue
        try:
            values = [int(w, 16) for w in words]
        except ValueError:
            continue
        for name, value in zip(names, values, strict=True):
            totals[name] += value
    totals.pop("entries", None)
    return totals


def _get(tables: Mapping[str, Mapping[str, int]], proto: str, name: str) -> int | None:
    return tables.get(proto, {}).get(name)


# The fields of a pod's snmp table, by the name of this module: (proto, field, key).
_POD_FIELDS = (
    ("Tcp", "OutSegs", TCP_SENT),
    ("Tcp", "RetransSegs", TCP_RETRANSMITTED),
    ("Ip", "FragFails", "frag_needed"),
    ("Ip", "InNoRoutes", "no_route"),
    ("Ip", "OutNoRoutes", "no_route"),
    ("Icmp", "OutDestUnreachs", ICMP_UNREACHABLE_SENT),
)
# header line -> (width, [(column, key)]): a kernel's headers never change, so a pod's
# table is read by position after the first (the scrape-time cost that grows with pods).
_COLUMNS: dict[str, tuple[int, list[tuple[int, str]]]] = {}


def _columns(header: str) -> tuple[int, list[tuple[int, str]]]:
    found = _COLUMNS.get(header)
    if found is None:
        words = header.split()
        proto = words[0].rstrip(":") if words else ""
        found = (
            len(words),
            [(words.index(f), key) for p, f, key in _POD_FIELDS if p == proto and f in words],
        )
        if len(_COLUMNS) < 64:  # bounded: a kernel has a handful of distinct headers
            _COLUMNS[header] = found
    return found


def pod_counters(snmp: str) -> dict[str, int]:
    """The same keys as :func:`namespace_counters` of an snmp table (without netstat),
    read by column position: what every scrape does for every pod."""
    out: dict[str, int] = {}
    lines = snmp.split("\n")
    for header, values in zip(lines[::2], lines[1::2], strict=False):  # snmp is pairs of lines
        width, columns = _columns(header)
        if not columns:
            continue
        words = values.split()
        if len(words) != width or words[0] != header[: len(words[0])]:
            continue  # torn, or out of step: skip rather than misread
        for col, key in columns:
            try:
                out[key] = out.get(key, 0) + int(words[col])
            except ValueError:
                continue
    return out or namespace_counters(snmp)  # out of step: the line-by-line parser


def namespace_counters(snmp: str, netstat: str | None = None) -> dict[str, int]:
    """The counters one namespace's ``snmp`` (and ``netstat``) tables give, by the names
    of this module (TCP_SENT, the DROP_REASONS, ...); a field the kernel lacks is absent."""
    t = parse_proc_table(snmp)
    out: dict[str, int] = {}
    for key, proto, name in (
        (TCP_SENT, "Tcp", "OutSegs"),
        (TCP_RETRANSMITTED, "Tcp", "RetransSegs"),
        ("frag_needed", "Ip", "FragFails"),
        (ICMP_UNREACHABLE_SENT, "Icmp", "OutDestUnreachs"),
    ):
        value = _get(t, proto, name)
        if value is not None:
            out[key] = value
    routes = [_get(t, "Ip", n) for n in ("InNoRoutes", "OutNoRoutes")]
    if any(v is not None for v in routes):
        out["no_route"] = sum(v for v in routes if v is not None)
    if netstat is not None:
        rpf = _get(parse_proc_table(netstat), "TcpExt", "IPReversePathFilter")
        if rpf is not None:
            out["rp_filter"] = rpf
    return out


def node_counters(
    snmp: str, netstat: str | None, arp_cache: str | None, conntrack: str | None
) -> dict[str, int]:
    """Everything the node namespace gives: its snmp/netstat counters, the neighbour
    table's unresolved discards and conntrack's insert failures (each None: absent)."""
    out = namespace_counters(snmp, netstat)
    if arp_cache is not None:
        value = parse_stat_table(arp_cache).get("unresolved_discards")
        if value is not None:
            out["neighbour_unresolved"] = value
    if conntrack is not None:
        value = parse_stat_table(conntrack).get("insert_failed")
        if value is not None:
            out["conntrack_insert_failed"] = value
    return out


class DeltaAccumulator:
    """Totals over sources (pods) that come and go, monotonic whatever they do.

    Each ``update`` gets every live source's current counters. A source seen for the
    first time adds all it counted (a new namespace starts at zero); a known one adds
    its increase; one whose counter went down (a namespace replaced under the same
    key) adds its new value; one no longer present is forgotten and its counts stay in
    the totals. A name appears in the totals once some source reported it.
    """

    def __init__(self) -> None:
        self._last: dict[str, dict[str, int]] = {}
        self._totals: dict[str, int] = {}

    def update(self, readings: Mapping[str, Mapping[str, int]]) -> dict[str, int]:
        for source, values in readings.items():
            last = self._last.get(source, {})
            for name, value in values.items():
                before = last.get(name)
                delta = value if before is None or value < before else value - before
                self._totals[name] = self._totals.get(name, 0) + delta
            self._last[source] = dict(values)
        for gone in self._last.keys() - readings.keys():
            del self._last[gone]
        return dict(self._totals)

    @property
    def sources(self) -> int:
        return len(self._last)


# ---------------------------------------------------------------------------
# Reading the kernel
# ---------------------------------------------------------------------------


def _read_fd(fd: int) -> str:
    return os.pread(fd, READ_SIZE, 0).decode("ascii", "replace")


def _read_file(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(READ_SIZE).decode("ascii", "replace")
    except FileNotFoundError:
        return None


def read_node(proc_net: str = "/proc/net") -> dict[str, int]:
    """The node namespace's counters (the agent's process runs there)."""
    snmp = _read_file(os.path.join(proc_net, "snmp"))
    if snmp is None:
        raise OSError(f"{proc_net}/snmp is missing; mount /proc")
    return node_counters(
        snmp,
        _read_file(os.path.join(proc_net, "netstat")),
        _read_file(os.path.join(proc_net, "stat", "arp_cache")),
        _read_file(os.path.join(proc_net, "stat", "nf_conntrack")),
    )


def _open_snmp() -> int:
    return os.open(os.path.join(PROC_NET, "snmp"), os.O_RDONLY | os.O_CLOEXEC)


def open_snmp_in(netns: str | int) -> int:
    """A descriptor of ``snmp`` of the namespace at a path or an open descriptor, opened
    from inside it: a descriptor is visited by the calling thread (an ADD's, after its
    reply), a path from a thread started for it."""
    if isinstance(netns, int):
        with visiting_netns(netns):
            return _open_snmp()
    return run_in_netns(netns, _open_snmp)


@dataclass
class _Open:
    identity: tuple[int, int]  # (st_dev, st_ino) of the namespace
    fd: int
    adopted: bool  # opened through the descriptor ADD passed, not through the path


MAX_HELD = 1024  # pod namespaces whose snmp table is kept open (far above pods per node)


def attachment_key(env: Mapping[str, str], stdin: bytes) -> str | None:
    """The CNI record key (``network/container_id/ifname``) of a request; None if the
    request does not name one (a malformed config is the handler's to refuse)."""
    try:
        network = json.loads(stdin).get("name")
    except (ValueError, AttributeError):
        return None
    cid, ifname = env.get("CNI_CONTAINERID", ""), env.get("CNI_IFNAME", "")
    if not (isinstance(network, str) and network and cid and ifname):
        return None
    return f"{network}/{cid}/{ifname}"


PodLister = Callable[[], Iterable[tuple[str, str]]]  # (attachment key, netns path)


class PodCounters:
    """Counters of every pod namespace, summed: ``read()`` once per scrape.

    ``pods`` lists the live attachments as (key, netns path). A namespace that cannot
    be opened (its path gone, another mount namespace) is skipped and counted in
    ``unreadable``; it is tried again at the next scrape.
    """

    def __init__(
        self,
        pods: PodLister,
        open_snmp: Callable[[str | int], int] = open_snmp_in,
        read_fd: Callable[[int], str] = _read_fd,
    ) -> None:
        self._pods = pods
        self._open_snmp = open_snmp
        self._read_fd = read_fd
        self._open: dict[str, _Open] = {}
        self._acc = DeltaAccumulator()
        self._lock = threading.Lock()  # two scrapes at once must not share descriptors
        self.read_namespaces = 0
        self.unreadable = 0

    def read(self) -> dict[str, int]:
        with self._lock:
            readings: dict[str, dict[str, int]] = {}
            unreadable = 0
            wanted = dict(self._pods())
            for key in self._open.keys() - wanted.keys():
                self._close(key)
            for key, path in wanted.items():
                text = self._read_pod(key, path)
                if text is None:
                    unreadable += 1
                else:
                    readings[key] = pod_counters(text)
            self.read_namespaces, self.unreadable = len(readings), unreadable
            return self._acc.update(readings)

    def adopt(self, key: str, netns_fd: int) -> None:
        """A successful ADD with the pod namespace's descriptor: open its snmp table through
        it now, since the agent may not see the runtime's namespace path (the DaemonSet
        mounts none). Kept until the attachment's record goes (DEL, GC)."""
        try:
            st = os.fstat(netns_fd)
            fd = self._open_snmp(netns_fd)
        except Exception as e:  # counters must never fail a CNI request
            log.debug("pod counters not opened key=%s error=%s", key, e)
            return
        with self._lock:
            self._close(key)
            if len(self._open) >= MAX_HELD:
                os.close(fd)
                return
            self._open[key] = _Open((st.st_dev, st.st_ino), fd, adopted=True)

    def release(self, key: str) -> None:
        """DEL: close the attachment's table now rather than at the next scrape."""
        with self._lock:
            self._close(key)

    def _read_pod(self, key: str, path: str) -> str | None:
        held = self._open.get(key)
        try:
            st = os.stat(path)
            identity: tuple[int, int] | None = (st.st_dev, st.st_ino)
        except OSError:
            identity = None
        if identity is None:
            # The path is gone (the runtime removed the namespace: never hold it alive),
            # or was never visible here: then only a descriptor adopted at ADD reads.
            if held is None or not held.adopted:
                self._close(key)
                return None
        elif held is not None and held.identity != identity:
            self._close(key)  # another namespace now under that path
            held = None
        try:
            if held is None:
                if identity is None or len(self._open) >= MAX_HELD:
                    return None
                held = _Open(identity, self._open_snmp(path), adopted=False)
                self._open[key] = held
            return self._read_fd(held.fd)
        except Exception as e:  # one pod's namespace must not fail the scrape
            log.debug("pod counters unreadable key=%s netns=%s error=%s", key, path, e)
            self._close(key)
            return None

    def _close(self, key: str) -> None:
        held = self._open.pop(key, None)
        if held is not None:
            with contextlib.suppress(OSError):
                os.close(held.fd)

    def close(self) -> None:
        with self._lock:
            for key in list(self._open):
                self._close(key)


@dataclass(frozen=True)
class KernelReading:
    """One scrape's totals: the node's own counters and the pods' summed."""

    node: Mapping[str, int]
    pods: Mapping[str, int]
    pod_namespaces: int  # pod namespaces read this scrape
    pod_namespaces_unreadable: int


class KernelCounters:
    """The scrape-time provider: the node namespace and the pods (``PodCounters``)."""

    def __init__(
        self, pods: PodCounters | None, read_node: Callable[[], Mapping[str, int]] = read_node
    ) -> None:
        self._pods = pods
        self._read_node = read_node
        self._node = DeltaAccumulator()
        self._lock = threading.Lock()

    def on_cni(
        self, env: Mapping[str, str], stdin: bytes, netns_fd: int | None, result: bytes = b""
    ) -> None:
        """A CNI request the agent answered with success: ADD adopts the namespace's
        descriptor, DEL releases it."""
        if self._pods is None:
            return
        key = attachment_key(env, stdin)
        command = env.get("CNI_COMMAND", "")
        if key is None:
            return
        if command == "ADD" and netns_fd is not None:
            self._pods.adopt(key, netns_fd)
        elif command == "DEL":
            self._pods.release(key)

    def __call__(self) -> KernelReading:
        with self._lock:
            node = self._node.update({"node": self._read_node()})
        if self._pods is None:
            return KernelReading(node, {}, 0, 0)
        pods = self._pods.read()
        return KernelReading(node, pods, self._pods.read_namespaces, self._pods.unreadable)


def record_lister(directory: str) -> PodLister:
    """(key, netns path) of every CNI record under ``directory`` (the agent's
    ``<state-dir>/cni``), re-read only when a network folder changes (an ADD or a DEL
    renames or unlinks a file there), so a scrape does not parse every record."""
    from flannelpy.cni.records import RecordStore

    store = RecordStore(directory)
    cache: dict[str, object] = {"stamp": None, "pods": [], "at": 0.0}

    def stamp() -> tuple[tuple[str, int], ...]:
        out = []
        for network in store.networks():
            try:
                out.append((network, os.stat(os.path.join(directory, network)).st_mtime_ns))
            except FileNotFoundError:
                continue
        return tuple(out)

    def pods() -> list[tuple[str, str]]:
        now, at = stamp(), time.monotonic()
        # Also now and then: two changes within the file system's timestamp granularity.
        if now != cache["stamp"] or at - float(cache["at"]) > RELIST_SECONDS:  # type: ignore[arg-type]
            cache["pods"] = [("/".join(r.key), r.netns) for r in store.list() if r.netns]
            cache["stamp"], cache["at"] = now, at
        listed: list[tuple[str, str]] = cache["pods"]  # type: ignore[assignment]
        return listed

    return pods


def kernel_families(reading: KernelReading | None = None) -> list[Metric]:
    """The exposition families of a reading (empty families: names only, for describe)."""
    retrans = {
        scope: CounterMetricFamily(
            f"flannelpy_{scope}_tcp_retransmitted_segments",
            f"TCP segments retransmitted by {_WHO[scope]} (Tcp RetransSegs).",
        )
        for scope in ("node", "pod")
    }
    sent = {
        scope: CounterMetricFamily(
            f"flannelpy_{scope}_tcp_sent_segments",
            f"TCP segments sent by {_WHO[scope]}, retransmissions included (Tcp OutSegs).",
        )
        for scope in ("node", "pod")
    }
    drops = CounterMetricFamily(
        "flannelpy_kernel_drops",
        "Packets the kernel dropped, by reason and scope (node: the node's namespace; "
        "pods: every pod namespace summed). A reason the kernel cannot report is absent.",
        labels=["scope", "reason"],
    )
    unreachable = CounterMetricFamily(
        "flannelpy_kernel_icmp_unreachable_sent",
        "ICMP destination-unreachable messages sent, every code (Icmp OutDestUnreachs), by scope.",
        labels=["scope"],
    )
    namespaces = GaugeMetricFamily(
        "flannelpy_pod_namespaces_counted",
        "Pod namespaces whose counters the last scrape read (readable=false: skipped, e.g. "
        "the agent cannot see the runtime's namespace path).",
        labels=["readable"],
    )
    if reading is not None:
        for scope, values in (("node", reading.node), ("pods", reading.pods)):
            short = "node" if scope == "node" else "pod"
            if TCP_RETRANSMITTED in values:
                retrans[short].add_metric([], values[TCP_RETRANSMITTED])
            if TCP_SENT in values:
                sent[short].add_metric([], values[TCP_SENT])
            for reason in DROP_REASONS:
                if reason in values:
                    drops.add_metric([scope, reason], values[reason])
            if ICMP_UNREACHABLE_SENT in values:
                unreachable.add_metric([scope], values[ICMP_UNREACHABLE_SENT])
        namespaces.add_metric(["true"], reading.pod_namespaces)
        namespaces.add_metric(["false"], reading.pod_namespaces_unreadable)
    return [
        retrans["node"],
        sent["node"],
        retrans["pod"],
        sent["pod"],
        drops,
        unreachable,
        namespaces,
    ]


_WHO = {"node": "the node's own namespace", "pod": "the node's pods, summed"}


class KernelCollector(Collector):
    """The kernel families, read when Prometheus scrapes (left out when ``read`` gives
    None: no provider, or it failed and its owner counted the failure)."""

    def __init__(self, read: Callable[[], KernelReading | None]) -> None:
        self._read = read

    def describe(self) -> Iterator[Metric]:
        yield from kernel_families()

    def collect(self) -> Iterator[Metric]:
        reading = self._read()
        if reading is not None:
            yield from kernel_families(reading)


def for_agent(state_dir: str) -> KernelCounters:
    """The agent's provider: the node and every pod its CNI records (``<state-dir>/cni``) name."""
    return KernelCounters(PodCounters(record_lister(os.path.join(state_dir, "cni"))))
