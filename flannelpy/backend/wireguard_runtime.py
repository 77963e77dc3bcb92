"""This node's WireGuard key and devices, shared by every WireguardBackend of the process.

The planner (:mod:`flannelpy.backend.wireguard`) hands the runtime each device's desired
state; the runtime loads the key, chooses kernel or userspace, starts the devices
(:mod:`flannelpy.dataplane.wireguard`, which reconcile themselves) and retires them a few
seconds after no peer needs them. It tells the agent which peers flannel-wg has
completed a handshake with, so a pair moves to the tunnel only once both ends can use it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any, Protocol

from flannelpy.backend.wireguard_config import DEVICE, DEVICE_V6, WireguardConfig
from flannelpy.dataplane.wgkeys import load_or_create_key
from flannelpy.dataplane.wgkeys import public_key as public_key_of
from flannelpy.dataplane.wireguard import WgDeviceSpec
from flannelpy.errors import ConfigError

log = logging.getLogger("flannelpy.backend.wireguard")

# After a live switch away: how long the device still receives from peers that have not
# seen our new lease yet (the lease watch delivers in well under a second).
RETIRE_AFTER_SECONDS = 5.0


class DeviceSink(Protocol):
    """Where the planned device goes (the device below, or a recorder in tests)."""

    def set_desired(self, spec: WgDeviceSpec) -> None: ...


class WireguardRuntime:
    """This node's key and device, shared by every WireguardBackend of the process (a
    live switch to wireguard builds a new backend; the key and device stay one).

    ``key_file``: ``WIREGUARD_KEY_FILE`` when set (Flannel's variable), else
    ``<state-dir>/wireguard.key``. Nothing on the host changes until the key or the
    device is first needed."""

    def __init__(
        self, key_file: str, socket_dir: str, sink: DeviceSink | None = None,
        implementation: str | None = None,
        on_repair: Callable[[str, int], None] | None = None,
        on_prepared: Callable[[str], None] | None = None,
        on_unencrypted: Callable[[int], None] | None = None,
    ) -> None:  # fmt: skip
        self.key_file = key_file
        self.socket_dir = socket_dir
        self._sink = sink
        self._on_repair = on_repair
        self._on_prepared = on_prepared
        self._on_unencrypted = on_unencrypted
        self.implementation = implementation  # chosen by prepare(); None until then
        self._private_key: str | None = None
        self._lock = threading.Lock()
        self.device: Any = None  # the WireguardDevice once started
        self.device_v6: Any = None  # flannel-wg-v6's, on a dual-stack node (Mode separate)
        self._retiring = 0  # bumped by every use and every retire: a stale timer does nothing
        self._retire_pending = False
        # The options the device last ran with: a node that switched away keeps them.
        self.config = WireguardConfig()
        # Told the public keys flannel-wg has completed a handshake with, when they change
        # (the agent's writer, which then routes those peers through the tunnel).
        self.on_confirmed: Callable[[frozenset[str]], None] | None = None

    def prepare(self, config: WireguardConfig) -> str:
        """Choose kernel or userspace (refusing what cannot run) and load the key."""
        from flannelpy.dataplane import wireguard as dp

        with self._lock:
            self.config = config
            if self.implementation is None:
                self.implementation = dp.choose_implementation(
                    config.implementation, dp.kernel_module_available(), dp.find_wireguard_go()
                )
            if self._private_key is None:
                self._private_key = load_or_create_key(self.key_file)
                log.info("wireguard implementation=%s key_file=%s public_key=%s",
                         self.implementation, self.key_file,
                         public_key_of(self._private_key))  # fmt: skip
                if self._on_prepared is not None:
                    self._on_prepared(self.implementation)
            return self.implementation

    @property
    def public_key(self) -> str:
        if self._private_key is None:
            raise ConfigError("the WireGuard key is not loaded; the agent must prepare it first")
        return public_key_of(self._private_key)

    def set_desired(self, spec: WgDeviceSpec) -> None:
        if spec.name == DEVICE_V6:
            return self._set_desired_v6(spec)
        with self._lock:
            self._retiring += 1  # in use again: a pending retire is off
            self._retire_pending = False
        if self._sink is None:
            from flannelpy.dataplane.wireguard import WireguardDevice

            assert self._private_key is not None and self.implementation is not None
            device = WireguardDevice(
                spec.name, self._private_key, self.implementation,  # type: ignore[arg-type]
                self.socket_dir, on_repair=self._on_repair, on_confirmed=self._confirmed,
            )  # fmt: skip
            self.device = device
            self._sink = device
        assert self._sink is not None
        self._sink.set_desired(spec)

    def _set_desired_v6(self, spec: WgDeviceSpec) -> None:
        """The IPv6 device: a second wireguard-go (or kernel device) with the same key
        (the only one IPv6-only)."""
        with self._lock:
            self._retiring += 1  # in use again: a pending retire is off
            self._retire_pending = False
        if self._sink is not None and self.device is None:  # a recorder (tests) takes both
            self._sink.set_desired(spec)
            return
        if self.device_v6 is None:
            from flannelpy.dataplane.wireguard import WireguardDevice

            assert self._private_key is not None and self.implementation is not None
            self.device_v6 = WireguardDevice(
                spec.name, self._private_key, self.implementation,  # type: ignore[arg-type]
                self.socket_dir, on_repair=self._on_repair,
            )  # fmt: skip
        self.device_v6.set_desired(spec)

    def _confirmed(self, _device: str, keys: frozenset[str]) -> None:
        if self.on_confirmed is not None:
            self.on_confirmed(keys)

    def report_unencrypted(self, count: int) -> None:
        if self._on_unencrypted is not None:
            self._on_unencrypted(count)

    def stop(self) -> None:
        if self.device is not None:
            self.device.stop()
        if self.device_v6 is not None:
            self.device_v6.stop()

    @property
    def running(self) -> bool:
        """A device is up (and not yet retired): a node that switched away may keep it."""
        return self.device is not None or self.device_v6 is not None

    def retire(self, after: float = RETIRE_AFTER_SECONDS) -> threading.Timer | None:
        """No peer needs the device any more: stop wireguard-go and delete the device
        ``after`` seconds from now, unless wireguard is planned again before. The device
        keeps its peers meanwhile (make-before-break): peers still sending through it
        do so until they see our new lease and move the pair to vxlan. Idempotent: a
        retire already pending is not pushed back."""
        with self._lock:
            if (self.device is None and self.device_v6 is None) or self._retire_pending:
                return None
            self._retiring += 1
            self._retire_pending = True
            ticket = self._retiring
        timer = threading.Timer(after, self._retire, args=(ticket,))
        timer.daemon = True
        timer.start()
        return timer

    def _retire(self, ticket: int) -> None:
        with self._lock:
            devices = [d for d in (self.device, self.device_v6) if d is not None]
            if ticket != self._retiring or not devices:
                return
            if self._sink is self.device:
                self._sink = None
            self.device = self.device_v6 = None
            self._retire_pending = False
        for device in devices:
            log.info("wireguard no longer used; removing device=%s", device.name)
            device.stop()
        self._confirmed(DEVICE, frozenset())  # a device made later starts over


def default_key_file(state_dir: str) -> str:
    return os.environ.get("WIREGUARD_KEY_FILE") or os.path.join(state_dir, "wireguard.key")


_runtime: WireguardRuntime | None = None


def set_runtime(runtime: WireguardRuntime | None) -> None:
    """Install the node's runtime (the composition root does, once per agent)."""
    global _runtime
    _runtime = runtime


def current_runtime() -> WireguardRuntime | None:
    return _runtime


def get_runtime() -> WireguardRuntime:
    if _runtime is None:
        raise ConfigError("the wireguard backend has no device runtime; start it through the agent")
    return _runtime
