"""IPv6 for pods, as the reference ``bridge`` plugin does it: sysctls, and waiting out
duplicate address detection.

The bridge gets the first address of the node's IPv6 pod subnet and ``accept_ra=0``
(it owns its routes), and ``net.ipv6.conf.all.forwarding=1`` is set; in the pod,
``accept_dad=0`` (and ``keep_addr_on_down=1``) is written for the interface before
its address goes on, then ADD waits until no address of the pod interface is
tentative (the reference's ``SettleAddresses``) and the bridge's gateway neither, so
the address is usable when ADD returns. Both the gateway and the pod address are also
added with ``IFA_F_NODAD``: a gateway address on a bridge that has no carrier yet
would otherwise sit tentative for a DAD round after the first port comes up.

Sysctls are those of the calling thread's network namespace: the pod's are written
by a thread inside it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from flannelpy.dataplane import nlbatch as nl
from flannelpy.dataplane import rtnl
from flannelpy.dataplane.podnames import IPInterface, interface_of
from flannelpy.errors import DataplaneError

SETTLE_SECONDS = 5.0  # the longest ADD waits for IPv6 addresses to leave tentative (as bridge's)


def write_sysctl(path: str, value: str) -> None:
    """Write ``/proc/sys/<path>`` in the calling thread's network namespace."""
    try:
        with open(f"/proc/sys/{path}", "w", encoding="ascii") as f:
            f.write(value)
    except OSError as e:
        raise DataplaneError(
            f"cannot set {path.replace('/', '.')}={value} ({e.strerror}); the agent needs"
            " write access to /proc/sys/net"
        ) from e


def read_sysctl(path: str) -> str | None:
    try:
        with open(f"/proc/sys/{path}", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


def enable_on_bridge(bridge: str) -> None:
    """The bridge owns its routes (no RA), and the node forwards IPv6 for its pods."""
    write_sysctl(f"net/ipv6/conf/{bridge}/accept_ra", "0")
    if read_sysctl(f"net/ipv6/conf/{bridge}/disable_ipv6") == "1":
        write_sysctl(f"net/ipv6/conf/{bridge}/disable_ipv6", "0")
    if read_sysctl("net/ipv6/conf/all/forwarding") != "1":
        write_sysctl("net/ipv6/conf/all/forwarding", "1")


def prepare_pod_interface(ifname: str) -> None:
    """Before the link is up, in the pod: IPv6 on, no DAD for any address."""
    for name in ("lo", ifname):
        if read_sysctl(f"net/ipv6/conf/{name}/disable_ipv6") == "1":
            write_sysctl(f"net/ipv6/conf/{name}/disable_ipv6", "0")
    write_sysctl(f"net/ipv6/conf/{ifname}/accept_dad", "0")
    # As the reference's IPAM does: the pod may take its link down and up without
    # losing its IPv6 address.
    write_sysctl(f"net/ipv6/conf/{ifname}/keep_addr_on_down", "1")


def dad_state(row: rtnl.AddrRow | rtnl.AddrRow6) -> str | None:
    """Why an address is not usable yet, or None when it is."""
    if row.flags & rtnl.IFA_F_DADFAILED:
        return "failed duplicate address detection"
    if row.flags & rtnl.IFA_F_TENTATIVE:
        return "tentative"
    return None


def settle(
    sock: nl.NetlinkSocket, ifindex: int, what: str, wanted: Sequence[IPInterface] = ()
) -> None:
    """Wait until no IPv6 address of ``ifindex`` (only those in ``wanted``, if given) is
    tentative; fail at once on DADFAILED, after SETTLE_SECONDS otherwise."""
    deadline = time.monotonic() + SETTLE_SECONDS
    pause = 0.001
    while True:
        pending = [
            a
            for a in nl.dump_link_addresses(sock, ifindex)
            if a.address.version == 6
            and (not wanted or interface_of(a) in wanted)
            and dad_state(a) is not None
        ]
        failed = [a for a in pending if a.flags & rtnl.IFA_F_DADFAILED]
        if failed:
            raise DataplaneError(
                f"{what}: address {interface_of(failed[0])} failed duplicate address"
                " detection; another host on the link uses it"
            )
        if not pending:
            return
        if time.monotonic() > deadline:
            raise DataplaneError(
                f"{what}: address {interface_of(pending[0])} is still tentative after"
                f" {SETTLE_SECONDS:g} s; check that the link is up"
            )
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
