"""Shared pieces of the benchmarks: statistics, fake peer leases, netlink route events.

The pure helpers (percentiles, lease documents, route-message parsing, log
timestamps, tables) are unit-tested; the rest does I/O against a lab's etcd.
"""

from __future__ import annotations

import math
import os
import secrets
import socket
import struct
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from ipaddress import IPv4Address, IPv4Network

from flannelpy_lab import etcd as lab_etcd

from flannelpy.subnet.keys import subnet_to_key, subnets_prefix
from flannelpy.subnet.lease import LeaseAttrs

ETCD_TXN_OPS = 128  # etcd's default --max-txn-ops
FAKE_PUBLIC_BASE = IPv4Address("172.16.0.1")  # fake peers' underlay addresses (never sent to)

# --- statistics -------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} is outside 0-100")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def summary(values: Sequence[float]) -> dict[str, float]:
    """p50, p90, p99 and max of ``values``."""
    return {
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values),
    }


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def ratio(ours: float, reference: float) -> float:
    return ours / reference if reference > 0 else math.inf


# --- fake peers ---------------------------------------------------------------------


@dataclass(frozen=True)
class FakePeer:
    subnet: IPv4Network
    public_ip: IPv4Address
    vtep_mac: str

    @property
    def key(self) -> str:
        """The lease key below ``<prefix>/subnets/``."""
        return subnet_to_key(self.subnet)

    @property
    def vtep_ip(self) -> IPv4Address:
        return self.subnet.network_address

    def lease_json(self) -> str:
        return LeaseAttrs(
            public_ip=self.public_ip,
            backend_type="vxlan",
            backend_data={"VNI": 1, "VtepMAC": self.vtep_mac},
            node_name=f"fake-{self.public_ip}",
        ).to_json()


def fake_peer(index: int, subnet: IPv4Network) -> FakePeer:
    """Peer number ``index``: a distinct public IP and a locally administered VTEP MAC."""
    mac = [0x02, 0xFB, *index.to_bytes(4, "big")]
    return FakePeer(
        subnet=subnet,
        public_ip=FAKE_PUBLIC_BASE + index,
        vtep_mac=":".join(f"{o:02x}" for o in mac),
    )


def fake_peers(count: int, subnets: Iterable[IPv4Network], first_index: int = 0) -> list[FakePeer]:
    """``count`` fake peers on the first ``count`` of ``subnets``."""
    peers = []
    for i, subnet in enumerate(subnets):
        if i == count:
            break
        peers.append(fake_peer(first_index + i, subnet))
    if len(peers) < count:
        raise ValueError(f"only {len(peers)} subnets for {count} fake peers")
    return peers


def put_peers(endpoint: str, prefix: str, peers: Sequence[FakePeer]) -> None:
    """Write the leases without a TTL, ``ETCD_TXN_OPS`` per transaction."""
    base = subnets_prefix(prefix)
    with lab_etcd.client(endpoint, timeout=10.0) as c:
        for start in range(0, len(peers), ETCD_TXN_OPS):
            chunk = peers[start : start + ETCD_TXN_OPS]
            ops = [c.transactions.put(base + p.key, p.lease_json()) for p in chunk]
            c.transaction(compare=[], success=ops, failure=[])


# --- netlink route events -------------------------------------------------------------

RTMGRP_IPV4_ROUTE = 0x40
RTM_NEWROUTE, RTM_DELROUTE = 24, 25
RTA_DST = 1
_NLMSG = struct.Struct("=IHHII")
_RTMSG = struct.Struct("=BBBBBBBBI")
_RTA = struct.Struct("=HH")


@dataclass(frozen=True)
class RouteEvent:
    added: bool  # RTM_NEWROUTE, else RTM_DELROUTE
    dst: IPv4Network
    protocol: int


def parse_route_events(buf: bytes) -> list[RouteEvent]:
    """IPv4 route additions and deletions in one netlink datagram; other messages are skipped."""
    events = []
    offset = 0
    while offset + _NLMSG.size <= len(buf):
        length, msg_type, _, _, _ = _NLMSG.unpack_from(buf, offset)
        if length < _NLMSG.size or offset + length > len(buf):
            break
        body = offset + _NLMSG.size
        if msg_type in (RTM_NEWROUTE, RTM_DELROUTE) and length >= _NLMSG.size + _RTMSG.size:
            family, dst_len, _, _, _, protocol, _, _, _ = _RTMSG.unpack_from(buf, body)
            dst = _rta_dst(buf, body + _RTMSG.size, offset + length)
            if family == socket.AF_INET and dst is not None:
                events.append(
                    RouteEvent(msg_type == RTM_NEWROUTE, IPv4Network((dst, dst_len)), protocol)
                )
        offset += (length + 3) & ~3
    return events


def _rta_dst(buf: bytes, offset: int, end: int) -> IPv4Address | None:
    while offset + _RTA.size <= end:
        rta_len, rta_type = _RTA.unpack_from(buf, offset)
        if rta_len < _RTA.size:
            return None
        if rta_type == RTA_DST and rta_len >= _RTA.size + 4:
            return IPv4Address(buf[offset + _RTA.size : offset + _RTA.size + 4])
        offset += (rta_len + 3) & ~3
    return None  # a default route has no RTA_DST


def route_event_socket() -> socket.socket:
    """A netlink socket subscribed to IPv4 route changes, in the calling thread's namespace."""
    sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, 0)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    sock.bind((0, RTMGRP_IPV4_ROUTE))
    return sock


# --- logs and tables -----------------------------------------------------------------


def log_time(line: str) -> float | None:
    """The unix time of an agent log line (``2024-05-01T12:00:00.123 INFO ...``, local time)."""
    stamp = line.split(" ", 1)[0]
    try:
        return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%f").timestamp()
    except ValueError:
        return None


def first_line_with(lines: Iterable[str], needle: str) -> str | None:
    return next((line for line in lines if needle in line), None)


def log_field(line: str, name: str) -> str | None:
    """The value of ``name=value`` in a log line."""
    for token in line.split():
        key, sep, value = token.partition("=")
        if sep and key == name:
            return value
    return None


def table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> str:
    """A plain aligned text table; floats get 3 decimals."""
    cells = [list(header)] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in cells)


def _cell(value: object) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"  # not measured (e.g. no log line for it)
        return "inf" if math.isinf(value) else f"{value:.3f}"
    return str(value)


def say(line: str) -> None:
    """Progress, on stderr: stdout carries the results."""
    print(line, file=sys.stderr, flush=True)


def compile_agent() -> None:
    """Write the agent's bytecode, as ``pip install`` does for an installed package. A
    checkout run with ``PYTHONDONTWRITEBYTECODE`` set (or from a read-only tree) would
    otherwise compile every module from source at each start: about 0.4 s of CPU and
    2 MiB here that no installed agent pays."""
    import compileall

    import flannelpy

    compileall.compile_dir(os.path.dirname(flannelpy.__file__), quiet=1)


def lab_name(prefix: str) -> str:
    """A bench's lab name: ``$FLANNELPY_LAB_PREFIX`` (when set: people sharing a machine
    tell their labs apart by it) or ``prefix``, then random hex, 6 characters in all."""
    return (os.environ.get("FLANNELPY_LAB_PREFIX", prefix) + secrets.token_hex(3))[:6]


def load_average() -> str:
    """The 1, 5 and 15-minute load averages, as a report line gives them."""
    with open("/proc/loadavg") as f:
        return " / ".join(f.read().split()[:3])


def lacks_root(prog: str) -> bool:
    """True, having said so, when not root: the labs need network namespaces."""
    if os.geteuid() == 0:
        return False
    print(f"{prog} needs root (network namespaces)", file=sys.stderr)
    return True
