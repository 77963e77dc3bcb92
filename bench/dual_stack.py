"""Dual stack against IPv4 only, ours against the real flanneld (v0.28.9), in one run.

    python -m bench.dual_stack [--repeat 3] [--pods 20]

One node, in a throwaway namespace (``bench.agent_start.reference_netns``: a veth
underlay ``ul0`` with 198.18.0.1/24, plus 2001:2::1/64 here, both benchmarking ranges)
where a child of this process runs a throwaway etcd on loopback and the four starts:
ours and flanneld, each with the network config ``10.0.0.0/8`` vxlan (IPv4 only) and
with ``EnableIPv6`` / ``IPv6Network fd10:244::/56`` added (dual). Per repeat the four
run one after the other, their order rotated between repeats; before each start the
network config is written, the store's leases, subnet.env, the state and host-local
directories, flannel.1, flannel-v6.1 and cni0 are removed: every start is a new
node's cold start in an empty cluster. Command lines are ``bench.versus_flanneld``'s.

* **start-to-ready**: spawn until a fresh subnet.env (polled every 2 ms), which must
  hold FLANNEL_IPV6_SUBNET exactly in dual stack.
* **CNI ADD**: then ``--pods`` ADDs into pod namespaces made beforehand (untimed),
  each spawn to exit, then their DELs (prevResult given). Ours: the static CNI
  executable the lab installs, with the lab's plugin config. flanneld: the reference
  ``bridge`` + ``host-local`` with the delegate config the flannel CNI plugin builds
  from subnet.env (``flannelpy_lab.flanneld.delegate_conf``: a second range and route
  for IPv6 in dual stack). The flannel plugin itself is not built here, so its own
  process start and subnet.env read are missing from flanneld's side: a lower bound.
  Every ADD must succeed with one address per family of the config. Two untimed
  ADD+DEL pairs first.

Reported: medians over every repeat; ratios side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from ipaddress import ip_interface
from typing import Any

from flannelpy_lab import agents, flanneld, plan
from flannelpy_lab import etcd as lab_etcd
from flannelpy_lab.pods import static_build
from flannelpy_lab.state import NodeInfo

from bench.agent_start import NET_CONF, reference_netns
from bench.cni_latency import Plugin, invoke
from bench.common import median, ratio, table
from bench.versus_flanneld import PREFIX, BenchNode, spawn, stop
from flannelpy.store.etcd.client import EtcdStore
from flannelpy.store.etcd.config import put_network_config
from flannelpy.subnet.keys import subnets_prefix

UNDERLAY6 = "2001:2::1/64"  # RFC 5180 benchmarking range, only inside the throwaway netns
FAMILIES = ("ipv4", "dual")
IMPLS = ("ours", "flanneld")
RUNS = tuple((impl, family) for impl in IMPLS for family in FAMILIES)
READY_POLL = 0.002
READY_TIMEOUT = 60.0
CNI_READY_TIMEOUT = 20.0
WARMUP = 2
NETWORK_NAME = "cbr0"
REF_BIN = "/usr/lib/cni"
LINKS = ("flannel.1", "flannel-v6.1", "cni0")

Say = Callable[[str], None]


@dataclass
class Sample:
    impl: str
    family: str
    start: float  # seconds, spawn -> fresh subnet.env
    adds: list[float]  # seconds per ADD
    dels: list[float]


def net_conf(family: str) -> str:
    doc = json.loads(NET_CONF)
    doc.update(plan.ip_family_net_conf(family))
    return json.dumps(doc)


def reset(node: BenchNode) -> None:
    for link in LINKS:
        subprocess.run(["ip", "link", "del", link], check=False, capture_output=True)
    for name in ("subnet.env", "state", "cni"):
        path = os.path.join(node.directory, name)
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.unlink(path)
    with lab_etcd.client(node.endpoint, timeout=10.0) as c:
        c.delete_prefix(subnets_prefix(PREFIX))


def wait_env(node: BenchNode, proc: subprocess.Popen[bytes], wall0: float, t0: float) -> float:
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"exited with {proc.returncode} before writing subnet.env")
        try:
            if os.stat(node.subnet_env).st_mtime >= wall0:
                return time.monotonic() - t0
        except FileNotFoundError:
            pass
        if time.monotonic() - t0 > READY_TIMEOUT:
            raise SystemExit(f"no subnet.env in {READY_TIMEOUT:g} s")
        time.sleep(READY_POLL)


def plugin_for(impl: str, node: BenchNode, cni_exec: str) -> Plugin:
    if impl == "ours":
        config: dict[str, Any] = {
            "cniVersion": flanneld.CNI_VERSION,
            "name": NETWORK_NAME,
            "type": "flannelpy",
            "agentSocket": os.path.join(node.directory, "run", "cni.sock"),
            "hairpinMode": True,
            "isDefaultGateway": True,
        }
        return Plugin("ours", cni_exec, os.path.dirname(cni_exec), config, "", "cni0")
    with open(node.subnet_env) as f:
        env = agents.parse_subnet_env(f.read(), node.subnet_env)
    info = NodeInfo(
        name="bench",
        namespace="",
        segment=1,
        underlay_iface="ul0",
        underlay_address="198.18.0.1/24",
        switch_port="",
        node_dir=node.directory,
        subnet_env=node.subnet_env,
        agent_log="",
    )
    config = flanneld.delegate_conf(info, env, NETWORK_NAME)
    return Plugin("flanneld", os.path.join(REF_BIN, "bridge"), REF_BIN, config, "", "cni0")


def checked_add(plugin: Plugin, cid: str, pod: str, family: str) -> tuple[float, dict[str, Any]]:
    call = invoke(plugin, "ADD", cid, pod)
    if call.rc != 0:
        raise SystemExit(f"{plugin.label} ADD {cid} failed: {call.error()}")
    result: dict[str, Any] = json.loads(call.stdout)
    versions = sorted(ip_interface(x["address"]).version for x in result.get("ips") or [])
    want = [4, 6] if family == "dual" else [4]
    if versions != want:
        raise SystemExit(f"{plugin.label} ADD {cid} gave families {versions}, not {want}")
    return call.seconds, result


def checked_del(plugin: Plugin, cid: str, pod: str, result: dict[str, Any]) -> float:
    call = invoke(plugin, "DEL", cid, pod, prev=result)
    if call.rc != 0:
        raise SystemExit(f"{plugin.label} DEL {cid} failed: {call.error()}")
    return call.seconds


def warm_up(plugin: Plugin, pod: str, family: str, tag: str) -> None:
    """Untimed ADD+DEL pairs; the first waits for our CNI server to answer."""
    deadline = time.monotonic() + CNI_READY_TIMEOUT
    for i in range(WARMUP):
        cid = f"warm-{tag}-{i}"
        while True:
            call = invoke(plugin, "ADD", cid, pod)
            if call.rc == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if call.rc != 0:
            raise SystemExit(f"{plugin.label}: warm-up ADD failed: {call.error()}")
        checked_del(plugin, cid, pod, json.loads(call.stdout))


def one_run(
    impl: str, family: str, node: BenchNode, pods: Sequence[str], cni_exec: str, tag: str
) -> Sample:
    reset(node)
    store = EtcdStore([node.endpoint], timeout=10.0)
    try:
        put_network_config(store, PREFIX, net_conf(family))
    finally:
        store.close()
    wall0, t0 = time.time(), time.monotonic()
    run = spawn(impl, node)
    try:
        try:
            start = wait_env(node, run.proc, wall0, t0)
        except SystemExit as e:
            raise SystemExit(f"{impl} {family}: {e}\n{run.tail()}") from None
        with open(node.subnet_env) as f:
            has_v6 = "FLANNEL_IPV6_SUBNET=" in f.read()
        if has_v6 != (family == "dual"):
            raise SystemExit(f"{impl} {family}: FLANNEL_IPV6_SUBNET present: {has_v6}")
        plugin = plugin_for(impl, node, cni_exec)
        warm_up(plugin, pods[0], family, tag)
        adds, dels, results = [], [], []
        for i, pod in enumerate(pods):
            seconds, result = checked_add(plugin, f"{tag}-{i}", pod, family)
            adds.append(seconds)
            results.append(result)
        for i, (pod, result) in enumerate(zip(pods, results, strict=True)):
            dels.append(checked_del(plugin, f"{tag}-{i}", pod, result))
    finally:
        stop(run)
    return Sample(impl, family, start, adds, dels)


def inside(repeat: int, pods: Sequence[str], cni_exec: str, say: Say) -> list[Sample]:
    from tests.support.etcd_server import running_etcd

    samples = []
    with tempfile.TemporaryDirectory(prefix="fpbench") as tmp, running_etcd() as etcd:
        node = BenchNode(tmp, etcd.endpoint)
        for r in range(repeat):
            order = RUNS[r % len(RUNS) :] + RUNS[: r % len(RUNS)]
            for impl, family in order:
                s = one_run(impl, family, node, pods, cni_exec, f"r{r}{impl[0]}{family[0]}")
                say(
                    f"round {r + 1}/{repeat} {impl} {family}: ready {s.start:.3f} s, "
                    f"ADD p50 {median(s.adds) * 1e3:.1f} ms, DEL p50 {median(s.dels) * 1e3:.1f} ms"
                )
                samples.append(s)
        reset(node)
    return samples


def report(samples: Sequence[Sample], repeat: int, pods: int, load: str) -> str:
    def med(impl: str, family: str, what: str) -> float:
        chosen = [s for s in samples if s.impl == impl and s.family == family]
        if what == "start":
            return median([s.start for s in chosen])
        return median([x for s in chosen for x in getattr(s, what)])

    rows: list[list[object]] = []
    for what, label, scale in (
        ("start", "start-to-ready (s)", 1.0),
        ("adds", "CNI ADD p50 (ms)", 1e3),
        ("dels", "CNI DEL p50 (ms)", 1e3),
    ):
        v = {(i, f): med(i, f, what) * scale for i, f in RUNS}
        rows.append(
            [
                label,
                *(round(v[run], 3) for run in RUNS),
                ratio(v["ours", "dual"], v["ours", "ipv4"]),
                ratio(v["flanneld", "dual"], v["flanneld", "ipv4"]),
                ratio(v["ours", "ipv4"], v["flanneld", "ipv4"]),
                ratio(v["ours", "dual"], v["flanneld", "dual"]),
            ]
        )
    head = [
        "",
        "ours IPv4",
        "ours dual",
        "flanneld IPv4",
        "flanneld dual",
        "ours dual/IPv4",
        "flanneld dual/IPv4",
        "ours/flanneld IPv4",
        "ours/flanneld dual",
    ]
    lines = [
        f"medians over {repeat} starts per column and {repeat * pods} ADDs/DELs; flanneld's "
        "CNI side is the flannel plugin's delegate (bridge + host-local) alone",
        table(head, rows),
        "every start (s): " + "; ".join(f"{s.impl} {s.family} {s.start:.3f}" for s in samples),
        "machine: " + load,
    ]
    return "\n".join(lines)


def _load() -> str:
    with open("/proc/loadavg") as f:
        return "load average " + " / ".join(f.read().split()[:3]) + f", {os.cpu_count()} CPUs"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.dual_stack",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--repeat", type=int, default=3, help="starts per implementation and family"
    )
    parser.add_argument("--pods", type=int, default=20, help="timed ADDs per start")
    parser.add_argument("--inside-netns", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pod-netns", nargs="*", default=[], help=argparse.SUPPRESS)
    parser.add_argument("--cni-exec", default="", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.dual_stack needs root (network namespaces)", file=sys.stderr)
        return 2
    if not 1 <= args.pods <= 200 or args.repeat < 1:
        print("--pods must be between 1 and 200 and --repeat at least 1", file=sys.stderr)
        return 2

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    if args.inside_netns:
        samples = inside(args.repeat, args.pod_netns, args.cni_exec, say)
        print(json.dumps([asdict(s) for s in samples]))
        return 0
    flanneld.binary()  # fails now, naming the build script, rather than mid-run
    cni_exec = static_build()
    if cni_exec is None:
        print("the static CNI executable did not build; run scripts/build-cni.sh", file=sys.stderr)
        return 2
    load0 = _load()
    pods = [f"fpbd{os.getpid()}p{i}" for i in range(args.pods)]
    made: list[str] = []
    try:
        for pod in pods:
            made.append(pod)
            subprocess.run(["ip", "netns", "add", pod], check=True)
            subprocess.run(["ip", "-n", pod, "link", "set", "lo", "up"], check=True)
        with reference_netns() as ns:
            subprocess.run(
                ["ip", "-n", ns, "addr", "add", UNDERLAY6, "dev", "ul0", "nodad"], check=True
            )
            child = [
                sys.executable,
                "-m",
                "bench.dual_stack",
                "--inside-netns",
                "--repeat",
                str(args.repeat),
                "--cni-exec",
                cni_exec,
                "--pod-netns",
                *pods,
            ]
            proc = subprocess.run(
                ["ip", "netns", "exec", ns, *child], stdout=subprocess.PIPE, text=True
            )
    except KeyboardInterrupt:
        return 130
    finally:
        for pod in made:
            subprocess.run(["ip", "netns", "del", pod], check=False, capture_output=True)
    if proc.returncode != 0:
        print(f"the run failed (exit {proc.returncode}); see above", file=sys.stderr)
        return 1
    samples = [Sample(**s) for s in json.loads(proc.stdout)]
    print(report(samples, args.repeat, args.pods, f"{load0} at start, {_load()} at the end"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
