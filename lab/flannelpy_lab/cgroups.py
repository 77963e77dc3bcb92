"""The kubelet lab's nodes' cgroups (v1, cgroupfs): made, emptied and removed.

Each node's kubelet and containerd run under a cgroup root of their own
(``/fpl-<lab>-<node>``) in every v1 hierarchy. Separate from the start and stop of the
processes (``flannelpy_lab.kubelet``): this is plain file work on ``/sys/fs/cgroup``.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from flannelpy_lab.errors import LabError

CGROUP_ROOT = "/sys/fs/cgroup"


def hierarchies() -> list[str]:
    """The cgroup v1 hierarchies (directories under /sys/fs/cgroup that are mounts)."""
    out = []
    for name in sorted(os.listdir(CGROUP_ROOT)):
        path = os.path.join(CGROUP_ROOT, name)
        if name != "unified" and not os.path.islink(path) and os.path.ismount(path):
            out.append(path)
    return out


def make_cgroups(parent: str) -> None:
    """The node's cgroup root in every v1 hierarchy (cpuset's with the root's cpus and
    mems, which a new cpuset cgroup lacks)."""
    for hierarchy in hierarchies():
        path = os.path.join(hierarchy, parent.lstrip("/"))
        os.makedirs(path, exist_ok=True)
        if os.path.basename(hierarchy) == "cpuset":
            for knob in ("cpuset.cpus", "cpuset.mems"):
                with open(os.path.join(hierarchy, knob), encoding="utf-8") as f:
                    value = f.read().strip()
                with open(os.path.join(path, knob), "w", encoding="utf-8") as f:
                    f.write(value)


def cgroup_pids(parent: str) -> set[int]:
    found: set[int] = set()
    for hierarchy in hierarchies():
        for dirpath, _, files in os.walk(os.path.join(hierarchy, parent.lstrip("/"))):
            if "cgroup.procs" in files:
                with contextlib.suppress(OSError), open(os.path.join(dirpath, "cgroup.procs")) as f:
                    found.update(int(line) for line in f if line.strip())
    return found


def kill_cgroup(parent: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (pids := cgroup_pids(parent)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.1)


def remove_cgroups(parent: str, timeout: float = 10.0) -> None:
    """Remove ``parent`` and every cgroup below it, bottom up (a cgroup stays busy for a
    moment after its last process is killed)."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for hierarchy in hierarchies():
            top = os.path.join(hierarchy, parent.lstrip("/"))
            if not os.path.isdir(top):
                continue
            for dirpath, _, _ in sorted(os.walk(top), key=lambda w: -w[0].count(os.sep)):
                try:
                    os.rmdir(dirpath)
                except OSError:
                    left.append(dirpath)
        if not left:
            return
        if time.monotonic() > deadline:
            raise LabError(
                f"cannot remove the cgroups {', '.join(left[:3])}: processes "
                "still run in them; kill them and run down again"
            )
        time.sleep(0.2)
