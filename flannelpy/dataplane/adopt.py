"""Which routes another Flannel left on this node are ours to take over (pure).

A node that ran the upstream flanneld before ours holds its routes to the peers'
subnets: ``10.244.5.0/24 via 10.244.5.0 dev flannel.1 onlink`` (vxlan) or
``10.244.5.0/24 via 100.64.0.5 dev eth0`` (host-gw, DirectRouting), installed
without a protocol, so the kernel tags them ``boot``. They are the same routes we
would program for the same leases. Taking them over (re-tagged with our protocol
by one replace, or deleted when no lease asks for them any more) keeps pod
traffic flowing through the switch; refusing them (the overlap check) or leaving
them (a departed peer's route, never cleaned) does not.

Only routes of exactly Flannel's shape qualify, so an operator's static route into
the Network (another prefix length, another device, another protocol) still counts
as foreign.
"""

from __future__ import annotations

from dataclasses import dataclass
from ipaddress import IPv4Address, IPv4Network

RTPROT_BOOT = 3  # what the kernel records for a route added without a protocol


@dataclass(frozen=True)
class FlannelRouteShape:
    """What a route flanneld installs for a peer's lease looks like on this node."""

    network: IPv4Network  # the Network of net-conf.json
    subnet_len: int  # its SubnetLen: every lease has this prefix length
    vxlan_device: str | None  # flannel.<VNI>: vxlan routes go through it
    underlay: str  # the underlay device: host-gw and DirectRouting routes go through it

    def adoptable(
        self, dst: IPv4Network, gateway: IPv4Address | None, device: str, protocol: int
    ) -> bool:
        """Is this route one flanneld would have installed for a lease in the Network?"""
        if protocol != RTPROT_BOOT or gateway is None:
            return False
        if dst.prefixlen != self.subnet_len or not dst.subnet_of(self.network):
            return False
        if self.vxlan_device is not None and device == self.vxlan_device:
            # Flannel's vxlan route: via the peer's VTEP address, its subnet's network address.
            return gateway == dst.network_address
        # host-gw / DirectRouting: via the peer's public IP on the underlay, never into the
        # Network itself.
        return device == self.underlay and gateway not in self.network
