"""CNI ADD/DEL latency of our plugin against the reference ``bridge`` + ``host-local``, same run.

    python -m bench.cni_latency [--pods 100] [--burst 100] [--repeat 3]

Three plugins, measured one after the other on the same machine state:

* **ours, static C** and **ours, Python launcher**: a 1-node vxlan lab with its
  agent running; the executable installed for the lab (``build/flannelpy-cni``)
  or written by ``cni_plugin.client.write_launcher``, forwarding to the agent's
  socket. The config sets ``ipCooldownSeconds`` 0: host-local has no cooldown,
  and the repeats re-use more addresses within 30 s than a /24 holds.
* **reference**: ``/usr/lib/cni/bridge`` (bridge ``cnir0``, isGateway, no
  masquerade, hairpin, MTU 1450) with ``host-local`` over a /24 and a default
  route, in a namespace of its own that this bench creates.

Every call is what a container runtime does: the executable is spawned with
the ``CNI_*`` variables and its config on stdin (DEL gets the ADD's result as
``prevResult``), timed from spawn to exit. The runtime side runs inside the
node's namespace for both: the driver's worker threads ``setns()`` into it
before they spawn anything (children inherit the thread's namespace), so no
``ip netns exec`` cost is added to either side. Pod namespaces are created
beforehand (not timed), with ``lo`` up, and shared by all three plugins.

Per plugin and repeat: N sequential ADDs then N sequential DELs (latency of
each), then a burst of ``--burst`` ADDs submitted at once to a warm pool of as
many threads (wall time until the last exits, failures), then a burst of as
many DELs. Checked on the way: every ADD succeeds with a distinct address, the
bridge holds one port per pod, and after DEL no veth is left, neither on the
node nor in any pod namespace. The plugins' order rotates between repeats so
each sees the same load. Also measured: executable start, as VERSION (no
agent contact) 50 times each, interleaved.

Goals (issue 3): our median ADD <= the reference's; our burst wall time <= the
reference's.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from flannelpy_lab import Lab

from bench.common import median, percentile, ratio, table
from cni_plugin.client import write_launcher
from flannelpy.dataplane.netns import enter_netns, netns_path, run_in_netns

PLUGIN_TIMEOUT = 60.0  # seconds per executable run
REF_BIN = "/usr/lib/cni"
REF_BRIDGE = "cnir0"
REF_SUBNET = "10.250.0.0/24"  # only inside the reference namespace
OUR_BRIDGE = "cni0"
MTU = 1450  # the lab's vxlan MTU over a 1500-byte underlay
IFNAME = "eth0"
CNI_VERSION = "1.0.0"
WARMUP = 3  # untimed ADD+DEL pairs per plugin first: bridges exist, caches are warm
VERSION_RUNS = 50
STATIC, PYTHON, REFERENCE = "ours static C", "ours python launcher", "reference bridge"
OURS = (STATIC, PYTHON)

Say = Callable[[str], None]


# --- one executable run -----------------------------------------------------------


@dataclass(frozen=True)
class Plugin:
    label: str
    binary: str
    cni_path: str
    config: dict[str, Any]  # the network config, without prevResult
    node_ns: str  # where the runtime runs it
    bridge: str  # where its host veths hang
    keep_veths: frozenset[str] = frozenset()  # veths of the node that are not pods'


@dataclass(frozen=True)
class Call:
    rc: int
    seconds: float
    stdout: bytes
    stderr: bytes

    def error(self) -> str:
        return (self.stdout or self.stderr).decode(errors="replace").strip()[-300:]


def invoke(
    plugin: Plugin,
    command: str,
    container_id: str,
    netns: str,
    prev: dict[str, Any] | None = None,
) -> Call:
    """Run the executable once, as a runtime does, in the calling thread's namespace."""
    conf = dict(plugin.config)
    if prev is not None:
        conf["prevResult"] = prev
    stdin = json.dumps(conf).encode()
    env = {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": container_id,
        "CNI_NETNS": netns_path(netns),
        "CNI_IFNAME": IFNAME,
        "CNI_PATH": plugin.cni_path,
    }
    started = time.perf_counter()
    proc = subprocess.run(
        [plugin.binary], input=stdin, env=env, capture_output=True, timeout=PLUGIN_TIMEOUT
    )
    return Call(proc.returncode, time.perf_counter() - started, proc.stdout, proc.stderr)


def address_of(call: Call) -> str | None:
    """The first address of a successful ADD's result."""
    if call.rc != 0:
        return None
    try:
        return str(json.loads(call.stdout)["ips"][0]["address"])
    except (ValueError, KeyError, IndexError, TypeError):
        return None


# --- namespaces and threads ------------------------------------------------------


def enter_and_check(ns: str) -> None:
    """Move this worker thread into ``ns`` and prove it: a plugin run in the wrong
    namespace would build its bridge on the host."""
    enter_netns(ns)
    if os.stat("/proc/thread-self/ns/net").st_ino != os.stat(netns_path(ns)).st_ino:
        raise RuntimeError(f"worker thread is not in namespace {ns} after setns")


@contextmanager
def ns_pool(ns: str, workers: int) -> Iterator[ThreadPoolExecutor]:
    """``workers`` threads, all inside ``ns`` and started before use (a burst must not
    time thread creation)."""
    pool = ThreadPoolExecutor(workers, f"ns-{ns}", initializer=enter_and_check, initargs=(ns,))
    try:
        barrier = threading.Barrier(workers)
        for f in [pool.submit(barrier.wait, 30.0) for _ in range(workers)]:
            f.result()
        yield pool
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"`ip {' '.join(args)}` failed: {proc.stderr.strip()}")


def make_netns(ns: str, created: list[str]) -> None:
    created.append(ns)  # first: an interrupted `ip netns add` may still have made it
    ip("netns", "add", ns)
    ip("-n", ns, "link", "set", "lo", "up")


def delete_netns(names: Sequence[str]) -> None:
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)


def links(ns: str, *selector: str) -> list[str]:
    out = subprocess.run(
        ["ip", "-n", ns, "-j", "link", "show", *selector],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return [str(link["ifname"]) for link in json.loads(out or "[]")]


def pod_interfaces(pods: Sequence[str]) -> dict[str, list[str]]:
    """Interfaces other than ``lo`` in each pod namespace that has any."""
    found = {}
    for ns in pods:
        names = [n for _, n in run_in_netns(ns, socket.if_nameindex) if n != "lo"]
        if names:
            found[ns] = names
    return found


# --- the phases -------------------------------------------------------------------


@dataclass
class Run:
    """One plugin, one repeat."""

    plugin: str
    repeat: int
    add: list[float] = field(default_factory=list)  # seconds, successful sequential ADDs
    delete: list[float] = field(default_factory=list)
    burst_add: float = 0.0  # wall seconds
    burst_del: float = 0.0
    failures: dict[str, int] = field(default_factory=dict)  # phase -> failed runs


class Checker:
    """Collects what went wrong; the bench reports it all and exits non-zero."""

    def __init__(self, say: Say) -> None:
        self.problems: list[str] = []
        self.say = say

    def fail(self, msg: str) -> None:
        self.problems.append(msg)
        self.say(f"PROBLEM: {msg}")

    def adds(self, where: str, plugin: Plugin, calls: Sequence[Call]) -> list[str]:
        bad = [c for c in calls if address_of(c) is None]
        for c in bad[:3]:
            self.fail(f"{where}: ADD failed (exit {c.rc}): {c.error()}")
        addresses = [a for a in map(address_of, calls) if a]
        if len(set(addresses)) != len(addresses):
            self.fail(f"{where}: {len(addresses) - len(set(addresses))} duplicate addresses")
        ports = links(plugin.node_ns, "master", plugin.bridge)
        if len(ports) != len(addresses):
            self.fail(f"{where}: {plugin.bridge} has {len(ports)} ports for {len(addresses)} pods")
        return addresses

    def dels(self, where: str, plugin: Plugin, calls: Sequence[Call], pods: Sequence[str]) -> None:
        for c in [c for c in calls if c.rc != 0][:3]:
            self.fail(f"{where}: DEL failed (exit {c.rc}): {c.error()}")
        left = [v for v in links(plugin.node_ns, "type", "veth") if v not in plugin.keep_veths]
        if left:
            self.fail(f"{where}: {len(left)} veths left on the node after DEL: {left[:5]}")
        in_pods = pod_interfaces(pods)
        if in_pods:
            self.fail(f"{where}: interfaces left in {len(in_pods)} pod namespaces after DEL")


def sequential_adds(plugin: Plugin, pods: Sequence[str], tag: str) -> list[Call]:
    """One ADD per pod, one after the other (run by a worker inside the node namespace)."""
    return [invoke(plugin, "ADD", f"{tag}-{i}", ns) for i, ns in enumerate(pods)]


def sequential_dels(
    plugin: Plugin, pods: Sequence[str], tag: str, adds: Sequence[Call]
) -> list[Call]:
    """The DELs of :func:`sequential_adds`, each with its ADD's result as prevResult."""
    return [
        invoke(plugin, "DEL", f"{tag}-{i}", ns, result_of(add))
        for i, (ns, add) in enumerate(zip(pods, adds, strict=True))
    ]


def result_of(call: Call) -> dict[str, Any] | None:
    return json.loads(call.stdout) if address_of(call) else None


def burst(
    pool: ThreadPoolExecutor,
    plugin: Plugin,
    command: str,
    pods: Sequence[str],
    tag: str,
    prevs: Sequence[dict[str, Any] | None],
) -> tuple[float, list[Call]]:
    """All of ``pods`` at once from the warm pool; (wall seconds to the last exit, calls)."""
    started = time.perf_counter()
    futures = [
        pool.submit(invoke, plugin, command, f"{tag}-{i}", ns, prev)
        for i, (ns, prev) in enumerate(zip(pods, prevs, strict=True))
    ]
    wait(futures)
    wall = time.perf_counter() - started
    return wall, [f.result() for f in futures]


def measure(
    plugin: Plugin,
    seq_pool: ThreadPoolExecutor,
    burst_pool: ThreadPoolExecutor,
    seq_pods: Sequence[str],
    burst_pods: Sequence[str],
    repeat: int,
    check: Checker,
) -> Run:
    run = Run(plugin.label, repeat)
    tag = f"fpb{repeat}{secrets.token_hex(3)}"
    where = f"{plugin.label}, repeat {repeat}"
    adds = seq_pool.submit(sequential_adds, plugin, seq_pods, tag + "s").result()
    check.adds(f"{where}, sequential", plugin, adds)
    dels = seq_pool.submit(sequential_dels, plugin, seq_pods, tag + "s", adds).result()
    check.dels(f"{where}, sequential", plugin, dels, seq_pods)
    run.add = [c.seconds for c in adds if address_of(c)]
    run.delete = [c.seconds for c in dels if c.rc == 0]
    none: list[dict[str, Any] | None] = [None] * len(burst_pods)
    run.burst_add, badds = burst(burst_pool, plugin, "ADD", burst_pods, tag + "b", none)
    check.adds(f"{where}, burst", plugin, badds)
    prevs = [result_of(c) for c in badds]
    run.burst_del, bdels = burst(burst_pool, plugin, "DEL", burst_pods, tag + "b", prevs)
    check.dels(f"{where}, burst", plugin, bdels, burst_pods)
    run.failures = {
        "seq ADD": sum(address_of(c) is None for c in adds),
        "seq DEL": sum(c.rc != 0 for c in dels),
        "burst ADD": sum(address_of(c) is None for c in badds),
        "burst DEL": sum(c.rc != 0 for c in bdels),
    }
    return run


def warm_up(plugin: Plugin, pool: ThreadPoolExecutor, pods: Sequence[str]) -> None:
    """A few untimed ADD+DEL pairs: the bridge exists and caches are warm for both sides."""
    tag = "fpbw" + secrets.token_hex(3)
    adds = pool.submit(sequential_adds, plugin, pods[:WARMUP], tag).result()
    dels = pool.submit(sequential_dels, plugin, pods[:WARMUP], tag, adds).result()
    for c in [*adds, *dels]:
        if c.rc != 0:
            raise SystemExit(f"{plugin.label}: warm-up failed (exit {c.rc}): {c.error()}")


def time_versions(plugins: Sequence[Plugin], runs: int) -> dict[str, list[float]]:
    """VERSION (answered by the executable alone) ``runs`` times each, interleaved."""
    seconds: dict[str, list[float]] = {p.label: [] for p in plugins}
    for _ in range(runs):
        for p in plugins:
            call = invoke(p, "VERSION", "fpbv", "lo")
            if call.rc != 0 or b"supportedVersions" not in call.stdout:
                raise SystemExit(f"{p.label}: VERSION failed (exit {call.rc}): {call.error()}")
            seconds[p.label].append(call.seconds)
    return seconds


# --- set-up ----------------------------------------------------------------------


@dataclass
class Bench:
    plugins: list[Plugin]  # static, python, reference
    pods: list[str]  # pod namespace names
    pools: dict[str, tuple[ThreadPoolExecutor, ThreadPoolExecutor]]  # node ns -> (seq, burst)


def lab_mtu(subnet_env: str) -> int | None:
    with open(subnet_env, encoding="utf-8") as f:
        for line in f:
            key, _, value = line.strip().partition("=")
            if key == "FLANNEL_MTU":
                return int(value)
    return None


@contextmanager
def bench_setup(pod_count: int, burst_size: int, say: Say) -> Iterator[Bench]:
    """Lab, reference namespace, pod namespaces, executables, namespace-bound thread pools;
    all removed on exit (also on errors and Ctrl-C: the stack unwinds in reverse)."""
    with ExitStack() as stack:
        tmp = tempfile.mkdtemp(prefix="fpbench-cni")
        stack.callback(shutil.rmtree, tmp, True)
        namespaces: list[str] = []
        stack.callback(delete_netns, namespaces)  # sees every name appended later
        say("bringing up a 1-node vxlan lab")
        lab = Lab.up("cn" + secrets.token_hex(2), 1, "vxlan")
        stack.callback(lab.down)
        node = lab.nodes[0]
        mtu = lab_mtu(node.subnet_env)
        if mtu != MTU:
            say(f"note: the lab's overlay MTU is {mtu}, the reference is configured with {MTU}")
        lab.install_cni("static")
        static_bin = os.path.join(lab.state.cni_bin_dir, "flannelpy")
        python_bin = os.path.join(tmp, "bin", "flannelpy")
        os.makedirs(os.path.dirname(python_bin))
        write_launcher(python_bin)

        suffix = f"{os.getpid()}{secrets.token_hex(2)}"
        ref_ns = f"fpbr{suffix}"
        make_netns(ref_ns, namespaces)
        pods = [f"fpbp{suffix}-{i}" for i in range(max(pod_count, burst_size))]
        say(f"creating {len(pods)} pod namespaces")
        for ns in pods:
            make_netns(ns, namespaces)

        ours = {
            "cniVersion": CNI_VERSION,
            "name": "fpbench",
            "type": "flannelpy",
            "agentSocket": node.cni_socket,
            "hairpinMode": True,
            "isDefaultGateway": True,
            "ipCooldownSeconds": 0,
        }
        reference = {
            "cniVersion": CNI_VERSION,
            "name": "fpbench-ref",
            "type": "bridge",
            "bridge": REF_BRIDGE,
            "isGateway": True,
            "ipMasq": False,
            "hairpinMode": True,
            "mtu": MTU,
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": REF_SUBNET}]],
                "routes": [{"dst": "0.0.0.0/0"}],
                "dataDir": os.path.join(tmp, "host-local"),
            },
        }
        node_veths = frozenset(links(node.namespace, "type", "veth"))
        plugins = [
            Plugin(
                STATIC, static_bin, lab.state.cni_path, ours, node.namespace, OUR_BRIDGE, node_veths
            ),
            Plugin(
                PYTHON,
                python_bin,
                f"{os.path.dirname(python_bin)}:{REF_BIN}",
                ours,
                node.namespace,
                OUR_BRIDGE,
                node_veths,
            ),
            Plugin(
                REFERENCE, os.path.join(REF_BIN, "bridge"), REF_BIN, reference, ref_ns, REF_BRIDGE
            ),
        ]
        pools = {}
        for ns in (node.namespace, ref_ns):
            seq = stack.enter_context(ns_pool(ns, 1))
            pools[ns] = (seq, stack.enter_context(ns_pool(ns, burst_size)))
        yield Bench(plugins, pods, pools)


# --- the run and the report -------------------------------------------------------


@dataclass
class Results:
    runs: list[Run] = field(default_factory=list)
    versions: dict[str, list[float]] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)


def run_bench(pod_count: int, burst_size: int, repeat: int, say: Say) -> Results:
    results = Results()
    check = Checker(say)
    with bench_setup(pod_count, burst_size, say) as b:
        seq_pods, burst_pods = b.pods[:pod_count], b.pods[:burst_size]
        for p in b.plugins:
            warm_up(p, b.pools[p.node_ns][0], b.pods)
        say(f"timing VERSION, {VERSION_RUNS} runs of each executable")
        seq = b.pools[b.plugins[0].node_ns][0]
        results.versions = seq.submit(time_versions, b.plugins, VERSION_RUNS).result()
        for r in range(1, repeat + 1):
            shift = (r - 1) % len(b.plugins)  # rotate the order: each plugin leads once
            for p in b.plugins[shift:] + b.plugins[:shift]:
                seq, bursts = b.pools[p.node_ns]
                run = measure(p, seq, bursts, seq_pods, burst_pods, r, check)
                results.runs.append(run)
                say(
                    f"repeat {r}/{repeat} {p.label}: ADD p50 {ms(median(run.add))} ms, "
                    f"DEL p50 {ms(median(run.delete))} ms, burst ADD {ms(run.burst_add)} ms, "
                    f"burst DEL {ms(run.burst_del)} ms"
                )
    results.problems = check.problems
    return results


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


@dataclass(frozen=True)
class Row:
    """One plugin over all repeats: latencies pooled, bursts as the median of the repeats."""

    add_p50: float
    add_p95: float
    del_p50: float
    del_p95: float
    burst_add: float
    burst_del: float
    failures: int

    def values(self) -> list[float]:
        return [
            self.add_p50,
            self.add_p95,
            self.del_p50,
            self.del_p95,
            self.burst_add,
            self.burst_del,
        ]


def summarise(runs: Sequence[Run]) -> Row:
    adds = [s for r in runs for s in r.add] or [float("nan")]
    dels = [s for r in runs for s in r.delete] or [float("nan")]
    return Row(
        percentile(adds, 50),
        percentile(adds, 95),
        percentile(dels, 50),
        percentile(dels, 95),
        median([r.burst_add for r in runs]),
        median([r.burst_del for r in runs]),
        sum(sum(r.failures.values()) for r in runs),
    )


def report(results: Results, pod_count: int, burst_size: int, repeat: int) -> str:
    labels = [STATIC, PYTHON, REFERENCE]
    rows = {label: summarise([r for r in results.runs if r.plugin == label]) for label in labels}
    ref = rows[REFERENCE]
    main_rows = [
        [label, *(v * 1000 for v in row.values()), row.failures] for label, row in rows.items()
    ]
    ratio_rows = [
        [label, *(ratio(o, r) for o, r in zip(rows[label].values(), ref.values(), strict=True))]
        for label in OURS
    ]
    per_run = [
        [
            r.plugin,
            r.repeat,
            *(
                v * 1000
                for v in (
                    median(r.add),
                    percentile(r.add, 95),
                    median(r.delete),
                    percentile(r.delete, 95),
                    r.burst_add,
                    r.burst_del,
                )
            ),
            " ".join(f"{k}:{v}" for k, v in r.failures.items() if v) or "-",
        ]
        for r in sorted(results.runs, key=lambda r: (labels.index(r.plugin), r.repeat))
        if r.add and r.delete
    ]
    ver_ref = median(results.versions[REFERENCE])
    versions = [
        [
            label,
            median(v) * 1000,
            percentile(v, 95) * 1000,
            min(v) * 1000,
            ratio(median(v), ver_ref),
        ]
        for label, v in results.versions.items()
    ]
    goals = []
    for label in OURS:
        row = rows[label]
        goals.append(
            f"{label}: median ADD {row.add_p50 * 1000:.1f} ms vs {ref.add_p50 * 1000:.1f} ms "
            f"({'met' if row.add_p50 <= ref.add_p50 else 'MISSED'}); burst ADD "
            f"{row.burst_add * 1000:.0f} ms vs {ref.burst_add * 1000:.0f} ms "
            f"({'met' if row.burst_add <= ref.burst_add else 'MISSED'})"
        )
    lat = [
        "ADD p50",
        "ADD p95",
        "DEL p50",
        "DEL p95",
        f"burst{burst_size} ADD",
        f"burst{burst_size} DEL",
    ]
    return "\n\n".join(
        [
            f"milliseconds; {pod_count} sequential ADDs/DELs x {repeat} repeats (percentiles over "
            f"all), bursts of {burst_size} (median of {repeat} walls); failures = failed runs",
            table(["plugin", *lat, "failures"], main_rows),
            "ratio ours / reference (goal: ADD p50 <= 1, burst ADD <= 1)",
            table(["plugin", *lat], ratio_rows),
            "goals:\n" + "\n".join(goals),
            "per repeat, milliseconds",
            table(["plugin", "repeat", *lat, "failed"], per_run),
            f"executable start: VERSION, no agent contact, {VERSION_RUNS} runs each, milliseconds",
            table(["executable", "p50", "p95", "min", "p50 / bridge"], versions),
            "checks: "
            + (
                "all passed (every ADD succeeded with a distinct address, the bridge "
                "held one port per pod, no veth left after DEL)"
                if not results.problems
                else f"{len(results.problems)} FAILED:\n" + "\n".join(results.problems)
            ),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.cni_latency",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--pods", type=int, default=100, help="sequential ADDs per repeat")
    parser.add_argument("--burst", type=int, default=100, help="concurrent ADDs in a burst")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.cni_latency needs root (network namespaces)", file=sys.stderr)
        return 2
    if not (1 <= args.pods <= 250 and 1 <= args.burst <= 250 and args.repeat >= 1):
        print("--pods and --burst must be 1-250 (one /24 each), --repeat >= 1", file=sys.stderr)
        return 2

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    def on_term(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # the same clean-up as Ctrl-C

    signal.signal(signal.SIGTERM, on_term)
    try:
        results = run_bench(args.pods, args.burst, args.repeat, say)
    except KeyboardInterrupt:  # the lab, namespaces and temporary files are gone already
        return 130
    print(report(results, args.pods, args.burst, args.repeat))
    return 1 if results.problems else 0


if __name__ == "__main__":
    sys.exit(main())
