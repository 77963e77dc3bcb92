"""A :class:`NodePolicy` as an nftables table, and the transaction between two of them.

The table (``inet flannelpy-policy``)::

    set   np_<policy>_<i|e><rule>_<p|c|n><4|6>   the compiled address sets (c: interval)
    map   ingress4 / ingress6                    local pod IP : jump pod_<pod>_in
    map   egress4 / egress6                      local pod IP : jump pod_<pod>_out
    chain forward  (hook forward, priority filter, policy accept)
          ct state established,related accept    replies to allowed connections
          ip saddr vmap @egress4 ; ip6 saddr vmap @egress6
          ip daddr vmap @ingress4 ; ip6 daddr vmap @ingress6
    chain input    (hook input): the egress half only, for pods talking to the node
    chain pod_<hash of namespace/name>_in|_out   one per selected pod and direction:
          <peer> <ports> counter return comment "namespace/policy ingress 0"   per Allow
          counter name deny_<hash>_<in|out> drop  isolated: nothing else passes
    counter deny_<hash of namespace and policies>_<in|out>   named, shared by every pod
          that the same policies of one namespace isolate in that direction: what
          ``flannelpy_policy_denied_packets_total{namespace,policy,direction}`` reads

A pod chain *returns* on an allowed packet rather than accepting it, so a packet
between two selected pods is judged by the sender's egress chain and then the
receiver's ingress chain. The node's own traffic to its pods leaves through the
output hook, which the table does not judge.

:func:`transaction` is the only writer's vocabulary: one ``nft -f`` script that
turns the old table into the new one touching only what differs (set and map
elements one by one; a chain's rules only when that chain's rules changed), and
never flushes the table.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field

from flannelpy.netpol.compile import ADDR_PORTS, CIDRS, Allow, NodePolicy, PodRules, PortMatch

TABLE = "flannelpy-policy"
FAMILY = "inet"
PREFIX = f"{FAMILY} {TABLE}"
FORWARD_HOOK = "type filter hook forward priority filter ; policy accept ;"
INPUT_HOOK = "type filter hook input priority filter ; policy accept ;"
COMMENT_MAX = 128  # nft's limit for a rule comment
ADDR_TYPES = {4: "ipv4_addr", 6: "ipv6_addr"}
IP = {4: "ip", 6: "ip6"}


@dataclass(frozen=True)
class NftSet:
    """A set (``value`` of every element empty) or a verdict map."""

    name: str
    type: str
    flags: str = ""  # "interval" or ""
    comment: str = ""
    elements: tuple[tuple[str, str], ...] = ()  # (key, value), sorted

    def declaration(self) -> str:
        parts = [f"type {self.type} ;"]
        if self.flags:
            parts.append(f"flags {self.flags} ;")
        if self.comment:
            parts.append(f'comment "{self.comment}" ;')
        kind = "map" if ":" in self.type else "set"
        return f"add {kind} {PREFIX} {self.name} {{ {' '.join(parts)} }}"


@dataclass(frozen=True)
class DenyCounter:
    """The named counter of the packets one set of policies of one namespace denies in
    one direction: its labels are the metric's (``policy``: the names, comma-joined)."""

    name: str
    namespace: str
    policy: str
    direction: str  # "ingress" or "egress"

    def declaration(self) -> str:
        comment = _comment(f"{self.namespace} {self.direction} {self.policy}", ",")
        return f'add counter {PREFIX} {self.name} {{ comment "{comment}" ; }}'


def deny_counter(namespace: str, policies: tuple[str, ...], direction: str) -> DenyCounter:
    policy = ",".join(policies)
    digest = hashlib.sha256(f"{namespace}/{policy}".encode()).hexdigest()[:12]
    name = f"deny_{digest}_{'in' if direction == 'ingress' else 'out'}"
    return DenyCounter(name, namespace, policy, direction)


@dataclass(frozen=True)
class NftChain:
    name: str
    hook: str = ""  # a base chain's "type ... hook ... priority ... ;", else empty
    rules: tuple[str, ...] = ()


@dataclass(frozen=True)
class Ruleset:
    """The whole table as values, keyed by name. The reconciler's policy adapter sees it
    through :meth:`script_from` and :attr:`table` alone."""

    sets: dict[str, NftSet] = field(default_factory=dict)
    chains: dict[str, NftChain] = field(default_factory=dict)
    counters: dict[str, DenyCounter] = field(default_factory=dict)

    table = PREFIX  # "inet flannelpy-policy"

    def script_from(self, old: Ruleset | None) -> str:
        """The transaction from ``old`` to this table; from nothing (the table absent)
        when ``old`` is None."""
        return full_script(self) if old is None else transaction(old, self)


def pod_chain(pod: PodRules, direction: str) -> str:
    digest = hashlib.sha256(pod.key.encode()).hexdigest()[:12]
    return f"pod_{digest}_{direction}"


def render(policy: NodePolicy) -> Ruleset:
    """The table that enforces ``policy``."""
    sets = {
        s.name: NftSet(
            s.name,
            _set_type(s.family, s.kind),
            "interval" if s.kind == CIDRS else "",
            _comment(s.comment, "=,"),
            tuple((e, "") for e in s.elements),
        )
        for s in policy.sets
    }
    maps: dict[str, dict[str, str]] = {f"{d}{f}": {} for d in ("ingress", "egress") for f in (4, 6)}
    chains = {
        "forward": NftChain(
            "forward",
            FORWARD_HOOK,
            (
                "ct state established,related accept",
                "ip saddr vmap @egress4",
                "ip6 saddr vmap @egress6",
                "ip daddr vmap @ingress4",
                "ip6 daddr vmap @ingress6",
            ),
        ),
        "input": NftChain(
            "input",
            INPUT_HOOK,
            (
                "ct state established,related accept",
                "ip saddr vmap @egress4",
                "ip6 saddr vmap @egress6",
            ),
        ),
    }
    counters: dict[str, DenyCounter] = {}
    for pod in policy.pods:
        for direction, allows, isolating in (
            ("in", pod.ingress, pod.ingress_policies),
            ("out", pod.egress, pod.egress_policies),
        ):
            if allows is None:
                continue
            name = pod_chain(pod, direction)
            rules = [_allow_rule(a, direction) for a in allows]
            deny = deny_counter(
                pod.namespace, isolating, "ingress" if direction == "in" else "egress"
            )
            counters[deny.name] = deny
            comment = _comment(pod.key + " " + direction)
            rules.append(f'counter name "{deny.name}" drop comment "{comment}"')
            chains[name] = NftChain(name, "", tuple(rules))
            for ip in pod.ips:
                family = 6 if ":" in ip else 4
                # Two pods claiming one address (one of them stale): the first keeps it.
                maps[f"{'ingress' if direction == 'in' else 'egress'}{family}"].setdefault(
                    ip, f"jump {name}"
                )
    for name, elements in maps.items():
        family = int(name[-1])
        sets[name] = NftSet(
            name, f"{ADDR_TYPES[family]} : verdict", elements=tuple(sorted(elements.items()))
        )
    return Ruleset(
        dict(sorted(sets.items())), dict(sorted(chains.items())), dict(sorted(counters.items()))
    )


def full_script(new: Ruleset) -> str:
    """Create the table as ``new`` from nothing (its first load: the table is absent)."""
    return transaction(Ruleset(), new, create_table=True)


def transaction(old: Ruleset, new: Ruleset, create_table: bool = False) -> str:
    """One atomic ``nft -f`` script from ``old`` to ``new``, touching only differences.

    Order: new counters, sets and chains are declared; set elements that go are
    deleted, then new ones added (an interval set never holds overlapping elements);
    changed chains are flushed and refilled, new ones filled; map elements change last
    of the additions, once their chains hold their rules; then chains, sets and
    counters that go, after everything that referred to them. Empty when nothing
    differs.
    """
    lines = [f"add table {PREFIX}"] if create_table else []
    is_map = {name for name, s in new.sets.items() if ":" in s.type}
    for name in sorted(set(new.counters) - set(old.counters)):
        lines.append(new.counters[name].declaration())
    for name in sorted(set(new.sets) - set(old.sets)):
        lines.append(new.sets[name].declaration())
    for name in sorted(set(new.chains) - set(old.chains)):
        hook = new.chains[name].hook
        lines.append(f"add chain {PREFIX} {name}" + (f" {{ {hook} }}" if hook else ""))
    plain = sorted(n for n in new.sets if n not in is_map)
    lines += _element_changes(old, new, plain)
    for name in sorted(new.chains):
        before = old.chains.get(name)
        rules = new.chains[name].rules
        if before is not None and before.rules == rules:
            continue
        if before is not None and before.rules:
            lines.append(f"flush chain {PREFIX} {name}")
        lines += [f"add rule {PREFIX} {name} {rule}" for rule in rules]
    lines += _element_changes(old, new, sorted(is_map))
    for name in sorted(set(old.chains) - set(new.chains)):
        if old.chains[name].rules:
            lines.append(f"flush chain {PREFIX} {name}")
    for name in sorted(set(old.chains) - set(new.chains)):
        lines.append(f"delete chain {PREFIX} {name}")
    for name in sorted(set(old.sets) - set(new.sets)):
        kind = "map" if ":" in old.sets[name].type else "set"
        lines.append(f"delete {kind} {PREFIX} {name}")
    for name in sorted(set(old.counters) - set(new.counters)):
        lines.append(f"delete counter {PREFIX} {name}")
    return "".join(line + "\n" for line in lines)


def changed_elements(old: Ruleset, new: Ruleset) -> int:
    """How many set and map elements differ between two tables (added + deleted)."""
    total = 0
    for name in set(old.sets) | set(new.sets):
        a = set(old.sets[name].elements) if name in old.sets else set()
        b = set(new.sets[name].elements) if name in new.sets else set()
        total += len(a ^ b)
    return total


def _element_changes(old: Ruleset, new: Ruleset, names: list[str]) -> list[str]:
    lines = []
    for name in names:
        before = dict(old.sets[name].elements) if name in old.sets else {}
        after = dict(new.sets[name].elements)
        gone = [k for k in before if k not in after or after[k] != before[k]]
        come = [k for k in after if k not in before or after[k] != before[k]]
        if gone:
            lines.append(f"delete element {PREFIX} {name} {{ {', '.join(gone)} }}")
        if come:
            items = ", ".join(f"{k} : {after[k]}" if after[k] else k for k in come)
            lines.append(f"add element {PREFIX} {name} {{ {items} }}")
    return lines


def _set_type(family: int, kind: str) -> str:
    if kind == ADDR_PORTS:
        return f"{ADDR_TYPES[family]} . inet_proto . inet_service"
    return ADDR_TYPES[family]


def _allow_rule(allow: Allow, direction: str) -> str:
    """``<peer> <ports> counter return comment "..."`` for one Allow."""
    parts: list[str] = []
    if allow.peer_set is not None and allow.family is not None:
        ip = IP[allow.family]
        if allow.kind == ADDR_PORTS:
            parts.append(f"{ip} daddr . meta l4proto . th dport @{allow.peer_set}")
        else:
            parts.append(f"{ip} {'saddr' if direction == 'in' else 'daddr'} @{allow.peer_set}")
    parts += _port_match(allow.ports)
    label = f"{allow.policy} {'ingress' if direction == 'in' else 'egress'} {allow.rule}"
    parts.append(f'counter return comment "{_comment(label)}"')
    return " ".join(parts)


def _port_match(ports: tuple[PortMatch, ...]) -> list[str]:
    """The port part of a rule: nothing (any), one protocol, or ``l4proto . dport`` pairs."""
    if not ports:
        return []
    protos = sorted({p.protocol.lower() for p in ports})
    if all(p.first is None for p in ports):
        return [
            f"meta l4proto {protos[0]}"
            if len(protos) == 1
            else f"meta l4proto {{ {', '.join(protos)} }}"
        ]
    items = []
    for p in ports:
        if p.first is None:
            items.append(f"{p.protocol.lower()} . 0-65535")
        elif p.first == p.last:
            items.append(f"{p.protocol.lower()} . {p.first}")
        else:
            items.append(f"{p.protocol.lower()} . {p.first}-{p.last}")
    return [f"meta l4proto . th dport {{ {', '.join(items)} }}"]


@functools.lru_cache(maxsize=16384)
def _comment(text: str, also: str = "") -> str:
    """Names are validated by the model; keep only their characters all the same. The
    same few thousand comments come back at every compile: kept, not made again."""
    kept = "-./ " + also
    return "".join(c for c in text if c.isascii() and (c.isalnum() or c in kept))[:COMMENT_MAX]
