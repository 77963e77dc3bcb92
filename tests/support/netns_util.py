"""Throwaway network namespaces for tests that need a real kernel (root only).

Every name carries the process id and a random suffix so parallel runs never
clash, and every namespace is deleted on exit even when the test fails
(deleting a namespace also deletes the links inside it).

    with temp_netns("nl") as ns:
        ns.veth("u0", "192.168.50.2/24")
        ns.ip("route add default via 192.168.50.1")
        ns.call(kernel.observe, ["flannel.1"], ["flannel.1"])
"""

from __future__ import annotations

import os
import secrets
import shlex
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from flannelpy.dataplane.netns import run_in_netns, start_in_netns

T = TypeVar("T")


def unique_name(prefix: str, max_len: int = 15) -> str:
    """``prefix`` + pid + random hex, cut to ``max_len`` (15 is the kernel's link-name limit)."""
    suffix = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
    return prefix[: max(0, max_len - len(suffix))] + suffix


def is_root() -> bool:
    return os.geteuid() == 0


class CommandFailed(subprocess.CalledProcessError):
    """A failed command whose message carries its stderr, so a test report shows why."""

    def __str__(self) -> str:
        return f"{super().__str__()}: {(self.stderr or '').strip() or 'no stderr'}"


def sh(args: str | list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a command (a string is split shell-style, never run by a shell)."""
    argv = shlex.split(args) if isinstance(args, str) else args
    done = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and done.returncode:
        raise CommandFailed(done.returncode, argv, done.stdout, done.stderr)
    return done


def add_netns(name: str) -> None:
    """``ip netns add``, tried once more after a failure: concurrent first uses of
    ``/run/netns`` race on its bind mount, and the loser fails once."""
    for attempt in range(2):
        done = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
        if done.returncode == 0:
            return
        if attempt == 0:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            time.sleep(0.2)
    raise CommandFailed(done.returncode, ["ip", "netns", "add", name], done.stdout, done.stderr)


class Netns:
    """A named network namespace created by :func:`temp_netns`."""

    def __init__(self, name: str) -> None:
        self.name = name

    def exec(self, args: str | list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
        """Run a command inside the namespace (``ip netns exec``)."""
        argv = shlex.split(args) if isinstance(args, str) else args
        return sh(["ip", "netns", "exec", self.name, *argv], check=check)

    def ip(self, args: str, check: bool = True) -> str:
        """``ip -n <ns> <args>``; returns stdout."""
        return sh(["ip", "-n", self.name, *shlex.split(args)], check=check).stdout

    def call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run ``fn`` in a thread inside the namespace and return its result."""
        return run_in_netns(self.name, fn, *args, **kwargs)

    def start(self, fn: Callable[..., Any], *args: Any) -> threading.Thread:
        """Start ``fn`` in a background thread inside the namespace."""
        return start_in_netns(self.name, fn, *args)

    def netlink_listeners(self, protocol: int = 0) -> list[int]:
        """The multicast group masks of this namespace's netlink sockets of ``protocol``
        (0 is rtnetlink) that listen to any group, from ``/proc/net/netlink``."""
        table = self.exec("cat /proc/net/netlink").stdout.splitlines()[1:]
        rows = [line.split() for line in table]
        return [groups for row in rows if int(row[1]) == protocol and (groups := int(row[3], 16))]

    def veth(self, name: str, address: str | None = None, peer: str | None = None) -> str:
        """A veth pair inside the namespace, both ends up; ``address`` (CIDR) on ``name``.

        The peer end stays in the namespace: a stand-in for an underlay NIC that
        carries no traffic anywhere (this kernel has no dummy driver).
        """
        peer = peer or f"{name}p"
        self.ip(f"link add {name} type veth peer name {peer}")
        self.ip(f"link set {name} up")
        self.ip(f"link set {peer} up")
        if address:
            self.ip(f"addr add {address} dev {name}")
        return name


@contextmanager
def temp_netns(prefix: str = "t") -> Iterator[Netns]:
    """A fresh namespace with ``lo`` up, deleted on exit whatever happens."""
    name = unique_name(f"fp{prefix}", max_len=40)
    add_netns(name)
    try:
        ns = Netns(name)
        ns.ip("link set lo up")
        yield ns
    finally:
        sh(["ip", "netns", "del", name], check=False)
