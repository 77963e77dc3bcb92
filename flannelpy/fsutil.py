"""Files other processes read: written whole or not at all.

``atomic_write`` is the one way the agent writes a file that a reader (a CNI
runtime, an operator, the agent itself after SIGKILL) may open at any moment:
a uniquely named temp file in the same directory, fsync, rename over the old
one, fsync the directory so the rename survives a power cut. Unique temp names
matter: two writers sharing one temp name make the loser's rename fail.

``GroupSync`` is the directory fsync shared by concurrent writers (group commit): a
writer that renamed under a lock leaves the lock first and then waits for one fsync
of the directory that began after its rename, which one thread runs for every writer
queued meanwhile. Each answer still waits until its own change is durable; a burst
of 100 writers pays a handful of directory fsyncs instead of 100 in a row.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path

_FAILURES_KEPT = 64  # a disk that fails this often fails the waiters' retries too


def atomic_write(
    path: str | os.PathLike[str],
    data: bytes | str,
    mode: int = 0o644,
    durable: bool = True,
    dir_mode: int = 0o777,
    sync_dir: bool = True,
) -> None:
    """Replace ``path`` with ``data``. ``durable=False`` skips both fsyncs, for files that
    describe only the running process (a status file is rewritten every few seconds).
    ``sync_dir=False`` skips only the directory's: the caller makes the rename durable
    itself, with the directory's :class:`GroupSync`, before it tells anyone.
    A missing directory is created with ``dir_mode`` (less the umask), as ``os.makedirs``
    does: only the last component gets it."""
    target = Path(path)
    payload = data.encode() if isinstance(data, str) else data
    tmp = write_temp(target, payload, mode, durable, dir_mode)
    try:
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable and sync_dir:
        fsync_dir(target.parent)


def rewrite(path: str | os.PathLike[str], data: str, mode: int = 0o644) -> None:
    """Replace ``path`` whole with ``data``, not durably (no fsync): a file that describes
    only the running process and is rewritten often (status.json, after every reconcile
    pass). The temp name is fixed per process, so the caller serialises its writes; the
    directory is created only when missing. Five system calls, where :func:`atomic_write`
    also makes a unique name and asks for the directory each time."""
    target = os.fspath(path)
    tmp = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.{os.getpid()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC
    try:
        fd = os.open(tmp, flags, mode)
    except FileNotFoundError:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd = os.open(tmp, flags, mode)
    try:
        view = memoryview(data.encode())
        while view:  # a short write is not an error from write(2); finish it
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    os.chmod(tmp, mode)  # as created, less the umask; the file's mode is ``mode``
    os.replace(tmp, target)


def write_temp(target: Path, payload: bytes, mode: int, durable: bool, dir_mode: int) -> str:
    """The first half of :func:`atomic_write`: ``payload`` in a uniquely named temp file
    beside ``target`` (fsync'd when ``durable``), whose name is returned for the caller
    to rename over ``target`` (or unlink). Nothing is left behind when it raises."""
    target.parent.mkdir(mode=dir_mode, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            view = memoryview(payload)
            while view:  # a short write is not an error from write(2); finish it
                view = view[f.write(view) :]
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.chmod(tmp, mode)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return tmp


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename or unlink in ``directory`` durable.

    A filesystem that cannot sync a directory says so with EINVAL (or ENOTSUP);
    there the rename is as durable as it gets, so that is not an error."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP):
            raise
    finally:
        os.close(fd)


class GroupCommit:
    """Changes made durable together (group commit): ``ticket()`` right after a change
    (under the caller's lock, if any), ``wait(ticket)`` after leaving that lock. It returns
    once a ``flush`` that began after the ticket was taken has completed. The first waiter
    runs it; waiters that arrive meanwhile queue behind it and the next one runs a single
    flush for all of them.

    A flush that takes its batch under a lock the ticket-takers hold returns the ticket
    count it took it at (``taken``, read under that lock): it covers those, not what was
    ticketed between its start and its snapshot. A flush that returns None covers what
    was ticketed when it began.

    A failed flush raises in the thread that ran it. With ``failures_cover`` false it
    covers nobody and the next waiter tries again (a directory fsync: retrying is
    harmless). With ``failures_cover`` true it fails every change it covered (an
    exception's ``covers`` attribute, else what was ticketed when it began), in every
    waiter: the flush has dropped those changes (a batch of writes whose caller went
    back to what is on disk), so no later flush may report them durable."""

    def __init__(self, flush: Callable[[], int | None], failures_cover: bool = False) -> None:
        self._flush = flush
        self._failures_cover = failures_cover
        self._cond = threading.Condition()
        self._taken = 0  # tickets handed out
        self._synced = 0  # every ticket up to this one is durable
        # Failed flushes: (tickets after, up to, why), the newest last; a few kept, as a
        # waiter reads its own once it wakes.
        self._failed: deque[tuple[int, int, BaseException]] = deque(maxlen=_FAILURES_KEPT)
        self._running = False
        self.flushes = 0  # flushes completed (tests, benches)

    def ticket(self) -> int:
        with self._cond:
            self._taken += 1
            return self._taken

    @property
    def taken(self) -> int:
        """Tickets handed out so far."""
        with self._cond:
            return self._taken

    def wait(self, ticket: int) -> None:
        with self._cond:
            while True:
                self._raise_if_failed(ticket)
                if self._synced >= ticket:
                    return
                if not self._running:
                    break
                self._cond.wait()
            self._running = True
            after, covers = self._synced, self._taken  # every change ticketed so far is made
        error: BaseException | None = None
        try:
            covers = self._flush() or covers
        except BaseException as e:
            error = e
            covers = getattr(e, "covers", None) or covers
            raise
        finally:
            with self._cond:
                self._running = False
                if error is None:
                    self._synced = max(self._synced, covers)
                    self.flushes += 1
                elif self._failures_cover:
                    self._failed.append((after, covers, error))
                    self._synced = max(self._synced, covers)  # settled: never flushed again
                self._cond.notify_all()

    def _raise_if_failed(self, ticket: int) -> None:
        for after, upto, why in self._failed:
            if after < ticket <= upto:
                raise why

    def sync(self) -> None:
        """Make every change made before this call durable."""
        self.wait(self.ticket())


class GroupSync(GroupCommit):
    """The fsync of one directory, shared by the threads that renamed or unlinked in it
    (a :class:`GroupCommit` whose flush is the directory's fsync; a failed one covers
    nobody: the next waiter tries again)."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = os.fspath(directory)
        super().__init__(self._fsync)

    @property
    def fsyncs(self) -> int:
        """Directory fsyncs run (tests, benches)."""
        return self.flushes

    def _fsync(self) -> None:
        fsync_dir(self.directory)
