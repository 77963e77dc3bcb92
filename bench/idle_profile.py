"""Where an idle agent's CPU and memory go, beside flanneld and the interpreter's floor.

Part 1 of :mod:`bench.versus_flanneld` (a throwaway namespace, an etcd on loopback with
the network config and N fake peer leases), but for one start of each implementation,
then ``--idle-seconds`` with nothing changing, sampled per thread from
``/proc/<pid>/task/*``: CPU (utime + stime) and wake-ups (voluntary context switches).
Our threads are named by ``py-spy dump`` when it is installed (``pip install py-spy``;
a development tool, not a dependency), else by their kernel name. Then the floor: RSS
and CPU of ``python -c pass`` and of the bare import groups the agent loads, each in a
fresh interpreter (``/usr/bin/time``-style, from ``wait4``'s rusage).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence

from bench.agent_start import _peer_subnets, reference_netns
from bench.common import compile_agent, fake_peers, lacks_root, load_average, put_peers, say, table
from bench.versus_flanneld import (
    CLK_TCK,
    IMPLS,
    PREFIX,
    START_SETTLE,
    bench_node,
    cpu_seconds,
    stop,
    time_start,
)

# What the agent imports in Kubernetes mode: its start, the node watch, the status Lease,
# Events, NetworkPolicy's watches (tests/unit/test_lazy_imports.py checks the same list
# never loads the kubernetes package).
KUBE_MODE_IMPORTS = (
    "import flannelpy.cli, flannelpy.commands.agent, flannelpy.agent.compose, "
    "flannelpy.store.open_store, flannelpy.store.node_control, flannelpy.store.kube.manager, "
    "flannelpy.store.kube.node_status, flannelpy.store.kube.events, "
    "flannelpy.store.kube.policy_watch, flannelpy.dataplane.netlink"
)
# What the agent imports, by group, each measured alone in a fresh interpreter.
IMPORT_GROUPS: tuple[tuple[str, str], ...] = (
    ("python -c pass", "pass"),
    ("etcd client (the JSON gateway's, over urllib3)", "import flannelpy.store.etcd.client"),
    # The gRPC transport, loaded only with an etcd client certificate.
    ("etcd client's gRPC transport", "import flannelpy.store.etcd.grpc_member"),
    ("pyroute2", "import pyroute2"),
    ("prometheus_client", "import prometheus_client"),
    # The kubernetes package, which no flannelpy module imports any more (README,
    # "Dependencies, and why"): what the agent would pay for it.
    ("kubernetes package (not imported)", "import kubernetes"),
    ("the agent's own modules (its start, etcd mode)", "import flannelpy.agent.compose"),
    (
        "all the agent imports at ready (etcd mode)",
        "import flannelpy.cli, flannelpy.commands.agent, flannelpy.agent.compose, "
        "flannelpy.store.etcd.client, flannelpy.dataplane.netlink",
    ),
    (
        "all the agent imports at ready (Kubernetes mode)",
        KUBE_MODE_IMPORTS,
    ),
)


def threads(pid: int) -> dict[int, tuple[str, float, int, float]]:
    """tid -> (kernel name, CPU seconds, voluntary context switches, of the CPU: in the
    kernel, stime)."""
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                text = f.read()
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                switches = next(
                    int(line.split()[1]) for line in f if line.startswith("voluntary_ctxt")
                )
        except (OSError, StopIteration):
            continue
        fields = text[text.rindex(")") + 2 :].split()
        name = text[text.index("(") + 1 : text.rindex(")")]
        utime, stime = int(fields[11]) / CLK_TCK, int(fields[12]) / CLK_TCK
        out[int(tid)] = (name, utime + stime, switches, stime)
    return out


def python_names(pid: int) -> dict[int, str]:
    """tid -> Python thread name, from ``py-spy dump`` (empty without py-spy)."""
    spy = shutil.which("py-spy") or os.path.join(os.path.dirname(sys.executable), "py-spy")
    if not os.access(spy, os.X_OK):
        return {}
    proc = subprocess.run(
        [spy, "dump", "--pid", str(pid)], capture_output=True, text=True, check=False
    )
    names = {}
    for m in re.finditer(r'^Thread (0x[0-9A-Fa-f]+|\d+) \(\w+\): "([^"]+)"', proc.stdout, re.M):
        ident = m.group(1)
        names[int(ident, 16) if ident.startswith("0x") else int(ident)] = m.group(2)
    return names


def idle_by_thread(counts: int, idle: float, agent_args: Sequence[str]) -> dict[str, object]:
    """Inside the namespace: one start of each implementation, then its idle window."""
    result: dict[str, object] = {}
    peers = fake_peers(counts, _peer_subnets())
    with bench_node(agent_args) as node:
        put_peers(node.endpoint, PREFIX, peers)
        for impl in IMPLS:
            start, run = time_start(impl, node, peers, {p.key for p in peers})
            try:
                time.sleep(START_SETTLE)
                pid = run.proc.pid
                before, cpu0, t0 = threads(pid), cpu_seconds(pid), time.monotonic()
                time.sleep(idle)
                after, cpu1, wall = threads(pid), cpu_seconds(pid), time.monotonic() - t0
                names = python_names(pid) if impl == "ours" else {}
                rows = []
                for tid, (kname, cpu, switches, kernel) in after.items():
                    _, cpu_before, sw_before, k_before = before.get(tid, (kname, 0.0, 0, 0.0))
                    name = names.get(tid, kname)
                    rows.append((name, cpu - cpu_before, switches - sw_before, kernel - k_before))
                result[impl] = {
                    "ready": start.seconds,
                    "rss": start.rss,
                    "idle_cpu": cpu1 - cpu0,
                    "wall": wall,
                    "threads": sorted(rows, key=lambda r: -r[1]),
                }
                say(f"{impl}: idle CPU {cpu1 - cpu0:.2f} s over {wall:.0f} s")
            finally:
                stop(run)
    return result


# Run after the import: the interpreter's own RSS and CPU (a fork's maxrss from wait4
# would count this bench's pages, copied before the exec).
SELF_REPORT = (
    "\nimport os\nt = os.times()\n"
    "print(next(int(l.split()[1]) for l in open('/proc/self/status') "
    "if l.startswith('VmRSS:')), t.user + t.system)"
)


def floor(repeat: int) -> list[tuple[str, float, float, float]]:
    """(group, RSS MiB, CPU s, wall s): medians over ``repeat`` fresh interpreters each."""
    rows = []
    for label, code in IMPORT_GROUPS:
        samples = []
        for _ in range(repeat):
            t0 = time.monotonic()
            out = subprocess.run(
                [sys.executable, "-c", code + SELF_REPORT],
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            samples.append((int(out[0]) / 1024, float(out[1]), time.monotonic() - t0))
        mid = sorted(samples, key=lambda s: s[1])[len(samples) // 2]
        rows.append((label, *mid))
    return rows


def report(idle: dict[str, dict], floors: list[tuple[str, float, float, float]], load: str) -> str:
    lines = [f"load average {load}", ""]
    ours, ref = idle["ours"], idle["flanneld"]
    lines.append(
        table(
            ["", "ours", "flanneld", "ours / flanneld"],
            [
                [
                    "idle CPU (s)",
                    f"{ours['idle_cpu']:.2f}",
                    f"{ref['idle_cpu']:.2f}",
                    f"{ours['idle_cpu'] / max(ref['idle_cpu'], 1e-9):.2f}",
                ],
                [
                    "RSS at ready (MiB)",
                    f"{ours['rss']:.1f}",
                    f"{ref['rss']:.1f}",
                    f"{ours['rss'] / ref['rss']:.2f}",
                ],
                [
                    "start-to-ready (s)",
                    f"{ours['ready']:.3f}",
                    f"{ref['ready']:.3f}",
                    f"{ours['ready'] / ref['ready']:.2f}",
                ],
            ],
        )
    )
    lines.append("")
    for impl in IMPLS:
        data = idle[impl]
        lines.append(f"{impl}: CPU and wake-ups per thread over {data['wall']:.0f} s")
        shown = [r for r in data["threads"] if r[1] >= 0.005 or r[2] >= 10]
        total = data["threads"]
        lines.append(
            table(
                ["thread", "CPU (s)", "of it in the kernel (s)", "wake-ups"],
                [
                    [name, f"{cpu:.2f}", f"{kernel:.2f}", switches]
                    for name, cpu, switches, kernel in shown
                ]
                + [
                    [
                        "(all threads)",
                        f"{sum(r[1] for r in total):.2f}",
                        f"{sum(r[3] for r in total):.2f}",
                        sum(r[2] for r in total),
                    ]
                ],
            )
        )
        lines.append("")
    lines.append("the floor: fresh interpreters (median)")
    lines.append(
        table(
            ["what", "RSS (MiB)", "CPU (s)", "wall (s)"],
            [
                [label, f"{rss:.1f}", f"{cpu:.3f}", f"{wall:.3f}"]
                for label, rss, cpu, wall in floors
            ],
        )
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.idle_profile", description=__doc__)
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    parser.add_argument("--floor-repeat", type=int, default=5)
    parser.add_argument("--agent-arg", action="append", default=[], metavar="ARG")
    parser.add_argument("--inside-netns", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.inside_netns:
        print(json.dumps(idle_by_thread(args.peers, args.idle_seconds, args.agent_arg)))
        return 0
    if lacks_root("bench.idle_profile"):
        return 2
    load = load_average()
    compile_agent()
    with reference_netns() as ns:
        child = [
            sys.executable, "-m", "bench.idle_profile", "--inside-netns",
            "--peers", str(args.peers), "--idle-seconds", str(args.idle_seconds),
            *(f"--agent-arg={a}" for a in args.agent_arg),
        ]  # fmt: skip
        proc = subprocess.run(
            ["ip", "netns", "exec", ns, *child], stdout=subprocess.PIPE, text=True, check=False
        )
    if proc.returncode != 0:
        raise SystemExit(f"the idle run failed (exit {proc.returncode}); see above")
    idle = json.loads(proc.stdout)
    floors = floor(args.floor_repeat)
    print(report(idle, floors, f"{load} -> {load_average()}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
