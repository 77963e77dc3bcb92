"""This node's VTEP MAC: stable across restarts, loaded only once a VTEP is wanted."""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from pathlib import Path

from flannelpy.backend.base import Backend, NodeContext
from flannelpy.dataplane.kernel import Kernel
from flannelpy.fsutil import atomic_write
from flannelpy.subnet.lease import Lease

log = logging.getLogger("flannelpy.agent.vtep")


def load_vtep_mac(
    kernel: Kernel, state_dir: str, device: str, advertised: str | None = None
) -> str:
    """A stable VTEP MAC: the live device's, else the one we last advertised (our Node's
    backend-data annotation in Kubernetes mode), else the one we recorded, else a new one.

    Peers hold our MAC in their neighbour and FDB tables; a new MAC after a
    restart would leave them stale until they see our lease change.
    """
    path = Path(state_dir) / f"vtep-mac-{device}"
    mac = kernel.link_mac(device) or advertised
    if mac is None and path.exists():
        mac = path.read_text().strip().lower() or None
    if mac is None:
        octets = [random.randrange(256) for _ in range(6)]
        octets[0] = (octets[0] & 0xFE) | 0x02  # unicast, locally administered
        mac = ":".join(f"{o:02x}" for o in octets)
    if not path.exists() or path.read_text().strip() != mac:
        atomic_write(path, mac + "\n", durable=True)
    return mac


class VtepMac:
    """The MAC we advertise while we keep a VTEP (always with vxlan; with host-gw while
    a peer may still encapsulate to us)."""

    def __init__(self, kernel: Kernel, state_dir: str, mac: str | None) -> None:
        self._kernel = kernel
        self._state_dir = state_dir
        self.mac = mac

    def if_needed(self, backend: Backend, ctx: NodeContext, peers: Sequence[Lease]) -> str | None:
        if not backend.needs_vtep(ctx, peers):
            return None
        if self.mac is None:
            from flannelpy.backend.vxlan import device_name

            self.mac = load_vtep_mac(
                self._kernel, self._state_dir, device_name(ctx.config.backend.vni)
            )
        return self.mac
