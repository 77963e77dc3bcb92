"""IPAM state on disk: one JSON file per lease subnet, written atomically.

Layout of the state directory (mode 0700)::

    lock                  flock(2)ed for the duration of every operation
    cooldown.json         {"longest_cooldown_seconds": N}: the longest ipCooldownSeconds
                          any ADD asked for, so a restart does not end one early
    10.244.1.0_24.json    PoolAllocator.to_doc() of lease 10.244.1.0/24
    fc00-0-0-1--_64.json  the same of the IPv6 subnet fc00:0:0:1::/64 (":" written "-")
    .10.244.1.0_24.json.*.tmp   the next version while it is being written

A write goes to a uniquely named temp file, which is renamed over the real one
(``flannelpy.fsutil.atomic_write``): a reader (or an agent restarted after
SIGKILL) sees the old or the new version, never a mix. That is all a process crash needs. ``fsync``
(the file, then the directory) additionally makes the rename survive a power
loss; it costs about 0.5 ms per write on this kind of disk. The file's fsync runs under
the lock, before the rename; the directory's does not: every change takes a ticket
of the directory's ``GroupSync`` and ``commit`` waits for it once the caller has left
the lock, so concurrent requests share directory fsyncs (group commit) and each
answer still waits until its own change is durable.

Every read and write happens under the lock, and the store remembers the bytes
it last read or wrote per file, so a caller can tell cheaply whether another
process (a second agent on the same directory) changed a file since.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager
from ipaddress import IPv4Network, IPv6Network, ip_network
from typing import Any

from flannelpy.errors import StoreError
from flannelpy.fsutil import GroupSync, atomic_write

log = logging.getLogger("flannelpy.ipam")

LOCK_NAME = "lock"
COOLDOWN_NAME = "cooldown.json"
_POOL_FILE = re.compile(r"^(\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}|[0-9a-f-]{2,39})_(\d{1,3})\.json$")

IPNetwork = IPv4Network | IPv6Network


def pool_file_name(subnet: IPNetwork) -> str:
    # No ":" in file names: tools that copy state directories (tar, scp) treat it specially.
    return f"{str(subnet.network_address).replace(':', '-')}_{subnet.prefixlen}.json"


class IpamStore:
    """The IPAM state directory; use every method inside ``with store.locked():``, and
    after leaving it, ``commit`` what ``take_ticket`` returned (the directory's fsync)."""

    def __init__(self, directory: str | os.PathLike[str], fsync: bool = True) -> None:
        self.directory = os.fspath(directory)
        self.fsync = fsync
        try:
            os.makedirs(self.directory, mode=0o700, exist_ok=True)
            self._lock_fd: int | None = os.open(
                os.path.join(self.directory, LOCK_NAME),
                os.O_RDWR | os.O_CREAT | os.O_CLOEXEC,
                0o600,
            )
        except OSError as e:
            raise StoreError(
                f"cannot open the IPAM state directory {self.directory}: {e.strerror}; "
                "check that it is a writable directory"
            ) from e
        self._held = False
        self._group = GroupSync(self.directory)
        self._ticket: int | None = None  # the newest change not yet committed
        # Bytes last read or written per file (None: the file was absent).
        # A subnet missing here is unknown, so changed() reports True.
        self._seen: dict[IPNetwork, bytes | None] = {}
        self._paths: dict[IPNetwork, str] = {}

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the directory's exclusive lock: no other process reads or writes meanwhile."""
        if self._lock_fd is None:
            raise RuntimeError("the IPAM store is closed")
        # flock locks belong to the open file description, so two stores in one
        # process exclude each other as two processes do.
        fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        self._held = True
        try:
            yield
        finally:
            self._held = False
            fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    def path(self, subnet: IPNetwork) -> str:
        path = self._paths.get(subnet)
        if path is None:
            path = self._paths[subnet] = os.path.join(self.directory, pool_file_name(subnet))
        return path

    def subnets(self) -> list[IPNetwork]:
        """The subnets that have a state file, in address order."""
        self._require_lock()
        found = []
        for name in os.listdir(self.directory):
            match = _POOL_FILE.match(name)
            if match:
                try:
                    found.append(ip_network(f"{match[1].replace('-', ':')}/{match[2]}"))
                except ValueError:
                    continue  # not one of ours (a host address with a prefix, say)
        return sorted(found, key=lambda n: (n.version, n))

    def load(self, subnet: IPNetwork) -> dict[str, Any] | None:
        """The subnet's state document, or None when it has no file yet."""
        data = self._read(subnet)
        self._seen[subnet] = data
        if data is None:
            return None
        try:
            doc = json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise self.corrupt(subnet, f"not JSON ({e})") from e
        if not isinstance(doc, dict):
            raise self.corrupt(subnet, "not a JSON object")
        return doc

    def changed(self, subnet: IPNetwork) -> bool:
        """Whether the file differs from what this store last read or wrote."""
        if subnet not in self._seen:
            return True
        return self._read(subnet) != self._seen[subnet]

    def save(self, subnet: IPNetwork, data: bytes) -> None:
        """Replace the subnet's file with ``data`` (a JSON document) atomically,
        and durably when ``fsync``."""
        self._require_lock()
        path = self.path(subnet)
        try:
            atomic_write(path, data, mode=0o600, durable=self.fsync, dir_mode=0o700, sync_dir=False)
        except OSError as e:
            # Whether the rename happened is unknown: force a re-read next time.
            self._seen.pop(subnet, None)
            raise StoreError(
                f"cannot write IPAM state file {path}: {e.strerror}; "
                "check free space and permissions of the state directory"
            ) from e
        self._changed()
        self._seen[subnet] = data

    def delete(self, subnet: IPNetwork) -> None:
        """Remove the subnet's file (a missing one is success), durably when ``fsync``."""
        self._require_lock()
        path = self.path(subnet)
        try:
            os.unlink(path)
            self._changed()
        except FileNotFoundError:
            pass
        except OSError as e:
            # Whether the unlink happened is unknown: force a re-read next time.
            self._seen.pop(subnet, None)
            raise StoreError(
                f"cannot delete IPAM state file {path}: {e.strerror}; "
                "check the state directory's permissions"
            ) from e
        self._seen[subnet] = None

    def load_longest_cooldown(self) -> float | None:
        """The persisted longest cooldown in seconds; None when absent or unusable (logged)."""
        self._require_lock()
        path = os.path.join(self.directory, COOLDOWN_NAME)
        try:
            with open(path, "rb") as f:
                value = json.loads(f.read())["longest_cooldown_seconds"]
        except FileNotFoundError:
            return None
        except (OSError, ValueError, KeyError, TypeError) as e:
            log.warning("ignoring unreadable IPAM cooldown file path=%s reason=%r", path, e)
            return None
        if isinstance(value, bool) or not isinstance(value, int | float) or not value >= 0:
            log.warning("ignoring invalid IPAM cooldown file path=%s value=%r", path, value)
            return None
        return float(value)

    def save_longest_cooldown(self, seconds: float) -> None:
        self._require_lock()
        path = os.path.join(self.directory, COOLDOWN_NAME)
        data = json.dumps({"longest_cooldown_seconds": seconds}).encode()
        try:
            atomic_write(path, data, mode=0o600, durable=self.fsync, dir_mode=0o700, sync_dir=False)
        except OSError as e:
            raise StoreError(
                f"cannot write IPAM state file {path}: {e.strerror}; "
                "check free space and permissions of the state directory"
            ) from e
        self._changed()

    def _changed(self) -> None:
        """A rename or unlink just happened: ``commit`` must make it durable."""
        if self.fsync:
            self._ticket = self._group.ticket()

    def take_ticket(self) -> int | None:
        """Under the lock, at the end of an operation: what ``commit`` must wait for (None:
        nothing to make durable)."""
        ticket, self._ticket = self._ticket, None
        return ticket

    def commit(self, ticket: int) -> None:
        """After leaving the lock: return once the directory's renames and unlinks up to
        ``ticket`` are durable (one fsync of the directory, shared with concurrent
        callers)."""
        try:
            self._group.wait(ticket)
        except OSError as e:
            raise StoreError(
                f"cannot make the IPAM state directory {self.directory} durable: "
                f"{e.strerror}; check the disk"
            ) from e

    def corrupt(self, subnet: IPNetwork, why: str) -> StoreError:
        """The error for a state file that cannot be used as it is."""
        return StoreError(
            f"IPAM state file {self.path(subnet)} is invalid: {why}; restore it from a backup "
            "or move it away once no pod uses addresses of that lease"
        )

    def _read(self, subnet: IPNetwork) -> bytes | None:
        self._require_lock()
        try:
            with open(self.path(subnet), "rb") as f:
                return f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            raise StoreError(
                f"cannot read IPAM state file {self.path(subnet)}: {e.strerror}; "
                "check the state directory's permissions"
            ) from e

    def _require_lock(self) -> None:
        if not self._held:
            raise RuntimeError("IpamStore used outside 'with store.locked()'")
