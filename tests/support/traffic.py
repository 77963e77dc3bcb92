"""Pod-to-pod traffic on the netns lab, counted packet by packet.

``PodTraffic`` runs ``traffic_probe.py`` inside pod namespaces: one ICMP prober
per pod echoing every other pod (each ordered pair at ``rate`` per second) and a
few long-lived TCP streams between pods on different nodes. ``stop()`` returns a
``TrafficReport``: every echo sent, answered or lost per ordered pair, every
stream that broke, and the probes' own CPU time. Tests assert on it, e.g. "a
rollout loses no packet and breaks no stream"::

    with PodTraffic(lab) as traffic:
        ...  # the change under test
        report = traffic.stop()
    print(report.summary())
    assert report.lost == 0 and not report.broken_streams
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import IO, Any

from flannelpy_lab import Lab
from flannelpy_lab.state import PodInfo

from tests.support.lab_util import backlog_drops

PROBE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "traffic_probe.py")
TCP_PORT = 7407
KILL_WAIT_S = 5.0  # after SIGKILL, for a probe to be reaped


class TrafficError(RuntimeError):
    """The harness itself failed (a probe died, a pair never answered): nothing was measured."""


# --- the report (pure) ---------------------------------------------------------------


@dataclass(frozen=True)
class PairCount:
    """Echoes from pod ``src`` to pod ``dst`` over the measured interval."""

    src: str
    dst: str
    dst_ip: str
    sent: int
    received: int
    lost: int
    lost_seqs: tuple[int, ...]  # the first ones (the probe caps the list)
    duplicates: int
    send_errors: int
    max_gap_ms: float  # longest time without a reply (sends go out on a 20 ms tick)
    max_rtt_ms: float
    measured_s: float  # the prober's measured interval (mark to last send)

    @property
    def rate(self) -> float:
        return self.sent / self.measured_s if self.measured_s > 0 else 0.0


@dataclass(frozen=True)
class StreamResult:
    """One long-lived TCP stream from pod ``client`` to pod ``server``."""

    client: str
    server: str
    sent: int
    echoed: int
    broken: bool
    error: str | None
    max_stall_ms: float  # longest wait for an echo


@dataclass(frozen=True)
class TrafficReport:
    """What the probes counted over the measured interval (warm-up excluded)."""

    pairs: tuple[PairCount, ...]
    streams: tuple[StreamResult, ...]
    rate: float  # echoes per second per ordered pair, as asked
    stream_rate: float  # messages per second per stream, as asked
    measured_s: float  # from the moment every probe counted to the stop
    warmup_s: float  # start to the measured interval
    cpu_s: float  # CPU time of all probe processes, whole lifetime
    wall_s: float  # the longest probe lifetime
    notes: tuple[str, ...] = ()
    backlog_drops: int = 0  # machine-wide, start to stop (lab_util.backlog_drops)

    @property
    def sent(self) -> int:
        return sum(p.sent for p in self.pairs)

    @property
    def received(self) -> int:
        return sum(p.received for p in self.pairs)

    @property
    def lost(self) -> int:
        return sum(p.lost for p in self.pairs)

    @property
    def lost_pairs(self) -> list[tuple[str, str]]:
        return [(p.src, p.dst) for p in self.pairs if p.lost]

    @property
    def broken_streams(self) -> list[StreamResult]:
        return [s for s in self.streams if s.broken]

    @property
    def min_pair_rate(self) -> float:
        return min((p.rate for p in self.pairs), default=0.0)

    @property
    def cpu_share(self) -> float:
        """Probe CPU as a fraction of one core over their lifetime."""
        return self.cpu_s / self.wall_s if self.wall_s > 0 else 0.0

    def summary(self) -> str:
        """One paragraph for test output."""
        pods = {p.src for p in self.pairs} | {p.dst for p in self.pairs}
        text = (
            f"Measured {self.measured_s:.1f} s after a {self.warmup_s:.1f} s warm-up (until"
            f" every pair had answered). ICMP: {len(self.pairs)} ordered pairs of {len(pods)}"
            f" pods at {self.rate:g}/s each (slowest pair {self.min_pair_rate:.1f}/s):"
            f" {self.sent} echoes sent, {self.received} answered, {self.lost} lost"
        )
        if self.pairs:
            text += f", longest gap {max(p.max_gap_ms for p in self.pairs):.0f} ms"
        lost = [p for p in self.pairs if p.lost]
        if lost:
            worst = sorted(lost, key=lambda p: -p.lost)[:6]
            shown = ", ".join(f"{p.src}->{p.dst} {p.lost}/{p.sent}" for p in worst)
            more = f" and {len(lost) - len(worst)} more" if len(lost) > len(worst) else ""
            text += f"; losses on {len(lost)} pairs: {shown}{more}"
        text += (
            f". TCP: {len(self.streams)} streams at {self.stream_rate:g}/s,"
            f" {sum(s.echoed for s in self.streams)} of {sum(s.sent for s in self.streams)}"
            f" messages echoed, {len(self.broken_streams)} broken"
        )
        if self.streams:
            text += f", longest stall {max(s.max_stall_ms for s in self.streams):.0f} ms"
        for s in self.broken_streams:
            text += f"; {s.client}->{s.server} broke: {s.error}"
        text += (
            f". Probe CPU {self.cpu_s:.2f} s over {self.wall_s:.1f} s"
            f" ({100 * self.cpu_share:.1f}% of one core)."
        )
        if self.backlog_drops:
            text += (
                f" Meanwhile the kernel dropped {self.backlog_drops} packets machine-wide"
                " for a full input backlog (not the data plane: the machine's CPU)."
            )
        if self.notes:
            text += " Notes: " + "; ".join(self.notes) + "."
        return text


def pair_counts(src: str, doc: Mapping[str, Any], names: Mapping[str, str]) -> list[PairCount]:
    """The ICMP prober report of pod ``src`` as pair counts (``names``: IP -> pod name)."""
    out = []
    for ip, t in sorted(doc["targets"].items(), key=lambda kv: names[kv[0]]):
        out.append(
            PairCount(
                src=src,
                dst=names[ip],
                dst_ip=ip,
                sent=int(t["sent"]),
                received=int(t["received"]),
                lost=int(t["lost"]),
                lost_seqs=tuple(t["lost_seqs"]),
                duplicates=int(t["duplicates"]),
                send_errors=int(t["send_errors"]),
                max_gap_ms=float(t["max_gap_ms"]),
                max_rtt_ms=float(t["max_rtt_ms"]),
                measured_s=float(doc["measured_s"]),
            )
        )
    return out


def stream_result(client: str, server: str, doc: Mapping[str, Any]) -> StreamResult:
    return StreamResult(
        client=client,
        server=server,
        sent=int(doc["sent"]),
        echoed=int(doc["echoed"]),
        broken=bool(doc["broken"]),
        error=doc["error"],
        max_stall_ms=float(doc["max_stall_ms"]),
    )


def notes_of(pairs: Sequence[PairCount], docs: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """What a reader of the counts should also know (``docs``: probe name -> its report)."""
    notes = []
    dup = sum(p.duplicates for p in pairs)
    if dup:
        notes.append(f"{dup} duplicate replies (not counted as received)")
    errors = sum(p.send_errors for p in pairs)
    if errors:
        notes.append(f"{errors} echoes could not be sent (counted sent and lost)")
    for name, doc in sorted(docs.items()):
        if doc.get("starved"):
            notes.append(f"{name} fell over 1 s behind its send schedule {doc['starved']} times")
        if doc.get("errors"):
            notes.append(f"{name}: {', '.join(doc['errors'][:3])}")
    return notes


def pick_streams(pods: Sequence[PodInfo], count: int) -> list[tuple[PodInfo, PodInfo]]:
    """``count`` distinct (client, server) pairs on different nodes, spread over the nodes:
    stream i goes from node i to node i+1 (mod the node count), taking each node's
    pods in turn."""
    by_node: dict[str, list[PodInfo]] = {}
    for pod in sorted(pods, key=lambda p: (p.node, p.name)):
        by_node.setdefault(pod.node, []).append(pod)
    nodes = sorted(by_node)
    if count and len(nodes) < 2:
        raise TrafficError("TCP streams between nodes need pods on at least two nodes")
    out: list[tuple[PodInfo, PodInfo]] = []
    for i in range(count):
        rnd = i // len(nodes)
        src = by_node[nodes[i % len(nodes)]]
        dst = by_node[nodes[(i + 1) % len(nodes)]]
        pair = (src[rnd % len(src)], dst[rnd % len(dst)])
        if pair in out or pair[0].node == pair[1].node:
            raise TrafficError(f"{count} distinct cross-node streams do not fit on these pods")
        out.append(pair)
    return out


# --- the probes (processes) ----------------------------------------------------------


@dataclass
class _Probe:
    name: str
    pod: PodInfo
    proc: subprocess.Popen[bytes]
    stderr: IO[bytes]
    buffer: bytes = b""
    events: list[dict[str, Any]] = field(default_factory=list)
    eof: bool = False

    def seen(self, event: str) -> bool:
        return any(e["event"] == event for e in self.events)

    def feed(self, data: bytes) -> None:
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        self.events += [json.loads(line) for line in lines if line.strip()]

    def report(self) -> dict[str, Any] | None:
        return next((e for e in self.events if e["event"] == "report"), None)

    def error_output(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace").strip()[-1500:]


class PodTraffic:
    """ICMP between every ordered pair of pods and TCP streams between nodes, counted.

    Start-up has a warm-up phase: the probes start, and counting begins only
    once every ordered pair has had its first echo reply and every stream its
    first echo (first ARP, first route lookups and the like are not counted).
    Then every probe is told to count from its next packet on, and ``start()``
    (or ``with``) returns: the report covers exactly the interval from then to
    ``stop()``. A pair that never answers within ``warmup_timeout`` is an error,
    not a loss.

    ``stop()`` stops the senders, waits ``grace`` seconds for echoes in flight,
    closes the streams cleanly and returns the ``TrafficReport``. Leaving the
    ``with`` block without ``stop()`` stops and keeps the report in ``report``;
    leaving it on an exception kills every probe.

    ``ipv6``: each pod also echoes every other pod's IPv6 address (a dual-stack lab), each
    family a pair of its own in the report (its ``dst_ip`` tells which).

    ``streams`` is a count (pairs chosen by ``pick_streams``) or explicit
    (client pod, server pod) names. ``stream_timeout``: how long a stream may
    wait for an echo before it counts as broken.
    """

    def __init__(
        self,
        lab: Lab,
        pods: Sequence[PodInfo] | None = None,
        *,
        rate: float = 20.0,
        streams: int | Sequence[tuple[str, str]] = 3,
        stream_rate: float = 50.0,
        stream_timeout: float = 5.0,
        grace: float = 2.0,
        warmup_timeout: float = 30.0,
        python: str = sys.executable,
        ipv6: bool = False,
    ) -> None:
        self.lab = lab
        self.pods = list(pods if pods is not None else lab.pods)
        if len(self.pods) < 2:
            raise TrafficError("traffic needs at least two pods")
        if any(p.ip is None for p in self.pods):
            raise TrafficError("every pod needs an address (a CNI ADD that succeeded)")
        self.rate = rate
        self.stream_rate = stream_rate
        self.stream_timeout = stream_timeout
        self.grace = grace
        self.warmup_timeout = warmup_timeout
        self.python = python
        if ipv6 and any(p.ip6 is None for p in self.pods):
            raise TrafficError("IPv6 traffic needs an IPv6 address on every pod (dual stack)")
        self.names = {str(p.ip): p.name for p in self.pods}
        self.names.update({str(p.ip6): p.name for p in self.pods if ipv6})
        if isinstance(streams, int):
            self.streams = pick_streams(self.pods, streams)
        else:
            by_name = {p.name: p for p in self.pods}
            self.streams = [(by_name[c], by_name[s]) for c, s in streams]
        self._icmp: list[_Probe] = []
        self._clients: list[_Probe] = []
        self._servers: list[_Probe] = []
        self._started_at = 0.0
        self._measuring_at = 0.0
        self._drops_at_start = 0
        self.report: TrafficReport | None = None

    # -- life cycle ---------------------------------------------------------------

    def __enter__(self) -> PodTraffic:
        return self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if kind is None and self.report is None and self._running():
            self.stop()
        else:
            self.kill()

    def start(self) -> PodTraffic:
        """Start every probe, wait out the warm-up, then start counting."""
        self._started_at = time.monotonic()
        self._drops_at_start = backlog_drops()
        deadline = self._started_at + self.warmup_timeout
        try:
            for server in {s.name: s for _, s in self.streams}.values():
                self._servers.append(
                    self._spawn(
                        f"tcp-server {server.name}", server, ["tcp-server", "--port", str(TCP_PORT)]
                    )
                )
            self._pump(self._servers, lambda p: p.seen("listening"), deadline, "listening")
            for pod in self.pods:
                targets = ",".join(ip for ip, name in self.names.items() if name != pod.name)
                argv = [
                    "icmp",
                    "--targets",
                    targets,
                    "--rate",
                    f"{self.rate:g}",
                    "--grace",
                    f"{self.grace:g}",
                ]
                self._icmp.append(self._spawn(f"icmp {pod.name}", pod, argv))
            for client, server in self.streams:
                argv = [
                    "tcp-client",
                    "--target",
                    str(server.ip),
                    "--port",
                    str(TCP_PORT),
                    "--rate",
                    f"{self.stream_rate:g}",
                    "--timeout",
                    f"{self.stream_timeout:g}",
                ]
                name = f"tcp {client.name}->{server.name}"
                self._clients.append(self._spawn(name, client, argv))
            senders = self._icmp + self._clients
            self._pump(senders, lambda p: p.seen("warm"), deadline, "warm")
            for probe in senders:
                probe.proc.send_signal(signal.SIGUSR1)
            self._pump(senders, lambda p: p.seen("measuring"), deadline, "measuring")
        except BaseException:
            self.kill()
            raise
        self._measuring_at = time.monotonic()
        return self

    def stop(self) -> TrafficReport:
        """Stop sending, collect every probe's counts, and build the report."""
        if self.report is not None:
            return self.report
        stopped_at = time.monotonic()
        try:
            senders = self._icmp + self._clients
            for probe in senders:
                probe.proc.send_signal(signal.SIGTERM)
            # Clients drain their echoes and close before the servers stop.
            self._collect(senders, self.grace + 2 * self.stream_timeout + 10)
            for probe in self._servers:
                probe.proc.send_signal(signal.SIGTERM)
            self._collect(self._servers, 10)
            self.report = self._build(stopped_at)
            return self.report
        finally:
            self.kill()

    def kill(self) -> None:
        """Kill every probe still running and release its files (idempotent)."""
        for probe in self._icmp + self._clients + self._servers:
            if probe.proc.poll() is None:
                probe.proc.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    probe.proc.wait(KILL_WAIT_S)
            if probe.proc.stdout is not None and not probe.proc.stdout.closed:
                probe.proc.stdout.close()
            probe.stderr.close()

    def alive(self) -> list[int]:
        """Pids of probes still running (none once stopped or killed)."""
        return [
            p.proc.pid for p in self._icmp + self._clients + self._servers if p.proc.poll() is None
        ]

    # -- internals ----------------------------------------------------------------

    def _running(self) -> bool:
        return bool(self.alive())

    def _spawn(self, name: str, pod: PodInfo, args: list[str]) -> _Probe:
        stderr = tempfile.TemporaryFile()  # noqa: SIM115  closed by kill()
        # ``ip netns exec`` execs the interpreter: the pid we signal is the probe's.
        # A new session keeps a terminal's Ctrl-C away from the probes: we stop them.
        proc = subprocess.Popen(
            ["ip", "netns", "exec", pod.namespace, self.python, "-u", PROBE, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=stderr,
            start_new_session=True,
        )
        return _Probe(name, pod, proc, stderr)

    def _pump(
        self,
        probes: Sequence[_Probe],
        done: Callable[[_Probe], bool],
        deadline: float,
        what: str,
    ) -> None:
        """Read probe output until ``done`` holds for every probe; fail on a dead probe."""
        with selectors.DefaultSelector() as sel:
            for probe in probes:
                if not probe.eof and probe.proc.stdout is not None:
                    sel.register(probe.proc.stdout.fileno(), selectors.EVENT_READ, probe)
            while not all(done(p) for p in probes):
                dead = [p for p in probes if p.eof and not done(p)]
                if dead:
                    raise TrafficError(self._died(dead[0]))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TrafficError(self._late(probes, done, what))
                for key, _ in sel.select(left):
                    probe = key.data
                    data = os.read(key.fd, 65536)
                    if data:
                        probe.feed(data)
                    else:
                        probe.eof = True
                        sel.unregister(key.fd)

    def _collect(self, probes: Sequence[_Probe], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for probe in probes:
            try:
                rest, _ = probe.proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired as e:
                raise TrafficError(f"probe {probe.name} did not report within {timeout:g} s") from e
            probe.feed(rest + b"\n")
            if probe.report() is None:
                raise TrafficError(self._died(probe))

    def _died(self, probe: _Probe) -> str:
        probe.proc.poll()
        return (
            f"probe {probe.name} ended (exit {probe.proc.returncode}) without its "
            f"counts: {probe.error_output() or 'no error output'}"
        )

    def _late(self, probes: Sequence[_Probe], done: Callable[[_Probe], bool], what: str) -> str:
        late = [p for p in probes if not done(p)]
        detail = []
        for probe in late[:5]:
            if probe in self._icmp and what == "warm":
                answered = {e["target"] for e in probe.events if e["event"] == "first"}
                silent = sorted(
                    self.names[ip]
                    for ip in self.names
                    if ip != str(probe.pod.ip) and ip not in answered
                )
                detail.append(f"{probe.pod.name} has no reply from {', '.join(silent)}")
            else:
                detail.append(f"{probe.name} is not {what}")
        return (
            f"{len(late)} of {len(probes)} probes not {what} after {self.warmup_timeout:g} s: "
            + "; ".join(detail)
        )

    def _build(self, stopped_at: float) -> TrafficReport:
        docs: dict[str, dict[str, Any]] = {}
        pairs: list[PairCount] = []
        for probe in self._icmp:
            doc = probe.report()
            assert doc is not None  # _collect checked
            docs[probe.name] = doc
            pairs += pair_counts(probe.pod.name, doc, self.names)
        streams = []
        for probe, (client, server) in zip(self._clients, self.streams, strict=True):
            doc = probe.report()
            assert doc is not None
            docs[probe.name] = doc
            streams.append(stream_result(client.name, server.name, doc))
        for probe in self._servers:
            doc = probe.report()
            assert doc is not None
            docs[probe.name] = doc
        notes = notes_of(pairs, docs)
        for probe in self._icmp + self._clients + self._servers:
            err = probe.error_output()
            if err:
                notes.append(f"{probe.name} wrote: {err[-200:]}")
        every = list(docs.values())
        return TrafficReport(
            pairs=tuple(pairs),
            streams=tuple(streams),
            rate=self.rate,
            stream_rate=self.stream_rate,
            measured_s=stopped_at - self._measuring_at,
            warmup_s=self._measuring_at - self._started_at,
            cpu_s=sum(float(d["cpu_s"]) for d in every),
            wall_s=max(float(d["wall_s"]) for d in every),
            notes=tuple(notes),
            backlog_drops=backlog_drops() - self._drops_at_start,
        )
