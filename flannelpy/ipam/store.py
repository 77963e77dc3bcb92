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
loss; it costs about 0.5 ms per write on this kind of disk.

Writes are group-committed: ``save`` only records the pool's new bytes and takes a
ticket; ``commit(ticket)``, called once the caller has left its locks, returns when a
batch holding that change is written, fsync'd, renamed and its directory fsync'd. The
first committer writes the batch for everyone queued (one write per changed pool, however
many requests changed it); the others wait for it, and their answers still wait until
their own change is durable. While a change is pending, the file lock stays held (the
batch's writer releases it): another process on the directory never reads a pool older
than what this one has handed out, and this one need not re-read its pools meanwhile. A
batch that fails is dropped whole: the pools are re-read from disk (``reload``) and every
change it held fails in its own request.

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
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from ipaddress import IPv4Network, IPv6Network, ip_network
from typing import Any

from flannelpy import fsutil
from flannelpy.errors import StoreError
from flannelpy.fsutil import GroupCommit, atomic_write

log = logging.getLogger("flannelpy.ipam")

LOCK_NAME = "lock"
COOLDOWN_NAME = "cooldown.json"
_POOL_FILE = re.compile(r"^(\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3}|[0-9a-f-]{2,39})_(\d{1,3})\.json$")

IPNetwork = IPv4Network | IPv6Network


class BatchLost(StoreError):
    """A batch of writes failed: every change it held (tickets up to ``covers``) failed
    with it, in each request that made one."""

    def __init__(self, message: str, covers: int) -> None:
        super().__init__(message)
        self.covers = covers


def pool_file_name(subnet: IPNetwork) -> str:
    # No ":" in file names: tools that copy state directories (tar, scp) treat it specially.
    return f"{str(subnet.network_address).replace(':', '-')}_{subnet.prefixlen}.json"


class IpamStore:
    """The IPAM state directory; use every method inside ``with store.locked():`` (holding
    ``lock``, the caller's lock for one operation), and after leaving both, ``commit`` what
    ``take_ticket`` returned. ``reload(subnets)`` is called with both held when a batch
    holding changes of those pools could not be written: memory must go back to disk."""

    def __init__(
        self,
        directory: str | os.PathLike[str],
        fsync: bool = True,
        lock: threading.Lock | None = None,
        reload: Callable[[list[IPNetwork]], None] | None = None,
    ) -> None:
        self.directory = os.fspath(directory)
        self.fsync = fsync
        self._op_lock = lock if lock is not None else threading.Lock()
        self._reload = reload
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
        self._kept = False  # the file lock stays held between operations: writes pending
        self._continuous = False  # this operation began with the file lock already held
        self._pending: dict[IPNetwork, bytes] = {}  # pools saved, not yet written
        self._group = GroupCommit(self._write_batch, failures_cover=True)
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
        self._continuous = self._kept
        if not self._kept:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
        self._held = True
        try:
            yield
        finally:
            self._held = False
            self._keep_or_unlock()

    def _keep_or_unlock(self) -> None:
        """Keep the file lock while writes are pending (their batch releases it)."""
        self._kept = bool(self._pending)
        if not self._kept and self._lock_fd is not None:
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
        """Whether the file differs from what this store last read or wrote. Not read
        while the file lock has been held since: nobody else can have written it."""
        if subnet not in self._seen:
            return True
        if self._continuous:
            return False
        return self._read(subnet) != self._seen[subnet]

    def save(self, subnet: IPNetwork, data: bytes) -> None:
        """Replace the subnet's file with ``data`` (a JSON document) in the next batch,
        atomically, and durably when ``fsync`` (see ``commit``)."""
        self._require_lock()
        self._pending[subnet] = data
        self._seen[subnet] = data
        self._ticket = self._group.ticket()  # written by a batch, with or without fsync

    def delete(self, subnet: IPNetwork) -> None:
        """Remove the subnet's file (a missing one is success), durably when ``fsync``."""
        self._require_lock()
        path = self.path(subnet)
        self._pending.pop(subnet, None)
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
        nothing to make durable). An operation that changed nothing still waits for the
        changes of others it saw pending: its answer (an exhaustion, an allocation found
        again) rests on them, so it must not come before they are written."""
        ticket, self._ticket = self._ticket, None
        if ticket is None and self._pending:
            ticket = self._group.taken
        return ticket

    def commit(self, ticket: int) -> None:
        """After leaving the locks: return once the changes up to ``ticket`` are written
        and durable (one batch, shared with concurrent callers). Raises StoreError, in
        every request it held, when their batch failed."""
        self._group.wait(ticket)

    def _write_batch(self) -> int:
        """One batch: every pending pool written (the operations' lock held, so nothing
        changes meanwhile), the file lock released, then the directory's fsync. Returns
        the tickets it covers (every change is ticketed under that lock)."""
        with self._op_lock:
            batch, self._pending = self._pending, {}
            covers = self._group.taken
            self._held = True
            try:
                for subnet, data in batch.items():
                    self._write(subnet, data)
            except StoreError as e:
                for subnet in batch:
                    self._seen.pop(subnet, None)  # whatever is on disk, read again
                if self._reload is not None:
                    self._reload(list(batch))
                raise BatchLost(str(e), covers) from e
            finally:
                self._held = False
                self._keep_or_unlock()
        if self.fsync:
            try:
                fsutil.fsync_dir(self.directory)
            except OSError as e:
                raise BatchLost(
                    f"cannot make the IPAM state directory {self.directory} durable: "
                    f"{e.strerror}; check the disk",
                    covers,
                ) from e
        return covers

    def _write(self, subnet: IPNetwork, data: bytes) -> None:
        path = self.path(subnet)
        try:
            atomic_write(path, data, mode=0o600, durable=self.fsync, dir_mode=0o700, sync_dir=False)
        except OSError as e:
            raise StoreError(
                f"cannot write IPAM state file {path}: {e.strerror}; "
                "check free space and permissions of the state directory"
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
