"""Which policy lets one connection through, or denies it, and why.

The question an operator asks first when a connection fails after a policy change.
The answer comes from the very values the kernel gets: each end's node is compiled
(:func:`~flannelpy.netpol.compile.compile_node`) and the packet is judged against that
node's chains as :mod:`flannelpy.netpol.nft` renders them: the sender's egress chain on
its node, then the receiver's ingress chain on its node; a pod no policy selects for a
direction has no chain there and everything passes. Replies are not judged (conntrack
lets them through), nor is the node's own traffic to its pods.

An end may be an address outside the cluster's pods (an ``ipBlock`` peer): it has no
chain of its own, so only the pod end's direction is judged.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address, ip_address, ip_network

from flannelpy.netpol.compile import (
    ADDR_PORTS,
    CIDRS,
    AddressSet,
    Allow,
    NodePolicy,
    PodRules,
    compile_node,
)
from flannelpy.netpol.model import Namespace, Pod, Policy

Addr = IPv4Address | IPv6Address


@dataclass(frozen=True)
class Judgement:
    """One direction of the connection, judged on one pod's node."""

    direction: str  # "egress" (the sender's) or "ingress" (the receiver's)
    pod: str  # namespace/name
    node: str
    allowed: bool
    isolating: tuple[str, ...]  # namespace/name of the policies that isolate the pod
    allowed_by: str | None  # "namespace/policy ingress rule 0", when a rule allows

    def sentence(self) -> str:
        where = f"{self.direction} of {self.pod} (node {self.node})"
        if not self.isolating:
            return f"{where}: allowed, no policy selects it for {self.direction}"
        by = ", ".join(self.isolating)
        if self.allowed_by is not None:
            return f"{where}: allowed by {self.allowed_by} (isolated by {by})"
        return f"{where}: denied, isolated by {by} and no rule of theirs matches"


@dataclass(frozen=True)
class Explanation:
    source: str  # namespace/name or an address
    destination: str
    source_ip: str
    destination_ip: str
    port: int
    protocol: str
    judgements: tuple[Judgement, ...]

    @property
    def allowed(self) -> bool:
        return all(j.allowed for j in self.judgements)

    def lines(self) -> list[str]:
        verdict = "allowed" if self.allowed else "denied"
        head = (
            f"{self.source} ({self.source_ip}) -> {self.destination} ({self.destination_ip}) "
            f"port {self.port}/{self.protocol}: {verdict}"
        )
        return [head, *("  " + j.sentence() for j in self.judgements)]


class ExplainError(ValueError):
    """The question names something the cluster does not have (one sentence)."""


Endpoint = Pod | Addr


def find_endpoint(text: str, pods: Iterable[Pod]) -> Endpoint:
    """``namespace/name`` of a pod, or an address outside the pods."""
    if "/" not in text:
        try:
            return ip_address(text)
        except ValueError:
            raise ExplainError(f"{text!r} is neither namespace/pod nor an IP address") from None
    for pod in pods:
        if pod.key == text:
            if not pod.ips:
                raise ExplainError(f"pod {text} has no IP address yet; wait until it runs")
            if pod.host_network:
                raise ExplainError(
                    f"pod {text} uses the host's network, which NetworkPolicy does not judge"
                )
            return pod
    raise ExplainError(f"no pod {text} in the cluster; check the namespace and the name")


def explain(
    policies: Sequence[Policy],
    pods: Sequence[Pod],
    namespaces: Sequence[Namespace],
    source: Endpoint,
    destination: Endpoint,
    port: int,
    protocol: str,
) -> Explanation:
    """Judge one new connection from ``source`` to ``destination`` on ``port/protocol``."""
    if isinstance(source, Addr) and isinstance(destination, Addr):
        raise ExplainError("name at least one end as namespace/pod")
    src_ip, dst_ip = _addresses(source, destination)
    nodes: dict[str, NodePolicy] = {}  # each end's node compiled once, both ends on one once

    def compiled_for(pod: Pod) -> _Compiled:
        if pod.node not in nodes:
            nodes[pod.node] = compile_node(policies, pods, namespaces, pod.node)
        node = nodes[pod.node]
        found = next((r for r in node.pods if r.key == pod.key), None)
        return _Compiled(found, {s.name: s for s in node.sets})

    judgements = []
    if isinstance(source, Pod):
        compiled = compiled_for(source)
        judgements.append(_judge("egress", source, compiled, src_ip, dst_ip, port, protocol))
    if isinstance(destination, Pod):
        compiled = compiled_for(destination)
        judgements.append(_judge("ingress", destination, compiled, src_ip, dst_ip, port, protocol))
    return Explanation(
        source.key if isinstance(source, Pod) else str(source),
        destination.key if isinstance(destination, Pod) else str(destination),
        str(src_ip),
        str(dst_ip),
        port,
        protocol,
        tuple(judgements),
    )


def _addresses(source: Endpoint, destination: Endpoint) -> tuple[Addr, Addr]:
    """One address per end, of one family: IPv4 first where both ends have it."""
    src = source.ips if isinstance(source, Pod) else (source,)
    dst = destination.ips if isinstance(destination, Pod) else (destination,)
    for version in (4, 6):
        a = [ip for ip in src if ip.version == version]
        b = [ip for ip in dst if ip.version == version]
        if a and b:
            return a[0], b[0]
    raise ExplainError("the two ends share no address family")


@dataclass(frozen=True)
class _Compiled:
    """One pod's chains (None: no policy selects it) and its node's sets."""

    rules: PodRules | None
    sets: dict[str, AddressSet]


def _judge(
    direction: str, pod: Pod, compiled: _Compiled, src: Addr, dst: Addr, port: int, protocol: str
) -> Judgement:
    rules, sets = compiled.rules, compiled.sets
    allows = None if rules is None else (rules.ingress if direction == "ingress" else rules.egress)
    if rules is None or allows is None:
        return Judgement(direction, pod.key, pod.node, True, (), None)
    names = rules.ingress_policies if direction == "ingress" else rules.egress_policies
    isolating = tuple(f"{pod.namespace}/{n}" for n in names)
    peer = src if direction == "ingress" else dst
    for allow in allows:
        if _matches(allow, direction, peer, dst, port, protocol, sets):
            label = f"{allow.policy} {direction} rule {allow.rule}"
            return Judgement(direction, pod.key, pod.node, True, isolating, label)
    return Judgement(direction, pod.key, pod.node, False, isolating, None)


def _matches(
    allow: Allow,
    direction: str,
    peer: Addr,
    dst: Addr,
    port: int,
    protocol: str,
    sets: dict[str, AddressSet],
) -> bool:
    """What the rendered rule of ``allow`` matches, judged in Python."""
    if allow.family is not None and allow.family != peer.version:
        return False
    if allow.peer_set is not None:
        elements = sets[allow.peer_set].elements if allow.peer_set in sets else ()
        if allow.kind == ADDR_PORTS:  # egress named ports: the destination's own triples
            return f"{dst} . {protocol.lower()} . {port}" in elements
        if allow.kind == CIDRS:
            if not any(peer in ip_network(e) for e in elements):
                return False
        elif str(peer) not in elements:
            return False
    if not allow.ports:
        return True
    return any(
        p.protocol == protocol
        and (p.first is None or (p.first <= port <= (p.last if p.last is not None else p.first)))
        for p in allow.ports
    )
