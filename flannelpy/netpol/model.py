"""NetworkPolicies, Pods and Namespaces as frozen values, parsed from the API's JSON.

The objects come from the API server, but the agent treats them as untrusted
input: every field is type-checked and bounded, and anything the agent cannot
represent exactly is refused with :class:`PolicyRefused` (one sentence naming
the object and the reason), never turned into a wider rule: that includes a field
of a policy's spec, rules, peers or ports that this agent does not know. The semantics are
``networking.k8s.io/v1``'s:

* a label selector's ``matchLabels`` and ``matchExpressions`` are ANDed; an empty
  selector selects everything; ``NotIn`` also matches objects without the key;
* a peer is an ``ipBlock`` or a ``podSelector`` and/or a ``namespaceSelector``:
  a pod selector alone means pods of the policy's namespace, a namespace
  selector alone every pod of the selected namespaces, both together the
  selected pods of the selected namespaces;
* ``policyTypes`` absent or empty: ``Ingress``, plus ``Egress`` when there are
  egress rules; rules of a direction not in ``policyTypes`` are ignored;
* a port without ``protocol`` is TCP; without ``port``, every port of the
  protocol; ``endPort`` needs a numeric ``port`` not above it; named ports are
  resolved later, per destination pod (:mod:`flannelpy.netpol.compile`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from ipaddress import IPv4Address, IPv4Network, IPv6Address, IPv6Network, ip_address, ip_network
from typing import Any

from flannelpy.errors import FlannelpyError

Net = IPv4Network | IPv6Network
Addr = IPv4Address | IPv6Address
PROTOCOLS = ("TCP", "UDP", "SCTP")
OPERATORS = ("In", "NotIn", "Exists", "DoesNotExist")
INGRESS = "Ingress"
EGRESS = "Egress"
MAX_ITEMS = 1000  # rules, peers, ports, expressions, values, labels: per list
MAX_TEXT = 317  # a qualified label key (253-char prefix, '/', 63-char name) is the longest
PORT_NAME = re.compile(r"^(?=.*[a-z])[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?$")  # IANA_SVC_NAME
METADATA_NAME = "kubernetes.io/metadata.name"
SPEC_FIELDS = ("podSelector", "ingress", "egress", "policyTypes")
DNS_LABEL = re.compile(r"^(?=.{1,63}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS_SUBDOMAIN = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9.]*[a-z0-9])?$")


class PolicyRefused(FlannelpyError):
    """An API object the agent cannot represent exactly; nothing of it is enforced."""

    exit_code = 2

    def __init__(self, what: str, reason: str) -> None:
        super().__init__(f"{what} is refused: {reason}")
        self.what = what
        self.reason = reason


# --- values -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Requirement:
    key: str
    operator: str  # one of OPERATORS
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "In":
            return self.key in labels and labels[self.key] in self.values
        if self.operator == "NotIn":
            return self.key not in labels or labels[self.key] not in self.values
        if self.operator == "Exists":
            return self.key in labels
        return self.key not in labels  # DoesNotExist


@dataclass(frozen=True)
class LabelSelector:
    """``matchLabels`` (as sorted pairs) AND ``matchExpressions``; empty selects all."""

    match_labels: tuple[tuple[str, str], ...] = ()
    expressions: tuple[Requirement, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.match_labels) and all(
            r.matches(labels) for r in self.expressions
        )


@dataclass(frozen=True)
class IPBlock:
    cidr: Net
    excepts: tuple[Net, ...] = ()

    def networks(self) -> tuple[Net, ...]:
        """``cidr`` minus every ``except``, as disjoint networks in address order."""
        nets: list[Net] = [self.cidr]
        for hole in self.excepts:
            nets = [part for net in nets for part in _exclude(net, hole)]
        return tuple(sorted(nets, key=lambda n: (n.network_address, n.prefixlen)))


@dataclass(frozen=True)
class Peer:
    """Exactly one of ``ip_block`` or (``pod_selector`` and/or ``namespace_selector``)."""

    pod_selector: LabelSelector | None = None
    namespace_selector: LabelSelector | None = None
    ip_block: IPBlock | None = None


@dataclass(frozen=True)
class Port:
    protocol: str = "TCP"
    port: int | str | None = None  # None: every port of the protocol; str: a named port
    end_port: int | None = None


@dataclass(frozen=True)
class Rule:
    """One ingress or egress rule; empty ``peers`` or ``ports``: any."""

    peers: tuple[Peer, ...] = ()
    ports: tuple[Port, ...] = ()


@dataclass(frozen=True)
class Policy:
    namespace: str
    name: str
    pod_selector: LabelSelector
    policy_types: frozenset[str]
    ingress: tuple[Rule, ...] = ()
    egress: tuple[Rule, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class ContainerPort:
    name: str
    port: int
    protocol: str = "TCP"


@dataclass(frozen=True)
class Pod:
    namespace: str
    name: str
    labels: tuple[tuple[str, str], ...]
    ips: tuple[Addr, ...]
    node: str
    ports: tuple[ContainerPort, ...] = ()
    host_network: bool = False

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @cached_property
    def label_map(self) -> dict[str, str]:  # computed once: selectors ask it per policy
        return dict(self.labels)

    @cached_property
    def addresses(self) -> tuple[tuple[int, int, str], ...]:
        """(family, integer, text) of each IP, computed once: every rule's sets list them."""
        return tuple((ip.version, int(ip), str(ip)) for ip in self.ips)

    def named_port(self, name: str, protocol: str) -> int | None:
        """The number of this pod's container port ``name`` with ``protocol``, if any."""
        for cp in self.ports:
            if cp.name == name and cp.protocol == protocol:
                return cp.port
        return None


@dataclass(frozen=True)
class Namespace:
    name: str
    labels: tuple[tuple[str, str], ...] = ()


# --- parsing ----------------------------------------------------------------------------


def parse_policy(obj: Any) -> Policy:
    """A ``networking.k8s.io/v1`` NetworkPolicy; :class:`PolicyRefused` if not exact."""
    namespace, name = _meta(obj, "NetworkPolicy")
    what = f"NetworkPolicy {namespace}/{name}"
    spec = _dict(obj.get("spec"), what, "spec", SPEC_FIELDS)
    selector = _selector(spec.get("podSelector"), what, "spec.podSelector")
    if selector is None:
        raise PolicyRefused(what, "spec.podSelector is missing; use {} to select every pod")
    ingress = _rules(spec, "ingress", "from", what)
    egress = _rules(spec, "egress", "to", what)
    types_raw = _list(spec.get("policyTypes"), what, "spec.policyTypes")
    types = set()
    for t in types_raw:
        if t not in (INGRESS, EGRESS):
            raise PolicyRefused(what, f"policyType {t!r} is neither Ingress nor Egress")
        types.add(t)
    if not types:  # the API's defaulting
        types = {INGRESS, EGRESS} if egress else {INGRESS}
    return Policy(
        namespace=namespace,
        name=name,
        pod_selector=selector,
        policy_types=frozenset(types),
        ingress=ingress if INGRESS in types else (),
        egress=egress if EGRESS in types else (),
    )


def parse_pod(obj: Any) -> Pod:
    """A Pod: labels, node, IPs (``status.podIPs``, else ``podIP``) and named ports."""
    namespace, name = _meta(obj, "Pod")
    what = f"Pod {namespace}/{name}"
    spec = _dict(obj.get("spec"), what, "spec")
    status = _dict(obj.get("status"), what, "status")
    raw_ips = [_dict(i, what, "status.podIPs[]").get("ip") for i in _list(
        status.get("podIPs"), what, "status.podIPs")]  # fmt: skip
    if not raw_ips and status.get("podIP"):
        raw_ips = [status["podIP"]]
    ips: list[Addr] = []
    for raw in raw_ips:
        try:
            ips.append(ip_address(_text(raw, what, "status.podIPs[].ip")))
        except ValueError as e:
            raise PolicyRefused(what, f"pod IP {raw!r} is not an IP address") from e
    ports: list[ContainerPort] = []
    for c in _list(spec.get("containers"), what, "spec.containers"):
        for p in _list(_dict(c, what, "spec.containers[]").get("ports"), what, "ports"):
            p = _dict(p, what, "spec.containers[].ports[]")
            if p.get("name") is None:
                continue
            number = _port_number(p.get("containerPort"), what)
            protocol = _protocol(p.get("protocol"), what)
            ports.append(ContainerPort(_text(p["name"], what, "port name"), number, protocol))
    phase = status.get("phase")
    return Pod(
        namespace=namespace,
        name=name,
        labels=_labels(obj["metadata"].get("labels"), what),
        # A finished pod's IP may already belong to another pod: it stands for nothing.
        ips=() if phase in ("Succeeded", "Failed") else tuple(dict.fromkeys(ips)),
        node=_text(spec.get("nodeName") or "", what, "spec.nodeName"),
        ports=tuple(ports),
        host_network=spec.get("hostNetwork") is True,
    )


def parse_namespace(obj: Any) -> Namespace:
    """A Namespace and its labels (with ``kubernetes.io/metadata.name``, as the API sets)."""
    _, name = _meta(obj, "Namespace", namespaced=False)
    labels = dict(_labels(obj["metadata"].get("labels"), f"Namespace {name}"))
    labels.setdefault(METADATA_NAME, name)
    return Namespace(name, tuple(sorted(labels.items())))


def _meta(obj: Any, kind: str, namespaced: bool = True) -> tuple[str, str]:
    if not isinstance(obj, dict) or not isinstance(obj.get("metadata"), dict):
        raise PolicyRefused(f"a {kind}", "metadata is missing or not an object")
    meta = obj["metadata"]
    name, namespace = meta.get("name"), meta.get("namespace", "")
    # Names reach nft comments: only what the API allows (no quotes, spaces, newlines).
    if not isinstance(name, str) or not DNS_SUBDOMAIN.match(name):
        raise PolicyRefused(f"a {kind}", "metadata.name is missing or not a DNS subdomain")
    if namespaced and (not isinstance(namespace, str) or not DNS_LABEL.match(namespace)):
        raise PolicyRefused(f"{kind} {name}", "metadata.namespace is missing or not a DNS label")
    return str(namespace), name


def _rules(spec: dict[str, Any], field: str, peers_field: str, what: str) -> tuple[Rule, ...]:
    rules = []
    for i, raw in enumerate(_list(spec.get(field), what, f"spec.{field}")):
        where = f"spec.{field}[{i}]"
        raw = _dict(raw, what, where, ("ports", peers_field))
        peers = tuple(
            _peer(p, what, f"{where}.{peers_field}[{j}]")
            for j, p in enumerate(_list(raw.get(peers_field), what, f"{where}.{peers_field}"))
        )
        ports = tuple(
            _port(p, what, f"{where}.ports[{j}]")
            for j, p in enumerate(_list(raw.get("ports"), what, f"{where}.ports"))
        )
        rules.append(Rule(peers, ports))
    return tuple(rules)


def _peer(raw: Any, what: str, where: str) -> Peer:
    raw = _dict(raw, what, where, ("podSelector", "namespaceSelector", "ipBlock"))
    pods = _selector(raw.get("podSelector"), what, f"{where}.podSelector")
    namespaces = _selector(raw.get("namespaceSelector"), what, f"{where}.namespaceSelector")
    block_raw = raw.get("ipBlock")
    if block_raw is not None:
        if pods is not None or namespaces is not None:
            raise PolicyRefused(what, f"{where} has an ipBlock beside a selector")
        return Peer(ip_block=_ip_block(block_raw, what, where))
    if pods is None and namespaces is None:
        raise PolicyRefused(what, f"{where} has no podSelector, namespaceSelector or ipBlock")
    return Peer(pod_selector=pods, namespace_selector=namespaces)


def _ip_block(raw: Any, what: str, where: str) -> IPBlock:
    raw = _dict(raw, what, f"{where}.ipBlock", ("cidr", "except"))
    cidr = _cidr(raw.get("cidr"), what, f"{where}.ipBlock.cidr")
    excepts = []
    for e in _list(raw.get("except"), what, f"{where}.ipBlock.except"):
        hole = _cidr(e, what, f"{where}.ipBlock.except")
        if hole.version != cidr.version or not _strictly_inside(hole, cidr):
            raise PolicyRefused(what, f"{where}.ipBlock.except {hole} is not inside cidr {cidr}")
        excepts.append(hole)
    return IPBlock(
        cidr, tuple(sorted(set(excepts), key=lambda n: (n.network_address, n.prefixlen)))
    )


def _port(raw: Any, what: str, where: str) -> Port:
    raw = _dict(raw, what, where, ("protocol", "port", "endPort"))
    protocol = _protocol(raw.get("protocol"), what)
    port, end = raw.get("port"), raw.get("endPort")
    if isinstance(port, str):
        if not PORT_NAME.match(port):
            raise PolicyRefused(what, f"{where}.port {port!r} is not a port name")
        if end is not None:
            raise PolicyRefused(what, f"{where}.endPort is set with the named port {port!r}")
        return Port(protocol, port)
    if port is None:
        if end is not None:
            raise PolicyRefused(what, f"{where}.endPort is set without a port")
        return Port(protocol)
    number = _port_number(port, what)
    if end is None:
        return Port(protocol, number)
    last = _port_number(end, what)
    if last < number:
        raise PolicyRefused(what, f"{where}.endPort {last} is below port {number}")
    return Port(protocol, number, last)


def _selector(raw: Any, what: str, where: str) -> LabelSelector | None:
    if raw is None:
        return None
    raw = _dict(raw, what, where, ("matchLabels", "matchExpressions"))
    labels = _labels(raw.get("matchLabels"), what)
    expressions = []
    for e in _list(raw.get("matchExpressions"), what, f"{where}.matchExpressions"):
        e = _dict(e, what, f"{where}.matchExpressions[]", ("key", "operator", "values"))
        key = _text(e.get("key"), what, f"{where}.matchExpressions[].key")
        op = e.get("operator")
        if op not in OPERATORS:
            raise PolicyRefused(what, f"{where} has the unknown operator {op!r} for key {key!r}")
        values = tuple(
            sorted({_text(v, what, f"{where}.values") for v in _list(e.get("values"), what, "")})
        )
        if op in ("In", "NotIn") and not values:
            raise PolicyRefused(what, f"{where} operator {op} for key {key!r} has no values")
        if op in ("Exists", "DoesNotExist") and values:
            raise PolicyRefused(what, f"{where} operator {op} for key {key!r} has values")
        expressions.append(Requirement(key, op, values))
    unique = sorted(set(expressions), key=lambda r: (r.key, r.operator, r.values))
    return LabelSelector(labels, tuple(unique))


def _labels(raw: Any, what: str) -> tuple[tuple[str, str], ...]:
    if raw is None:
        return ()
    if not isinstance(raw, dict) or len(raw) > MAX_ITEMS:
        raise PolicyRefused(what, "labels are not a map of at most 1000 strings")
    return tuple(
        sorted((_text(k, what, "label key"), _text(v, what, "label")) for k, v in raw.items())
    )


def _cidr(raw: Any, what: str, where: str) -> Net:
    try:
        # Host bits are masked off, as the API server's own parsing does.
        return ip_network(_text(raw, what, where), strict=False)
    except ValueError as e:
        raise PolicyRefused(what, f"{where} {raw!r} is not a CIDR") from e


def _protocol(raw: Any, what: str) -> str:
    if raw is None:
        return "TCP"
    if raw not in PROTOCOLS:
        raise PolicyRefused(what, f"protocol {raw!r} is not TCP, UDP or SCTP")
    return str(raw)


def _port_number(raw: Any, what: str) -> int:
    if isinstance(raw, bool) or not isinstance(raw, int) or not 1 <= raw <= 65535:
        raise PolicyRefused(what, f"port {raw!r} is not a number from 1 to 65535")
    return raw


def _text(raw: Any, what: str, where: str) -> str:
    if not isinstance(raw, str) or len(raw) > MAX_TEXT:
        raise PolicyRefused(what, f"{where} is not a string of at most {MAX_TEXT} characters")
    return raw


def _dict(raw: Any, what: str, where: str, fields: tuple[str, ...] | None = None) -> dict[str, Any]:
    """An object; with ``fields``, one that has no other field: a field added to the API
    later may narrow a rule, and ignoring it would enforce a wider one."""
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise PolicyRefused(what, f"{where} is not an object")
    unknown = sorted(str(k) for k in raw if fields is not None and k not in fields)
    if unknown:
        raise PolicyRefused(what, f"{where} has the field {unknown[0]!r}, which is not understood")
    return raw


def _list(raw: Any, what: str, where: str) -> Sequence[Any]:
    if raw is None:
        return ()
    if not isinstance(raw, list) or len(raw) > MAX_ITEMS:
        raise PolicyRefused(what, f"{where} is not a list of at most {MAX_ITEMS} items")
    return raw


def _span(net: Net) -> tuple[int, int]:
    return int(net.network_address), int(net.broadcast_address)


def _strictly_inside(inner: Net, outer: Net) -> bool:
    (a, b), (c, d) = _span(inner), _span(outer)
    return inner.prefixlen > outer.prefixlen and c <= a and b <= d


def _exclude(net: Net, hole: Net) -> list[Net]:
    (a, b), (c, d) = _span(net), _span(hole)
    if hole.version != net.version or d < a or b < c:
        return [net]
    if hole.prefixlen <= net.prefixlen:
        return []  # the hole covers the whole network
    return list(net.address_exclude(hole))  # type: ignore[arg-type]
