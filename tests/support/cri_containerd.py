"""containerd (Debian's package, 1.6) with its CRI plugin, run for a test as a node runs it.

``containerd_on_node(node_netns, cni_bin_dir, cni_conf_dir)`` starts one containerd
with its own root, state dir, socket and config under a temporary directory, in the
node's network namespace and in a mount namespace of its own, and yields a
``Containerd`` whose ``cri`` speaks the CRI the kubelet speaks. The CRI plugin
keeps pod network namespaces under its state dir (``netns_mounts_under_state_dir``):
they are bind mounts that only containerd's mount namespace sees, as on a node
whose agent runs in a container (the agent sees an empty file at that path).

Settings this machine needs: cgroupfs (no systemd); ``restrict_oom_score_adj``
(root lacks CAP_SYS_RESOURCE, so runc cannot give the sandbox its default -998 and
fails with "can't get final child's PID from pipe"); AppArmor off (a node may have
it, this kernel has not). The overlayfs snapshotter works on the root filesystem.
No rlimit settings: the CRI sets none (the pod inherits containerd's).
The pause image is made here from busybox-static (no registry is reachable) and
imported with ``ctr``.
containerd's fixed host paths (``/run/containerd`` for shim sockets and runc state,
libcni's cache ``/var/lib/cni``) are bind mounts of temporary directories inside
its mount namespace.

On exit every pod sandbox is stopped and removed through the CRI, containerd is
stopped, whatever still runs from the temporary directory (shims, pause processes)
is killed, the pods' cgroups are removed and the temporary directory is deleted.
The mounts containerd made die with its mount namespace.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

from flannelpy_lab.images import PAUSE_IMAGE
from flannelpy_lab.kubelet import containerd_config

from tests.support.cri_api import CriClient, CriError
from tests.support.image_archive import write_image_archive
from tests.support.podman_util import BUSYBOX, is_static_elf, write_rootfs_tar
from tests.support.waiting import wait_until

# The pause container's process: sleeps until the runtime kills it, as pause does.
PAUSE_ENTRYPOINT = ("/bin/sleep", "2147483647")
# Host paths containerd 1.6 uses whatever its configuration says.
HOST_PATHS = ("/run/containerd", "/var/lib/cni")
START_TIMEOUT = 30.0
CGROUP_ROOT = "/sys/fs/cgroup"
MISSING_TOOLS_HINT = "run scripts/bootstrap.sh, which installs containerd, runc and busybox-static"


class ContainerdError(AssertionError):
    """containerd could not be set up or left something behind; the message says what."""


@dataclass
class Containerd:
    """One running containerd, its CRI client and the cgroup parent of its pods."""

    base: str
    pid: int
    cri: CriClient
    cgroup_parent: str
    log_path: str
    sandboxes: dict[str, Any] = field(default_factory=dict)  # live sandbox ID: its config

    def log_tail(self, lines: int = 10) -> str:
        """The last warnings and errors containerd logged (its info lines are long and many)."""
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            wanted = [line for line in f if "level=info" not in line and "level=debug" not in line]
        return "".join(line[:2000] for line in wanted[-lines:])

    def run_pod_sandbox(self, name: str, namespace: str = "default") -> str:
        """RunPodSandbox with the config the kubelet generates for a plain pod; returns its ID."""
        uid = (
            f"{secrets.token_hex(4)}-{secrets.token_hex(2)}-{secrets.token_hex(2)}-"
            f"{secrets.token_hex(2)}-{secrets.token_hex(6)}"
        )
        log_dir = os.path.join(self.base, "pods", f"{namespace}_{name}_{uid}")
        os.makedirs(log_dir, exist_ok=True)  # the kubelet makes it before RunPodSandbox
        msg = self.cri.message
        config = msg(
            "PodSandboxConfig",
            metadata=msg("PodSandboxMetadata", name=name, uid=uid, namespace=namespace, attempt=0),
            hostname=name,
            log_directory=log_dir,
            dns_config=msg(
                "DNSConfig",
                servers=["10.96.0.10"],
                options=["ndots:5"],
                searches=[f"{namespace}.svc.cluster.local", "svc.cluster.local"],
            ),
            labels={
                "io.kubernetes.pod.name": name,
                "io.kubernetes.pod.namespace": namespace,
                "io.kubernetes.pod.uid": uid,
            },
            annotations={"kubernetes.io/config.source": "api"},
            linux=msg(
                "LinuxPodSandboxConfig",
                cgroup_parent=f"{self.cgroup_parent}/pod{uid}",
                security_context=msg(
                    "LinuxSandboxSecurityContext",
                    namespace_options=msg("NamespaceOption", network=0, pid=1, ipc=0),
                ),
            ),
        )
        request = msg("RunPodSandboxRequest", config=config, runtime_handler="")
        try:
            sandbox_id = str(self.cri.call("RunPodSandbox", request).pod_sandbox_id)
        except CriError as e:
            raise CriError(f"{e}\ncontainerd log:\n{self.log_tail()}") from None
        self.sandboxes[sandbox_id] = config
        return sandbox_id

    def start_container(self, sandbox_id: str, name: str, *command: str) -> str:
        """CreateContainer + StartContainer in the sandbox, from the local image (the
        busybox rootfs); returns the container ID."""
        msg = self.cri.message
        config = msg(
            "ContainerConfig",
            metadata=msg("ContainerMetadata", name=name, attempt=0),
            image=msg("ImageSpec", image=PAUSE_IMAGE),
            command=list(command),
            log_path=f"{name}/0.log",
            linux=msg(
                "LinuxContainerConfig",
                security_context=msg(
                    "LinuxContainerSecurityContext",
                    namespace_options=msg("NamespaceOption", network=0, pid=1, ipc=0),
                ),
            ),
        )
        request = msg(
            "CreateContainerRequest",
            pod_sandbox_id=sandbox_id,
            config=config,
            sandbox_config=self.sandboxes[sandbox_id],
        )
        container_id = str(self.cri.call("CreateContainer", request).container_id)
        self.cri.call("StartContainer", msg("StartContainerRequest", container_id=container_id))
        return container_id

    def exec_sync(self, container_id: str, *argv: str, timeout: int = 10) -> tuple[int, str]:
        """ExecSync in the container (as ``kubectl exec`` ends up); (exit code, output)."""
        request = self.cri.message(
            "ExecSyncRequest", container_id=container_id, cmd=list(argv), timeout=timeout
        )
        response = self.cri.call("ExecSync", request, timeout=timeout + 10)
        return int(response.exit_code), (response.stdout + response.stderr).decode(errors="replace")

    def status(self, sandbox_id: str) -> tuple[Any, dict[str, Any]]:
        """PodSandboxStatus (verbose): the status and containerd's info document."""
        request = self.cri.message(
            "PodSandboxStatusRequest", pod_sandbox_id=sandbox_id, verbose=True
        )
        response = self.cri.call("PodSandboxStatus", request)
        return response.status, json.loads(response.info.get("info", "{}"))

    def netns_path(self, sandbox_id: str) -> str:
        """The network namespace containerd made for the sandbox (the path CNI got)."""
        _, info = self.status(sandbox_id)
        for ns in info["runtimeSpec"]["linux"]["namespaces"]:
            if ns["type"] == "network":
                return str(ns["path"])
        raise ContainerdError(f"sandbox {sandbox_id} has no network namespace in its spec")

    def stop_and_remove(self, sandbox_id: str) -> None:
        """What the kubelet does when a pod goes: StopPodSandbox (CNI DEL), then Remove."""
        self.cri.call(
            "StopPodSandbox", self.cri.message("StopPodSandboxRequest", pod_sandbox_id=sandbox_id)
        )
        self.cri.call(
            "RemovePodSandbox",
            self.cri.message("RemovePodSandboxRequest", pod_sandbox_id=sandbox_id),
        )
        self.sandboxes.pop(sandbox_id, None)

    def in_netns(
        self, netns: str, argv: Sequence[str], timeout: float = 15.0
    ) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` in the pod namespace ``netns``, opened in containerd's mount
        namespace (the only one where the path is the namespace)."""
        return subprocess.run(
            ["nsenter", f"--target={self.pid}", "--mount", "nsenter", f"--net={netns}", *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    def sees(self, path: str) -> bool:
        """Whether ``path`` exists in containerd's mount namespace."""
        return os.path.exists(f"/proc/{self.pid}/root{path}")


def require_tools() -> None:
    for tool in ("containerd", "containerd-shim-runc-v2", "ctr", "runc", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            raise ContainerdError(f"{tool} is not installed; {MISSING_TOOLS_HINT}")
    if not os.path.exists(BUSYBOX) or not is_static_elf(BUSYBOX):
        raise ContainerdError(
            f"{BUSYBOX} is missing or not statically linked; {MISSING_TOOLS_HINT}"
        )


def config_toml(base: str, cni_bin_dir: str, cni_conf_dir: str) -> str:
    # The lab's own config, so these tests exercise the containerd the lab's nodes run.
    return containerd_config(base, cni_bin_dir, cni_conf_dir)


def _start(base: str, node_netns: str) -> subprocess.Popen[bytes]:
    """containerd in ``node_netns`` and a new mount namespace (mounts stay in it), with
    temporary directories over the host paths it would otherwise write."""
    binds = " && ".join(
        f"mount --bind {os.path.join(base, 'host', p.strip('/').replace('/', '-'))} {p}"
        for p in HOST_PATHS
    )
    script = f"{binds} && exec containerd --config {os.path.join(base, 'config.toml')}"
    with open(os.path.join(base, "containerd.log"), "wb") as log:
        return subprocess.Popen(
            [
                "nsenter",
                f"--net=/run/netns/{node_netns}",
                "unshare",
                "--mount",
                "--propagation",
                "slave",
                "sh",
                "-c",
                script,
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _import_pause_image(base: str, socket_path: str) -> None:
    rootfs = os.path.join(base, "rootfs.tar")
    write_rootfs_tar(rootfs)
    archive = os.path.join(base, "pause-image.tar")
    write_image_archive(archive, PAUSE_IMAGE, rootfs, PAUSE_ENTRYPOINT)
    proc = subprocess.run(
        ["ctr", f"--address={socket_path}", "--namespace=k8s.io", "images", "import", archive],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if proc.returncode != 0:
        raise ContainerdError(f"ctr images import failed: {(proc.stderr or proc.stdout).strip()}")


def _comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm", encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return ""


@contextmanager
def containerd_on_node(
    node_netns: str, cni_bin_dir: str, cni_conf_dir: str
) -> Iterator[Containerd]:
    """A running containerd in the node namespace ``node_netns`` (see the module doc)."""
    require_tools()
    created = [p for p in HOST_PATHS if not os.path.exists(p)]
    base = tempfile.mkdtemp(prefix="fpcri")  # short: socket paths must fit 108 bytes
    cgroup_parent = f"/flannelpy-cri-{os.path.basename(base)}"
    proc: subprocess.Popen[bytes] | None = None
    ctrd: Containerd | None = None
    mount_ns: tuple[int, int] | None = None  # containerd's: its mounts live while it does
    try:
        for p in HOST_PATHS:
            os.makedirs(p, exist_ok=True)  # a mount point for the bind
            os.makedirs(os.path.join(base, "host", p.strip("/").replace("/", "-")))
        with open(os.path.join(base, "config.toml"), "w", encoding="utf-8") as f:
            f.write(config_toml(base, cni_bin_dir, cni_conf_dir))
        proc = _start(base, node_netns)
        wait_until(
            lambda: proc.poll() is not None or _comm(proc.pid) == "containerd",
            timeout=START_TIMEOUT,
            what="containerd starting",
        )
        mount_ns = _mount_ns(proc.pid)
        socket_path = os.path.join(base, "containerd.sock")
        cri = CriClient(socket_path)
        ctrd = Containerd(base, proc.pid, cri, cgroup_parent, os.path.join(base, "containerd.log"))
        try:
            wait_until(
                lambda: proc.poll() is not None or cri.ready(),
                timeout=START_TIMEOUT,
                what="containerd's CRI reporting RuntimeReady and NetworkReady",
            )
        except AssertionError as e:
            raise ContainerdError(f"{e}\ncontainerd log:\n{ctrd.log_tail()}") from None
        if proc.poll() is not None or _comm(proc.pid) != "containerd":
            raise ContainerdError(f"containerd exited at start:\n{ctrd.log_tail()}")
        _import_pause_image(base, socket_path)
        yield ctrd
    finally:
        leftovers = _teardown(base, proc, ctrd, created, cgroup_parent, mount_ns)
    if leftovers:
        raise ContainerdError(f"containerd left behind (processes now killed): {leftovers}")


def _teardown(
    base: str,
    proc: subprocess.Popen[bytes] | None,
    ctrd: Containerd | None,
    created: Sequence[str],
    cgroup_parent: str,
    mount_ns: tuple[int, int] | None,
) -> list[str]:
    if ctrd is not None and proc is not None and proc.poll() is None:
        with suppress(CriError):
            listed = ctrd.cri.call("ListPodSandbox", timeout=10).items
            for sandbox in listed:
                with suppress(CriError):
                    ctrd.stop_and_remove(sandbox.id)
    if ctrd is not None:
        ctrd.cri.close()
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    leftovers = _kill_remaining(base, mount_ns, cgroup_parent)
    leftovers += [f"cgroup {path}" for path in _remove_cgroups(cgroup_parent)]
    for p in created:
        with suppress(OSError):  # kept if anything else put files there meanwhile
            os.rmdir(p)
    shutil.rmtree(base, ignore_errors=True)
    if os.path.exists(base):
        leftovers.append(f"directory {base}")
    return leftovers


def _mount_ns(pid: int) -> tuple[int, int] | None:
    try:
        st = os.stat(f"/proc/{pid}/ns/mnt")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _remaining(base: str, mount_ns: tuple[int, int] | None, cgroup_parent: str) -> dict[int, str]:
    """Processes of this containerd: naming ``base`` (shims name its socket), in its mount
    namespace (which holds its mounts while any is), in its pods' cgroups, or below those."""
    found: set[int] = set()
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        pid = int(entry)
        try:  # any of these reads fails once the process is gone or going
            with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if fields[0] in ("Z", "X"):
                continue
            children.setdefault(int(fields[1]), []).append(pid)
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if base.encode() in f.read():
                    found.add(pid)
            if mount_ns is not None and _mount_ns(pid) == mount_ns:
                found.add(pid)
        except (OSError, IndexError, ValueError):
            continue
    pids_tree = os.path.join(CGROUP_ROOT, "pids", cgroup_parent.lstrip("/"))
    for dirpath, _, files in os.walk(pids_tree):
        if "cgroup.procs" in files:
            with suppress(OSError), open(os.path.join(dirpath, "cgroup.procs")) as f:
                found.update(int(line) for line in f if line.strip())
    todo = list(found)
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return {pid: _comm(pid) for pid in sorted(found) if pid != os.getpid()}


def _kill_remaining(
    base: str, mount_ns: tuple[int, int] | None, cgroup_parent: str, grace: float = 5.0
) -> list[str]:
    """Give what remains ``grace`` seconds to exit (shims go just after RemovePodSandbox),
    then kill it; returns what had to be killed."""
    deadline = time.monotonic() + grace
    while (found := _remaining(base, mount_ns, cgroup_parent)) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in found:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    with suppress(AssertionError):
        wait_until(
            lambda: not _remaining(base, mount_ns, cgroup_parent),
            timeout=5.0,
            what="killed processes exiting",
        )
    return [f"{pid} {comm}" for pid, comm in found.items()]


def _remove_cgroups(parent: str, timeout: float = 10.0) -> list[str]:
    """Remove ``parent`` and the cgroups below it in every v1 hierarchy (bottom up);
    returns those still there after ``timeout`` (a cgroup stays busy for a moment after
    its last process is killed)."""
    deadline = time.monotonic() + timeout
    while True:
        left = []
        for hierarchy in os.listdir(CGROUP_ROOT):
            top = os.path.join(CGROUP_ROOT, hierarchy, parent.lstrip("/"))
            if os.path.islink(os.path.join(CGROUP_ROOT, hierarchy)) or not os.path.isdir(top):
                continue
            for dirpath, _, _ in sorted(os.walk(top), key=lambda w: -w[0].count(os.sep)):
                try:
                    os.rmdir(dirpath)
                except OSError:
                    left.append(dirpath)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)
