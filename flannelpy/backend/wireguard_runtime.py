"""This node's WireGuard key and devices: what the reconciler applies the planned devices to.

The planner (:mod:`flannelpy.backend.wireguard`) puts each device's desired state in the
:class:`~flannelpy.dataplane.state.DesiredState` it returns, and never touches a device.
The agent loads the key (:meth:`WireguardRuntime.prepare`) when the node starts on
wireguard or switches to it; the reconciler hands every pass's devices to
:meth:`WireguardRuntime.apply`, which starts, updates and stops them
(:mod:`flannelpy.dataplane.wireguard`; each keeps itself as desired between passes). A
device leaving the plan goes at once: the planner keeps it in the plan for a grace first.
The runtime tells the agent which peers flannel-wg has completed a handshake with, so a
pair moves to the tunnel only once both ends can use it.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from typing import Protocol

from flannelpy.backend.wireguard_config import WireguardConfig, WireguardIdentity
from flannelpy.dataplane.wgkeys import load_or_create_key
from flannelpy.dataplane.wgkeys import public_key as public_key_of
from flannelpy.dataplane.wgspec import WgDeviceSpec
from flannelpy.errors import ConfigError, DataplaneError

log = logging.getLogger("flannelpy.backend.wireguard")


class Device(Protocol):
    """One running device (:class:`~flannelpy.dataplane.wireguard.WireguardDevice`, or a
    fake in tests)."""

    def set_desired(self, spec: WgDeviceSpec) -> None: ...

    def stop(self) -> None: ...


# name, private key, implementation, socket dir, on_repair, on_confirmed -> a device
DeviceFactory = Callable[..., Device]


def _real_device(
    name: str,
    private_key: str,
    implementation: str,
    socket_dir: str,
    on_repair: Callable[[str, int], None] | None,
    on_confirmed: Callable[[str, frozenset[str]], None] | None,
) -> Device:
    from flannelpy.dataplane.wireguard import WireguardDevice

    return WireguardDevice(
        name,
        private_key,
        implementation,  # type: ignore[arg-type]
        socket_dir,
        on_repair=on_repair,
        on_confirmed=on_confirmed,
    )


class WireguardRuntime:
    """This node's key and devices.

    ``key_file``: ``WIREGUARD_KEY_FILE`` when set (Flannel's variable), else
    ``<state-dir>/wireguard.key``. Nothing on the host changes until the key or a
    device is first needed."""

    def __init__(
        self,
        key_file: str,
        socket_dir: str,
        implementation: str | None = None,
        on_repair: Callable[[str, int], None] | None = None,
        on_prepared: Callable[[str], None] | None = None,
        make_device: DeviceFactory = _real_device,
    ) -> None:
        self.key_file = key_file
        self.socket_dir = socket_dir
        self._on_repair = on_repair
        self._on_prepared = on_prepared
        self._make_device = make_device
        self.implementation = implementation  # chosen by prepare(); None until then
        self._private_key: str | None = None
        self._lock = threading.Lock()
        self.devices: dict[str, Device] = {}  # by name: flannel-wg, flannel-wg-v6
        # Told, per device, the public keys it has completed a handshake with, when they
        # change (the agent's writer, which then routes those peers through the tunnel).
        self.on_confirmed: Callable[[str, frozenset[str]], None] | None = None

    def prepare(self, config: WireguardConfig) -> WireguardIdentity:
        """Choose kernel or userspace (refusing what cannot run) and load the key: the
        node's identity, which planning takes from the node context from then on."""
        from flannelpy.dataplane import wireguard as dp

        with self._lock:
            if self.implementation is None:
                self.implementation = dp.choose_implementation(
                    config.implementation, dp.kernel_module_available(), dp.find_wireguard_go()
                )
            if self._private_key is None:
                self._private_key = load_or_create_key(self.key_file)
                log.info(
                    "wireguard implementation=%s key_file=%s public_key=%s",
                    self.implementation,
                    self.key_file,
                    public_key_of(self._private_key),
                )
                if self._on_prepared is not None:
                    self._on_prepared(self.implementation)
            return WireguardIdentity(public_key_of(self._private_key), config)

    @property
    def public_key(self) -> str:
        if self._private_key is None:
            raise ConfigError("the WireGuard key is not loaded; the agent must prepare it first")
        return public_key_of(self._private_key)

    def apply(self, specs: Iterable[WgDeviceSpec]) -> None:
        """Make the running devices those of ``specs``: start the missing, hand each its
        desired state (a change is written before this returns, so the routes the
        reconciler writes next find their peers), stop the others."""
        wanted = {spec.name: spec for spec in specs}
        for name in [n for n in self.devices if n not in wanted]:
            log.info("wireguard no longer used; removing device=%s", name)
            self.devices.pop(name).stop()
            self._confirmed(name, frozenset())  # a device made later starts over
        for name, spec in sorted(wanted.items()):
            device = self.devices.get(name)
            if device is None:
                if self._private_key is None or self.implementation is None:
                    raise DataplaneError(
                        f"{name} is planned before the WireGuard key was loaded; restart the agent"
                    )
                device = self._make_device(
                    name,
                    self._private_key,
                    self.implementation,
                    self.socket_dir,
                    self._on_repair,
                    self._confirmed,
                )
                self.devices[name] = device
            device.set_desired(spec)

    def _confirmed(self, device: str, keys: frozenset[str]) -> None:
        if self.on_confirmed is not None:
            self.on_confirmed(device, keys)

    def stop(self) -> None:
        """The agent stops: the devices go too, as flanneld's do; the key stays."""
        for device in self.devices.values():
            device.stop()
        self.devices.clear()


def default_key_file(state_dir: str) -> str:
    return os.environ.get("WIREGUARD_KEY_FILE") or os.path.join(state_dir, "wireguard.key")
