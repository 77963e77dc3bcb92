"""Our agent beside the real flanneld (v0.28.9), in one run, on the same machine state.

    python -m bench.versus_flanneld [--peers 1000 5000] [--repeat 3] [--changes 1000]
                                    [--idle-seconds 60] [--nodes 10] [--flanneld-nodes 5]
                                    [--leases 20]

Part 1, one node, in a throwaway namespace (a veth underlay ``ul0`` with 198.18.0.1/24,
loopback up) where a child of this process runs a throwaway etcd on loopback, the
implementations and the measurements. etcd holds the network config (``10.0.0.0/8``,
vxlan) and N fake peer leases (``bench.common.fake_peers``). Each implementation is
spawned as an operator would run it, process start included, with the same flags
where both have them:

* ours: ``flannelpy agent`` with the lab's command line (``flannelpy_lab.agents``);
* flanneld: ``--etcd-endpoints --etcd-prefix --iface --ip-masq --subnet-file`` (the
  lab's, without its ``-v 2``, which logs a line per peer).

"Ready" is the later of: subnet.env written (polled every 2 ms) and the last of the N
peer routes added (a netlink route-event socket opened before the spawn stamps each).
Then ``ip -br route show dev flannel.1`` must list exactly N routes. Rounds alternate
(ours, flanneld, flanneld, ours, ...); before each start flannel.1, subnet.env and the
node's own lease are removed, so every start is a new node's cold start. RSS: VmRSS
summed over the process tree once ready.

On the last round at the first N, after ready: CPU seconds (utime + stime of the
process tree, from /proc) for ``--changes`` lease rewrites (each peer's VtepMAC
changed, written 128 per transaction), until every neighbour on flannel.1 carries its
new MAC, plus 1 s; then idle CPU over ``--idle-seconds``.

Part 2, propagation: a ``--nodes`` lab whose last ``--flanneld-nodes`` run flanneld (as
the lab runs them). One fake lease at a time is written (then deleted) and the time
until its route appears (disappears) on every node is stamped per node
(``bench.propagation``); reported per implementation over its own nodes.

Ratios are ours / flanneld. Part 2's lab uses the shared lab underlay (one lab at a time).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from ipaddress import IPv4Network

from flannelpy_lab import Lab, agents, flanneld
from flannelpy_lab import etcd as lab_etcd

from bench.agent_start import NET_CONF, REF_UNDERLAY, _peer_subnets, reference_netns
from bench.common import (
    ETCD_TXN_OPS,
    FakePeer,
    compile_agent,
    fake_peers,
    lab_name,
    median,
    parse_route_events,
    percentile,
    put_peers,
    ratio,
    route_event_socket,
    table,
)
from bench.propagation import FAKE_INDEX_BASE, LAB_TIMEOUT, free_subnets, run_trials
from flannelpy.store.etcd.client import EtcdStore
from flannelpy.store.etcd.config import put_network_config
from flannelpy.subnet.keys import subnets_prefix

DEVICE = "flannel.1"
PREFIX = "/coreos.com/network"
UNDERLAY = "ul0"  # bench.agent_start.reference_netns's veth, 198.18.0.1/24
NODE_NAME = "bench-node"
IMPLS = ("ours", "flanneld")
READY_POLL = 0.002
READY_TIMEOUT = 120.0
CHANGE_TIMEOUT = 120.0
START_SETTLE = 2.0  # seconds after ready before the changes: the start's follow-up passes
CHANGE_SETTLE = 1.0  # seconds of follow-up work counted after the kernel converged
CHANGE_POLL = 0.05
CLK_TCK = os.sysconf("SC_CLK_TCK")


# --- processes -------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str]:
    with open(f"/proc/{pid}/stat") as f:
        text = f.read()
    return text[text.rindex(")") + 2 :].split()  # fields from 3 (state) on


def process_tree(root: int) -> list[int]:
    """``root`` and its descendants alive now."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(_stat_fields(int(entry))[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def cpu_seconds(root: int) -> float:
    """utime + stime of the tree, plus what its exited, reaped children used."""
    ticks = 0
    for pid in process_tree(root):
        try:
            f = _stat_fields(pid)
        except OSError:
            continue
        ticks += int(f[11]) + int(f[12])  # utime, stime (fields 14, 15)
        if pid == root:
            ticks += int(f[13]) + int(f[14])  # cutime, cstime
    return ticks / CLK_TCK


def rss_mib(root: int) -> float:
    """VmRSS summed over the tree (shared pages counted in each process)."""
    kib = 0
    for pid in process_tree(root):
        try:
            with open(f"/proc/{pid}/status") as f:
                kib += next((int(line.split()[1]) for line in f if line.startswith("VmRSS:")), 0)
        except OSError:
            continue
    return kib / 1024


@dataclass
class Running:
    impl: str
    proc: subprocess.Popen[bytes]
    log: str

    def tail(self) -> str:
        with open(self.log, encoding="utf-8", errors="replace") as f:
            return "".join(f.readlines()[-15:])


@dataclass(frozen=True)
class BenchNode:
    """The node of part 1: this namespace, its underlay ``ul0`` and an etcd on loopback."""

    directory: str
    endpoint: str
    agent_args: tuple[str, ...] = ()  # more flags for ours (e.g. to switch a part off)

    @property
    def subnet_env(self) -> str:
        return os.path.join(self.directory, "subnet.env")


def argv_of(impl: str, node: BenchNode) -> tuple[list[str], dict[str, str]]:
    """Each implementation's command line, as the lab runs it (``flannelpy_lab.agents``,
    ``flannelpy_lab.flanneld``) but without flanneld's ``-v 2`` (a log line per peer)."""
    store = ["--etcd-endpoints", node.endpoint, "--etcd-prefix", PREFIX]
    common = ["--iface", UNDERLAY, "--ip-masq", "--subnet-file", node.subnet_env]
    if impl == "ours":
        env = agents.agent_env()
        env["NODE_NAME"] = NODE_NAME
        run_dir = os.path.join(node.directory, "run")
        os.makedirs(os.path.join(run_dir, "flannel"), exist_ok=True)
        argv = [
            sys.executable,
            "-m",
            "flannelpy",
            "agent",
            *common,
            "--node-name",
            NODE_NAME,
            "--state-dir",
            os.path.join(node.directory, "state"),
            "--run-dir",
            run_dir,
            "--log-level",
            "info",
            *store,
            *node.agent_args,
        ]
        return argv, env
    if impl == "floor":  # bench.event_floor: the least a Python agent does per event
        floor = [sys.executable, "-m", "bench.event_floor", "--etcd-endpoint", node.endpoint]
        floor += ["--prefix", subnets_prefix(PREFIX), "--subnet-file", node.subnet_env]
        return [*floor, "--local", REF_UNDERLAY.split("/")[0]], dict(os.environ)
    return [flanneld.binary(), *store, *common, "--healthz-port", "0"], dict(os.environ)


def spawn(impl: str, node: BenchNode) -> Running:
    argv, env = argv_of(impl, node)
    log = os.path.join(node.directory, f"{impl}.log")
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return Running(impl, proc, log)


def stop(run: Running) -> None:
    if run.proc.poll() is None:
        run.proc.send_signal(signal.SIGTERM)
        try:
            run.proc.wait(10)
        except subprocess.TimeoutExpired:
            run.proc.kill()
            run.proc.wait(5)


# --- kernel (this namespace) -------------------------------------------------------------


class RouteAdds:
    """Monotonic time of the first route addition (``seen``) and the first removal
    (``removed``) per destination, in this namespace."""

    def __init__(self) -> None:
        self.sock = route_event_socket()
        self.sock.settimeout(0.2)
        self.seen: dict[IPv4Network, float] = {}
        self.removed: dict[IPv4Network, float] = {}
        self.overflows = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                data = self.sock.recv(1 << 20)
            except TimeoutError:
                continue
            except OSError:  # ENOBUFS: events lost; ready falls back to a dump
                self.overflows += 1
                continue
            now = time.monotonic()
            for event in parse_route_events(data):
                (self.seen if event.added else self.removed).setdefault(event.dst, now)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()


def _ip_lines(*args: str) -> list[str]:
    out = subprocess.run(["ip", *args], check=True, capture_output=True, text=True)
    return [line for line in out.stdout.splitlines() if line.strip()]


def route_count() -> int:
    return len(_ip_lines("-4", "-br", "route", "show", "dev", DEVICE))


def neigh_macs() -> dict[str, str]:
    """VTEP address -> MAC of the permanent neighbours on flannel.1."""
    macs = {}
    for line in _ip_lines("-4", "neigh", "show", "dev", DEVICE, "nud", "permanent"):
        parts = line.split()
        if "lladdr" in parts:
            macs[parts[0]] = parts[parts.index("lladdr") + 1].lower()
    return macs


def reset_node(node: BenchNode, fake_keys: set[str]) -> None:
    """Make the next start a new node's: no flannel.1, no subnet.env, no own lease."""
    subprocess.run(["ip", "link", "del", DEVICE], check=False, capture_output=True)
    if os.path.exists(node.subnet_env):
        os.unlink(node.subnet_env)
    base = subnets_prefix(PREFIX)
    with lab_etcd.client(node.endpoint, timeout=10.0) as c:
        for _, meta in c.get_prefix(base):
            key = meta.key.decode()
            if key[len(base) :] not in fake_keys:
                c.delete(key)


# --- part 1: one node, run inside a throwaway namespace ------------------------------------


@dataclass
class Start:
    impl: str
    n: int
    seconds: float
    env_seconds: float  # spawn -> subnet.env alone
    rss: float


@dataclass
class Steady:
    impl: str
    n: int
    change_seconds: float  # write of the first change -> every neighbour updated
    change_cpu: float
    idle_cpu: float
    idle_seconds: float


def wait_ready(
    run: Running,
    node: BenchNode,
    adds: RouteAdds,
    peers: set[IPv4Network],
    t0: float,
    wall0: float,
) -> tuple[float, float]:
    """(seconds to ready, seconds to subnet.env) after ``t0``."""
    env_at: float | None = None
    deadline = t0 + READY_TIMEOUT
    checks = 0
    while True:
        if run.proc.poll() is not None:
            raise SystemExit(f"{run.impl} exited with {run.proc.returncode}:\n{run.tail()}")
        now = time.monotonic()
        if env_at is None:
            try:
                if os.stat(node.subnet_env).st_mtime >= wall0:
                    env_at = now
            except FileNotFoundError:
                pass
        if env_at is not None:
            got = [t for dst, t in list(adds.seen.items()) if dst in peers]
            if len(got) == len(peers):
                return max(env_at, max(got)) - t0, env_at - t0
            checks += 1
            if adds.overflows and checks % 25 == 0 and route_count() >= len(peers):
                return time.monotonic() - t0, env_at - t0  # events lost: a dump decides
        if now > deadline:
            raise SystemExit(f"{run.impl} not ready in {READY_TIMEOUT:g} s:\n{run.tail()}")
        time.sleep(READY_POLL)


def time_start(
    impl: str, node: BenchNode, peers: Sequence[FakePeer], fake_keys: set[str]
) -> tuple[Start, Running]:
    reset_node(node, fake_keys)
    adds = RouteAdds()
    try:
        wall0, t0 = time.time(), time.monotonic()
        run = spawn(impl, node)
        try:
            subnets = {p.subnet for p in peers}
            seconds, env_seconds = wait_ready(run, node, adds, subnets, t0, wall0)
            rss = rss_mib(run.proc.pid)
            found = route_count()
            if found != len(peers):
                raise SystemExit(f"{impl}: {found} routes via {DEVICE}, expected {len(peers)}")
        except BaseException:
            stop(run)
            raise
    finally:
        adds.close()
    return Start(impl, len(peers), seconds, env_seconds, rss), run


def rewrite_macs(node: BenchNode, peers: Sequence[FakePeer], generation: int) -> list[FakePeer]:
    """Every peer with a new VtepMAC (``02:<generation>:...``), written 128 per transaction."""
    moved = [
        FakePeer(p.subnet, p.public_ip, f"02:{generation:02x}" + p.vtep_mac[5:]) for p in peers
    ]
    base = subnets_prefix(PREFIX)
    with lab_etcd.client(node.endpoint, timeout=10.0) as c:
        for start in range(0, len(moved), ETCD_TXN_OPS):
            chunk = moved[start : start + ETCD_TXN_OPS]
            ops = [c.transactions.put(base + p.key, p.lease_json()) for p in chunk]
            c.transaction(compare=[], success=ops, failure=[])
    return moved


def measure_steady(
    run: Running,
    node: BenchNode,
    peers: Sequence[FakePeer],
    changes: int,
    generation: int,
    idle: float,
    say: Callable[[str], None],
) -> Steady:
    time.sleep(START_SETTLE)
    cpu0, t0 = cpu_seconds(run.proc.pid), time.monotonic()
    moved = rewrite_macs(node, peers[:changes], generation)
    want = {str(p.vtep_ip): p.vtep_mac for p in moved}
    while True:
        if run.proc.poll() is not None:
            raise SystemExit(f"{run.impl} exited during the changes:\n{run.tail()}")
        macs = neigh_macs()
        if all(macs.get(ip) == mac for ip, mac in want.items()):
            done = time.monotonic() - t0
            break
        if time.monotonic() - t0 > CHANGE_TIMEOUT:
            left = sum(macs.get(ip) != mac for ip, mac in want.items())
            raise SystemExit(f"{run.impl}: {left} neighbours kept their old MAC")
        time.sleep(CHANGE_POLL)
    time.sleep(CHANGE_SETTLE)
    change_cpu = cpu_seconds(run.proc.pid) - cpu0
    say(
        f"{run.impl}: {changes} lease changes applied in {done:.2f} s, {change_cpu:.2f} CPU s; "
        f"now idle for {idle:g} s"
    )
    cpu1, t1 = cpu_seconds(run.proc.pid), time.monotonic()
    time.sleep(idle)
    idle_cpu, idle_wall = cpu_seconds(run.proc.pid) - cpu1, time.monotonic() - t1
    return Steady(run.impl, len(peers), done, change_cpu, idle_cpu, idle_wall)


@contextlib.contextmanager
def bench_node(agent_args: Sequence[str]) -> Iterator[BenchNode]:
    """The node of part 1 in this namespace: a temporary directory and an etcd on
    loopback holding the network config (no peers yet)."""
    from tests.support.etcd_server import running_etcd

    with tempfile.TemporaryDirectory(prefix="fpbench") as tmp, running_etcd() as etcd:
        store = EtcdStore([etcd.endpoint], timeout=10.0)
        try:
            put_network_config(store, PREFIX, NET_CONF)
        finally:
            store.close()
        yield BenchNode(tmp, etcd.endpoint, tuple(agent_args))


def part_one_inside(
    counts: Sequence[int],
    repeat: int,
    changes: int,
    idle: float,
    agent_args: Sequence[str],
    say: Callable[[str], None],
) -> tuple[list[Start], list[Steady]]:
    """Part 1, in the namespace this process runs in (see :func:`part_one`)."""
    starts: list[Start] = []
    steady: list[Steady] = []
    all_peers = fake_peers(max(counts), _peer_subnets())
    with bench_node(agent_args) as node:
        written = 0
        for n in sorted(counts):
            put_peers(node.endpoint, PREFIX, all_peers[written:n])
            written = n
            peers = all_peers[:n]
            fake_keys = {p.key for p in peers}
            for r in range(repeat):
                for impl in IMPLS if r % 2 == 0 else IMPLS[::-1]:
                    start, run = time_start(impl, node, peers, fake_keys)
                    try:
                        starts.append(start)
                        say(
                            f"N={n} round {r + 1}/{repeat} {impl}: ready {start.seconds:.3f} s "
                            f"(subnet.env {start.env_seconds:.3f} s), RSS {start.rss:.0f} MiB"
                        )
                        if n == min(counts) and r == repeat - 1:
                            generation = 0xFC + IMPLS.index(impl)  # a MAC prefix per side
                            steady.append(
                                measure_steady(
                                    run, node, peers, min(changes, n), generation, idle, say
                                )
                            )
                            rewrite_macs(node, peers, 0xFB)  # the original MACs again
                    finally:
                        stop(run)
    return starts, steady


def part_one(
    counts: Sequence[int], repeat: int, changes: int, idle: float, agent_args: Sequence[str]
) -> tuple[list[Start], list[Steady]]:
    """Part 1 in a throwaway namespace (veth underlay ``ul0``, loopback up), run by a
    child of this process started inside it; the namespace is removed on exit."""
    with reference_netns() as ns:
        argv = [
            sys.executable,
            "-m",
            "bench.versus_flanneld",
            "--inside-netns",
            "--peers",
            *map(str, counts),
            "--repeat",
            str(repeat),
            "--changes",
            str(changes),
            "--idle-seconds",
            str(idle),
            *(f"--agent-arg={arg}" for arg in agent_args),
        ]
        proc = subprocess.run(
            ["ip", "netns", "exec", ns, *argv], stdout=subprocess.PIPE, text=True, check=False
        )
    if proc.returncode != 0:
        raise SystemExit(f"part 1 failed (exit {proc.returncode}); see above")
    doc = json.loads(proc.stdout)
    return [Start(**s) for s in doc["starts"]], [Steady(**s) for s in doc["steady"]]


# --- part 2: propagation in a mixed lab ---------------------------------------------------


@dataclass
class Propagation:
    impl: str
    nodes: list[str]
    add: list[float] = field(default_factory=list)  # per lease: the last of its nodes
    remove: list[float] = field(default_factory=list)
    missing: int = 0


def part_two(
    nodes: int, flanneld_nodes: int, leases: int, say: Callable[[str], None]
) -> list[Propagation]:
    name = lab_name("bg")
    say(f"bringing up lab {name}: {nodes} nodes, the last {flanneld_nodes} flanneld")
    lab = Lab.up(
        name, nodes, "vxlan", timeout=LAB_TIMEOUT, progress=say, flanneld_nodes=flanneld_nodes
    )
    try:
        peers = fake_peers(leases, free_subnets(lab, leases), first_index=FAKE_INDEX_BASE)
        trials = run_trials(lab, peers, say, protocols=None)
    finally:
        lab.down()
    out = []
    for impl, kind in (("ours", "flannelpy"), ("flanneld", "flanneld")):
        names = [n.name for n in lab.nodes if n.agent_kind == kind]
        res = Propagation(impl, names)
        for t in trials:
            if all(n in t.add for n in names) and all(n in t.remove for n in names):
                res.add.append(max(t.add[n] for n in names))
                res.remove.append(max(t.remove[n] for n in names))
            else:
                res.missing += 1
        out.append(res)
    return out


# --- report -----------------------------------------------------------------------------


def _load() -> str:
    with open("/proc/loadavg") as f:
        one, five, fifteen = f.read().split()[:3]
    return f"load average {one} / {five} / {fifteen}, {os.cpu_count()} CPUs"


def report(
    starts: Sequence[Start],
    steady: Sequence[Steady],
    props: Sequence[Propagation],
    loads: Sequence[str],
) -> str:
    rows: list[list[object]] = []

    def row(what: str, ours: float, theirs: float) -> None:
        rows.append([what, ours, theirs, ratio(ours, theirs)])

    for n in sorted({s.n for s in starts}):
        by = {i: [s for s in starts if s.n == n and s.impl == i] for i in IMPLS}
        row(f"start-to-ready, {n} peers (s)", *(median([s.seconds for s in by[i]]) for i in IMPLS))
        row(
            f"  of which to subnet.env, {n} peers (s)",
            *(median([s.env_seconds for s in by[i]]) for i in IMPLS),
        )
        row(f"RSS at ready, {n} peers (MiB)", *(median([s.rss for s in by[i]]) for i in IMPLS))
    st = {s.impl: s for s in steady}
    if len(st) == 2:
        n = st["ours"].n
        row(f"lease changes applied, {n} peers (s)", *(st[i].change_seconds for i in IMPLS))
        row(f"CPU for the lease changes, {n} peers (s)", *(st[i].change_cpu for i in IMPLS))
        row(
            f"idle CPU over {st['ours'].idle_seconds:.0f} s, {n} peers (s)",
            *(st[i].idle_cpu for i in IMPLS),
        )
    pr = {p.impl: p for p in props}
    if len(pr) == 2 and pr["ours"].add and pr["flanneld"].add:
        for label, attr in (("new lease -> route", "add"), ("deleted lease -> no route", "remove")):
            for q in (50, 95):
                row(
                    f"{label}, last of own nodes, p{q} (s)",
                    *(percentile(getattr(pr[i], attr), q) for i in IMPLS),
                )
    lines = [
        "ratio = ours / flanneld; starts are medians over the rounds",
        table(["", "ours", "flanneld", "ratio"], rows),
    ]
    if starts:
        lines.append("every start (seconds to ready / to subnet.env, RSS MiB):")
    for s in starts:
        lines.append(f"  N={s.n} {s.impl}: {s.seconds:.3f} / {s.env_seconds:.3f}, {s.rss:.0f}")
    for p in props:
        lines.append(
            f"propagation {p.impl}: nodes {','.join(p.nodes)}, {len(p.add)} leases, "
            f"{p.missing} did not reach every node"
        )
    lines.append("machine: " + "; ".join(loads))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.versus_flanneld",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--peers", type=int, nargs="+", default=[1000, 5000])
    parser.add_argument("--repeat", type=int, default=3, help="start rounds per implementation")
    parser.add_argument("--changes", type=int, default=1000, help="lease rewrites timed")
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    parser.add_argument("--nodes", type=int, default=10, help="part 2 lab size (0: skip part 2)")
    parser.add_argument("--flanneld-nodes", type=int, default=5)
    parser.add_argument("--leases", type=int, default=20, help="part 2: leases timed")
    parser.add_argument(
        "--agent-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="part 1: one more flag for our agent (repeatable), e.g. "
        "--agent-arg=--probe-interval=3600 to see the prober's share",
    )
    parser.add_argument("--skip-single-node", action="store_true", help="skip part 1")
    parser.add_argument("--inside-netns", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.versus_flanneld needs root (network namespaces)", file=sys.stderr)
        return 2
    if any(not 1 <= n <= 60000 for n in args.peers):
        print("--peers must be between 1 and 60000", file=sys.stderr)
        return 2
    if args.nodes and not 0 < args.flanneld_nodes < args.nodes:
        print("--flanneld-nodes must leave at least one node of ours", file=sys.stderr)
        return 2
    flanneld.binary()  # fails now, naming the build script, rather than mid-run
    compile_agent()

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.inside_netns:
        starts, steady = part_one_inside(
            args.peers, args.repeat, args.changes, args.idle_seconds, args.agent_arg, say
        )
        print(
            json.dumps(
                {"starts": [asdict(s) for s in starts], "steady": [asdict(s) for s in steady]}
            )
        )
        return 0
    loads = [f"at start: {_load()}"]
    try:
        starts, steady = [], []
        if not args.skip_single_node:
            starts, steady = part_one(
                args.peers, args.repeat, args.changes, args.idle_seconds, args.agent_arg
            )
            loads.append(f"after part 1: {_load()}")
        props = part_two(args.nodes, args.flanneld_nodes, args.leases, say) if args.nodes else []
        if props:
            loads.append(f"after part 2: {_load()}")
    except KeyboardInterrupt:  # every namespace and lab is gone already
        return 130
    print(report(starts, steady, props, loads))
    return 0


if __name__ == "__main__":
    sys.exit(main())
