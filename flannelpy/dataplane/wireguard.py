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
namespace (``nsenter -t <pid> -m -n wg show``). The pid is kept beside it, so a
restarted agent adopts the running process instead of cutting traffic.

Keys: :mod:`flannelpy.dataplane.wgkeys`.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from ipaddress import IPv4Interface, IPv6Interface
from typing import Any, Literal, Protocol

from flannelpy.dataplane.uapi import WgDeviceConfig, WgPeer, format_set, uapi_get, uapi_set
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

# --- the desired device and its difference (pure) ----------------------------


@dataclass(frozen=True)
class WgDeviceSpec:
    """Everything of one WireGuard device the agent owns."""

    name: str
    listen_port: int
    mtu: int
    # our lease's network address /32 (/128 on flannel-wg-v6), as Flannel's
    address: IPv4Interface | IPv6Interface | None
    peers: frozenset[WgPeer] = frozenset()


@dataclass(frozen=True)
class PeerChanges:
    private_key: str | None = None  # set when the device's differs
    listen_port: int | None = None
    remove: tuple[str, ...] = ()
    set: tuple[WgPeer, ...] = ()
    counts: dict[str, int] = field(default_factory=dict, compare=False)

    @property
    def empty(self) -> bool:
        return (self.private_key is None and self.listen_port is None
                and not self.remove and not self.set)  # fmt: skip


def peer_changes(spec: WgDeviceSpec, private_key: str, observed: WgDeviceConfig) -> PeerChanges:
    """What to write so the device matches ``spec``: peers missing, differing or extra."""
    wanted = {peer.public_key: peer for peer in spec.peers}
    remove = tuple(sorted(k for k in observed.peers if k not in wanted))
    to_set = tuple(
        peer for key, peer in sorted(wanted.items())
        if observed.peers.get(key) != peer
    )  # fmt: skip
    key = private_key if observed.private_key != private_key else None
    port = spec.listen_port if observed.listen_port != spec.listen_port else None
    return PeerChanges(
        private_key=key, listen_port=port, remove=remove, set=to_set,
        counts={"peers_removed": len(remove), "peers_set": len(to_set),
                "key": int(key is not None), "port": int(port is not None)},
    )  # fmt: skip


def confirmed_peers(
    spec: WgDeviceSpec, previous: frozenset[str], observed: WgDeviceConfig
) -> frozenset[str]:
    """The planned peers a handshake has been completed with, now or before (pure). Kept
    once seen: a restarted wireguard-go forgets its handshakes, but the peer knows our key
    and answers the next one, so its route need not go back to vxlan meanwhile."""
    wanted = {peer.public_key for peer in spec.peers}
    return frozenset((previous | observed.handshaken) & wanted)


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


class PyrouteLink:
    def exists(self, name: str) -> bool:
        from pyroute2 import IPRoute

        with IPRoute() as ipr:
            return bool(ipr.link_lookup(ifname=name))

    def ensure(self, spec: WgDeviceSpec, create_kind: str | None) -> None:
        from pyroute2 import IPRoute
        from pyroute2.netlink.exceptions import NetlinkError

        try:
            with IPRoute() as ipr:
                found = ipr.link_lookup(ifname=spec.name)
                if not found and create_kind is not None:
                    ipr.link("add", ifname=spec.name, kind=create_kind)
                    found = ipr.link_lookup(ifname=spec.name)
                if not found:
                    raise DataplaneError(f"the WireGuard device {spec.name} does not exist")
                index = found[0]
                link = ipr.link("get", index=index)[0]
                if link.get_attr("IFLA_MTU") != spec.mtu:
                    ipr.link("set", index=index, mtu=spec.mtu)
                if spec.address is not None:
                    family = 10 if spec.address.version == 6 else 2  # AF_INET6, AF_INET
                    have = {(a.get_attr("IFA_ADDRESS"), a["prefixlen"])
                            for a in ipr.get_addr(index=index, family=family)
                            if a["scope"] == 0}  # fmt: skip  # not a link-local one
                    want = (str(spec.address.ip), spec.address.network.prefixlen)
                    for addr, plen in have - {want}:
                        ipr.addr("del", index=index, address=addr, prefixlen=plen)
                    if want not in have:
                        ipr.addr("replace", index=index, address=want[0], prefixlen=want[1])
                if not link["flags"] & 1:  # IFF_UP
                    ipr.link("set", index=index, state="up")
        except NetlinkError as e:
            raise DataplaneError(f"could not set up {spec.name}: {e}") from e

    def delete(self, name: str) -> None:
        from pyroute2 import IPRoute
        from pyroute2.netlink.exceptions import NetlinkError

        with IPRoute() as ipr, contextlib.suppress(NetlinkError):
            ipr.link("del", ifname=name)


class UapiConfigurator:
    def __init__(self, socket_path: str) -> None:
        self.socket_path = socket_path

    def get(self) -> WgDeviceConfig:
        return uapi_get(self.socket_path)

    def set(self, changes: PeerChanges) -> None:
        uapi_set(self.socket_path, format_set(
            changes.private_key, changes.listen_port, changes.set, changes.remove
        ))  # fmt: skip


class KernelConfigurator:
    """pyroute2's generic netlink WireGuard family (the kernel module)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def get(self) -> WgDeviceConfig:
        from pyroute2 import WireGuard

        peers: dict[str, WgPeer] = {}
        handshaken: set[str] = set()
        private_key: str | None = None
        port = 0
        with WireGuard() as wg:
            for msg in wg.info(self.name):
                raw_key = msg.get_attr("WGDEVICE_A_PRIVATE_KEY")
                if raw_key:
                    private_key = _b64(raw_key)
                port = msg.get_attr("WGDEVICE_A_LISTEN_PORT") or port
                for p in msg.get_attr("WGDEVICE_A_PEERS") or []:
                    peer = _kernel_peer(p)
                    if peer is not None:
                        peers[peer.public_key] = peer
                        if _kernel_handshake_seconds(p):
                            handshaken.add(peer.public_key)
        return WgDeviceConfig(private_key=private_key, listen_port=port, peers=peers,
                              handshaken=frozenset(handshaken))  # fmt: skip

    def set(self, changes: PeerChanges) -> None:
        from pyroute2 import WireGuard
        from pyroute2.netlink.exceptions import NetlinkError

        try:
            with WireGuard() as wg:
                if changes.private_key is not None or changes.listen_port is not None:
                    args: dict[str, Any] = {}
                    if changes.private_key is not None:
                        args["private_key"] = changes.private_key
                    if changes.listen_port is not None:
                        args["listen_port"] = changes.listen_port
                    wg.set(self.name, **args)
                for key in changes.remove:
                    wg.set(self.name, peer={"public_key": key, "remove": True})
                for peer in changes.set:
                    spec: dict[str, Any] = {
                        "public_key": peer.public_key,
                        "allowed_ips": sorted(str(n) for n in peer.allowed_ips),
                        "persistent_keepalive": peer.keepalive,
                    }
                    if peer.endpoint is not None:
                        spec["endpoint_addr"] = str(peer.endpoint[0])
                        spec["endpoint_port"] = peer.endpoint[1]
                    if peer.preshared_key:
                        spec["preshared_key"] = peer.preshared_key
                    wg.set(self.name, peer=spec)
        except NetlinkError as e:
            raise DataplaneError(f"could not configure {self.name}: {e}") from e


def _kernel_handshake_seconds(msg: Any) -> int:
    """WGPEER_A_LAST_HANDSHAKE_TIME's seconds (pyroute2 decodes a timespec); 0: never."""
    value = msg.get_attr("WGPEER_A_LAST_HANDSHAKE_TIME")
    try:
        return int(value["tv_sec"]) if value is not None else 0
    except (KeyError, TypeError, ValueError):
        return 0


def _b64(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _kernel_peer(msg: Any) -> WgPeer | None:
    from ipaddress import ip_address, ip_network

    key = msg.get_attr("WGPEER_A_PUBLIC_KEY")
    if not key:
        return None
    allowed = set()
    for a in msg.get_attr("WGPEER_A_ALLOWEDIPS") or []:
        allowed.add(ip_network(a.get_attr("WGALLOWEDIP_A_IPADDR") or "0.0.0.0/0", strict=False))
    endpoint = msg.get_attr("WGPEER_A_ENDPOINT")
    ep = None
    if isinstance(endpoint, dict) and endpoint.get("family") in (2, 10):
        ep = (ip_address(endpoint["addr"]), int(endpoint["port"]))
    psk = msg.get_attr("WGPEER_A_PRESHARED_KEY")
    psk_s = _b64(psk) if psk else None
    if psk_s is not None and base64.b64decode(psk_s) == bytes(32):
        psk_s = None
    return WgPeer(
        public_key=_b64(key), endpoint=ep, allowed_ips=frozenset(allowed),
        keepalive=int(msg.get_attr("WGPEER_A_PERSISTENT_KEEPALIVE_INTERVAL") or 0),
        preshared_key=psk_s,
    )  # fmt: skip


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
        script = ('mkdir -p /var/run/wireguard && mount --bind "$1" /var/run/wireguard '
                  '&& exec "$2" -f "$3"')  # fmt: skip
        logfile = open(os.path.join(self.socket_dir, f"{self.name}.log"), "ab")  # noqa: SIM115
        try:
            proc = subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script,
                 "sh", self.socket_dir, self.binary, self.name],
                stdin=subprocess.DEVNULL, stdout=logfile, stderr=logfile,
                env={**os.environ, "LOG_LEVEL": "error"}, start_new_session=True,
            )  # fmt: skip
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
            UapiConfigurator(self.process.socket_path) if self.process
            else KernelConfigurator(name)
        )  # fmt: skip
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
                self._nudge(tuple(p for p in changes.set
                                  if fresh or p.public_key not in observed.peers))  # fmt: skip
                done = {k: v for k, v in changes.counts.items() if v}
                log.info("reconciled WireGuard device=%s %s", self.name,
                         " ".join(f"{k}={v}" for k, v in sorted(done.items())))  # fmt: skip
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
        return (spec is not None and time.monotonic() < until
                and any(p.public_key not in self.confirmed for p in spec.peers))  # fmt: skip

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
