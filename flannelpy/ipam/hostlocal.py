"""The reference ``host-local`` IPAM plugin's data dir: read on take-over, written on hand-over.

A node that ran the upstream flanneld gave its pods addresses through the flannel
CNI plugin's delegate, ``bridge`` + ``host-local``. host-local keeps one file per
address under ``<dataDir>/<network name>/`` (default ``/var/lib/cni/networks/cbr0``):
the file is named by the IP and holds ``<container id>\\r\\n<ifname>`` (a bare
container id in releases before 0.8), beside ``last_reserved_ip.<range>`` and
``lock``. Our IPAM holds those addresses for their pods (``NodeIpam.hold_foreign``)
so it never hands one out twice; and before flanneld takes a node back, our live
allocations are written in the same format (``write_allocations``) so host-local
does not hand out ours.

Parsing and rendering are pure; the two file functions are the thin I/O.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address

from flannelpy.fsutil import atomic_write

log = logging.getLogger("flannelpy.ipam")

DEFAULT_DIR = "/var/lib/cni/networks/cbr0"  # host-local's default dataDir, Flannel's network
LINE_BREAK = "\r\n"  # host-local's separator between container id and ifname
LAST_RESERVED = "last_reserved_ip.0"  # the round-robin cursor of the first (only) range
DEFAULT_IFNAME = "eth0"  # what a pre-0.8 file (container id alone) was made for


@dataclass(frozen=True)
class HostLocalEntry:
    """One address host-local handed out: to the pod interface (container_id, ifname)."""

    ip: IPv4Address | IPv6Address  # a dual-stack node's host-local holds both families
    container_id: str
    ifname: str


def parse_entry(name: str, content: str) -> HostLocalEntry | None:
    """The entry of the file ``name`` holding ``content``; None for host-local's other files
    (``lock``, ``last_reserved_ip.*``) and empty files."""
    try:
        ip = ip_address(name)
    except ValueError:
        return None
    lines = [line.strip() for line in content.strip().splitlines()]
    if not lines or not lines[0]:
        return None
    ifname = lines[1] if len(lines) > 1 and lines[1] else DEFAULT_IFNAME
    return HostLocalEntry(ip, lines[0], ifname)


def within(
    entries: Iterable[HostLocalEntry], subnets: Sequence[IPv4Network | IPv6Network]
) -> list[HostLocalEntry]:
    """The entries whose address lies in one of ``subnets``, by family, then address."""
    return sorted(
        (e for e in entries if any(e.ip in s for s in subnets)),
        key=lambda e: (e.ip.version, int(e.ip)),
    )


def render(entries: Iterable[HostLocalEntry]) -> dict[str, str]:
    """File name -> content, as host-local writes them."""
    return {str(e.ip): f"{e.container_id}{LINE_BREAK}{e.ifname}" for e in entries}


def read_dir(directory: str) -> list[HostLocalEntry]:
    """Every entry (both families) in host-local's network dir; [] when it does not exist."""
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    entries = []
    for name in names:
        try:
            with open(
                os.path.join(directory, name), encoding="utf-8", errors="replace", newline=""
            ) as f:
                entry = parse_entry(name, f.read())
        except (IsADirectoryError, FileNotFoundError):  # removed by a concurrent DEL
            continue
        if entry is not None:
            entries.append(entry)
    return entries


def remove_entry(directory: str, entry: HostLocalEntry) -> None:
    """Forget ``entry`` in host-local's dir, as its DEL would (only if it still names that
    pod: host-local may have handed the address out again meanwhile)."""
    path = os.path.join(directory, str(entry.ip))
    try:
        with open(path, encoding="utf-8", errors="replace", newline="") as f:
            current = parse_entry(str(entry.ip), f.read())
        if current == entry:
            os.unlink(path)
    except FileNotFoundError:
        pass


def write_allocations(
    directory: str, entries: Iterable[HostLocalEntry], last: IPv4Address | None = None
) -> int:
    """Write ``entries`` into host-local's dir (those it lacks); with ``last``, its
    round-robin cursor too. Returns how many files were written."""
    os.makedirs(directory, mode=0o755, exist_ok=True)
    written = 0
    for name, content in render(entries).items():
        path = os.path.join(directory, name)
        if os.path.exists(path):
            continue
        atomic_write(path, content, durable=True)
        written += 1
    if last is not None:
        atomic_write(os.path.join(directory, LAST_RESERVED), str(last), durable=True)
    return written
