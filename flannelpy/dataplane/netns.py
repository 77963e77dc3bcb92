"""Run Python code inside a network namespace without forking.

A network namespace belongs to a thread, not to a process: a fresh thread that
calls ``setns(fd, CLONE_NEWNET)`` sees only that namespace's links, and every
socket it opens (netlink included) stays bound to that namespace for its
lifetime. The thread exits afterwards, so no thread of the caller is ever left
in a foreign namespace. Python 3.11 has no ``os.setns``, hence ctypes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from flannelpy.errors import DataplaneError

CLONE_NEWNET = 0x40000000
NETNS_RUN_DIR = "/run/netns"  # where `ip netns add` puts its bind mounts

T = TypeVar("T")

_libc: ctypes.CDLL | None = None


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


def enter_netns(name_or_path: str) -> None:
    """Move the *calling thread* into a namespace for good. Only for threads we own."""
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
        raise DataplaneError(f"cannot enter network namespace {path}: {e.strerror}") from e
    finally:
        os.close(fd)


def run_in_netns(name_or_path: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
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


def start_in_netns(
    name_or_path: str, fn: Callable[..., Any], *args: Any, **kwargs: Any
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
