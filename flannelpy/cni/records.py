"""What each ADD did, on disk, so DEL never depends on the current config.

One JSON file per attachment: ``<dir>/<network>/<container_id>@<ifname>.json``.
A container ID cannot contain ``@`` (the spec's validation allows only
``[A-Za-z0-9_.-]``), so the name splits back unambiguously; the network name
and ``ifname`` are validated the same way before they get here, and checked
again below so no name can leave the directory.

Writes are atomic (temp file, fsync, ``os.replace``, fsync of the directory):
ADD returns only once its record is durable. The directory's fsync is shared by the
ADDs that wrote into it meanwhile (``fsutil.GroupSync``): a burst pays a few, not one
per pod. A record that cannot be read (bad
JSON, a disk error) is not absent: its pod may be alive, so ``present`` still
says True, the start-up GC keeps the address and reports the file
(``unreadable``); only a DEL for that key releases it. Deletes are not fsync'd: a record
that comes back after a power loss names a veth and an allocation that are
already gone, and DEL or the start-up GC removes it again harmlessly.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Interface, IPv6Address, IPv6Interface, ip_interface
from pathlib import Path
from typing import Any

from flannelpy.fsutil import GroupSync, write_temp

log = logging.getLogger(__name__)

_SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]*$")
SUFFIX = ".json"
FORMAT_VERSION = 1

IPAddress = IPv4Address | IPv6Address
IPInterface = IPv4Interface | IPv6Interface


@dataclass(frozen=True)
class Record:
    """One attachment: enough for DEL, CHECK, GC and an idempotent ADD."""

    network: str
    container_id: str
    ifname: str
    netns: str
    host_veth: str
    bridge: str
    # The pod's addresses with their lease's prefix, one per family, IPv4 first
    # (e.g. 10.244.1.5/24 and fc00:0:0:1::5/64), and each one's gateway.
    addresses: tuple[IPInterface, ...]
    gateways: tuple[IPAddress, ...]
    result: dict[str, Any]  # the ADD result as rendered for cniVersion 1.1.0
    created_at: float = field(default_factory=time.time)

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.network, self.container_id, self.ifname)

    @property
    def address(self) -> IPInterface:
        """The first family's address."""
        return self.addresses[0]

    def to_doc(self) -> dict[str, Any]:
        # Field by field: dataclasses.asdict deep-copies the result, a cost on every ADD.
        return {
            "network": self.network,
            "container_id": self.container_id,
            "ifname": self.ifname,
            "netns": self.netns,
            "host_veth": self.host_veth,
            "bridge": self.bridge,
            # "address"/"gateway" (the first family's) are what records before dual stack
            # held; kept so an older agent still finds the pod's veth and address.
            "address": str(self.addresses[0]),
            "gateway": str(self.gateways[0]),
            "addresses": [str(a) for a in self.addresses],
            "gateways": [str(g) for g in self.gateways],
            "result": self.result,
            "created_at": self.created_at,
            "version": FORMAT_VERSION,
        }

    @staticmethod
    def from_doc(doc: Any) -> Record:
        """Raises ValueError naming what is missing or wrong."""
        if not isinstance(doc, dict):
            raise ValueError("a record must be a JSON object")
        wanted = ("network", "container_id", "ifname", "netns", "host_veth", "bridge")
        missing = [k for k in (*wanted, "address", "gateway", "result") if k not in doc]
        if missing:
            raise ValueError(f"record lacks {', '.join(missing)}")
        if not all(isinstance(doc[k], str) for k in wanted) or not isinstance(doc["result"], dict):
            raise ValueError("record fields have the wrong types")
        addresses = doc.get("addresses", [doc["address"]])
        gateways = doc.get("gateways", [doc["gateway"]])
        if (
            not isinstance(addresses, list)
            or not isinstance(gateways, list)
            or not addresses
            or len(addresses) != len(gateways)
            or not all(isinstance(a, str) for a in addresses + gateways)
        ):
            raise ValueError("record addresses and gateways must be equally long lists of text")
        return Record(
            network=doc["network"],
            container_id=doc["container_id"],
            ifname=doc["ifname"],
            netns=doc["netns"],
            host_veth=doc["host_veth"],
            bridge=doc["bridge"],
            addresses=tuple(ip_interface(a) for a in addresses),
            gateways=tuple(_address(g) for g in gateways),
            result=doc["result"],
            created_at=float(doc.get("created_at", 0.0)),
        )


@dataclass(frozen=True)
class Staged:
    """A record written to its temp file (``RecordStore.stage``), to be published."""

    network: str
    final: str
    temp: str


def _address(text: str) -> IPAddress:
    return ip_interface(text).ip  # a plain address is an interface with a full prefix


def _check_names(network: str, container_id: str, ifname: str) -> None:
    if not _SAFE.match(network) or not _SAFE.match(container_id):
        raise ValueError(f"unsafe network name or container ID: {network!r} {container_id!r}")
    if not ifname or "/" in ifname or ifname in (".", "..") or "\0" in ifname:
        raise ValueError(f"unsafe interface name {ifname!r}")


class RecordStore:
    """Records under ``directory`` (created 0700 when missing). Thread-safe: every
    write goes through its own temp file; callers serialise per attachment."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        os.makedirs(directory, mode=0o700, exist_ok=True)
        self._groups: dict[str, GroupSync] = {}  # network -> its folder's directory fsync
        self._groups_lock = threading.Lock()

    def path(self, network: str, container_id: str, ifname: str) -> str:
        _check_names(network, container_id, ifname)
        return os.path.join(self.directory, network, f"{container_id}@{ifname}{SUFFIX}")

    def write(self, record: Record) -> None:
        """Durably store ``record`` (replacing any earlier one for its key)."""
        self.publish(self.stage(record))

    def stage(self, record: Record) -> Staged:
        """The first half of ``write``: the record in a temp file beside its place, its
        content durable, not yet visible (ADD stages it while IPAM's change is being made
        durable, and publishes it after)."""
        final = self.path(*record.key)
        data = json.dumps(record.to_doc(), sort_keys=True).encode()
        temp = write_temp(Path(final), data, 0o600, durable=True, dir_mode=0o700)
        return Staged(record.network, final, temp)

    def publish(self, staged: Staged) -> None:
        """The second half of ``write``: the staged record renamed into place, durably."""
        try:
            os.replace(staged.temp, staged.final)
        except BaseException:
            self.discard(staged)
            raise
        with self._groups_lock:
            group = self._groups.get(staged.network)
            if group is None:
                group = self._groups[staged.network] = GroupSync(os.path.dirname(staged.final))
        group.sync()

    @staticmethod
    def discard(staged: Staged) -> None:
        """A staged record that will not be published."""
        _unlink(staged.temp)

    def read(self, network: str, container_id: str, ifname: str) -> Record | None:
        """The record, or None when there is none or it is unreadable (logged): use
        ``present`` before treating None as "no such attachment"."""
        return self._load(self.path(network, container_id, ifname))

    def present(self, network: str, container_id: str, ifname: str) -> bool:
        """Whether a record file exists for the key, readable or not."""
        return os.path.lexists(self.path(network, container_id, ifname))

    def unreadable(self) -> list[tuple[str, str]]:
        """(path, why) of every record file that exists but cannot be used."""
        found = []
        for network in self.networks():
            folder = os.path.join(self.directory, network)
            for entry in _entries(folder):
                path = os.path.join(folder, entry)
                try:
                    _parse(path)
                except FileNotFoundError:
                    continue
                except (OSError, ValueError) as e:
                    found.append((path, str(e)))
        return found

    def delete(self, network: str, container_id: str, ifname: str) -> bool:
        return _unlink(self.path(network, container_id, ifname))

    def networks(self) -> list[str]:
        try:
            return sorted(
                n
                for n in os.listdir(self.directory)
                if _SAFE.match(n) and os.path.isdir(os.path.join(self.directory, n))
            )
        except FileNotFoundError:
            return []

    def list(self, network: str | None = None) -> list[Record]:
        """Every readable record, of one network or of all."""
        names = [network] if network is not None else self.networks()
        return [r for n in names for r in self._in_network(n)]

    def _in_network(self, network: str) -> Iterator[Record]:
        folder = os.path.join(self.directory, network)
        for entry in _entries(folder):
            record = self._load(os.path.join(folder, entry))
            if record is not None:
                yield record

    def _load(self, path: str) -> Record | None:
        try:
            return _parse(path)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:  # JSONDecodeError is a ValueError
            log.warning("unreadable CNI record, kept path=%s reason=%s", path, e)
            return None


def _entries(folder: str) -> list[str]:
    try:
        entries = sorted(os.listdir(folder))
    except FileNotFoundError:
        return []
    return [e for e in entries if e.endswith(SUFFIX) and "@" in e]


def _parse(path: str) -> Record:
    with open(path, "rb") as f:
        data = f.read()
    try:
        return Record.from_doc(json.loads(data))
    except (TypeError, ValueError) as e:  # a torn or hand-edited file; bytes: UnicodeError
        raise ValueError(f"not a valid record ({e})") from e


def _unlink(path: str) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
