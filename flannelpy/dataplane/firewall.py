"""ip-masq and forward rules: Flannel's iptables chains, kept exact.

The rules (Flannel's, in Flannel's order; comment ``flanneld masq`` /
``flanneld forward`` on each)::

    nat     POSTROUTING      -j FLANNEL-POSTRTG           (our jump, appended)
    nat     FLANNEL-POSTRTG  -m mark --mark 0x4000/0x4000 -j RETURN   kube-proxy masquerades these
                             -s <subnet> -d <Network> -j RETURN       pod → pod: no NAT
                             -s <Network> -d <subnet> -j RETURN
                             ! -s <Network> -d <subnet> -j RETURN     outside → our pods: no NAT
                             -s <Network> ! -d 224.0.0.0/4 -j MASQUERADE --random-fully
                             ! -s <Network> -d <Network> -j MASQUERADE --random-fully
    filter  FORWARD          -j FLANNEL-FWD               (our jump, appended)
    filter  FLANNEL-FWD      -s <Network> -j ACCEPT ; -d <Network> -j ACCEPT

The jumps in the builtin chains are placed as Flannel places them: appended
once at start (an existing one is moved to the end), then only checked to
exist. Whatever another agent puts above them (Calico's Felix, kube-proxy,
network policy) stays above: inserting ours first would accept every pod
packet before policy is applied, and fighting over position 1 rewrites
POSTROUTING and FORWARD on every resync. Our own chains are compared exactly
(order and duplicates too) with the lines we would write: nothing else has a
reason to be in them. A chain that differs is rewritten with one
``iptables-restore --noflush`` transaction per table, which replaces only our
chains and our jump rules: everything else on the host is untouched.

Between changes the adapter only checks (``iptables -S`` of each chain, every
``--iptables-resync``). With iptables-nft (``iptables --version`` says "nf_tables")
every rule lives in nftables, and every committed change to any nftables table of the
namespace, by anyone, moves one counter: the ruleset generation
(:mod:`~flannelpy.dataplane.nfgen`; reads such as ``iptables -S`` leave it alone).
A check that found every chain as desired remembers the generation read just before
its listing; while the generation still reads that, nothing can have changed since,
and the next check is skipped (:func:`needs_check`). A rule deleted by hand is a
committed change, so it is found at the next resync as before. With iptables-legacy
(no generation covers its tables) every resync lists the chains.
"""

from __future__ import annotations

import logging
import os
import platform
import re
import shlex
import subprocess
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from ipaddress import IPv4Network, IPv6Network
from typing import Any

from flannelpy.errors import ConfigError, DataplaneError

log = logging.getLogger(__name__)

MASQ_CHAIN = "FLANNEL-POSTRTG"
FORWARD_CHAIN = "FLANNEL-FWD"
MASQ_COMMENT = "flanneld masq"
FORWARD_COMMENT = "flanneld forward"
KUBE_PROXY_MARK = "0x4000/0x4000"  # kube-proxy's masquerade mark: it does the NAT itself
Net = IPv4Network | IPv6Network  # one family per rule set: iptables or ip6tables
MULTICAST = "224.0.0.0/4"
MULTICAST6 = "ff00::/8"  # what Flannel's IPv6 masquerade rule excludes (ip6tables)
RANDOM_FULLY = "--random-fully"
OUR_CHAINS = (("nat", MASQ_CHAIN), ("filter", FORWARD_CHAIN))
BUILTIN_CHAINS = frozenset({"PREROUTING", "INPUT", "FORWARD", "OUTPUT", "POSTROUTING"})
TABLE_BUILTINS = {
    "nat": ("PREROUTING", "INPUT", "OUTPUT", "POSTROUTING"),
    "filter": ("INPUT", "FORWARD", "OUTPUT"),
}
DEFAULT_LOCK_FILE = "/run/xtables.lock"  # shared with kube-proxy and Flannel (hostPath mount)

# Reasons a chain is out of sync, most significant first (one is reported per sync).
MISSING = "missing"
DUPLICATES = "duplicates"
EXTRA = "extra rules"
WRONG_ORDER = "wrong order"
REASONS = (MISSING, DUPLICATES, EXTRA, WRONG_ORDER)


@dataclass(frozen=True)
class Rule:
    """One ``-A chain spec...`` rule; ``line`` is exactly what ``iptables -S`` prints for it."""

    table: str
    chain: str
    spec: tuple[str, ...]

    @property
    def line(self) -> str:
        return " ".join(["-A", self.chain, *(_quote(arg) for arg in self.spec)])

    @property
    def target(self) -> str | None:
        return _target(self.spec)


@dataclass(frozen=True)
class ChainPlan:
    """Whether a chain is exactly as desired; if not, why, and which of its lines are ours."""

    in_sync: bool
    reason: str = ""  # one of REASONS when not in sync
    stale: tuple[str, ...] = ()  # observed jump lines to delete before re-inserting (builtins)


@dataclass(frozen=True)
class SyncResult:
    repaired: bool
    reason: str = ""  # the most significant of REASONS, for a low-cardinality metric label
    details: tuple[str, ...] = ()  # "nat/FLANNEL-POSTRTG: missing", for logs


# --- pure: the rules --------------------------------------------------------------------


def masq_rules(
    network: Net | Sequence[Net],
    node_subnets: Sequence[Net],
    random_fully: bool,
) -> list[Rule]:
    """Flannel's masquerade rules for this node; one RETURN pair per subnet the node holds.

    ``network`` may be several pod ranges (the primary Network first, then the other
    address pools): traffic between any two of them keeps its source. With one
    range the rules are exactly Flannel's.
    """
    networks = _networks(network)
    primary = str(networks[0])
    # ip6tables: the same chains and rules with IPv6 ranges, as Flannel writes them.
    multicast = MULTICAST6 if networks[0].version == 6 else MULTICAST
    subnets = list(dict.fromkeys(node_subnets))  # order kept, duplicates dropped
    for subnet in subnets:
        if not any(
            subnet.version == net.version and subnet.subnet_of(net)  # type: ignore[arg-type]
            for net in networks
        ):
            raise ConfigError(f"node subnet {subnet} is outside the network {_names(networks)}")
    masq = ("-j", "MASQUERADE", RANDOM_FULLY) if random_fully else ("-j", "MASQUERADE")
    comment = ("-m", "comment", "--comment", MASQ_COMMENT)

    def rule(*spec: str) -> Rule:
        return Rule("nat", MASQ_CHAIN, spec)

    rules = [
        Rule("nat", "POSTROUTING", (*comment, "-j", MASQ_CHAIN)),
        rule("-m", "mark", "--mark", KUBE_PROXY_MARK, *comment, "-j", "RETURN"),
    ]
    for subnet in subnets:
        for net in map(str, networks):
            rules.append(rule("-s", str(subnet), "-d", net, *comment, "-j", "RETURN"))
            rules.append(rule("-s", net, "-d", str(subnet), *comment, "-j", "RETURN"))
    for subnet in subnets:
        # Sources in any pod range returned above; what is left comes from outside.
        rules.append(rule("!", "-s", primary, "-d", str(subnet), *comment, "-j", "RETURN"))
    for src in map(str, networks):
        for dst in map(str, networks):
            if src != dst:
                rules.append(rule("-s", src, "-d", dst, *comment, "-j", "RETURN"))
    for net in map(str, networks):
        rules.append(rule("-s", net, "!", "-d", multicast, *comment, *masq))
    for net in map(str, networks):
        rules.append(rule("!", "-s", net, "-d", net, *comment, *masq))
    return rules


def forward_rules(network: Net | Sequence[Net]) -> list[Rule]:
    """Flannel's forward rules: accept anything to or from the network (every pod range)."""
    comment = ("-m", "comment", "--comment", FORWARD_COMMENT)
    rules = [Rule("filter", "FORWARD", (*comment, "-j", FORWARD_CHAIN))]
    for net in map(str, _networks(network)):
        rules.append(Rule("filter", FORWARD_CHAIN, ("-s", net, *comment, "-j", "ACCEPT")))
        rules.append(Rule("filter", FORWARD_CHAIN, ("-d", net, *comment, "-j", "ACCEPT")))
    return rules


def _networks(network: Net | Sequence[Net]) -> list[Net]:
    nets = [network] if isinstance(network, IPv4Network | IPv6Network) else list(network)
    if not nets:
        raise ConfigError("no pod network given for the firewall rules; set Network")
    return list(dict.fromkeys(nets))


def _names(networks: Sequence[Net]) -> str:
    return " or ".join(str(n) for n in networks)


def without_random_fully(rules: Iterable[Rule]) -> list[Rule]:
    """The same rules for an iptables or kernel that lacks ``--random-fully``."""
    return [replace(r, spec=tuple(a for a in r.spec if a != RANDOM_FULLY)) for r in rules]


# --- pure: whether to look at all ----------------------------------------------------


@dataclass(frozen=True)
class Checked:
    """A check that found ``rules`` exactly in place, and the ruleset generation read just
    before its listing."""

    rules: tuple[Rule, ...]
    generation: int


def needs_check(last: Checked | None, rules: Sequence[Rule], generation: int | None) -> bool:
    """Whether ``rules`` must be listed again: always, unless the last check of these very
    rules found them in place and the namespace's ruleset generation (None: not known,
    e.g. iptables-legacy) still reads what it read before that check."""
    return (
        last is None
        or generation is None
        or generation != last.generation
        or tuple(rules) != last.rules
    )


# --- pure: comparing a chain ------------------------------------------------------------


def plan_chain(desired: Sequence[Rule], observed: Sequence[str]) -> ChainPlan:
    """Our own chain: in sync only when its rules are exactly ``desired``, in order.

    ``observed`` is ``iptables -S <chain>`` output (``-N``/``-P`` lines are
    ignored); an empty list means the chain does not exist.
    """
    want = [r.line for r in desired]
    have = _rule_lines(observed)
    if have == want:
        return ChainPlan(True)
    return ChainPlan(False, _why(want, have))


def plan_jumps(
    desired: Sequence[Rule], observed: Sequence[str], bootstrap: bool = False
) -> ChainPlan:
    """A builtin chain (POSTROUTING, FORWARD): our jumps present, wherever they are.

    Other rules in the chain are not ours and are ignored, as Flannel ignores
    them. At ``bootstrap`` (the first sync after start) our jumps must be the
    chain's last rules, once each, as Flannel leaves them after deleting and
    appending them; ``stale`` then lists every observed jump to our chains, which
    the repair deletes (by spec, never by position) before appending ``desired``.
    Later, only a missing jump is a difference, and the repair appends it alone.
    """
    want = [r.line for r in desired]
    targets = {r.target for r in desired}
    have = _rule_lines(observed)
    ours = [line for line in have if _target(_split(line)) in targets]
    if not bootstrap:
        if all(line in ours for line in want):
            return ChainPlan(True)
        return ChainPlan(False, MISSING)
    if ours == want and have[len(have) - len(want) :] == want:
        return ChainPlan(True)
    return ChainPlan(False, _why(want, ours), stale=tuple(ours))


def missing_jumps(desired: Sequence[Rule], observed: Sequence[str]) -> list[Rule]:
    """The jumps of ``desired`` that ``observed`` (``iptables -S`` lines) lacks."""
    have = set(_rule_lines(observed))
    return [r for r in desired if r.line not in have]


def _why(want: Sequence[str], have: Sequence[str]) -> str:
    if any(line not in have for line in want):
        return MISSING
    if any(n > 1 for n in Counter(have).values()):
        return DUPLICATES
    if any(line not in want for line in have):
        return EXTRA
    return WRONG_ORDER


def most_significant(reasons: Iterable[str]) -> str:
    found = set(reasons)
    return next((r for r in REASONS if r in found), "")


def restore_script(
    table: str,
    rewrite: Sequence[tuple[str, Sequence[Rule]]],
    jumps: Sequence[tuple[str, Sequence[Rule], Sequence[str]]],
) -> str:
    """One ``iptables-restore --noflush`` transaction for ``table``.

    ``rewrite``: (our chain, its rules); declaring a chain with --noflush creates
    it or empties it, then the rules are appended. ``jumps``: (builtin chain, jump
    rules to append, stale lines); stale jumps are deleted by spec, then the
    jumps are appended in order, after every rule already in the chain.
    """
    lines = [f"*{table}"]
    lines += [f":{chain} - [0:0]" for chain, _ in rewrite]
    for _, rules in rewrite:
        lines += [r.line for r in rules]
    for _, rules, stale in jumps:
        lines += ["-D" + line[len("-A") :] for line in stale]
        lines += [r.line for r in rules]
    lines.append("COMMIT")
    return "\n".join(lines) + "\n"


def random_fully_supported(iptables_version: str, kernel_release: str) -> bool:
    """``--random-fully`` needs iptables >= 1.6.2 (as go-iptables checks) and Linux >= 3.13."""
    return _version(iptables_version, r"v(\d+)\.(\d+)\.(\d+)") >= (1, 6, 2) and _version(
        kernel_release, r"^(\d+)\.(\d+)"
    ) >= (3, 13)


def _version(text: str, pattern: str) -> tuple[int, ...]:
    m = re.search(pattern, text)
    return tuple(int(g) for g in m.groups()) if m else ()


def _rule_lines(observed: Sequence[str]) -> list[str]:
    return [line.strip() for line in observed if line.startswith("-A ")]


def _split(line: str) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(line))
    except ValueError:  # unbalanced quotes: not a line we wrote
        return tuple(line.split())


def _target(spec: Sequence[str]) -> str | None:
    for i, arg in enumerate(spec[:-1]):
        if arg in ("-j", "--jump", "-g", "--goto"):
            return spec[i + 1]
    return None


def _quote(arg: str) -> str:
    # iptables -S prints arguments with spaces in double quotes (comments).
    return f'"{arg}"' if " " in arg or not arg else arg


# --- the adapter ------------------------------------------------------------------------

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


class IptablesFirewall:
    """Keeps our chains and jumps exactly as desired through the iptables CLI.

    ``command_prefix`` (e.g. ``("ip", "netns", "exec", "ns1")``) runs every
    command inside a network namespace, whose iptables state is its own.
    ``generation`` asks the nftables ruleset generation of the namespace the commands
    run in (:class:`~flannelpy.dataplane.nfgen.RulesetGeneration`); with iptables-nft a
    check is skipped while it has not moved since the last check found every chain in
    place (module docstring). None: every sync lists the chains.
    """

    def __init__(
        self,
        run: Runner = subprocess.run,
        command_prefix: Sequence[str] = (),
        lock_file: str | None = None,
        wait_seconds: int = 5,
        random_fully: bool | None = None,  # None: detect once, on first use
        timeout: float = 30.0,
        ipv6: bool = False,  # ip6tables (dual stack): the same chains in the IPv6 tables
        generation: Callable[[], int | None] | None = None,
    ) -> None:
        self._iptables = "ip6tables" if ipv6 else "iptables"
        self._run = run
        self._prefix = tuple(command_prefix)
        self._lock_file = lock_file or os.environ.get("XTABLES_LOCKFILE") or DEFAULT_LOCK_FILE
        self._wait = ("-w", str(wait_seconds))
        self._random_fully = random_fully
        self._timeout = timeout
        # Builtin chains whose jumps were placed since start (see plan_jumps' bootstrap).
        self._placed: set[tuple[str, str]] = set()
        self._generation = generation
        self._version: str | None = None  # `iptables --version`, asked once
        # The last check that found its chains in place, by the chains it covers.
        self._checked: dict[frozenset[tuple[str, str]], Checked] = {}

    @property
    def random_fully(self) -> bool:
        if self._random_fully is None:
            self._random_fully = random_fully_supported(self.version, platform.release())
            if not self._random_fully:
                log.warning("iptables lacks --random-fully, masquerading without it")
        return self._random_fully

    @property
    def version(self) -> str:
        """``iptables --version`` (empty when it fails), asked once."""
        if self._version is None:
            proc = self._exec([self._iptables, "--version"])
            self._version = (proc.stdout + proc.stderr) if proc.returncode == 0 else ""
        return self._version

    @property
    def nf_tables(self) -> bool:
        """iptables-nft: the rules live in nftables, under its ruleset generation."""
        return "(nf_tables)" in self.version

    def _generation_now(self) -> int | None:
        if self._generation is None or not self.nf_tables:
            return None
        return self._generation()

    def sync(self, rules: Sequence[Rule]) -> SyncResult:
        """Make our chains exactly ``rules`` and our jumps present (placed at the end on
        the first sync); report whether a repair was needed."""
        if not self.random_fully:
            rules = without_random_fully(rules)
        covered = frozenset((r.table, r.chain) for r in rules)
        # Read before the listing: a change after it moves the generation past this one.
        generation = self._generation_now()
        if not needs_check(self._checked.get(covered), rules, generation):
            return SyncResult(False)
        self._checked.pop(covered, None)
        details: list[str] = []
        reasons: list[str] = []
        for table, chains in _by_table(rules).items():
            script, problems = self._table_repair(table, chains)
            builtins = {(table, chain) for chain in chains if chain in BUILTIN_CHAINS}
            if script is None:
                self._placed |= builtins
                continue
            reasons += [reason for _, reason in problems]
            details += [f"{table}/{chain}: {reason}" for chain, reason in problems]
            self._restore(table, script)
            self._placed |= builtins
            _, still = self._table_repair(table, chains)
            if still:
                found = ", ".join(f"{table}/{c}: {r}" for c, r in still)
                raise DataplaneError(
                    f"iptables rules still differ after a repair ({found}); "
                    "check what else rewrites these chains"
                )
        reason = most_significant(reasons)
        if details:
            # Our own repair moved the generation: the next resync checks once more.
            log.info("firewall repaired reason=%s details=%s", reason, "; ".join(details))
        elif generation is not None:
            self._checked[covered] = Checked(tuple(rules), generation)
        return SyncResult(bool(details), reason, tuple(details))

    def remove(self) -> None:
        """Delete our jumps and chains (the clean-up when nftables mode starts). Missing
        ones are fine."""
        self._checked.clear()
        for table, chain in OUR_CHAINS:
            if not self._list(table, chain):
                continue
            lines = [f"*{table}"]
            for builtin in TABLE_BUILTINS[table]:
                observed = self._list(table, builtin)
                lines += [
                    "-D" + line[len("-A") :]
                    for line in _rule_lines(observed)
                    if _target(_split(line)) == chain
                ]
            lines += [f"-F {chain}", f"-X {chain}", "COMMIT"]
            self._restore(table, "\n".join(lines) + "\n")

    def list_rules(self, table: str, chain: str) -> list[str]:
        """``iptables -S <chain>`` lines; empty when the chain does not exist."""
        return self._list(table, chain)

    # -- internals --

    def _table_repair(
        self, table: str, chains: dict[str, list[Rule]]
    ) -> tuple[str | None, list[tuple[str, str]]]:
        rewrite: list[tuple[str, Sequence[Rule]]] = []
        jumps: list[tuple[str, Sequence[Rule], Sequence[str]]] = []
        problems: list[tuple[str, str]] = []
        # Our chains first: a jump is only valid once its target exists.
        for chain, chain_rules in sorted(chains.items(), key=lambda kv: kv[0] in BUILTIN_CHAINS):
            observed = self._list(table, chain)
            if chain in BUILTIN_CHAINS:
                bootstrap = (table, chain) not in self._placed
                plan = plan_jumps(chain_rules, observed, bootstrap)
                if not plan.in_sync:
                    append = chain_rules if bootstrap else missing_jumps(chain_rules, observed)
                    jumps.append((chain, append, plan.stale))
            else:
                plan = plan_chain(chain_rules, observed)
                if not plan.in_sync:
                    rewrite.append((chain, chain_rules))
            if not plan.in_sync:
                problems.append((chain, plan.reason))
        if not problems:
            return None, []
        return restore_script(table, rewrite, jumps), problems

    def _list(self, table: str, chain: str) -> list[str]:
        proc = self._exec([self._iptables, *self._wait, "-t", table, "-S", chain])
        if proc.returncode == 0:
            return proc.stdout.splitlines()
        if chain in BUILTIN_CHAINS:
            raise DataplaneError(
                f"{self._iptables} cannot list {table}/{chain}: {_first_line(proc.stderr)}; "
                "check that iptables works on this host"
            )
        # A missing user chain is an error for iptables; for us it is "missing",
        # and any other failure resurfaces when the repair runs iptables-restore.
        log.debug("chain not listed table=%s chain=%s error=%s", table, chain, proc.stderr.strip())
        return []

    def _restore(self, table: str, script: str) -> None:
        proc = self._exec([f"{self._iptables}-restore", *self._wait, "--noflush"], input=script)
        if proc.returncode != 0:
            raise DataplaneError(
                f"{self._iptables}-restore failed for table {table}: {_first_line(proc.stderr)}; "
                "check the iptables installation and the xtables lock"
            )

    def _exec(
        self, argv: Sequence[str], input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "XTABLES_LOCKFILE": self._lock_file}
        kwargs: dict[str, Any] = {
            "input": input,
            "capture_output": True,
            "text": True,
            "env": env,
            "check": False,
            "timeout": self._timeout,
        }
        try:
            return self._run([*self._prefix, *argv], **kwargs)
        except FileNotFoundError as e:
            raise DataplaneError(f"{argv[0]} is not installed; install the iptables package") from e
        except subprocess.TimeoutExpired as e:
            raise DataplaneError(
                f"{argv[0]} did not finish in {self._timeout:g} s; check the xtables lock holder"
            ) from e


def _by_table(rules: Iterable[Rule]) -> dict[str, dict[str, list[Rule]]]:
    tables: dict[str, dict[str, list[Rule]]] = {}
    for r in rules:
        tables.setdefault(r.table, {}).setdefault(r.chain, []).append(r)
    return tables


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else "no error output"
