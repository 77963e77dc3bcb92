"""The prober's CPU per round at N silent peers: its Python warm, and its thread in real time.

    python -m bench.prober_rounds [--peers 1000] [--seconds 20] [--repeat 3]

N peers that never answer (as ``bench.versus_flanneld``'s fake peers), the default
budget (20 rounds a second: a cycle of 50 s at 1,000 peers), the overlay MTU 1450, so
every round is two echoes and a timeout. Two measurements of the same code:

* **warm**: the prober's ticks back to back on a fake clock advanced by the tick (0.25 s),
  one cycle first, then two simulated minutes; the real ICMP transport with its
  ``sendmsg`` dropped before the kernel, so this is the Python of a round alone, with the
  interpreter's caches warm. CPU of the thread per simulated minute and per round.
* **real time**: in a throwaway network namespace (a veth underlay, the peers on-link
  behind it, so every echo is sent and never answered), the real transport and
  ``Prober.run`` for ``--seconds``, as the agent runs it: the thread's CPU per round and
  how much of it is ``tick()``; beside it, a thread that only waits as often (the tick's
  wake-ups with nothing to do), the floor of a tick on this machine.

``--tick`` runs both with another tick than the prober's (an experiment: the agent's is
``TICK_SECONDS``). Reported: medians over ``--repeat``. The namespace is removed at the end.
"""

from __future__ import annotations

import argparse
import logging
import secrets
import socket
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from ipaddress import IPv4Address
from typing import Any

from bench.common import lacks_root, load_average, say, table
from flannelpy.dataplane.icmp import IcmpTransport
from flannelpy.dataplane.netns import netns_path, run_in_netns
from flannelpy.observe.prober import TICK_SECONDS, Prober

OWN = IPv4Address("10.244.1.1")
MTU = 1450


def peers(count: int) -> dict[str, tuple[IPv4Address, str]]:
    """Keyed as the agent keys them (a subnet per peer), each target on-link behind ul0."""
    return {
        f"10.{100 + i // 250}.{i % 250}.0/24": (IPv4Address(OWN) + 1 + i, f"peer-{i}")
        for i in range(count)
    }


def make_prober(transport: Any, count: int, clock: Callable[[], float] = time.time) -> Prober:
    prober = Prober(
        transport,
        clock,
        mtu_provider=lambda: MTU,
        own_address_provider=lambda: OWN,
        on_results=lambda results: None,
    )
    prober.set_peers(peers(count))
    return prober


def rounds(prober: Prober) -> int:
    return sum(p.probes for p in prober._peers.values())


class NoSend:
    """The transport's socket with every send dropped before the kernel."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock

    def sendmsg(self, *args: object) -> int:
        return 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def warm(count: int, tick_seconds: float = TICK_SECONDS) -> tuple[float, float]:
    """(ms of CPU per simulated minute, µs per round), the ticks back to back."""
    now = [1_700_000_000.0]
    with IcmpTransport() as transport:
        transport._sock = NoSend(transport._sock)  # type: ignore[assignment]
        prober = make_prober(transport, count, lambda: now[0])
        ticks_per_minute = round(60 / tick_seconds)
        for _ in range(ticks_per_minute):  # the first cycle: every peer's first round
            prober.tick()
            now[0] += tick_seconds
        before, cpu = rounds(prober), time.thread_time()
        for _ in range(2 * ticks_per_minute):
            prober.tick()
            now[0] += tick_seconds
        cpu = time.thread_time() - cpu
        done = rounds(prober) - before
    return cpu / 2 * 1000, cpu / max(done, 1) * 1e6


def real_time(count: int, seconds: float, tick_seconds: float = TICK_SECONDS) -> dict[str, float]:
    """The prober's thread over ``seconds`` of wall time, in the calling namespace."""
    with IcmpTransport() as transport:
        prober = make_prober(transport, count)
        ticks, in_tick = [0], [0.0]
        tick = prober.tick

        def timed_tick() -> float:
            ticks[0] += 1
            t0 = time.thread_time()
            wake = tick()
            in_tick[0] += time.thread_time() - t0
            return wake

        prober.tick = timed_tick  # type: ignore[method-assign]
        stop = threading.Event()
        timer = threading.Timer(seconds, stop.set)
        timer.start()
        cpu = time.thread_time()
        prober.run(stop, tick_seconds)
        cpu = time.thread_time() - cpu
        done = rounds(prober)
    waits = threading.Event()
    floor = time.thread_time()
    for _ in range(ticks[0]):
        waits.wait(tick_seconds / 50)  # as many wake-ups, shorter: the same work each
    floor = time.thread_time() - floor
    per_minute = 60 / seconds
    return {
        "rounds": done * per_minute,
        "ticks": ticks[0] * per_minute,
        "cpu": cpu * per_minute * 1000,
        "in_tick": in_tick[0] * per_minute * 1000,
        "per_round": cpu / max(done, 1) * 1e6,
        "wake_floor": floor * per_minute * 1000,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peers", type=int, default=1000)
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--tick", type=float, default=TICK_SECONDS, help="the prober's tick (an experiment)"
    )
    args = parser.parse_args(argv)
    if lacks_root("bench.prober_rounds"):
        return 1
    logging.basicConfig(level=logging.ERROR)  # the first rounds' verdicts are logged
    ns = "prb-" + secrets.token_hex(3)
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        for cmd in (
            "link set lo up",
            "link add ul0 type veth peer name ul0p",
            "link set ul0 up",
            "link set ul0p up",
            "addr add 10.244.1.1/16 dev ul0",
        ):
            subprocess.run(["ip", "-n", ns, *cmd.split()], check=True)
        warm_runs, timed = [], []
        for n in range(args.repeat):
            say(f"round {n + 1}/{args.repeat}: warm, then {args.seconds:g} s in real time")
            path = netns_path(ns)
            warm_runs.append(run_in_netns(path, warm, args.peers, args.tick))
            timed.append(run_in_netns(path, real_time, args.peers, args.seconds, args.tick))
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)

    def mid(values: list[float]) -> float:
        return statistics.median(values)

    print(
        f"{args.peers} silent peers, a {args.tick:g} s tick; medians of {args.repeat}; "
        "per minute of prober time"
    )
    rows: list[tuple[object, ...]] = [
        ("warm: ticks back to back, no sends", mid([w[0] for w in warm_runs]),
         mid([w[1] for w in warm_runs]), "", ""),
        ("real time: the prober's thread", mid([t["cpu"] for t in timed]),
         mid([t["per_round"] for t in timed]), mid([t["rounds"] for t in timed]),
         mid([t["ticks"] for t in timed])),
        ("  of it in tick()", mid([t["in_tick"] for t in timed]), "", "", ""),
        ("  a thread only waking as often", mid([t["wake_floor"] for t in timed]), "", "", ""),
    ]  # fmt: skip
    print(table(("", "CPU (ms/min)", "per round (µs)", "rounds/min", "ticks/min"), rows))
    print(f'{{"load_average": "{load_average()}"}}')
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
