"""The WireGuard device: kernel module or userspace ``wireguard-go``, one behaviour.

The backend plans a :class:`WgDeviceSpec` (device, port, MTU, address, one peer
per lease); :class:`WireguardDevice` makes the device match it and keeps it so.
Its loop (every :data:`POLL_SECONDS`) reads the device back and applies only the
difference (:func:`peer_changes`, pure), so a peer removed or changed by hand
(``wg set flannel-wg peer K remove``) or a key overwritten is put back within a
second, and a ``wireguard-go`` that died is started again and reconfigured.

Kernel: the device is ``ip link add flannel-wg type wireguard`` and is configured
through pyroute2's WireGuard generic netlink family. Userspace: ``wireguard-go -f
flannel-wg`` creates a TUN device and serves WireGuard's UAPI (:mod:`uapi`) at
``/var/run/wireguard/<dev>.sock``, a directory compiled into it. Several nodes of
one host (a lab, or nodes in containers sharing /run) would all claim the same
socket, so it runs in a private mount namespace in which the agent's own
``<run-dir>/wireguard`` is mounted over /var/run/wireguard: the socket is then
``<run-dir>/wireguard/<dev>.sock`` for the agent and ``wg`` sees it inside that
namespace (``nsenter -t <pid> -m -n wg show``). The mount point is made on a tmpfs
mounted over /var/run in that namespace alone (the socket directory is reached through
the shell's working directory, which the tmpfs does not hide), so nothing is created
in the host's /run: a ``mkdir /run/wireguard`` there used to outlive every agent, and
removing it while another node's wireguard-go had its socket mounted on it would
unmount that node's socket. The pid is kept beside it, so a restarted agent adopts the
running process instead of cutting traffic.

Keys: :mod:`flannelpy.dataplane.wgkeys`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Literal, Protocol

from flannelpy.dataplane.uapi import WgDeviceConfig, WgPeer, format_set, uapi_get, uapi_set
from flannelpy.dataplane.wgnetlink import KernelConfigurator, PyrouteLink
from flannelpy.dataplane.wgspec import PeerChanges, WgDeviceSpec, confirmed_peers, peer_changes
from flannelpy.errors import ConfigError, DataplaneError
from flannelpy.fsutil import atomic_write

log = logging.getLogger("flannelpy.dataplane.wireguard")

Implementation = Literal["kernel", "userspace"]
POLL_SECONDS = 0.5  # how often the device is read back: a hand-made change lasts < 1 s
# ... and while a peer planned in the last HANDSHAKE_WATCH_SECONDS has not completed a
# handshake: its route moves to the tunnel when one has, and the peer's end sees the same
# handshake at the same moment. A peer that never answers is not polled for forever.
HANDSHAKE_POLL_SECONDS = 0.1
HANDSHAKE_WATCH_SECONDS = 15.0
START_TIMEOUT_SECONDS = 10.0  # for wireguard-go to create its device and socket
WIREGUARD_GO = "wireguard-go"
KERNEL_FIX = (
    "the kernel has no WireGuard module; load it (modprobe wireguard, from the kernel's "
    'modules package) or set Backend "Implementation" to "auto" to run wireguard-go instead'
)
USERSPACE_FIX = (
    "wireguard-go is not installed; install it (Debian: apt-get install wireguard-go) or "
    "load the kernel's wireguard module"
)

# --- implementations ---------------------------------------------------------


def kernel_module_available(release: str | None = None) -> bool:
    """The wireguard module is loaded, built in, or installed for this kernel."""
    if os.path.isdir("/sys/module/wireguard"):
        return True
    release = release or os.uname().release
    for name in ("modules.builtin", "modules.dep"):
        with contextlib.suppress(OSError), open(f"/lib/modules/{release}/{name}") as f:
            if any("/wireguard.ko" in line for line in f):
                return True
    return False


def choose_implementation(
    wanted: str, module: bool, userspace_binary: str | None
) -> Implementation:
    """``wanted`` is the config's Implementation: auto, kernel or userspace (pure)."""
    if wanted == "kernel" or (wanted == "auto" and module):
        if not module:
            raise ConfigError(f'Backend "Implementation" is "kernel" but {KERNEL_FIX}')
        return "kernel"
    if userspace_binary is None:
        raise ConfigError(USERSPACE_FIX)
    return "userspace"


class Link(Protocol):
    """The rtnetlink side of the device (MTU, address, up), and whether it exists."""

    def exists(self, name: str) -> bool: ...

    def ensure(self, spec: WgDeviceSpec, create_kind: str | None) -> None: ...

    def delete(self, name: str) -> None: ...


class Configurator(Protocol):
    def get(self) -> WgDeviceConfig: ...

    def set(self, changes: PeerChanges) -> None: ...


class UapiConfigurator:
    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path

    def get(self) -> WgDeviceConfig:
        return uapi_get(self.socket_path)

    def set(self, changes: PeerChanges) -> None:
        uapi_set(
            self.socket_path,
            format_set(changes.private_key, changes.listen_port, changes.set, changes.remove),
        )


class UserspaceProcess:
    """One ``wireguard-go`` for one device, in a private mount namespace (module docstring)."""

    def __init__(self, name: str, socket_dir: str, binary: str = WIREGUARD_GO) -> None:
        self.name = name
        self.socket_dir = socket_dir
        self.binary = binary
        self.pid: int | None = None
        self.restarts = 0

    @property
    def socket_path(self) -> str:
        return os.path.join(self.socket_dir, f"{self.name}.sock")

    @property
    def _pid_file(self) -> str:
        return os.path.join(self.socket_dir, f"{self.name}.pid")

    def alive(self) -> bool:
        if self.pid is None:
            return False
        with contextlib.suppress(ChildProcessError):
            done, _ = os.waitpid(self.pid, os.WNOHANG)
            if done:
                return False
        try:
            with open(f"/proc/{self.pid}/comm") as f:
                return f.read().strip().startswith("wireguard")
        except OSError:
            return False

    def adopt(self) -> bool:
        """Take over a wireguard-go a previous agent started, if it still serves."""
        try:
            with open(self._pid_file) as f:
                self.pid = int(f.read().strip())
        except (OSError, ValueError):
            return False
        if self.alive() and os.path.exists(self.socket_path):
            log.info("adopted the running wireguard-go device=%s pid=%s", self.name, self.pid)
            return True
        self.pid = None
        return False

    def start(self, link: Link) -> None:
        os.makedirs(self.socket_dir, mode=0o700, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        if link.exists(self.name):  # a device left without its process: wireguard-go would fail
            link.delete(self.name)
        script = (  # $1, the socket directory, mounted where wireguard-go seeks it
            'cd "$1" && mount -n -t tmpfs -o mode=0755 flannelpy-wg /var/run '
            "&& mkdir /var/run/wireguard && mount -n -c --bind . /var/run/wireguard "
            '&& cd / && exec "$2" -f "$3"'
        )
        logfile = open(os.path.join(self.socket_dir, f"{self.name}.log"), "ab")  # noqa: SIM115
        try:
            proc = subprocess.Popen(
                [
                    "unshare",
                    "--mount",
                    "--propagation",
                    "private",
                    "--",
                    "sh",
                    "-c",
                    script,
                    "sh",
                    self.socket_dir,
                    self.binary,
                    self.name,
                ],
                stdin=subprocess.DEVNULL,
                stdout=logfile,
                stderr=logfile,
                env={**os.environ, "LOG_LEVEL": "error"},
                start_new_session=True,
            )
        except OSError as e:
            raise DataplaneError(f"could not start {self.binary}: {e}") from e
        finally:
            logfile.close()
        self.pid = proc.pid
        atomic_write(self._pid_file, f"{proc.pid}\n".encode())
        deadline = time.monotonic() + START_TIMEOUT_SECONDS
        while not (os.path.exists(self.socket_path) and link.exists(self.name)):
            if proc.poll() is not None:
                raise DataplaneError(
                    f"{self.binary} for {self.name} exited with status {proc.returncode}; "
                    f"see {self.socket_dir}/{self.name}.log"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise DataplaneError(
                    f"{self.binary} did not create {self.name} within "
                    f"{START_TIMEOUT_SECONDS:g} s; see {self.socket_dir}/{self.name}.log"
                )
            time.sleep(0.02)
        log.info("started wireguard-go device=%s pid=%s", self.name, self.pid)

    def stop(self) -> None:
        if self.pid is None or not self.alive():
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + 3.0
        while self.alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self._pid_file)
        self.pid = None


class WireguardDevice:
    """Keeps one WireGuard device as desired (thread-safe; one loop thread).

    ``set_desired`` is called by the planner (the agent's writer) and applies a change
    before it returns (the first call also brings the device up), so the routes
    planned with it never point at a peer the device does not have yet.
    """

    def __init__(
        self,
        name: str,
        private_key: str,
        implementation: Implementation,
        socket_dir: str,
        link: Link | None = None,
        on_repair: Callable[[str, int], None] | None = None,
        on_confirmed: Callable[[str, frozenset[str]], None] | None = None,
    ) -> None:
        self.name = name
        self.private_key = private_key
        self.implementation = implementation
        self.link: Link = link or PyrouteLink()
        self.process = UserspaceProcess(name, socket_dir) if implementation == "userspace" else None
        self.configurator: Configurator = (
            UapiConfigurator(self.process.socket_path) if self.process else KernelConfigurator(name)
        )
        self._on_repair = on_repair
        self._on_confirmed = on_confirmed
        # Public keys of the planned peers a handshake has been completed with.
        self.confirmed: frozenset[str] = frozenset()
        self._watch_until = 0.0  # polls fast until then while a peer is unconfirmed
        self._lock = threading.Lock()
        self._pass_lock = threading.Lock()
        self._spec: WgDeviceSpec | None = None
        self._wake = threading.Event()
        self._started = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.last_error: str | None = None

    def set_desired(self, spec: WgDeviceSpec) -> None:
        with self._lock:
            changed = spec != self._spec
            self._spec = spec
            if changed:
                self._watch_until = time.monotonic() + HANDSHAKE_WATCH_SECONDS
        if not self._started:
            self._started = True
            self._bring_up()
            self._thread = threading.Thread(
                target=self._run, name=f"wireguard-{self.name}", daemon=True
            )
            self._thread.start()
        elif changed:
            # Now, on the planner's thread: the routes the planner hands the reconciler
            # next (a peer's vxlan route dropped for the tunnel) must find the peer there.
            try:
                self.reconcile_once()
            except (DataplaneError, OSError) as e:
                log.warning("WireGuard device not as desired yet, retrying: %s", e)
                self._wake.set()

    def _bring_up(self) -> None:
        try:
            if self.process is not None and not self.process.adopt():
                self.process.start(self.link)
            self.reconcile_once()
        except (DataplaneError, OSError) as e:  # the loop retries; the route waits for it
            log.warning("WireGuard device not configured yet: %s", e)
            self.last_error = str(e)

    def reconcile_once(self) -> PeerChanges | None:
        with self._pass_lock:
            with self._lock:
                spec = self._spec
            if spec is None:
                return None
            if self.process is not None and not self.process.alive():
                log.warning("wireguard-go is not running; starting it again device=%s", self.name)
                self.process.restarts += 1
                self.process.start(self.link)
                if self._on_repair:
                    self._on_repair("process", 1)
            self.link.ensure(spec, "wireguard" if self.process is None else None)
            observed = self.configurator.get()
            changes = peer_changes(spec, self.private_key, observed)
            self._note_handshakes(spec, observed, fresh_key=changes.private_key is not None)
            if not changes.empty:
                self.configurator.set(changes)
                fresh = changes.private_key is not None
                self._nudge(
                    tuple(p for p in changes.set if fresh or p.public_key not in observed.peers)
                )
                done = {k: v for k, v in changes.counts.items() if v}
                log.info(
                    "reconciled WireGuard device=%s %s",
                    self.name,
                    " ".join(f"{k}={v}" for k, v in sorted(done.items())),
                )
                if self._on_repair:
                    for kind, count in done.items():
                        self._on_repair(kind, count)
            self.last_error = None
            return changes

    def _note_handshakes(
        self, spec: WgDeviceSpec, observed: WgDeviceConfig, fresh_key: bool
    ) -> None:
        """Track which planned peers have completed a handshake; say when that changes (the
        agent then routes them through the tunnel). A new key of ours starts over."""
        previous = frozenset() if fresh_key else self.confirmed
        confirmed = confirmed_peers(spec, previous, observed)
        if confirmed == self.confirmed:
            return
        self.confirmed = confirmed
        if self._on_confirmed is not None:
            self._on_confirmed(self.name, confirmed)

    def _awaiting_handshake(self) -> bool:
        with self._lock:
            spec, until = self._spec, self._watch_until
        return (
            spec is not None
            and time.monotonic() < until
            and any(p.public_key not in self.confirmed for p in spec.peers)
        )

    def _nudge(self, peers: tuple[WgPeer, ...]) -> None:
        """Handshake now with ``peers``: every peer of a new device (or key), whose peers
        still hold sessions with the device it replaced and would keep sending on them until
        WireGuard's 15 s timeout; and a peer just added, which may have dropped our
        handshake while it did not know us yet (WireGuard retries only 5 s later). Turning
        persistent keepalive on sends one keepalive at once (wireguard-go and the kernel
        alike), so it is switched on and back off."""
        quiet = tuple(peer for peer in peers if peer.keepalive == 0)
        if not quiet:
            return
        self.configurator.set(PeerChanges(set=tuple(replace(p, keepalive=1) for p in quiet)))
        self.configurator.set(PeerChanges(set=quiet))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(HANDSHAKE_POLL_SECONDS if self._awaiting_handshake() else POLL_SECONDS)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self.reconcile_once()
            except (DataplaneError, OSError) as e:
                if self.last_error != str(e):
                    log.warning("WireGuard device not as desired, retrying: %s", e)
                self.last_error = str(e)

    def stop(self, remove: bool = True) -> None:
        """Stop the loop; with ``remove``, the device goes too (as Flannel removes it)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if not remove:
            return
        if self.process is not None:
            self.process.stop()
        else:
            self.link.delete(self.name)


def find_wireguard_go() -> str | None:
    return shutil.which(WIREGUARD_GO)
