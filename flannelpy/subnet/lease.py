"""The lease model, and Flannel's JSON format for it (its key: :mod:`flannelpy.subnet.keys`).

A lease is one node's claim on one subnet of the network. The value format is
Flannel's ``LeaseAttrs`` so that flanneld and flannelpy nodes can share one
etcd; our own additions live under the ``"Flannelpy"`` key, which Go's JSON
decoder ignores.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network
from typing import Any

from flannelpy.subnet.bounded_json import loads_bounded
from flannelpy.subnet.json_object import JsonObject
from flannelpy.subnet.keys import subnet_to_key

EXTENSION_KEY = "Flannelpy"
_NO_IPV4 = "0.0.0.0"


@dataclass(frozen=True, slots=True)
class LeaseAttrs:
    """What a node advertises with its lease (Flannel's LeaseAttrs plus extensions)."""

    public_ip: IPv4Address | None  # None: IPv6-only (Flannel writes "0.0.0.0")
    backend_type: str
    backend_data: Mapping[str, Any] | None = None
    public_ipv6: IPv6Address | None = None  # the node's IPv6 underlay address (dual stack)
    backend_v6_data: Mapping[str, Any] | None = None
    # Extensions (Flannel ignores them): the node's name, used to recognise a
    # node re-created with a new address, its overlay MTU, and whether a vxlan
    # node routes on-link peers directly (peers choose the same path back).
    node_name: str | None = None
    mtu: int | None = None
    direct_routing: bool | None = None  # True, or None: written only when True

    @property
    def vtep_mac(self) -> str | None:
        return _lower_mac(self.backend_data)

    def to_json(self) -> str:
        doc: dict[str, Any] = {
            # An IPv6-only node has no IPv4 address: Flannel's zero ip.IP4 is "0.0.0.0".
            "PublicIP": str(self.public_ip) if self.public_ip is not None else _NO_IPV4,
            "PublicIPv6": str(self.public_ipv6) if self.public_ipv6 is not None else None,
            "BackendType": self.backend_type,
        }
        if self.backend_data is not None:
            doc["BackendData"] = dict(self.backend_data)
        if self.backend_v6_data is not None:
            doc["BackendV6Data"] = dict(self.backend_v6_data)
        ext: dict[str, Any] = {}
        if self.node_name is not None:
            ext["NodeName"] = self.node_name
        if self.mtu is not None:
            ext["MTU"] = self.mtu
        if self.direct_routing:
            ext["DirectRouting"] = True
        if ext:
            doc[EXTENSION_KEY] = ext
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | bytes) -> LeaseAttrs:
        """Parse a lease value written by another machine: bounded in size and depth,
        every field type-checked. Raises ValueError naming what is wrong."""
        try:
            doc = loads_bounded(raw)
        except ValueError as e:
            raise ValueError(f"lease {e}") from e
        if not isinstance(doc, dict):
            raise ValueError("lease value is not a JSON object")
        try:
            public_ip: IPv4Address | None = IPv4Address(doc["PublicIP"])
        except (KeyError, ValueError, TypeError) as e:
            raise ValueError(f"lease value has no valid PublicIP: {doc.get('PublicIP')!r}") from e
        if public_ip == IPv4Address(_NO_IPV4):
            public_ip = None
        ext = doc.get(EXTENSION_KEY) or {}
        if not isinstance(ext, dict):
            ext = {}
        mtu = ext.get("MTU")
        name = ext.get("NodeName")
        public_ipv6 = _ipv6_or_none(doc.get("PublicIPv6"))
        if public_ip is None and public_ipv6 is None:
            raise ValueError("lease value has neither a PublicIP nor a PublicIPv6")
        backend_type = doc.get("BackendType")
        return cls(
            public_ip=public_ip,
            backend_type=sys.intern(backend_type) if isinstance(backend_type, str) else "",
            backend_data=_object_or_none(doc.get("BackendData")),
            public_ipv6=public_ipv6,
            backend_v6_data=_object_or_none(doc.get("BackendV6Data")),
            node_name=name if isinstance(name, str) else None,
            mtu=mtu if isinstance(mtu, int) and not isinstance(mtu, bool) else None,
            direct_routing=True if ext.get("DirectRouting") is True else None,
        )

    @property
    def vtep_mac_v6(self) -> str | None:
        """The MAC of the node's IPv6 VTEP (``flannel-v6.<VNI>``), from BackendV6Data."""
        return _lower_mac(self.backend_v6_data)


def _lower_mac(data: Mapping[str, Any] | None) -> str | None:
    """``VtepMAC`` in lower case: the lease's own string when it is (as Flannel writes
    it), so the plan's neighbour and FDB entry share it instead of each holding a copy."""
    mac = (data or {}).get("VtepMAC")
    if not mac:
        return None
    text = str(mac)
    lower = text.lower()
    return text if lower == text else lower


def _ipv6_or_none(value: Any) -> IPv6Address | None:
    """PublicIPv6: absent, null or not a string is "no IPv6" (as for the other fields);
    a string must be an IPv6 address (a lease from another machine naming a bogus one
    is refused, not half-read)."""
    if not isinstance(value, str) or value == "":
        return None
    if len(value) > 64:
        raise ValueError(f"lease value has no valid PublicIPv6: {value[:64]!r}...")
    try:
        return IPv6Address(value)
    except ValueError as e:
        raise ValueError(f"lease value has no valid PublicIPv6: {value!r}") from e


def _object_or_none(value: Any) -> Mapping[str, Any] | None:
    """A JSON object as a :class:`JsonObject`: JSON's decoder gives every lease a dict
    of its own, with its own ``"VNI"`` and ``"VtepMAC"``, where thousands of leases can
    share the names and keep their values in a tuple."""
    if not isinstance(value, dict):
        return None
    return JsonObject(value)


@dataclass(frozen=True, slots=True)
class Lease:
    """A subnet held by a node. ``expiration`` is a unix time, None for a reservation.

    ``subnet`` is the IPv4 subnet, ``ipv6_subnet`` the IPv6 one: both in dual stack,
    only ``subnet`` in IPv4 mode, only ``ipv6_subnet`` in IPv6-only mode (at least
    one, checked on construction)."""

    subnet: IPv4Network | None
    attrs: LeaseAttrs
    expiration: float | None = None
    ipv6_subnet: IPv6Network | None = None
    # Store bookkeeping: etcd mod revision and lease id (0/None when not from etcd).
    revision: int = field(default=0, compare=False)
    store_lease_id: int | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.subnet is None and self.ipv6_subnet is None:
            raise ValueError("a lease needs an IPv4 or an IPv6 subnet")

    @property
    def ipv4_subnet(self) -> IPv4Network:
        """The IPv4 subnet, for code that runs only with IPv4 (pools, warm capacity,
        rollouts): raises ValueError on an IPv6-only lease."""
        if self.subnet is None:
            raise ValueError(f"lease {self.key} has no IPv4 subnet (IPv6-only)")
        return self.subnet

    @property
    def subnets(self) -> tuple[IPv4Network | IPv6Network, ...]:
        """The lease's subnets, IPv4 first."""
        return tuple(n for n in (self.subnet, self.ipv6_subnet) if n is not None)

    @property
    def primary_subnet(self) -> IPv4Network | IPv6Network:
        """The subnet that names the lease in logs and metrics: IPv4, else IPv6."""
        return self.subnets[0]

    @property
    def order(self) -> tuple[int, int, int, int]:
        """A sort key: by IPv4 subnet (as IPv4Network sorts), IPv6-only leases first."""
        v4 = (int(self.subnet.network_address), self.subnet.prefixlen) if self.subnet else (-1, 0)
        v6 = self.ipv6_subnet
        return (*v4, int(v6.network_address) if v6 else -1, v6.prefixlen if v6 else 0)

    @property
    def key(self) -> str:
        return subnet_to_key(self.subnet, self.ipv6_subnet)

    @property
    def vtep_ip(self) -> IPv4Address | None:
        """The VTEP address Flannel puts on the vxlan device: the subnet's network
        address; None without IPv4."""
        return self.subnet.network_address if self.subnet is not None else None

    @property
    def gateway(self) -> IPv4Address | None:
        """The first usable address of the subnet: the bridge gateway, FLANNEL_SUBNET's
        address; None without IPv4."""
        return self.subnet.network_address + 1 if self.subnet is not None else None

    @property
    def vtep_ip6(self) -> IPv6Address | None:
        """The IPv6 VTEP address (on ``flannel-v6.<VNI>`` as /128): the IPv6 subnet's
        network address, as Flannel does; None without IPv6."""
        return self.ipv6_subnet.network_address if self.ipv6_subnet is not None else None

    @property
    def gateway6(self) -> IPv6Address | None:
        """The IPv6 bridge gateway, FLANNEL_IPV6_SUBNET's address; None without IPv6."""
        return self.ipv6_subnet.network_address + 1 if self.ipv6_subnet is not None else None
