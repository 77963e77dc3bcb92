"""One policy change into the kernel: the ``nft`` command against libnftables in-process.

    python -m bench.policy_table_write [--rules 0 300 3000] [--changes 200]

For each count of foreign rules (iptables-nft rules in the ``ip filter`` table, as
kube-proxy's iptables mode leaves them: one chain, N rules matching a destination and
port), a throwaway network namespace holds them beside a policy table of the agent's
shape (a set and a map of pod addresses). Each change adds or deletes one element of
the set, the smallest transaction a pod change makes, timed to its return:

* **reference**: ``nft -f -`` as a process, the script on stdin (what the agent ran
  before: a process per change, which reads the namespace's ruleset first);
* **ours**: the same script through one libnftables context kept for the run
  (``flannelpy.dataplane.libnft``), as the agent runs it now.

Also timed: the read-back of the table (``nft -s list table``, as the agent reads it) both ways, and
the ruleset generation (``NFT_MSG_GETGEN``) asked right after a change that deleted an
element: over a socket made for the question (the reference, as the agent asked before)
against one socket kept open (``flannelpy.dataplane.nfgen.RulesetGeneration``), both
from a thread in the namespace.
Reported: p50 and p99 in ms per way and ours / reference. The namespace is removed at the end.
"""

from __future__ import annotations

import argparse
import secrets
import subprocess
import sys
import time
from collections.abc import Callable

from bench.common import lacks_root, load_average, percentile, say, table
from flannelpy.dataplane.libnft import LibNftables
from flannelpy.dataplane.netns import netns_path, run_in_netns
from flannelpy.dataplane.nfgen import RulesetGeneration, ruleset_generation

TABLE = "inet bench-policy"
SETUP = f"""add table {TABLE}
add set {TABLE} peers {{ type ipv4_addr; }}
add map {TABLE} ingress4 {{ type ipv4_addr : verdict; }}
add chain {TABLE} forward {{ type filter hook forward priority filter; policy accept; }}
add rule {TABLE} forward ip daddr vmap @ingress4
"""


def foreign_rules(ns: str, count: int) -> None:
    """``count`` iptables-nft rules in one chain, restored in one go."""
    lines = ["*filter", ":KUBE-BENCH - [0:0]", "-A FORWARD -j KUBE-BENCH"]
    for i in range(count):
        lines.append(
            f"-A KUBE-BENCH -d 10.96.{i // 250}.{i % 250 + 1}/32 -p tcp --dport 80 -j ACCEPT"
        )
    lines.append("COMMIT")
    subprocess.run(["ip", "netns", "exec", ns, "iptables-restore", "--noflush"],
                   input="\n".join(lines) + "\n", text=True, check=True)  # fmt: skip


def time_changes(run: Callable[[str], None], changes: int) -> list[float]:
    """Add then delete element ``10.244.x.y``, ``changes`` transactions in all (ms each)."""
    times = []
    for i in range(changes):
        verb = "add" if i % 2 == 0 else "delete"
        address = f"10.244.{(i // 2) // 250}.{(i // 2) % 250 + 1}"
        started = time.perf_counter()
        run(f"{verb} element {TABLE} peers {{ {address} }}\n")
        times.append((time.perf_counter() - started) * 1000)
    return times


def time_generation(
    library: LibNftables, ask: Callable[[], int | None], path: str, changes: int
) -> list[float]:
    """Add and delete one element, then time one generation question (ms each)."""
    times = []
    for i in range(changes):
        for verb in ("add", "delete"):
            library(
                ["nft", "-f", "-"],
                input=f"{verb} element {TABLE} peers {{ 10.245.0.{i % 250 + 1} }}\n",
            )
        started = time.perf_counter()
        if run_in_netns(path, ask) is None:
            raise SystemExit("the kernel did not answer NFT_MSG_GETGEN")
        times.append((time.perf_counter() - started) * 1000)
    return times


def measure(rules: int, changes: int) -> dict[str, list[float]]:
    ns = "bench-nft-" + secrets.token_hex(3)
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=SETUP, text=True,
                       check=True)  # fmt: skip
        foreign_rules(ns, rules)
        library = run_in_netns(netns_path(ns), LibNftables.load)
        if library is None:
            raise SystemExit("libnftables cannot be loaded: install libnftables1")

        def command(script: str) -> None:
            subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=script,
                           text=True, check=True, capture_output=True)  # fmt: skip

        def in_process(script: str) -> None:
            done = library(["nft", "-f", "-"], input=script)
            if done.returncode != 0:
                raise SystemExit(f"libnftables: {done.stderr.strip()}")

        listing = ["nft", "-s", "list", "table", *TABLE.split()]

        def list_by_command(_: str) -> None:
            subprocess.run(["ip", "netns", "exec", ns, *listing], capture_output=True, check=True)

        def list_in_process(_: str) -> None:
            library(listing)

        def enter_only(_: str) -> None:  # "ip netns exec" alone: a fork, an exec and a setns
            subprocess.run(["ip", "netns", "exec", ns, "true"], check=True)

        kept = RulesetGeneration()
        path = netns_path(ns)
        return {
            "generation after a delete, a socket each": time_generation(
                library, ruleset_generation, path, changes // 4
            ),
            "generation after a delete, kept socket": time_generation(
                library, kept, path, changes // 4
            ),
            "write one element, nft process": time_changes(command, changes),
            "write one element, libnftables": time_changes(in_process, changes),
            "read the table back, nft process": time_changes(list_by_command, changes // 4),
            "read the table back, libnftables": time_changes(list_in_process, changes // 4),
            "ip netns exec true": time_changes(enter_only, changes),
        }
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.policy_table_write", description=__doc__)
    parser.add_argument("--rules", type=int, nargs="+", default=[0, 300, 3000])
    parser.add_argument("--changes", type=int, default=200)
    args = parser.parse_args(argv)
    if lacks_root(parser.prog):
        return 2
    rows = []
    for rules in args.rules:
        say(f"{rules} foreign rules: {args.changes} changes each way")
        got = measure(rules, args.changes)
        base = percentile(got["ip netns exec true"], 50)
        for what in ("write one element", "read the table back"):
            ref, ours = got[f"{what}, nft process"], got[f"{what}, libnftables"]
            ref50 = percentile(ref, 50) - base
            rows.append((rules, what, ref50, percentile(ref, 99) - base, percentile(ours, 50),
                         percentile(ours, 99), percentile(ours, 50) / ref50))  # fmt: skip
        ref = got["generation after a delete, a socket each"]
        ours = got["generation after a delete, kept socket"]
        rows.append((rules, "generation after a delete (socket each / kept)", percentile(ref, 50),
                     percentile(ref, 99), percentile(ours, 50), percentile(ours, 99),
                     percentile(ours, 50) / percentile(ref, 50)))  # fmt: skip
    print("ms each; reference: the nft process (net of `ip netns exec true`'s p50) or a socket"
          " per generation question; ours: libnftables or the kept socket")  # fmt: skip
    print(table(("foreign rules", "what", "reference p50", "reference p99", "ours p50",
                 "ours p99", "p50 ours / reference"), rows))  # fmt: skip
    print(f'{{"load_average": "{load_average()}"}}')
    return 0


if __name__ == "__main__":
    sys.exit(main())
