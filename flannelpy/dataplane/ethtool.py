"""Transmit checksum offload of a link, through the legacy SIOCETHTOOL ioctl.

Flannel's documented fix for the kernel bug that leaves VXLAN UDP checksums
wrong on some NICs (packets reach the peer and are dropped there, silently) is
``ethtool -K flannel.1 tx-checksum-ip-generic off``. We do the same without the
ethtool binary: ETHTOOL_STXCSUM with a ``struct ethtool_value``, which the
kernel maps onto the device's checksum features.

The ioctl acts on the network namespace of the calling thread (the socket is
opened there), so namespace code calls it through ``run_in_netns``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import socket
import struct

from flannelpy.errors import DataplaneError, InterfaceNotFound

SIOCETHTOOL = 0x8946
ETHTOOL_GTXCSUM = 0x00000016
ETHTOOL_STXCSUM = 0x00000017
IFNAMSIZ = 16


class _EthtoolValue(ctypes.Structure):
    """``struct ethtool_value { __u32 cmd; __u32 data; }``"""

    _fields_ = [("cmd", ctypes.c_uint32), ("data", ctypes.c_uint32)]


def _ethtool(ifname: str, cmd: int, data: int = 0) -> int:
    """Run one ethtool_value command on ``ifname``; return the data the kernel left."""
    name = ifname.encode()
    if not name or len(name) >= IFNAMSIZ:
        raise InterfaceNotFound(
            f"{ifname!r} is not a valid interface name; give a name of 1..15 characters"
        )
    value = _EthtoolValue(cmd, data)
    # struct ifreq: the name, then a union whose ifr_data points at our struct.
    ifreq = struct.pack(f"{IFNAMSIZ}sP", name, ctypes.addressof(value))
    ifreq += b"\0" * (40 - len(ifreq))  # sizeof(struct ifreq) on 64-bit Linux
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            fcntl.ioctl(sock.fileno(), SIOCETHTOOL, ifreq)
    except OSError as e:
        if e.errno == errno.ENODEV:
            raise InterfaceNotFound(
                f"interface {ifname} does not exist in this network namespace; "
                "create it before changing its offloads"
            ) from e
        raise DataplaneError(
            f"ethtool request {cmd:#x} on {ifname} failed ({e.strerror}); "
            "check that the driver supports checksum offload changes and that we run as root"
        ) from e
    return int(value.data)


def tx_checksum(ifname: str) -> bool:
    """True when transmit checksum offload is on for ``ifname`` (ETHTOOL_GTXCSUM)."""
    return _ethtool(ifname, ETHTOOL_GTXCSUM) != 0


def set_tx_checksum(ifname: str, enabled: bool) -> None:
    """Turn transmit checksum offload of ``ifname`` on or off (ETHTOOL_STXCSUM).

    Idempotent; raises DataplaneError if the kernel did not take the change.
    """
    _ethtool(ifname, ETHTOOL_STXCSUM, int(enabled))
    if tx_checksum(ifname) != enabled:
        state = "on" if enabled else "off"
        raise DataplaneError(
            f"the driver of {ifname} did not turn tx checksum offload {state}; "
            "its checksum features are fixed, so leave --vxlan-tx-checksum-off unset"
        )
