"""Podman (Debian's package, CNI network backend) on lab nodes, for end-to-end tests.

``podman_on_nodes(lab, ["n1", "n2"])`` gives one ``PodmanNode`` per lab node:
podman with its own containers.conf, storage and image under one temporary
directory, run as ``nsenter --net=<node namespace> podman ...``. Podman runs
the CNI plugins (ours, then ``portmap``) in its own network namespace, so they
act inside the node as they would on that machine. ``nsenter`` rather than
``ip netns exec`` keeps the host's mount namespace: the namespace podman
bind-mounts for a container then stays visible to later podman commands and
to conmon's exit cleanup (``podman container cleanup``, which inherits the
node namespace from conmon).

Settings this machine needs (each found by trying): ``runc`` (crun refuses the
cgroup layout), ``cgroupfs``, the ``file`` events logger, explicit ulimits
(root lacks CAP_SYS_RESOURCE, so podman's defaults cannot be applied), file
locks (not the /dev/shm segment a host podman would share), ``vfs`` storage
(any filesystem) and an image made with ``podman import`` from a
busybox-static rootfs, since no registry is reachable.

On exit every container is removed, anything still running from the
temporary directory is killed, its mounts are undone and it is deleted, with
the few host directories podman 4.3 writes to whatever its configuration
(libcni's result cache, the image blob cache, runc's state) removed if they
were not there before.
"""

from __future__ import annotations

import io
import json
import os
import resource
import shutil
import signal
import struct
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from ipaddress import IPv4Address
from typing import Any

from flannelpy_lab import Lab
from flannelpy_lab.state import NodeInfo

from flannelpy.ipam.allocator import Allocation, PoolAllocator
from flannelpy.ipam.store import IpamStore

IMAGE = "localhost/flannelpy-busybox:latest"
BUSYBOX = "/bin/busybox"  # from busybox-static: the rootfs has no libc
APPLETS = ("sh", "ping", "nc", "httpd", "sleep", "cat", "wget", "ip")
PODMAN_TIMEOUT = 60.0
# Written by podman 4.3 outside its configured directories; removed afterwards
# when the test created them (entries in them are per container and go with it).
HOST_DIRS = ("/var/lib/containers", "/var/lib/cni/results", "/var/lib/cni", "/run/runc")
MISSING_TOOLS_HINT = "run scripts/bootstrap.sh, which installs podman, runc and busybox-static"


class PodmanError(AssertionError):
    """A podman command failed; the message carries its command line and output."""


@dataclass(frozen=True)
class PodmanNode:
    """Podman as it would run on one lab node."""

    node: NodeInfo
    root: str  # this node's podman directory: configs, storage, run and tmp dirs
    network: str  # the CNI network name: the node conflist's "name"

    def env(self) -> dict[str, str]:
        return os.environ | {
            "CONTAINERS_CONF": os.path.join(self.root, "containers.conf"),
            "CONTAINERS_STORAGE_CONF": os.path.join(self.root, "storage.conf"),
            "CONTAINERS_REGISTRIES_CONF": os.path.join(self.root, "registries.conf"),
        }

    def podman(
        self, *args: str, check: bool = True, timeout: float = PODMAN_TIMEOUT
    ) -> subprocess.CompletedProcess[str]:
        argv = ["nsenter", f"--net=/run/netns/{self.node.namespace}", "podman", *args]
        proc = subprocess.run(
            argv, capture_output=True, text=True, env=self.env(), timeout=timeout, check=False
        )
        if check and proc.returncode != 0:
            raise PodmanError(
                f"`podman {' '.join(args)}` on node {self.node.name} exited with "
                f"{proc.returncode}: {(proc.stderr or proc.stdout).strip()[-1500:]}"
            )
        return proc

    def run(self, name: str, *command: str, publish: Sequence[str] = ()) -> str:
        """``podman run -d`` on the node's CNI network; returns the full container ID."""
        ports = [arg for spec in publish for arg in ("--publish", spec)]
        out = self.podman(
            "run", "--detach", "--name", name, "--network", self.network, *ports, IMAGE, *command
        ).stdout
        return out.strip().splitlines()[-1]

    def exec(self, container: str, *command: str) -> subprocess.CompletedProcess[str]:
        return self.podman("exec", container, *command, check=False)

    def inspect(self, container: str) -> dict[str, Any]:
        doc = json.loads(self.podman("container", "inspect", container).stdout)
        return dict(doc[0])

    def network_settings(self, container: str) -> dict[str, Any]:
        """Our network's entry in ``podman inspect``: IPAddress, MacAddress, ..."""
        return dict(self.inspect(container)["NetworkSettings"]["Networks"][self.network])

    def address(self, container: str) -> IPv4Address:
        return IPv4Address(self.network_settings(container)["IPAddress"])

    def remove(self, *containers: str) -> None:
        """``podman rm --force``, stopping at once (the test's containers ignore SIGTERM)."""
        self.podman("rm", "--force", "--time", "0", *containers)


def node_pools(node: NodeInfo) -> list[PoolAllocator]:
    """The node agent's IPAM pools, read from its state directory under its lock."""
    store = IpamStore(os.path.join(node.node_dir, "state", "ipam"), fsync=False)
    try:
        with store.locked():
            docs = [store.load(subnet) for subnet in store.subnets()]
    finally:
        store.close()
    return [PoolAllocator.from_doc(doc) for doc in docs if doc]


def node_allocations(node: NodeInfo) -> list[Allocation]:
    return [a for pool in node_pools(node) for a in pool.allocations()]


@contextmanager
def podman_on_nodes(lab: Lab, nodes: Sequence[str]) -> Iterator[dict[str, PodmanNode]]:
    """Podman set up on each of ``nodes`` (the lab's CNI must be installed), torn down on exit."""
    require_tools()
    absent = [d for d in HOST_DIRS if not os.path.exists(d)]
    base = tempfile.mkdtemp(prefix="flannelpy-podman-")
    out: dict[str, PodmanNode] = {}
    try:
        tarball = os.path.join(base, "rootfs.tar")
        write_rootfs_tar(tarball)
        for name in nodes:
            out[name] = _configure(lab, lab.node(name), os.path.join(base, name))
            out[name].podman("import", "--quiet", tarball, IMAGE)
        yield out
    finally:
        leftovers = _teardown(list(out.values()), base, absent)
    if leftovers:
        raise PodmanError(f"podman left running processes (now killed): {leftovers}")


def require_tools() -> None:
    for tool in ("podman", "runc", "conmon", "nsenter"):
        if shutil.which(tool) is None:
            raise PodmanError(f"{tool} is not installed; {MISSING_TOOLS_HINT}")
    if not os.path.exists(BUSYBOX) or not is_static_elf(BUSYBOX):
        raise PodmanError(f"{BUSYBOX} is missing or not statically linked; {MISSING_TOOLS_HINT}")


def is_static_elf(path: str) -> bool:
    """Whether ``path`` is a 64-bit little-endian ELF without a program interpreter."""
    with open(path, "rb") as f:
        header = f.read(64)
        if header[:6] != b"\x7fELF\x02\x01":
            return False
        (phoff,) = struct.unpack_from("<Q", header, 32)
        phentsize, phnum = struct.unpack_from("<HH", header, 54)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    pt_interp = 3
    return all(struct.unpack_from("<I", table, i * phentsize)[0] != pt_interp for i in range(phnum))


def write_rootfs_tar(path: str) -> None:
    """A minimal image rootfs: static busybox plus applet symlinks and the usual mount points."""
    with tarfile.open(path, "w") as tar:
        for directory in ("bin", "dev", "etc", "proc", "root", "run", "sys", "tmp"):
            info = tarfile.TarInfo(directory)
            info.type, info.mode = tarfile.DIRTYPE, 0o1777 if directory == "tmp" else 0o755
            tar.addfile(info)
        with open(BUSYBOX, "rb") as f:
            data = f.read()
        info = tarfile.TarInfo("bin/busybox")
        info.size, info.mode = len(data), 0o755
        tar.addfile(info, io.BytesIO(data))
        for applet in APPLETS:
            link = tarfile.TarInfo(f"bin/{applet}")
            link.type, link.linkname = tarfile.SYMTYPE, "busybox"
            tar.addfile(link)


def _configure(lab: Lab, node: NodeInfo, root: str) -> PodmanNode:
    net_dir = os.path.join(root, "net.d")
    os.makedirs(net_dir)
    # A copy of the node's conflist: podman keeps a lock file in its config dir.
    shutil.copy(node.conflist, net_dir)
    with open(node.conflist, encoding="utf-8") as f:
        network = json.load(f)["name"]
    files = {
        "containers.conf": containers_conf(root, net_dir, lab.state.cni_path.split(":")),
        "storage.conf": storage_conf(root),
        "registries.conf": "unqualified-search-registries = []\n",
    }
    for name, text in files.items():
        with open(os.path.join(root, name), "w", encoding="utf-8") as f:
            f.write(text)
    return PodmanNode(node=node, root=root, network=network)


def containers_conf(root: str, net_dir: str, plugin_dirs: Sequence[str]) -> str:
    # No static_dir: conmon's exit command passes --root, which resets it to
    # <graphroot>/libpod; another value would hide the container from cleanup.
    # Modest ulimits: runc could not apply even the current hard nproc limit
    # here (EPERM), while these work.
    nofile = _limit(resource.RLIMIT_NOFILE, 1024)
    nproc = _limit(resource.RLIMIT_NPROC, 4096)
    return f"""\
[containers]
default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = {_toml(os.path.join(root, "events.log"))}
lock_type = "file"
tmp_dir = {_toml(os.path.join(root, "tmp"))}
image_copy_tmp_dir = {_toml(os.path.join(root, "tmp"))}
volume_path = {_toml(os.path.join(root, "volumes"))}

[network]
network_backend = "cni"
network_config_dir = {_toml(net_dir)}
cni_plugin_dirs = [{", ".join(_toml(d) for d in plugin_dirs)}]
"""


def storage_conf(root: str) -> str:
    return f"""\
[storage]
driver = "vfs"
graphroot = {_toml(os.path.join(root, "storage"))}
runroot = {_toml(os.path.join(root, "run"))}
"""


def _toml(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid TOML basic string


def _limit(which: int, wanted: int) -> int:
    """``wanted``, or the process's hard limit if that is lower (it cannot be raised)."""
    hard = resource.getrlimit(which)[1]
    return wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)


def _teardown(nodes: Sequence[PodmanNode], base: str, absent_host_dirs: Sequence[str]) -> list[str]:
    """Remove everything podman made; returns the processes that had to be killed."""
    for pm in nodes:
        with suppress(PodmanError, subprocess.TimeoutExpired):
            pm.podman("rm", "--all", "--force", "--time", "0")
    killed = kill_processes_under(base)
    for mount in reversed(mounts_under(base)):
        subprocess.run(["umount", "--lazy", mount], capture_output=True, check=False)
    shutil.rmtree(base, ignore_errors=True)
    _remove_host_dirs(absent_host_dirs)
    return killed


def processes_under(base: str) -> dict[int, str]:
    """Live processes that belong to ``base``: named in their command line, or rooted in it.

    conmon, runc and podman name the directory in their arguments; a
    container's own processes have as root mount a directory of its storage.
    """
    found = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    continue
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            root = _root_mount_source(int(pid))
        except (OSError, IndexError):  # exiting: /proc/<pid>/mountinfo reads EINVAL
            continue
        if base in cmdline or root.startswith(base + os.sep):
            found[int(pid)] = cmdline
    return found


def _root_mount_source(pid: int) -> str:
    """The directory mounted as the process's "/" (mountinfo fields: root, then mount point)."""
    with open(f"/proc/{pid}/mountinfo", encoding="utf-8", errors="replace") as f:
        for line in f:
            fields = line.split()
            if fields[4] == "/":
                return fields[3]
    return ""


def kill_processes_under(base: str, grace: float = 5.0) -> list[str]:
    """Kill what still runs from ``base`` after ``grace`` seconds (conmon exits just after rm)."""
    deadline = time.monotonic() + grace
    while (found := processes_under(base)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in found:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return [f"{pid} {cmd}" for pid, cmd in sorted(found.items())]


def mounts_under(base: str) -> list[str]:
    """Mount points at or below ``base`` in this mount namespace, in mount order."""
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        points = [line.split()[4] for line in f]
    return [p for p in points if p == base or p.startswith(base + os.sep)]


def _remove_host_dirs(absent_before: Sequence[str]) -> None:
    for path in absent_before:
        if path == "/var/lib/containers":
            # Only podman's image blob cache lives here when nothing else uses podman.
            shutil.rmtree(path, ignore_errors=True)
        else:
            with suppress(OSError):  # keep it if anything else put files there meanwhile
                os.rmdir(path)
