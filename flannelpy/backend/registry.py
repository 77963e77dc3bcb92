"""The explicit backend registry, looked up case-insensitively."""

from __future__ import annotations

from flannelpy.backend.base import Backend
from flannelpy.backend.hostgw import HostGwBackend
from flannelpy.backend.vxlan import VxlanBackend
from flannelpy.backend.wireguard import WireguardBackend
from flannelpy.errors import ConfigError

_BACKENDS: dict[str, type[Backend]] = {
    "vxlan": VxlanBackend,
    "host-gw": HostGwBackend,
    "wireguard": WireguardBackend,
}


def supported_backends() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def get_backend(type_name: str) -> Backend:
    try:
        return _BACKENDS[type_name.lower()]()
    except KeyError:
        raise ConfigError(
            f'backend "{type_name}" is not supported by flannelpy; '
            f"set Backend.Type to one of: {', '.join(_BACKENDS)}"
        ) from None
