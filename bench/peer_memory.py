"""Where our agent's memory per peer goes: RSS at ready, the allocator's slack, and a
``tracemalloc`` profile, at each of several peer counts.

    python -m bench.peer_memory [--peers 1000 5000] [--frames 8] [--top 25]

Part 1 of :mod:`bench.versus_flanneld` (a throwaway namespace, an etcd on loopback with
the network config and N fake peer leases), our agent alone, run by
:mod:`bench.heap_probe` (the agent unchanged, plus a socket that reports on its heap).
Per N, two starts:

* untraced: VmRSS at ready (as ``bench.versus_flanneld`` reads it), every 0.25 s for
  ``--settle`` seconds, then once the agent is quiet, right before and after glibc's
  ``malloc_trim(0)`` in the agent: what the allocator kept of freed memory;
* traced (``python -X tracemalloc=--frames``; ``--frames 0``: no traced start): once the
  agent is quiet, the Python heap (current and peak) and a snapshot.

Then the per-peer slope between the smallest and the largest N, for RSS and the traced
heap, and the snapshots' difference grouped by line and by file: what each allocation
site holds per peer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Sequence
from typing import Any

from bench.agent_start import _peer_subnets, reference_netns
from bench.common import (
    FakePeer,
    compile_agent,
    fake_peers,
    lacks_root,
    load_average,
    put_peers,
    say,
)
from bench.heap_probe import ask
from bench.versus_flanneld import (
    PREFIX,
    BenchNode,
    RouteAdds,
    Running,
    argv_of,
    bench_node,
    cpu_seconds,
    reset_node,
    rss_mib,
    stop,
    wait_ready,
)


def spawn_probed(node: BenchNode, sock: str, frames: int) -> Running:
    """Our agent as ``bench.versus_flanneld`` runs it, under :mod:`bench.heap_probe`."""
    argv, env = argv_of("ours", node)
    assert argv[1:3] == ["-m", "flannelpy"], argv
    traced = [f"-Xtracemalloc={frames}"] if frames else []
    argv = [argv[0], *traced, "-m", "bench.heap_probe", sock, *argv[3:]]
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), env.get("PYTHONPATH", "")])
    log = os.path.join(node.directory, "ours.log")
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    return Running("ours", proc, log)


def wait_quiet(pid: int, limit: float = 120.0) -> float:
    """Seconds until the agent uses under 5 % of a CPU over a second (the start's
    follow-up passes done: a traced agent runs several times slower)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        cpu = cpu_seconds(pid)
        time.sleep(1.0)
        if cpu_seconds(pid) - cpu < 0.05:
            break
    return time.monotonic() - t0


def one_start(
    node: BenchNode, peers: list[FakePeer], frames: int, settle: float, snap: str
) -> dict[str, Any]:
    reset_node(node, {p.key for p in peers})
    sock = os.path.join(node.directory, "heap.sock")
    adds = RouteAdds()
    try:
        wall0, t0 = time.time(), time.monotonic()
        run = spawn_probed(node, sock, frames)
        try:
            ready, _ = wait_ready(run, node, adds, {p.subnet for p in peers}, t0, wall0)
            out: dict[str, Any] = {"n": len(peers), "traced": bool(frames), "ready": ready}
            out["rss_ready"] = rss_mib(run.proc.pid)
            timeline = []
            while time.monotonic() - t0 < ready + settle:
                time.sleep(0.25)
                timeline.append(round(rss_mib(run.proc.pid), 1))
            out["rss_timeline"] = timeline
            out["quiet_after"] = wait_quiet(run.proc.pid)
            heap = ask(sock, "rss")
            out["rss_settled"] = heap["rss"] / 1024
            out["hwm"] = heap["hwm"] / 1024
            out["current"], out["peak"] = heap["current"], heap["peak"]
            if frames:
                ask(sock, f"snapshot {snap}", timeout=300)
                out["snapshot"] = snap
            else:
                trim = ask(sock, "trim")
                out["rss_before_trim"] = trim["before"] / 1024
                out["rss_after_trim"] = trim["after"] / 1024
                out["trim_seconds"] = trim["seconds"]
                time.sleep(settle)
                out["rss_after_trim_settled"] = ask(sock, "rss")["rss"] / 1024
        finally:
            stop(run)
    finally:
        adds.close()
    return out


def inside(counts: Sequence[int], frames: int, settle: float, workdir: str) -> list[dict[str, Any]]:
    all_peers = fake_peers(max(counts), _peer_subnets())
    results = []
    with bench_node(()) as node:
        written = 0
        for n in sorted(counts):
            put_peers(node.endpoint, PREFIX, all_peers[written:n])
            written = n
            peers = all_peers[:n]
            for f in (0, frames) if frames else (0,):
                snap = os.path.join(workdir, f"snapshot-{n}.bin")
                r = one_start(node, peers, f, settle, snap)
                say(f"N={n} traced={bool(f)}: {json.dumps(r)}")
                results.append(r)
    return results


def grouped(path: str, key: str) -> dict[str, int]:
    snap = tracemalloc.Snapshot.load(path).filter_traces(
        (tracemalloc.Filter(False, tracemalloc.__file__),)
    )
    out: dict[str, int] = {}
    for stat in snap.statistics(key):
        frame = stat.traceback[0]
        name = frame.filename if key == "filename" else f"{frame.filename}:{frame.lineno}"
        out[name] = out.get(name, 0) + stat.size
    return out


def short(path: str) -> str:
    for marker in ("/flannelpy/", "/site-packages/", "/lib/python3"):
        if marker in path:
            return path[path.index(marker) + 1 :]
    return path


def per_peer(results: list[dict[str, Any]], top: int) -> str:
    lines = []
    untraced = sorted((r for r in results if not r["traced"]), key=lambda r: r["n"])
    traced = sorted((r for r in results if r["traced"]), key=lambda r: r["n"])
    lo, hi = untraced[0], untraced[-1]
    dn = hi["n"] - lo["n"]
    if dn:
        for field in ("rss_ready", "rss_settled", "rss_after_trim"):
            slope = (hi[field] - lo[field]) * 1024 * 1024 / dn
            lines.append(f"{field}: {lo[field]:.1f} -> {hi[field]:.1f} MiB, {slope:.0f} B/peer")
        if not traced:
            return "\n".join(lines)
        tl, th = traced[0], traced[-1]
        slope = (th["current"] - tl["current"]) / dn
        lines.append(
            f"traced heap: {tl['current'] / 2**20:.1f} -> {th['current'] / 2**20:.1f} MiB "
            f"(peak {tl['peak'] / 2**20:.1f} -> {th['peak'] / 2**20:.1f}), {slope:.0f} B/peer"
        )
        for key in ("filename", "lineno"):
            a, b = grouped(tl["snapshot"], key), grouped(th["snapshot"], key)
            diff = {k: b.get(k, 0) - a.get(k, 0) for k in set(a) | set(b)}
            lines.append(f"per peer by {key} (bytes):")
            for k, v in sorted(diff.items(), key=lambda kv: -kv[1])[:top]:
                lines.append(f"  {v / dn:8.1f}  {short(k)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.peer_memory", description=__doc__)
    parser.add_argument("--peers", type=int, nargs="+", default=[1000, 5000])
    parser.add_argument("--frames", type=int, default=8, help="tracemalloc frames kept")
    parser.add_argument("--settle", type=float, default=3.0, help="seconds after ready")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--keep", metavar="DIR", help="keep the snapshots in DIR")
    parser.add_argument("--workdir", help=argparse.SUPPRESS)
    parser.add_argument("--inside-netns", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if lacks_root("bench.peer_memory"):
        return 2
    if args.inside_netns:
        results = inside(args.peers, args.frames, args.settle, args.workdir)
        print(json.dumps(results))
        return 0
    compile_agent()
    say(f"load average {load_average()}")
    with tempfile.TemporaryDirectory(prefix="fpmem") as tmp, reference_netns() as ns:
        work = args.keep or tmp
        os.makedirs(work, exist_ok=True)
        cmd = [sys.executable, "-m", "bench.peer_memory", "--inside-netns", "--workdir", work]
        cmd += ["--peers", *map(str, args.peers), "--frames", str(args.frames)]
        cmd += ["--settle", str(args.settle)]
        proc = subprocess.run(
            ["ip", "netns", "exec", ns, *cmd], stdout=subprocess.PIPE, text=True, check=False
        )
        if proc.returncode != 0:
            raise SystemExit(f"failed (exit {proc.returncode}); see above")
        results = json.loads(proc.stdout)
        print(per_peer(results, args.top))
    say(f"load average {load_average()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
