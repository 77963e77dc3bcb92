"""The whole etcd keyspace, in one place (no client import: pure string maths).

Flannel's keys, shared with flanneld so both can run in one cluster::

    <prefix>/config                              net-conf.json
    <prefix>/subnets/10.244.1.0-24               a lease (dual stack: ...-24&fd00:1::-64;
                                                 IPv6-only: 0.0.0.0-0&fd00:1::-64)

flannelpy's own, under ``<prefix>/flannelpy/`` (Flannel never reads them)::

    <prefix>/flannelpy/pools/10.250.0.0-16       an address pool (IPv6: fd00:250::-48)
    <prefix>/flannelpy/nodes/<node>/override     a node's wanted Backend
    <prefix>/flannelpy/nodes/<node>/status       what the node's agent runs and sees
    <prefix>/flannelpy/rollout                   the backend rollout's record
    <prefix>/flannelpy/events/<unix-ns>-<node>   a change forced past the disruption policy

``prefix`` is ``--etcd-prefix`` (``/coreos.com/network`` by default); a trailing
slash is ignored.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network


@dataclass(frozen=True)
class KeyValue:
    """One key as read from the store."""

    key: str
    value: bytes
    mod_revision: int
    create_revision: int = 0
    lease_id: int = 0  # 0: no TTL lease attached (a permanent key)


# --- Flannel's keys --------------------------------------------------------------------


def config_key(prefix: str) -> str:
    return f"{prefix.rstrip('/')}/config"


def subnets_prefix(prefix: str) -> str:
    return f"{prefix.rstrip('/')}/subnets/"


def lease_key(
    prefix: str, subnet: IPv4Network | None, ipv6_subnet: IPv6Network | None = None
) -> str:
    """``<prefix>/subnets/10.244.1.0-24``."""
    return subnets_prefix(prefix) + subnet_to_key(subnet, ipv6_subnet)


# Flannel's key of an IPv6-only lease: its empty IPv4 subnet (0.0.0.0/0) joined with
# the IPv6 one, ``0.0.0.0-0&fd00:1::-64`` (MakeSubnetKey with an empty ip.IP4Net).
_NO_IPV4_KEY_PART = "0.0.0.0-0"


def subnet_to_key(subnet: IPv4Network | None, ipv6_subnet: IPv6Network | None = None) -> str:
    """``10.244.1.0/24`` → ``10.244.1.0-24``; dual stack joins both with ``&``;
    IPv6-only (no IPv4 subnet) is ``0.0.0.0-0&fd00:1::-64``, as Flannel writes it."""
    if subnet is None:
        if ipv6_subnet is None:
            raise ValueError("a lease key needs an IPv4 or an IPv6 subnet")
        key = _NO_IPV4_KEY_PART
    else:
        key = f"{subnet.network_address}-{subnet.prefixlen}"
    if ipv6_subnet is not None:
        key += f"&{ipv6_subnet.network_address}-{ipv6_subnet.prefixlen}"
    return key


def key_to_subnet(key: str) -> tuple[IPv4Network | None, IPv6Network | None]:
    """Inverse of :func:`subnet_to_key` (at least one of the two is set); raises
    ValueError for a key that is not a lease."""
    v4_part, _, v6_part = key.partition("&")
    v6 = _parse_key_part(v6_part, 6) if v6_part else None
    assert v6 is None or isinstance(v6, IPv6Network)
    if v4_part == _NO_IPV4_KEY_PART:
        if v6 is None:
            raise ValueError(f"lease key {key!r} has neither an IPv4 nor an IPv6 subnet")
        return None, v6
    v4 = _parse_key_part(v4_part, 4)
    assert v4 is None or isinstance(v4, IPv4Network)
    if v4 is None:
        raise ValueError(f"lease key {key!r} has no IPv4 subnet")
    return v4, v6


def _parse_key_part(part: str, version: int) -> IPv4Network | IPv6Network | None:
    addr, sep, plen = part.rpartition("-")
    if not sep or not plen.isdigit():
        raise ValueError(f"lease key part {part!r} is not ADDRESS-PREFIXLEN")
    net = ipaddress.ip_network(f"{addr}/{plen}", strict=True)
    if net.version != version:
        raise ValueError(f"lease key part {part!r} is not IPv{version}")
    return net


# --- flannelpy's keys ------------------------------------------------------------------


def _root(prefix: str) -> str:
    return prefix.rstrip("/") + "/flannelpy/"


def pools_prefix(prefix: str) -> str:
    return _root(prefix) + "pools/"


def pool_key(prefix: str, network: IPv4Network | IPv6Network) -> str:
    """``<prefix>/flannelpy/pools/10.250.0.0-16`` (an IPv6 pool: ``.../fd00:250::-48``)."""
    return pools_prefix(prefix) + f"{network.network_address}-{network.prefixlen}"


def pool_key_network(suffix: str) -> IPv4Network | IPv6Network:
    """Inverse of :func:`pool_key` for the part after the pools prefix; ValueError for a
    key that is not in canonical ADDRESS-PREFIXLEN form."""
    addr, sep, plen = suffix.rpartition("-")
    try:
        network = ipaddress.ip_network(f"{addr}/{plen}", strict=True)
    except ValueError:
        network = None
    if not sep or network is None or f"{network.network_address}-{network.prefixlen}" != suffix:
        raise ValueError("the key is not in canonical ADDRESS-PREFIXLEN form")
    return network


def nodes_prefix(prefix: str) -> str:
    return _root(prefix) + "nodes/"


def override_key(prefix: str, node: str) -> str:
    return f"{nodes_prefix(prefix)}{node}/override"


def status_key(prefix: str, node: str) -> str:
    return f"{nodes_prefix(prefix)}{node}/status"


def node_of_key(prefix: str, key: str) -> tuple[str, str] | None:
    """``(node, "override"|"status")`` for a key under ``nodes/``, else None."""
    rest = key[len(nodes_prefix(prefix)) :] if key.startswith(nodes_prefix(prefix)) else None
    if rest is None or rest.count("/") != 1:
        return None
    node, kind = rest.split("/")
    return (node, kind) if node and kind in ("override", "status") else None


def rollout_key(prefix: str) -> str:
    return _root(prefix) + "rollout"


def events_prefix(prefix: str) -> str:
    return _root(prefix) + "events/"


def event_key(prefix: str, unix_ns: int, node: str) -> str:
    """``<prefix>/flannelpy/events/<unix-ns>-<node>``: keys sort by time."""
    return f"{events_prefix(prefix)}{unix_ns}-{node}"
