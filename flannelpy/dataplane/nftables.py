"""ip-masq and forward rules in nftables mode (``EnableNFTables: true``): Flannel's tables.

Flannel (v0.28, ``pkg/trafficmngr/nftables``) keeps two tables of its own and
creates both at start, even when only one family is configured::

    table ip flannel-ipv4   comment "rules for flannel-ipv4"
      chain postrtg   type nat hook postrouting priority srcnat   (with --ip-masq)
        meta mark 0x4000 return                          kube-proxy masquerades these
        ip saddr <subnet> ip daddr <Network> return      pod → pod: no NAT
        ip saddr <Network> ip daddr <subnet> return
        ip saddr != <subnet> ip daddr <Network> return   (sic: Flannel's iptables rule
                                                          reads ``! -s <Network> -d <subnet>``)
        ip saddr <Network> ip daddr != 224.0.0.0/4 masquerade fully-random
        ip saddr != <Network> ip daddr <Network> masquerade fully-random
      chain forward   type filter hook forward priority filter    (with --iptables-forward-rules)
        ip saddr <Network> accept ; ip daddr <Network> accept
    table ip6 flannel-ipv6  comment "rules for flannel-ipv6"        (empty for IPv4 only)
      the same two chains with ``ip6`` matches, the IPv6Network and the node's IPv6
      subnet, excluding ff00::/8 instead of 224.0.0.0/4 (with EnableIPv6)

The rule texts here are the ones flanneld writes; ``nft list table`` prints
them back the same on both implementations. The tables are ours alone, so a
repair rebuilds them whole in one ``nft -f`` transaction (delete and re-add):
the chains keep Flannel's order and no packet sees a half-built table.
Unlike flanneld, which writes the rules once at start, the firewall timer
compares ``nft list table`` with what the last rebuild produced and repairs
any difference.
"""

from __future__ import annotations

import logging
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Network, IPv6Network
from typing import Any

from flannelpy.dataplane.firewall import MISSING, MULTICAST, MULTICAST6, SyncResult
from flannelpy.errors import ConfigError, DataplaneError

log = logging.getLogger(__name__)

IPV4_TABLE = "flannel-ipv4"
IPV6_TABLE = "flannel-ipv6"
POSTRTG_CHAIN = "postrtg"
FORWARD_CHAIN = "forward"
TABLES = (("ip", IPV4_TABLE), ("ip6", IPV6_TABLE))
POSTRTG_COMMENT = "chain to manage traffic masquerading by flannel"
FORWARD_COMMENT = "chain to accept flannel traffic"
KUBE_PROXY_MARK = "0x4000"
CHANGED = "changed"  # there, but not as the last rebuild left it (or the rules changed)
AT_START = "start"  # there at start: flanneld rewrites its tables at start, and so do we


Net = IPv4Network | IPv6Network  # one family per rule set: its own table


@dataclass(frozen=True)
class NftRules:
    """The content of our tables: the rule texts of each chain; None: no such chain.

    ``postrtg``/``forward`` go to ``ip flannel-ipv4``, ``postrtg6``/``forward6`` to
    ``ip6 flannel-ipv6`` (dual stack)."""

    postrtg: tuple[str, ...] | None
    forward: tuple[str, ...] | None
    postrtg6: tuple[str, ...] | None = None
    forward6: tuple[str, ...] | None = None


# --- pure: the rules --------------------------------------------------------------------


def masq_rules(
    network: Net | Sequence[Net],
    node_subnets: Sequence[Net],
    random_fully: bool,
) -> tuple[str, ...]:
    """Flannel's ``postrtg`` rules; with one range and one subnet, exactly flanneld's.

    IPv6 ranges give the rules of ``ip6 flannel-ipv6`` (``ip6`` matches, ff00::/8).
    Several pod ranges (the primary Network first, then the other address pools)
    and subnets extend them as the iptables rules are extended: pod-to-pod
    traffic between any of them keeps its source.
    """
    networks = _networks(network)
    ip = _family(networks[0])
    multicast = MULTICAST6 if networks[0].version == 6 else MULTICAST
    primary = str(networks[0])
    subnets = list(dict.fromkeys(node_subnets))
    for subnet in subnets:
        if not any(_within(subnet, net) for net in networks):
            names = " or ".join(map(str, networks))
            raise ConfigError(f"node subnet {subnet} is outside the network {names}")
    masquerade = "masquerade fully-random" if random_fully else "masquerade"
    rules = [f"meta mark {KUBE_PROXY_MARK} return"]
    for subnet in subnets:
        for net in map(str, networks):
            rules.append(f"{ip} saddr {subnet} {ip} daddr {net} return")
            rules.append(f"{ip} saddr {net} {ip} daddr {subnet} return")
    for subnet in subnets:
        rules.append(f"{ip} saddr != {subnet} {ip} daddr {primary} return")
    for src in map(str, networks):
        for dst in map(str, networks):
            if src != dst:
                rules.append(f"{ip} saddr {src} {ip} daddr {dst} return")
    for net in map(str, networks):
        rules.append(f"{ip} saddr {net} {ip} daddr != {multicast} {masquerade}")
    for net in map(str, networks):
        rules.append(f"{ip} saddr != {net} {ip} daddr {net} {masquerade}")
    return tuple(rules)


def forward_rules(network: Net | Sequence[Net]) -> tuple[str, ...]:
    """Flannel's ``forward`` rules: accept anything to or from the network (every pod range)."""
    networks = _networks(network)
    ip = _family(networks[0])
    rules: list[str] = []
    for net in map(str, networks):
        rules += [f"{ip} saddr {net} accept", f"{ip} daddr {net} accept"]
    return tuple(rules)


def _networks(network: Net | Sequence[Net]) -> list[Net]:
    nets = [network] if isinstance(network, IPv4Network | IPv6Network) else list(network)
    if not nets:
        raise ConfigError("no pod network given for the firewall rules; set Network")
    if len({n.version for n in nets}) > 1:
        names = ", ".join(map(str, nets))
        raise ConfigError(f"pod networks {names} mix IPv4 and IPv6; give one family per table")
    return list(dict.fromkeys(nets))


def _family(network: Net) -> str:
    return "ip6" if network.version == 6 else "ip"


def _within(subnet: Net, network: Net) -> bool:
    if isinstance(subnet, IPv4Network) and isinstance(network, IPv4Network):
        return subnet.subnet_of(network)
    if isinstance(subnet, IPv6Network) and isinstance(network, IPv6Network):
        return subnet.subnet_of(network)
    return False


def rebuild_script(rules: NftRules) -> str:
    """One ``nft -f`` transaction that leaves our tables exactly ``rules``.

    ``add`` before ``delete`` makes the delete valid when a table is absent; the
    chains are created in flanneld's order (postrtg, then forward), IPv4 table first.
    """
    lines: list[str] = []
    for family, table in TABLES:
        lines += [f"add table {family} {table}", f"delete table {family} {table}"]
    for family, table in TABLES:
        lines.append(f'add table {family} {table} {{ comment "rules for {table}" ; }}')
    chains = (
        (IPV4_TABLE, POSTRTG_CHAIN, "nat", "postrouting", "srcnat", POSTRTG_COMMENT,
         rules.postrtg),
        (IPV4_TABLE, FORWARD_CHAIN, "filter", "forward", "filter", FORWARD_COMMENT,
         rules.forward),
        (IPV6_TABLE, POSTRTG_CHAIN, "nat", "postrouting", "srcnat", POSTRTG_COMMENT,
         rules.postrtg6),
        (IPV6_TABLE, FORWARD_CHAIN, "filter", "forward", "filter", FORWARD_COMMENT,
         rules.forward6),
    )  # fmt: skip
    for table, chain, kind, hook, priority, comment, chain_rules in chains:
        if chain_rules is None:
            continue
        prefix = f"ip6 {table}" if table == IPV6_TABLE else f"ip {table}"
        lines.append(
            f"add chain {prefix} {chain} {{ type {kind} hook {hook} priority {priority} ; "
            f'comment "{comment}" ; }}'
        )
        lines += [f"add rule {prefix} {chain} {rule}" for rule in chain_rules]
    return "\n".join(lines) + "\n"


def remove_script() -> str:
    """Delete both tables, present or not (the clean-up when iptables mode starts)."""
    lines: list[str] = []
    for family, table in TABLES:
        lines += [f"add table {family} {table}", f"delete table {family} {table}"]
    return "\n".join(lines) + "\n"


def random_fully_probe() -> str:
    """flanneld's check for ``masquerade fully-random``: a chain that ``nft --check``
    accepts only when the kernel and nft support it (nothing is committed)."""
    return (
        f"add table ip {IPV4_TABLE}\n"
        f"add chain ip {IPV4_TABLE} masqueradeTest {{ type nat hook postrouting priority "
        "srcnat ; }\n"
        f"add rule ip {IPV4_TABLE} masqueradeTest ip saddr != 127.0.0.1 masquerade fully-random\n"
    )


# --- the adapter ------------------------------------------------------------------------

Runner = Callable[..., "subprocess.CompletedProcess[str]"]


class NftablesFirewall:
    """Keeps Flannel's nftables tables exactly as desired through the ``nft`` command.

    ``command_prefix`` (e.g. ``("ip", "netns", "exec", "ns1")``) runs every
    command inside a network namespace, whose nftables state is its own.
    """

    def __init__(
        self,
        run: Runner = subprocess.run,
        command_prefix: Sequence[str] = (),
        random_fully: bool | None = None,  # None: ask nft once, on first use
        timeout: float = 30.0,
    ) -> None:
        self._run = run
        self._prefix = tuple(command_prefix)
        self._random_fully = random_fully
        self._timeout = timeout
        # What the last rebuild wrote, and `nft list table` of both tables right after it.
        self._built: tuple[NftRules, dict[str, str]] | None = None

    @property
    def random_fully(self) -> bool:
        if self._random_fully is None:
            proc = self._exec(["nft", "--check", "-f", "-"], input=random_fully_probe())
            self._random_fully = proc.returncode == 0
            if not self._random_fully:
                log.warning("nftables lacks masquerade fully-random, masquerading without it")
        return self._random_fully

    def sync(self, rules: NftRules) -> SyncResult:
        """Make our tables exactly ``rules``: rebuilt on the first sync (as flanneld does
        at start), when ``rules`` change, and whenever their listing differs from what
        the last rebuild left (a rule, chain or table deleted or added by hand)."""
        observed = self.listing()
        if self._built == (rules, observed):
            return SyncResult(False)
        problems = {name: self._why(rules, name, text) for name, text in observed.items()}
        details = tuple(f"{name}: {why}" for name, why in problems.items() if why)
        reason = next(r for r in (MISSING, CHANGED, AT_START) if r in problems.values())
        self._apply(rebuild_script(rules), "rebuild the flannel tables")
        self._built = (rules, self.listing())
        log.info("firewall rebuilt reason=%s details=%s", reason, "; ".join(details))
        return SyncResult(True, reason, details)

    def remove(self) -> None:
        """Delete both tables; absent ones are fine."""
        self._apply(remove_script(), "delete the flannel tables")

    def listing(self) -> dict[str, str]:
        """``nft list table`` of each of our tables; empty when a table does not exist."""
        found: dict[str, str] = {}
        for family, table in TABLES:
            proc = self._exec(["nft", "list", "table", family, table])
            if proc.returncode != 0 and "No such file or directory" not in proc.stderr:
                raise DataplaneError(
                    f"nft cannot list table {family} {table}: {first_line(proc.stderr)}; "
                    "check that nftables works on this host"
                )
            found[f"{family} {table}"] = proc.stdout if proc.returncode == 0 else ""
        return found

    # -- internals --

    def _why(self, rules: NftRules, name: str, text: str) -> str:
        if not text:
            return MISSING
        if self._built is None:
            return AT_START
        built_rules, built_listing = self._built
        return CHANGED if built_rules != rules or built_listing[name] != text else ""

    def _apply(self, script: str, what: str) -> None:
        proc = self._exec(["nft", "-f", "-"], input=script)
        if proc.returncode != 0:
            raise DataplaneError(
                f"nft could not {what}: {first_line(proc.stderr)}; "
                "check that the kernel has nftables (nf_tables, nft_masq)"
            )

    def _exec(
        self, argv: Sequence[str], input: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return run_nft(self._run, [*self._prefix, *argv], input, self._timeout)


def run_nft(
    run: Runner, argv: Sequence[str], input: str | None, timeout: float
) -> subprocess.CompletedProcess[str]:
    """Run an ``nft`` command line (``argv``, maybe behind a netns prefix), its output as text;
    a missing binary or a hang becomes DataplaneError."""
    kwargs: dict[str, Any] = {
        "input": input,
        "capture_output": True,
        "text": True,
        "check": False,
        "timeout": timeout,
    }
    try:
        return run(list(argv), **kwargs)
    except FileNotFoundError as e:
        raise DataplaneError("nft is not installed; install the nftables package") from e
    except subprocess.TimeoutExpired as e:
        raise DataplaneError(f"nft did not finish in {timeout:g} s") from e


def first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else "no error output"
