"""Kubernetes mode, the pure part: Node objects in, leases and status patches out.

The Kubernetes subnet manager (:mod:`flannelpy.store.kube`) only moves JSON
between the API server and these functions. Nodes are plain dicts as the API
server sends them (``metadata``, ``spec``, ``status``), never client models:
large clusters list faster that way, and the tests need no client.

Flannel's annotations, with the default prefix ``flannel.alpha.coreos.com/``::

    kube-subnet-manager   "true" on every node a Flannel-compatible agent manages;
                          nodes without it are not peers
    backend-type          "vxlan", "host-gw"
    backend-data          the BackendData JSON as a string ("null" for host-gw)
    public-ip             the address peers send to
    public-ip-overwrite   set by the user: advertised instead of our own address
    node-public-ip        set by the user: acts as --public-ip for that node
    public-ipv6, backend-v6-data, public-ipv6-overwrite, node-public-ipv6
                          the same for IPv6 (dual stack), as Flannel writes them
    flannelpy-mtu         ours: the node's overlay MTU (Flannel ignores it)
"""

from __future__ import annotations

import json
import os
import re
import socket
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_network
from typing import Any

from flannelpy.config.netconf import NetworkConfig
from flannelpy.errors import ConfigError
from flannelpy.subnet.bounded_json import loads_bounded
from flannelpy.subnet.json_object import JsonObject
from flannelpy.subnet.lease import Lease, LeaseAttrs

Node = Mapping[str, Any]  # a Node object as JSON

MANAGED_VALUE = "true"
CONDITION_TYPE = "NetworkUnavailable"
CONDITION_REASON = "FlannelIsUp"
CONDITION_MESSAGE = "Flannel is running on this node"  # Flannel's text, kept for tools
_MAC = re.compile(r"[0-9a-f]{2}(:[0-9a-f]{2}){5}")


@dataclass(frozen=True)
class AnnotationKeys:
    """The full annotation names for one ``--kube-annotation-prefix``."""

    managed: str
    backend_type: str
    backend_data: str
    backend_v6_data: str
    public_ip: str
    public_ipv6: str
    public_ip_overwrite: str
    public_ipv6_overwrite: str
    node_public_ip: str
    node_public_ipv6: str
    mtu: str
    direct_routing: str


def annotation_keys(prefix: str) -> AnnotationKeys:
    """Flannel's rule: a prefix without ``/`` gets one appended; a prefix with one
    that does not end in ``/`` or ``-`` gets ``-`` (``example.com/net`` → ``example.com/net-``)."""
    if prefix.count("/") > 1:
        raise ConfigError(
            f"--kube-annotation-prefix {prefix!r} has more than one slash; "
            "use a DNS name like flannel.alpha.coreos.com, optionally followed by /name"
        )
    if "/" not in prefix:
        prefix += "/"
    if not prefix.endswith(("/", "-")):
        prefix += "-"
    return AnnotationKeys(
        managed=prefix + "kube-subnet-manager",
        backend_type=prefix + "backend-type",
        backend_data=prefix + "backend-data",
        backend_v6_data=prefix + "backend-v6-data",
        public_ip=prefix + "public-ip",
        public_ipv6=prefix + "public-ipv6",
        public_ip_overwrite=prefix + "public-ip-overwrite",
        public_ipv6_overwrite=prefix + "public-ipv6-overwrite",
        node_public_ip=prefix + "node-public-ip",
        node_public_ipv6=prefix + "node-public-ipv6",
        # Inside the same prefix, so two agents with different prefixes (two
        # networks on one cluster) never overwrite each other's value.
        mtu=prefix + "flannelpy-mtu",
        direct_routing=prefix + "flannelpy-direct-routing",
    )


# ---------------------------------------------------------------------------
# Node identity
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class NodeIdentity:
    """Either a node name, or the pod (namespace, name) whose spec.nodeName to read."""

    node_name: str | None = None
    pod_namespace: str | None = None
    pod_name: str | None = None


def resolve_identity(
    configured: str | None, environ: Mapping[str, str], hostname: str | None = None
) -> NodeIdentity:
    """Flannel's order: ``NODE_NAME``, else ``POD_NAME`` + ``POD_NAMESPACE``.

    ``configured`` is ``--node-name``; the flag parser fills it with the hostname
    when nothing is given, and a hostname must not beat the pod's own
    ``spec.nodeName`` (node names are often FQDNs or cloud instance ids).
    """
    hostname = hostname if hostname is not None else socket.gethostname()
    from_env = environ.get("NODE_NAME", "").strip()
    if from_env:
        return NodeIdentity(node_name=from_env)
    if configured and configured != hostname:
        return NodeIdentity(node_name=configured)
    pod = environ.get("POD_NAME", "").strip()
    namespace = environ.get("POD_NAMESPACE", "").strip()
    if pod and namespace:
        return NodeIdentity(pod_namespace=namespace, pod_name=pod)
    if configured:
        return NodeIdentity(node_name=configured)
    raise ConfigError(
        "cannot tell which Node this agent runs on; set NODE_NAME (fieldRef spec.nodeName) "
        "or POD_NAME and POD_NAMESPACE in the DaemonSet"
    )


def default_environ() -> Mapping[str, str]:
    return os.environ


# ---------------------------------------------------------------------------
# Reading nodes
# ---------------------------------------------------------------------------


def node_name(node: Node) -> str:
    return str((node.get("metadata") or {}).get("name") or "")


def node_annotations(node: Node) -> Mapping[str, str]:
    found = (node.get("metadata") or {}).get("annotations")
    return found if isinstance(found, dict) else {}


def resource_version(obj: Node) -> str | None:
    rv = (obj.get("metadata") or {}).get("resourceVersion")
    return str(rv) if rv else None


def pod_cidrs(node: Node) -> tuple[IPv4Network | None, IPv6Network | None]:
    """The node's IPv4 and IPv6 pod CIDRs from ``spec.podCIDRs`` (else ``spec.podCIDR``).

    Raises ValueError for a CIDR that does not parse or more than one per family.
    """
    spec = node.get("spec") or {}
    listed = spec.get("podCIDRs") or ([spec["podCIDR"]] if spec.get("podCIDR") else [])
    v4: IPv4Network | None = None
    v6: IPv6Network | None = None
    for text in listed:
        try:
            net = ip_network(str(text).strip(), strict=False)
        except ValueError as e:
            raise ValueError(f"pod CIDR {text!r} is not a CIDR") from e
        if isinstance(net, IPv4Network):
            if v4 is not None and v4 != net:
                raise ValueError(f"more than one IPv4 pod CIDR ({v4}, {net})")
            v4 = net
        else:
            if v6 is not None and v6 != net:
                raise ValueError(f"more than one IPv6 pod CIDR ({v6}, {net})")
            v6 = net
    return v4, v6


def own_subnets(
    node: Node, config: NetworkConfig
) -> tuple[IPv4Network | None, IPv6Network | None] | None:
    """Our lease's subnets from our Node, or None while the podCIDR of a family the
    network runs is not assigned (IPv4 only, both in dual stack, IPv6 only with
    EnableIPv4 false).

    Raises ConfigError when the podCIDR lies outside Network: the cluster's
    ``--cluster-cidr`` and net-conf.json disagree, and only a person can fix that.
    """
    name = node_name(node)
    try:
        v4, v6 = pod_cidrs(node)
    except ValueError as e:
        raise ConfigError(f"node {name}: {e}; fix spec.podCIDRs of the Node") from e
    if not config.enable_ipv4:
        return None if v6 is None else (None, _inside_ipv6_network(name, v6, config))
    if v4 is None:
        return None
    if config.network is None or not v4.subnet_of(config.network):
        raise ConfigError(
            f"node {name} has pod CIDR {v4}, which is outside Network {config.network} of "
            "net-conf.json; make net-conf.json's Network match the controller-manager's "
            "--cluster-cidr"
        )
    if not config.enable_ipv6:
        return v4, None
    if v6 is None:
        return None  # dual stack: wait until the controller-manager assigns both families
    return v4, _inside_ipv6_network(name, v6, config)


def _inside_ipv6_network(name: str, v6: IPv6Network, config: NetworkConfig) -> IPv6Network:
    if config.ipv6_network is None or not v6.subnet_of(config.ipv6_network):
        raise ConfigError(
            f"node {name} has IPv6 pod CIDR {v6}, which is outside IPv6Network "
            f"{config.ipv6_network} of net-conf.json; make them match"
        )
    return v6


def own_vtep_mac(node: Node, keys: AnnotationKeys) -> str | None:
    """The VtepMAC this node advertised before (its backend-data), if well-formed."""
    data = _json_object(node_annotations(node).get(keys.backend_data))
    mac = str((data or {}).get("VtepMAC") or "").strip().lower()
    return mac if _MAC.fullmatch(mac) else None


def node_public_ip(node: Node, keys: AnnotationKeys) -> IPv4Address | None:
    """The user-set ``node-public-ip`` annotation (acts as --public-ip), if valid."""
    return _ipv4_or_none(node_annotations(node).get(keys.node_public_ip))


def public_ip_overwrite(node: Node, keys: AnnotationKeys) -> IPv4Address | None:
    return _ipv4_or_none(node_annotations(node).get(keys.public_ip_overwrite))


def node_public_ipv6(node: Node, keys: AnnotationKeys) -> IPv6Address | None:
    """The user-set ``node-public-ipv6`` annotation (acts as --public-ipv6), if valid."""
    return _ipv6_or_none(node_annotations(node).get(keys.node_public_ipv6))


def public_ipv6_overwrite(node: Node, keys: AnnotationKeys) -> IPv6Address | None:
    return _ipv6_or_none(node_annotations(node).get(keys.public_ipv6_overwrite))


def _ipv6_or_none(text: Any) -> IPv6Address | None:
    if not text or len(str(text)) > 64:
        return None
    try:
        return IPv6Address(str(text).strip())
    except ValueError:
        return None


def _ipv4_or_none(text: Any) -> IPv4Address | None:
    if not text:
        return None
    try:
        return IPv4Address(str(text).strip())
    except ValueError:
        return None


def _json_object(text: Any) -> dict[str, Any] | None:
    if not text:
        return None
    try:
        value = loads_bounded(str(text))
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _mtu_or_none(text: str) -> int | None:
    # ASCII only: str.isdigit() accepts "²", which int() refuses.
    if not (text.isascii() and text.isdigit() and len(text) <= 6):
        return None
    return int(text)


class NotALease(ValueError):
    """A managed node whose annotations or podCIDR cannot make a lease (message says why)."""


def node_to_lease(node: Node, keys: AnnotationKeys, config: NetworkConfig) -> Lease | None:
    """The lease a peer node advertises, or None if it is not one of ours yet
    (no ``kube-subnet-manager: "true"``, or no podCIDR). Raises NotALease for a
    managed node with unusable data."""
    notes = node_annotations(node)
    if notes.get(keys.managed) != MANAGED_VALUE:
        return None
    try:
        v4, v6 = pod_cidrs(node)
    except ValueError as e:
        raise NotALease(str(e)) from e
    ipv6_only = not config.enable_ipv4
    if (v6 if ipv6_only else v4) is None:
        return None
    if v4 is not None and config.network is not None and not v4.subnet_of(config.network):
        raise NotALease(f"pod CIDR {v4} is outside Network {config.network}")
    # The overwrite is what the node will advertise once its agent sees it; using
    # it at once saves one round trip through that agent. IPv6-only, as flanneld, the
    # IPv4 annotations are not read.
    public_ip = None
    backend_data = None
    if not ipv6_only:
        public_ip = public_ip_overwrite(node, keys) or _ipv4_or_none(notes.get(keys.public_ip))
        if public_ip is None:
            raise NotALease(f"annotation {keys.public_ip} is not an IPv4 address")
        backend_data = _backend_data(notes.get(keys.backend_data), keys.backend_data)
    public_ipv6 = None
    if config.enable_ipv6:
        written = notes.get(keys.public_ipv6)
        public_ipv6 = public_ipv6_overwrite(node, keys) or _ipv6_or_none(written)
        if (written or ipv6_only) and public_ipv6 is None:
            raise NotALease(f"annotation {keys.public_ipv6} is not an IPv6 address")
    mtu_text = str(notes.get(keys.mtu) or "")
    attrs = LeaseAttrs(
        public_ip=public_ip,
        backend_type=str(notes.get(keys.backend_type) or ""),
        backend_data=backend_data,
        public_ipv6=public_ipv6,
        backend_v6_data=(
            _backend_data(notes.get(keys.backend_v6_data), keys.backend_v6_data)
            if public_ipv6 is not None
            else None
        ),
        node_name=node_name(node) or None,
        mtu=_mtu_or_none(mtu_text),
        direct_routing=True if notes.get(keys.direct_routing) == "true" else None,
    )
    ipv6 = v6 if config.enable_ipv6 else None
    return Lease(subnet=None if ipv6_only else v4, attrs=attrs, expiration=None, ipv6_subnet=ipv6)


def _backend_data(text: Any, key: str) -> Mapping[str, Any] | None:
    if text in (None, "", "null"):
        return None
    value = _json_object(text)
    if value is None:
        raise NotALease(f"annotation {key} is not a JSON object: {str(text)[:60]!r}")
    return JsonObject(value)  # a thousand Nodes' share their names


def leases_by_key(by_node: Mapping[str, Lease], own_node: str | None) -> dict[str, Lease]:
    """Node name → lease, re-keyed by lease key. Two nodes claiming one podCIDR (a
    controller-manager bug or a hand edit) keep one deterministically: our own
    node, else the first name in order. :func:`duplicate_claims` names the losers."""
    result: dict[str, Lease] = {}
    for name in sorted(by_node, key=lambda n: (n != own_node, n)):
        lease = by_node[name]
        result.setdefault(lease.key, lease)
    return result


def duplicate_claims(by_node: Mapping[str, Lease], kept: Mapping[str, Lease]) -> list[str]:
    """Names of nodes whose lease lost a podCIDR collision in :func:`leases_by_key`."""
    return sorted(name for name, lease in by_node.items() if kept.get(lease.key) is not lease)


# ---------------------------------------------------------------------------
# Writing our node
# ---------------------------------------------------------------------------


def advertised_attrs(attrs: LeaseAttrs, node: Node, keys: AnnotationKeys) -> LeaseAttrs:
    """What we advertise: ``attrs`` with a valid ``public-ip-overwrite`` (and
    ``public-ipv6-overwrite`` in dual stack) as the public IP, and the Node's name as
    the node name."""
    overwrite = public_ip_overwrite(node, keys)
    overwrite6 = public_ipv6_overwrite(node, keys) if attrs.public_ipv6 is not None else None
    name = node_name(node) or attrs.node_name
    return replace(
        attrs,
        public_ip=overwrite or attrs.public_ip,
        public_ipv6=overwrite6 or attrs.public_ipv6,
        node_name=name,
    )


def backend_data_text(data: Mapping[str, Any] | None) -> str:
    """Go's json.Marshal of the backend's RawMessage: compact; nil is ``null``."""
    return "null" if data is None else json.dumps(dict(data), separators=(",", ":"))


def desired_annotations(advertised: LeaseAttrs, keys: AnnotationKeys) -> dict[str, str]:
    wanted = {keys.managed: MANAGED_VALUE, keys.backend_type: advertised.backend_type}
    if advertised.public_ip is not None:  # IPv6-only: no IPv4 annotations, as flanneld
        wanted[keys.backend_data] = backend_data_text(advertised.backend_data)
        wanted[keys.public_ip] = str(advertised.public_ip)
    if advertised.public_ipv6 is not None:
        wanted[keys.public_ipv6] = str(advertised.public_ipv6)
        wanted[keys.backend_v6_data] = backend_data_text(advertised.backend_v6_data)
    if advertised.mtu is not None:
        wanted[keys.mtu] = str(advertised.mtu)
        # Always written ("false" too), so turning DirectRouting off needs no deletion.
        wanted[keys.direct_routing] = "true" if advertised.direct_routing else "false"
    return wanted


def _same_annotation(key: str, have: str | None, want: str, keys: AnnotationKeys) -> bool:
    if have == want:
        return True
    if have is not None and key in (keys.backend_data, keys.backend_v6_data):
        # Equal JSON written with other spacing or key order is not a change.
        try:
            return bool(json.loads(have) == json.loads(want))
        except ValueError:
            return False
    return False


def condition_is_set(node: Node) -> bool:
    for cond in (node.get("status") or {}).get("conditions") or []:
        if cond.get("type") == CONDITION_TYPE:
            return cond.get("status") == "False" and cond.get("reason") == CONDITION_REASON
    return False


def rfc3339(unix_time: float) -> str:
    return datetime.fromtimestamp(int(unix_time), UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def status_patch(
    node: Node,
    advertised: LeaseAttrs,
    keys: AnnotationKeys,
    now: float,
    set_condition: bool = True,
) -> dict[str, Any] | None:
    """The strategic-merge patch of ``nodes/<name>/status`` that brings our Node to
    ``advertised``, holding only what differs; None when nothing does.

    Conditions merge by ``type`` in a strategic-merge patch, so sending our one
    condition leaves the kubelet's (Ready, MemoryPressure, ...) alone. Without
    ``set_condition`` (``--set-node-network-unavailable=false``, as in flanneld) the
    condition is left to whoever else manages it.
    """
    current = node_annotations(node)
    changed = {
        key: value
        for key, value in desired_annotations(advertised, keys).items()
        if not _same_annotation(key, current.get(key), value, keys)
    }
    patch: dict[str, Any] = {}
    if changed:
        patch["metadata"] = {"annotations": changed}
    if set_condition and not condition_is_set(node):
        stamp = rfc3339(now)
        patch["status"] = {
            "conditions": [
                {
                    "type": CONDITION_TYPE,
                    "status": "False",
                    "reason": CONDITION_REASON,
                    "message": CONDITION_MESSAGE,
                    "lastTransitionTime": stamp,
                    "lastHeartbeatTime": stamp,
                }
            ]
        }
    return patch or None


def changed_keys(patch: Mapping[str, Any] | None) -> list[str]:
    """For logs: the annotation keys and condition a status patch writes."""
    if not patch:
        return []
    names: Iterable[str] = (patch.get("metadata") or {}).get("annotations", {}).keys()
    out = sorted(names)
    if "status" in patch:
        out.append(f"condition/{CONDITION_TYPE}")
    return out
