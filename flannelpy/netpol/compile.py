"""All policies, pods and namespaces + this node's name -> this node's desired policy state.

The result (:class:`NodePolicy`) holds two kinds of values:

* **address sets**. ``np_<hash of the peer>_p<4|6>``: the IPs of the pods one peer
  (its namespace selector, or the policy's namespace, and its pod selector) matches
  anywhere in the cluster, **shared by every rule of every policy with that peer**: a
  cluster's policies repeat a few selectors ("every pod of the team's namespaces"), and
  a set per rule would hold the same thousands of addresses once per policy. Per
  (policy, direction, rule index, kind, family), named
  ``np_<hash of namespace/name>_<i|e><rule>_<kind><4|6>``: ``c`` the rule's ipBlocks
  minus their excepts (disjoint CIDRs), ``n`` for an egress rule with named ports the
  triples ``IP . protocol . port`` of every destination pod (selected by the rule's
  selectors, inside one of its ipBlocks, or any pod when it names no peer) whose
  container port of that name resolves. A set's name depends only on what it stands
  for, never on its members, so a pod that changes labels, appears or goes changes only
  the elements of the sets it enters or leaves; a set exists while a rule that applies
  to a pod of this node uses it;
* **per local pod and direction**, ``None`` when no policy selects the pod for
  it (not isolated: everything passes) or the tuple of :class:`Allow` that
  together are the union of every selecting policy's rules (empty: isolated,
  everything is denied but replies; the node's own traffic to its pods is never
  judged). Named ports of ingress rules are resolved on the local pod itself.

Host-network pods and pods without an IP are neither selected nor peers (their
addresses are the node's, or nothing); a pod whose Namespace has not been read
matches no namespace selector. A pod this node's CNI attached (``attached``: its
namespace/name and addresses, from the ADD) whose addresses no Pod object shows yet is
**denied both ways** where a policy of its namespace exists (:data:`UNREAD`): its labels
are not known, so a policy might select it, and fail-closed is the safe reading until
the watch brings it (the kubelet reports a pod's IP only after the ADD).

Everything is sorted, so the same input (one Pod per namespace/name) in any order
compiles to an equal value.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from ipaddress import collapse_addresses

from flannelpy.netpol.model import (
    EGRESS,
    INGRESS,
    Addr,
    LabelSelector,
    Namespace,
    Net,
    Peer,
    Pod,
    Policy,
    Rule,
)

PODS = "p"  # set kinds, the letter in the set's name
CIDRS = "c"
ADDR_PORTS = "n"
UNREAD = "(pod not read yet)"  # what isolates an attached pod whose Pod object is unread


@dataclass(frozen=True)
class AddressSet:
    name: str
    family: int  # 4 or 6
    kind: str  # PODS, CIDRS or ADDR_PORTS
    comment: str  # "namespace/name ingress rule 0"
    elements: tuple[str, ...]  # sorted: "10.0.0.1", "10.0.0.0/8", "10.0.0.1 . tcp . 80"


@dataclass(frozen=True)
class PortMatch:
    protocol: str  # TCP, UDP or SCTP
    first: int | None = None  # None: every port of the protocol
    last: int | None = None


@dataclass(frozen=True)
class Allow:
    """One way one rule of one policy lets a pod's traffic pass in one direction."""

    policy: str  # namespace/name
    rule: int
    family: int | None = None  # None with peer_set None: any peer of either family
    peer_set: str | None = None
    kind: str = PODS  # of peer_set; ADDR_PORTS sets carry the ports themselves
    ports: tuple[PortMatch, ...] = ()  # (): any port of any protocol


@dataclass(frozen=True)
class PodRules:
    namespace: str
    name: str
    ips: tuple[str, ...]
    ingress: tuple[Allow, ...] | None  # None: not isolated
    egress: tuple[Allow, ...] | None
    # The names of the policies (of the pod's namespace) that isolate it, per direction.
    ingress_policies: tuple[str, ...] = ()
    egress_policies: tuple[str, ...] = ()

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass(frozen=True)
class NodePolicy:
    sets: tuple[AddressSet, ...] = ()  # sorted by name
    pods: tuple[PodRules, ...] = ()  # sorted by namespace/name; only selected local pods


def compile_node(
    policies: Iterable[Policy],
    pods: Iterable[Pod],
    namespaces: Iterable[Namespace],
    node: str,
    attached: Mapping[str, Sequence[Addr]] | None = None,
) -> NodePolicy:
    """This node's desired policy state (see the module's docstring)."""
    policies = list(policies)
    cluster = _Cluster(pods, namespaces)
    local = [p for p in cluster.live if p.node == node]
    sets: dict[str, AddressSet] = {}
    allows: dict[tuple[str, str], list[Allow]] = {}
    isolating: dict[tuple[str, str], list[str]] = {}
    for policy in sorted(policies, key=lambda p: p.key):
        selected = [
            p
            for p in local
            if p.namespace == policy.namespace and policy.pod_selector.matches(p.label_map)
        ]
        if not selected:
            continue
        for direction, rules in ((INGRESS, policy.ingress), (EGRESS, policy.egress)):
            if direction not in policy.policy_types:
                continue
            for pod in selected:
                allows.setdefault((pod.key, direction), [])
                isolating.setdefault((pod.key, direction), []).append(policy.name)
            for index, rule in enumerate(rules):
                ctx = _RuleContext(policy, direction, index, rule, cluster, sets)
                for pod in selected:
                    allows[(pod.key, direction)] += ctx.allows_for(pod)
    pod_rules = []
    for pod in local:
        ingress, egress = allows.get((pod.key, INGRESS)), allows.get((pod.key, EGRESS))
        if ingress is None and egress is None:
            continue
        pod_rules.append(
            PodRules(
                pod.namespace,
                pod.name,
                tuple(str(ip) for ip in pod.ips),
                None if ingress is None else tuple(ingress),
                None if egress is None else tuple(egress),
                tuple(isolating.get((pod.key, INGRESS), ())),
                tuple(isolating.get((pod.key, EGRESS), ())),
            )
        )
    pod_rules += _unread(attached or {}, local, {p.namespace for p in policies})
    pod_rules.sort(key=lambda r: r.key)
    return NodePolicy(tuple(sets[n] for n in sorted(sets)), tuple(pod_rules))


def _unread(
    attached: Mapping[str, Sequence[Addr]], local: Sequence[Pod], guarded: set[str]
) -> list[PodRules]:
    """Attached pods whose addresses no Pod object of this node shows, in a namespace
    with a policy: isolated both ways, nothing allowed."""
    shown = {ip for p in local for ip in p.ips}
    found = []
    for key, ips in sorted(attached.items()):
        namespace, _, name = key.partition("/")
        fresh = tuple(str(ip) for ip in ips if ip not in shown)
        if fresh and namespace in guarded:
            # Its own name: the Pod object, once read, may carry the same one.
            found.append(PodRules(namespace, f"{name}.unread", fresh, (), (), (UNREAD,), (UNREAD,)))
    return found


@functools.lru_cache(maxsize=16384)
def peer_set_name(peer: Peer, policy_namespace: str, family: int) -> str:
    """The stable name of the set of pods a peer selects: it depends on the selectors
    (and, without a namespace selector, the policy's namespace) alone. Kept: every
    compile asks again for every rule's peers."""
    key = repr(_peer_key(peer, policy_namespace))
    return f"np_{hashlib.sha256(key.encode()).hexdigest()[:12]}_{PODS}{family}"


def _peer_key(peer: Peer, policy_namespace: str) -> tuple[object, ...]:
    ns_sel, pod_sel = peer.namespace_selector, peer.pod_selector
    return (ns_sel, pod_sel, policy_namespace if ns_sel is None else None)


def describe_peer(peer: Peer, policy_namespace: str) -> str:
    """What a peer selects, for a set's comment: "pods app=db of namespace shop"."""
    pods = _selector_text(peer.pod_selector) if peer.pod_selector is not None else "all"
    if peer.namespace_selector is None:
        return f"pods {pods} of namespace {policy_namespace}"
    return f"pods {pods} of namespaces {_selector_text(peer.namespace_selector)}"


def _selector_text(selector: LabelSelector) -> str:
    parts = [f"{k}={v}" for k, v in selector.match_labels]
    parts += [f"{r.key} {r.operator} {','.join(r.values)}".strip() for r in selector.expressions]
    return " ".join(parts) or "all"


@functools.lru_cache(maxsize=16384)
def set_name(policy: str, direction: str, rule: int, kind: str, family: int) -> str:
    """The stable name of a rule's set: it depends on the policy's identity, nothing else."""
    digest = hashlib.sha256(policy.encode()).hexdigest()[:12]
    return f"np_{digest}_{'i' if direction == INGRESS else 'e'}{rule}_{kind}{family}"


class _Cluster:
    """The live pods (sorted) and namespace labels, with each peer's pods found once:
    policies often share selectors (every pod of a namespace, every namespace)."""

    def __init__(self, pods: Iterable[Pod], namespaces: Iterable[Namespace]) -> None:
        self.live = sorted((p for p in pods if p.ips and not p.host_network), key=lambda p: p.key)
        self.ns_labels = {ns.name: dict(ns.labels) for ns in namespaces}
        self.by_namespace: dict[str, list[Pod]] = {}
        for p in self.live:
            self.by_namespace.setdefault(p.namespace, []).append(p)
        self._found: dict[tuple[object, ...], list[Pod]] = {}
        # Per namespace, its pods by each label they carry (made when first asked).
        self._by_label: dict[str, dict[tuple[str, str], list[Pod]]] = {}

    def candidates(self, namespace: str, selector: LabelSelector | None) -> Sequence[Pod]:
        """The pods of ``namespace`` that may match ``selector`` (in order): those with
        the rarest of its ``matchLabels`` pairs, or all of them when it has none. The
        caller still checks the whole selector on each."""
        pods = self.by_namespace.get(namespace, [])
        if selector is None or not selector.match_labels:
            return pods
        index = self._by_label.get(namespace)
        if index is None:
            index = self._by_label[namespace] = {}
            for pod in pods:
                for pair in pod.label_map.items():
                    index.setdefault(pair, []).append(pod)
        return min((index.get(pair, []) for pair in selector.match_labels), key=len)

    def peer_pods(self, peer: Peer, policy_namespace: str) -> list[Pod]:
        """The live pods ``peer`` selects, looked at namespace by namespace (a selector's
        namespaces first: most peers name few of a cluster's pods)."""
        ns_sel, pod_sel = peer.namespace_selector, peer.pod_selector
        key = _peer_key(peer, policy_namespace)
        if key not in self._found:
            if ns_sel is None:
                namespaces = [policy_namespace]
            else:
                # A pod of a namespace not read yet matches no namespace selector: its
                # labels are unknown, and NotIn or DoesNotExist would let it in.
                namespaces = [n for n, labels in self.ns_labels.items() if ns_sel.matches(labels)]
            self._found[key] = [
                p
                for n in sorted(namespaces)
                for p in self.candidates(n, pod_sel)
                if pod_sel is None or pod_sel.matches(p.label_map)
            ]
        return self._found[key]


class _RuleContext:
    """One rule of one policy: its sets, made once, and its allows for each selected pod."""

    def __init__(
        self,
        policy: Policy,
        direction: str,
        index: int,
        rule: Rule,
        cluster: _Cluster,
        sets: dict[str, AddressSet],
    ) -> None:
        self.policy, self.direction, self.index, self.rule = policy, direction, index, rule
        self.sets = sets
        live = cluster.live
        self.numeric = _merge_ports(
            PortMatch(p.protocol, p.port, p.end_port or p.port) if p.port else PortMatch(p.protocol)
            for p in rule.ports
            if not isinstance(p.port, str)
        )
        self.named = sorted({(p.port, p.protocol) for p in rule.ports if isinstance(p.port, str)})
        pod_peers = [p for p in rule.peers if p.ip_block is None]
        self.cluster = cluster
        self.peer_sets: list[tuple[int, str, str]] = []  # (family, name, kind)
        # Address sets serve every rule but an egress rule of named ports only.
        addressed = direction == INGRESS or not rule.ports or bool(self.numeric)
        blocks: dict[int, list[Net]] = {4: [], 6: []}
        for peer in rule.peers:
            for net in peer.ip_block.networks() if peer.ip_block is not None else ():
                blocks[net.version].append(net)
        for family in (4, 6) if addressed else ():
            for peer in pod_peers:
                name = self._peer_set(peer, family)
                if (family, name, PODS) not in self.peer_sets:  # one peer written twice
                    self.peer_sets.append((family, name, PODS))
            if blocks[family]:
                merged = collapse_addresses(blocks[family])  # type: ignore[type-var]
                elements = [((int(n.network_address), n.prefixlen), str(n)) for n in merged]
                self.peer_sets.append((family, self._set(CIDRS, family, elements), CIDRS))
        self.port_sets: list[tuple[int, str]] = []  # egress named ports: (family, name)
        if direction == EGRESS and self.named:
            # A named port resolves on the destination pod: one selected by the rule's
            # selectors, or any pod (with no peers), or one whose address is in an ipBlock.
            chosen = {
                p.key for peer in pod_peers for p in cluster.peer_pods(peer, policy.namespace)
            }
            for family in (4, 6):
                triples = [
                    ((int(ip), number, len(proto)), f"{ip} . {proto.lower()} . {number}")
                    for dest in live
                    for ip in dest.ips
                    if ip.version == family
                    and (
                        not rule.peers
                        or dest.key in chosen
                        or any(ip in net for net in blocks[family])
                    )
                    for name, proto in self.named
                    if (number := dest.named_port(name, proto))
                ]
                self.port_sets.append((family, self._set(ADDR_PORTS, family, triples)))

    def allows_for(self, pod: Pod) -> list[Allow]:
        """The ways this rule lets ``pod``'s traffic pass (none when no port of it resolves)."""
        numeric = self.numeric
        if self.direction == INGRESS and self.named:  # named ports resolve on the pod itself
            resolved = [(pod.named_port(n, proto), proto) for n, proto in self.named]
            numeric = _merge_ports([*numeric, *(PortMatch(pr, n, n) for n, pr in resolved if n)])
        key, index = self.policy.key, self.index
        found: list[Allow] = []
        if not self.rule.ports or numeric:
            if not self.rule.peers:
                found.append(Allow(key, index, ports=numeric))
            found += [Allow(key, index, f, name, kind, numeric) for f, name, kind in self.peer_sets]
        found += [Allow(key, index, f, name, ADDR_PORTS) for f, name in self.port_sets]
        return found

    def _peer_set(self, peer: Peer, family: int) -> str:
        """The shared set of the pods ``peer`` selects, made by its first user."""
        namespace = self.policy.namespace
        name = peer_set_name(peer, namespace, family)
        if name not in self.sets:
            found = self.cluster.peer_pods(peer, namespace)
            members = sorted({(n, t) for p in found for v, n, t in p.addresses if v == family})
            comment = describe_peer(peer, namespace)
            self.sets[name] = AddressSet(name, family, PODS, comment, tuple(t for _, t in members))
        return name

    def _set(self, kind: str, family: int, elements: Sequence[tuple[tuple[int, ...], str]]) -> str:
        """Record the rule's set; ``elements`` are (sort key, text): sorted by address."""
        name = set_name(self.policy.key, self.direction, self.index, kind, family)
        comment = f"{self.policy.key} {self.direction.lower()} rule {self.index}"
        texts = tuple(text for _, text in sorted(set(elements)))
        self.sets[name] = AddressSet(name, family, kind, comment, texts)
        return name


def _merge_ports(ports: Iterable[PortMatch]) -> tuple[PortMatch, ...]:
    """Ports as disjoint, merged ranges per protocol (a protocol without a port
    swallows its ranges), sorted: one value per meaning."""
    by_proto: dict[str, list[tuple[int, int]] | None] = {}
    for p in ports:
        if p.first is None or by_proto.get(p.protocol, []) is None:
            by_proto[p.protocol] = None
            continue
        ranges = by_proto.setdefault(p.protocol, [])
        assert ranges is not None
        ranges.append((p.first, p.last if p.last is not None else p.first))
    merged: list[PortMatch] = []
    for proto in sorted(by_proto):
        ranges = by_proto[proto]
        if ranges is None:
            merged.append(PortMatch(proto))
            continue
        spans: list[list[int]] = []
        for first, last in sorted(ranges):
            if spans and first <= spans[-1][1] + 1:
                spans[-1][1] = max(spans[-1][1], last)
            else:
                spans.append([first, last])
        merged += [PortMatch(proto, a, b) for a, b in spans]
    return tuple(merged)
