"""Run Python code inside a network namespace without forking.

A network namespace belongs to a thread, not to a process: a fresh thread that
calls ``setns(fd, CLONE_NEWNET)`` sees only that namespace's links, and every
socket it opens (netlink included) stays bound to that namespace for its
lifetime. The thread exits afterwards, so no thread of the caller is ever left
in a foreign namespace. Python 3.11 has no ``os.setns``, hence ctypes.

A namespace is named by a path (opened here) or by an open file descriptor:
the CNI executable opens ``CNI_NETNS`` in the runtime's mount namespace and
passes the descriptor, so the agent never needs to see the runtime's paths.
:func:`require_netns_fd` tells a network namespace from anything else.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import stat
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from flannelpy.errors import DataplaneError

CLONE_NEWNET = 0x40000000
NS_GET_NSTYPE = 0xB703  # _IO(0xb7, 0x3), linux/nsfs.h (Linux 4.11): the CLONE_NEW* of an nsfs fd
# The other kinds, to name what was passed instead.
_NS_KINDS = {
    0x00020000: "mount",
    0x02000000: "cgroup",
    0x04000000: "UTS",
    0x08000000: "IPC",
    0x10000000: "user",
    0x20000000: "PID",
    0x00000080: "time",
}
NETNS_RUN_DIR = "/run/netns"  # where `ip netns add` puts its bind mounts

T = TypeVar("T")

_libc: ctypes.CDLL | None = None


class NotANetns(DataplaneError):
    """A file descriptor that is not a network namespace (a file, another kind of namespace)."""


class CannotEnterNetns(DataplaneError):
    """setns() into a namespace failed (it is gone, or not a network namespace)."""


def require_netns_fd(fd: int) -> None:
    """Raise NotANetns unless ``fd`` refers to a network namespace; the message says what
    it is instead. NS_GET_NSTYPE answers ENOTTY (or EINVAL) for anything outside nsfs."""
    try:
        kind = fcntl.ioctl(fd, NS_GET_NSTYPE)
    except OSError as e:
        if e.errno in (errno.ENOTTY, errno.EINVAL):
            raise NotANetns(_what_is(fd)) from e
        raise NotANetns(f"it cannot be inspected ({e.strerror})") from e
    if kind != CLONE_NEWNET:
        raise NotANetns(f"it is a {_NS_KINDS.get(kind, hex(kind))} namespace")


def _what_is(fd: int) -> str:
    try:
        mode = os.fstat(fd).st_mode
    except OSError as e:
        return f"it cannot be inspected ({e.strerror})"
    if stat.S_ISREG(mode):
        # What an agent in another mount namespace sees of a runtime's bind mount.
        return "it is a regular file, not a namespace"
    if stat.S_ISDIR(mode):
        return "it is a directory, not a namespace"
    return "it is not a namespace"


def _setns(fd: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def netns_path(name_or_path: str) -> str:
    """``"ns1"`` → ``/run/netns/ns1``; a path (anything with a ``/``) is kept as is."""
    return name_or_path if "/" in name_or_path else os.path.join(NETNS_RUN_DIR, name_or_path)


def enter_netns(name_or_path: str | int) -> None:
    """Move the *calling thread* into a namespace (a name, a path or an open fd, which
    stays open) for good. Only for threads we own."""
    if isinstance(name_or_path, int):
        try:
            _setns(name_or_path)
        except OSError as e:
            raise CannotEnterNetns(
                f"cannot enter the network namespace of fd {name_or_path}: {e.strerror}"
            ) from e
        return
    path = netns_path(name_or_path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as e:
        raise DataplaneError(
            f"network namespace {path} cannot be opened ({e.strerror}); create it first"
        ) from e
    try:
        _setns(fd)
    except OSError as e:
        raise CannotEnterNetns(f"cannot enter network namespace {path}: {e.strerror}") from e
    finally:
        os.close(fd)


def run_in_netns(name_or_path: str | int, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Call ``fn(*args, **kwargs)`` in a new thread inside the namespace; return its result.

    Exceptions raised by ``fn`` (or by entering the namespace) are re-raised here.
    """
    result: list[T] = []
    error: list[BaseException] = []

    def target() -> None:
        try:
            enter_netns(name_or_path)
            result.append(fn(*args, **kwargs))
        except BaseException as e:  # handed to the caller's thread
            error.append(e)

    thread = threading.Thread(target=target, name=f"netns:{name_or_path}", daemon=True)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


class StrandedInNetns(BaseException):
    """The calling thread could not return to its own network namespace. A BaseException:
    no handler on the way up catches it, and the thread ends rather than open its next
    netlink socket in a pod's namespace."""


@contextmanager
def visiting_netns(target: int) -> Iterator[None]:
    """The *calling thread* inside the namespace of the descriptor ``target`` for the
    block, then back in its own: :func:`run_in_netns` without a thread to start and join,
    each a wait for the scheduler when the machine is busy. Only for short blocks that
    touch nothing of the thread's own namespace. Entering fails with
    :class:`CannotEnterNetns`; not getting back raises :class:`StrandedInNetns`."""
    home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    try:
        enter_netns(target)
        try:
            yield
        finally:
            try:
                _setns(home)
            except OSError as e:
                raise StrandedInNetns(f"cannot return to the thread's namespace: {e}") from e
    finally:
        os.close(home)


def start_in_netns(
    name_or_path: str | int, fn: Callable[..., Any], *args: Any, **kwargs: Any
) -> threading.Thread:
    """Like :func:`run_in_netns` but return the started thread instead of waiting.

    For long-running loops (a ``watch``); ``fn``'s exceptions are lost, so ``fn``
    must report through its own channel.
    """

    def target() -> None:
        enter_netns(name_or_path)
        fn(*args, **kwargs)

    thread = threading.Thread(target=target, name=f"netns:{name_or_path}", daemon=True)
    thread.start()
    return thread
