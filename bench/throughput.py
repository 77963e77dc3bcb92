"""Pod-to-pod TCP throughput and the CPU it costs: vxlan, wireguard, and the underlay.

    python -m bench.throughput [--seconds 5] [--repeat 3]

One run, three paths, each measured with ``iperf3`` (one TCP stream, ``--seconds``
long) between two nodes of a 2-node lab:

- **underlay** (the reference): node to node on the lab underlay, no pods, no overlay;
- **vxlan**: pod on n1 to pod on n2 of a vxlan lab;
- **wireguard**: the same in a wireguard lab (wireguard-go, userspace: this kernel has
  no WireGuard module).

Two labs are built one after the other (vxlan, then wireguard); in each, the underlay
and the pod path take turns ``--repeat`` times, so both see the same machine state.
The underlay rows of both labs form the reference.

CPU per transfer: user+system time of the two ``iperf3`` processes (their rusage,
from ``wait4``), of every node's ``wireguard-go`` (``/proc/<pid>/stat`` utime+stime
before and after), and of the whole host (the busy ticks of ``/proc/stat``: all
but idle and iowait), each divided by the GB received. Ratios are ours over the
underlay's medians.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from ipaddress import IPv4Interface

from flannelpy_lab import Lab

from bench.common import median, ratio, table

LAB_TIMEOUT = 120.0
REACH_TIMEOUT = 20.0  # seconds for the first pod-to-pod ping (a WireGuard handshake retries at 5 s)
PORT = 5201
TICKS = os.sysconf("SC_CLK_TCK")
GB = 1e9

# --- pure ---------------------------------------------------------------------------


def host_busy_ticks(proc_stat: str) -> int:
    """Busy ticks of all CPUs from /proc/stat's ``cpu`` line: every field but idle and
    iowait, without guest time (already counted in user and nice)."""
    for line in proc_stat.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            values = [int(v) for v in fields[1:]]
            user, nice, system, _idle, _iowait, irq, softirq = values[:7]
            steal = values[7] if len(values) > 7 else 0
            return user + nice + system + irq + softirq + steal
    raise ValueError("/proc/stat has no cpu line")


def pid_cpu_ticks(pid_stat: str) -> int:
    """utime + stime of /proc/<pid>/stat (fields 14 and 15; the name may hold spaces)."""
    rest = pid_stat[pid_stat.rindex(")") + 2 :].split()
    return int(rest[11]) + int(rest[12])


def iperf3_received(report: str) -> tuple[float, int]:
    """Bytes received and retransmits from ``iperf3 -c ... -J`` output."""
    doc = json.loads(report)
    if "error" in doc:
        raise RuntimeError(f"iperf3 failed: {doc['error']}")
    end = doc["end"]
    return float(end["sum_received"]["bytes"]), int(end["sum_sent"].get("retransmits", 0))


@dataclass(frozen=True)
class Sample:
    path: str  # "underlay", "vxlan", "wireguard"
    seconds: float
    received_bytes: float
    retransmits: int
    iperf3_cpu: float  # seconds, client + server
    wireguard_go_cpu: float  # seconds, every node's wireguard-go
    host_cpu: float  # busy seconds of the whole host over the run

    @property
    def gbit_per_s(self) -> float:
        return self.received_bytes * 8 / self.seconds / 1e9

    def per_gb(self, cpu: float) -> float:
        return cpu / (self.received_bytes / GB) if self.received_bytes else float("nan")


def report(samples: Sequence[Sample]) -> str:
    """Medians per path and their ratios against the underlay's medians."""
    paths = ["underlay", *sorted({s.path for s in samples} - {"underlay"})]

    def med(path: str, value: Callable[[Sample], float]) -> float:
        values = [value(s) for s in samples if s.path == path]
        return median(values) if values else float("nan")

    base_rate = med("underlay", lambda s: s.gbit_per_s)
    base_host = med("underlay", lambda s: s.per_gb(s.host_cpu))
    rows = []
    for path in paths:
        rate = med(path, lambda s: s.gbit_per_s)
        host = med(path, lambda s: s.per_gb(s.host_cpu))
        rows.append(
            [
                path,
                sum(s.path == path for s in samples),
                rate,
                ratio(rate, base_rate),
                med(path, lambda s: s.per_gb(s.iperf3_cpu)),
                med(path, lambda s: s.per_gb(s.wireguard_go_cpu)),
                host,
                ratio(host, base_host),
                med(path, lambda s: float(s.retransmits)),
            ]
        )
    runs = table(
        [
            "path",
            "runs",
            "Gbit/s",
            "× underlay",
            "iperf3 CPU s/GB",
            "wireguard-go CPU s/GB",
            "host CPU s/GB",
            "× underlay",
            "retransmits",
        ],
        rows,
    )
    each = table(
        ["path", "Gbit/s", "host CPU s/GB"],
        [[s.path, s.gbit_per_s, s.per_gb(s.host_cpu)] for s in samples],
    )
    return f"medians:\n{runs}\n\nevery run, in order:\n{each}"


# --- measuring ------------------------------------------------------------------------


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def wireguard_go_pids(lab: Lab) -> list[int]:
    pids = []
    for node in lab.nodes:
        path = os.path.join(node.node_dir, "run", "wireguard", "flannel-wg.pid")
        if os.path.exists(path):
            pids.append(int(_read(path).strip()))
    return pids


def _cpu_of(pids: Sequence[int]) -> int:
    return sum(pid_cpu_ticks(_read(f"/proc/{pid}/stat")) for pid in pids)


def _rusage_seconds(pid: int) -> tuple[int, float]:
    _, status, usage = os.wait4(pid, 0)
    return status, usage.ru_utime + usage.ru_stime


def iperf3_once(
    path: str,
    server_ns: str,
    client_ns: str,
    server_ip: str,
    seconds: int,
    wg_pids: Sequence[int],
) -> Sample:
    """One iperf3 transfer from ``client_ns`` to ``server_ip`` (in ``server_ns``)."""
    server = subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            server_ns,
            "iperf3",
            "-s",
            "-1",
            "-B",
            server_ip,
            "-p",
            str(PORT),
            "--forceflush",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert server.stdout is not None
    try:
        line = server.stdout.readline()
        while line and "listening" not in line:
            line = server.stdout.readline()
        if not line:
            raise RuntimeError(f"iperf3 -s in {server_ns} did not start")
        wg0, host0, t0 = _cpu_of(wg_pids), host_busy_ticks(_read("/proc/stat")), time.monotonic()
        client = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                client_ns,
                "iperf3",
                "-c",
                server_ip,
                "-p",
                str(PORT),
                "-t",
                str(seconds),
                "-J",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert client.stdout is not None
        out = client.stdout.read()
        client_status, client_cpu = _rusage_seconds(client.pid)
        client.returncode = os.waitstatus_to_exitcode(client_status)
        elapsed = time.monotonic() - t0
        wg1, host1 = _cpu_of(wg_pids), host_busy_ticks(_read("/proc/stat"))
        server.stdout.read()
        server_status, server_cpu = _rusage_seconds(server.pid)
        server.returncode = os.waitstatus_to_exitcode(server_status)
    finally:
        if server.returncode is None:
            server.kill()
            server.wait()
    received, retransmits = iperf3_received(out)
    return Sample(
        path=path,
        seconds=float(seconds),
        received_bytes=received,
        retransmits=retransmits,
        iperf3_cpu=client_cpu + server_cpu,
        wireguard_go_cpu=(wg1 - wg0) / TICKS,
        host_cpu=(host1 - host0) / TICKS * (seconds / elapsed),
    )


def _ip(address: str | None) -> str:
    assert address is not None
    return str(IPv4Interface(address).ip)


def _pod_ping(namespace: str, target: str) -> bool:
    argv = ["ip", "netns", "exec", namespace, "ping", "-c", "1", "-W", "1", target]
    return subprocess.run(argv, capture_output=True, timeout=10).returncode == 0


def measure_lab(
    backend: str, seconds: int, repeat: int, say: Callable[[str], None]
) -> list[Sample]:
    name = "bt" + secrets.token_hex(2)
    say(f"bringing up {backend} lab {name} with 2 nodes and a pod on each")
    lab = Lab.up(name, 2, backend, pods_per_node=1, timeout=LAB_TIMEOUT, progress=say)
    try:
        n1, n2 = lab.node("n1"), lab.node("n2")
        p1, p2 = lab.pod("n1-p1"), lab.pod("n2-p1")
        deadline = time.monotonic() + REACH_TIMEOUT
        while not _pod_ping(p1.namespace, _ip(p2.address)):
            if time.monotonic() > deadline:
                raise SystemExit(f"pods of the {backend} lab do not reach each other")
        wg_pids = wireguard_go_pids(lab) if backend == "wireguard" else []
        samples = []
        for i in range(repeat):
            samples.append(
                iperf3_once("underlay", n2.namespace, n1.namespace, str(n2.ip), seconds, wg_pids)
            )
            samples.append(
                iperf3_once(backend, p2.namespace, p1.namespace, _ip(p2.address), seconds, wg_pids)
            )
            say(
                f"{backend} {i + 1}/{repeat}: underlay {samples[-2].gbit_per_s:.2f} Gbit/s, "
                f"{backend} {samples[-1].gbit_per_s:.2f} Gbit/s"
            )
        return samples
    finally:
        lab.down()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.throughput",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seconds", type=int, default=5, help="length of each iperf3 run")
    parser.add_argument("--repeat", type=int, default=3, help="runs per path and lab")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench.throughput needs root (network namespaces)", file=sys.stderr)
        return 2

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    try:
        samples = []
        for backend in ("vxlan", "wireguard"):
            samples += measure_lab(backend, args.seconds, args.repeat, say)
    except KeyboardInterrupt:
        return 130
    print(report(samples))
    return 0


if __name__ == "__main__":
    sys.exit(main())
