"""Files other processes read: written whole or not at all.

``atomic_write`` is the one way the agent writes a file that a reader (a CNI
runtime, an operator, the agent itself after SIGKILL) may open at any moment:
a uniquely named temp file in the same directory, fsync, rename over the old
one, fsync the directory so the rename survives a power cut. Unique temp names
matter: two writers sharing one temp name make the loser's rename fail.
"""

from __future__ import annotations

import contextlib
import errno
import os
import tempfile
from pathlib import Path


def atomic_write(
    path: str | os.PathLike[str],
    data: bytes | str,
    mode: int = 0o644,
    durable: bool = True,
    dir_mode: int = 0o777,
) -> None:
    """Replace ``path`` with ``data``. ``durable=False`` skips both fsyncs, for files that
    describe only the running process (a status file is rewritten every few seconds).
    A missing directory is created with ``dir_mode`` (less the umask), as ``os.makedirs``
    does: only the last component gets it."""
    target = Path(path)
    target.parent.mkdir(mode=dir_mode, parents=True, exist_ok=True)
    payload = data.encode() if isinstance(data, str) else data
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
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(target.parent)


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
