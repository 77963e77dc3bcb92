"""Dual stack against a real kernel: two nodes on one veth with an IPv4 and an IPv6
(ULA) underlay, each programmed from its backend's plan through NetlinkKernel, then
real packets in both families: flannel.1 over IPv4, flannel-v6.1 over IPv6 with the
70-byte IPv6 overhead (a DF packet of exactly the device MTU crosses, one byte more is
refused locally), host-gw routes per family, and a reconcile pass that finds nothing
left to do."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network

import pytest

from flannelpy.backend.base import NodeContext
from flannelpy.backend.registry import get_backend
from flannelpy.config.netconf import parse_network_config
from flannelpy.dataplane.diff import diff
from flannelpy.dataplane.netlink import NetlinkKernel
from flannelpy.subnet.lease import Lease
from tests.support.netns_util import Netns, is_root, sh, temp_netns, unique_name

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(not is_root(), reason="network namespaces need root"),
]

MACS = {1: "02:00:00:00:01:01", 2: "02:00:00:00:01:02"}
# flannel-v6.1's own MACs (bit 2 of the first octet flipped), as each node advertises them.
MACS6 = {1: "06:00:00:00:01:01", 2: "06:00:00:00:01:02"}


def config(backend: str) -> object:
    return parse_network_config(
        json.dumps(
            {
                "Network": "10.244.0.0/16",
                "EnableIPv6": True,
                "IPv6Network": "fc00::/48",
                "Backend": {"Type": backend},
            }
        )
    )


@pytest.fixture
def pair() -> Iterator[tuple[Netns, Netns]]:
    """Two node namespaces joined by one veth (u0 each): 192.168.77.n/24, fd00:64::n/64."""
    with temp_netns("d1") as a, temp_netns("d2") as b:
        left, right = unique_name("dsa"), unique_name("dsb")
        sh(["ip", "link", "add", left, "type", "veth", "peer", "name", right])
        for ns, dev, n in ((a, left, 1), (b, right, 2)):
            sh(["ip", "link", "set", dev, "netns", ns.name])
            ns.ip(f"link set {dev} name u0")
            ns.ip("link set u0 up")
            ns.ip(f"addr add 192.168.77.{n}/24 dev u0")
            ns.ip(f"addr add fd00:64::{n}/64 dev u0 nodad")
            ns.ip("route add default via 192.168.77.254")
            ns.exec("sysctl -qw net.ipv6.conf.all.forwarding=1")
        yield a, b


def node_lease(n: int, backend: str, mtu: int) -> Lease:
    from flannelpy.subnet.lease import LeaseAttrs

    data = {"VNI": 1, "VtepMAC": MACS[n]} if backend == "vxlan" else None
    data6 = {"VNI": 1, "VtepMAC": MACS6[n]} if backend == "vxlan" else None
    return Lease(
        subnet=IPv4Network(f"10.244.{n}.0/24"),
        ipv6_subnet=IPv6Network(f"fc00:0:0:{n}::/64"),
        attrs=LeaseAttrs(
            public_ip=IPv4Address(f"192.168.77.{n}"),
            backend_type=backend,
            backend_data=data,
            public_ipv6=IPv6Address(f"fd00:64::{n}"),
            backend_v6_data=data6,
            mtu=mtu,
        ),
    )


def program(ns: Netns, n: int, backend: str) -> NodeContext:
    """Plan node ``n`` against the other and apply it; the second pass must be empty."""
    kernel = NetlinkKernel()
    underlay = ns.call(kernel.find_underlay, ("u0",))
    assert underlay.ip6 == IPv6Address(f"fd00:64::{n}")
    ctx = NodeContext(
        config=config(backend),  # type: ignore[arg-type]
        underlay=underlay,
        public_ip=underlay.ip,
        node_name=f"n{n}",
        public_ipv6=underlay.ip6,
    )
    be = get_backend(backend)
    mac = MACS[n] if backend == "vxlan" else None
    own, peer = node_lease(n, backend, be.mtu(ctx)), node_lease(3 - n, backend, be.mtu(ctx))
    desired = be.plan(ctx, [own], [peer], mac)
    names = [link.name for link in desired.links]
    observed = ns.call(kernel.observe, names, names)
    result = ns.call(kernel.apply, diff(desired, observed))
    assert result.failures == ()
    again = diff(desired, ns.call(kernel.observe, names, names))
    assert again.empty, again
    return ctx


def ping(ns: Netns, dst: str, size: int | None = None) -> tuple[bool, str]:
    """One DF ping (no -q: iputils does not print "message too long" with -q)."""
    args = ["ping", "-c", "1", "-W", "2"]
    if size is not None:
        args += ["-M", "do", "-s", str(size)]
    proc = ns.exec([*args, dst], check=False)
    return proc.returncode == 0, proc.stdout + proc.stderr


def test_vxlan_dual_stack_reaches_in_both_families_with_the_ipv6_mtu_right(
    pair: tuple[Netns, Netns],
) -> None:
    a, b = pair
    program(a, 1, "vxlan")
    program(b, 2, "vxlan")
    link6 = a.ip("-d link show flannel-v6.1")
    assert "mtu 1430" in link6 and "local fd00:64::1" in link6
    assert "mtu 1450" in a.ip("link show flannel.1")
    # A MAC per device and family, as flanneld's; the peer's FDB names each.
    assert f"link/ether {MACS6[1]} " in link6
    assert f"link/ether {MACS[1]} " in a.ip("link show flannel.1")
    assert "fc00:0:0:2::/64 via fc00:0:0:2:: dev flannel-v6.1" in a.ip("-6 route show proto 75")
    assert (
        "dst fd00:64::2" in a.ip("neigh show dev flannel-v6.1")
        or "fd00:64::2"
        in sh(
            ["ip", "netns", "exec", a.name, "bridge", "fdb", "show", "dev", "flannel-v6.1"]
        ).stdout
    )
    # Each family crosses through its own device, node to node (VTEP to VTEP).
    ok4, out4 = ping(a, "10.244.2.0")
    assert ok4, out4
    ok6, out6 = ping(a, "fc00:0:0:2::")
    assert ok6, out6
    # IPv6 over IPv6: a DF packet of exactly 1430 (payload 1430-40-8) crosses: 1430 + 70
    # fills the 1500-byte underlay. One byte more is refused here, not lost on the way.
    ok, out = ping(a, "fc00:0:0:2::", 1430 - 48)
    assert ok, out
    ok, out = ping(a, "fc00:0:0:2::", 1430 - 48 + 1)
    assert not ok and re.search(r"[Mm]essage too long|mtu ?= ?1430", out), out
    # IPv4 over IPv4: 1450 (payload 1450-20-8).
    ok, out = ping(a, "10.244.2.0", 1450 - 28)
    assert ok, out
    ok, out = ping(a, "10.244.2.0", 1450 - 28 + 1)
    assert not ok and re.search(r"[Mm]essage too long|mtu ?= ?1450", out), out


def test_host_gw_dual_stack_routes_each_family_via_the_peer(pair: tuple[Netns, Netns]) -> None:
    a, b = pair
    for ns, n in ((a, 1), (b, 2)):
        program(ns, n, "host-gw")
        # Stand-ins for cni0's gateway addresses: the first address of each own subnet.
        ns.ip(f"addr add 10.244.{n}.1/32 dev lo")
        ns.ip(f"addr add fc00:0:0:{n}::1/128 dev lo")
    assert "fc00:0:0:2::/64 via fd00:64::2 dev u0" in a.ip("-6 route show proto 75")
    ok4, out4 = ping(a, "10.244.2.1")
    assert ok4, out4
    ok6, out6 = ping(a, "fc00:0:0:2::1")
    assert ok6, out6
    # host-gw: the full underlay MTU in IPv6 too (1500 - 48).
    ok, out = ping(a, "fc00:0:0:2::1", 1500 - 48)
    assert ok, out
