"""Echoes between a kubelet lab's pods, through ``kubectl exec ping``, and their judge.

Ping's output says which echoes its socket was handed a reply for. That is not the
same as which replies reached the pod: ping reads a raw socket that every ICMP message
of the pod's network namespace is queued to (its own replies, the other pinger's, the
echo requests from other pods), and while the process waits for a CPU on a loaded
machine that queue can fill; the kernel then drops the message at the socket and ping
reports a lost echo that the network delivered. The namespace's own ICMP counters
(``/proc/net/snmp``: ``OutEchos``, ``InEchoReps``) count every request sent and every
reply arriving before any socket sees it, so a pod whose replies arrived equal the
requests it sent lost none in the network, whatever ping printed.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from typing import Any

from flannelpy_lab import Lab, kube_api
from flannelpy_lab import kube as control_plane

ECHO_INTERVAL = 0.1  # seconds between echoes of one pair
STATS = re.compile(r"(\d+) packets transmitted, (\d+) packets received")
REPLY = re.compile(r"seq=(\d+) ttl=\d+ time=([\d.]+) ms")
# After the pings, how long a pod's count of replies may still be catching up with its
# requests (the last echo's reply in flight): a reply late by more than this is lost.
SETTLE_SECONDS = 2.0


def pairs(pods: list[dict[str, Any]]) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Every ordered pod pair, in the order start_pings runs them."""
    return [(a, b) for a in pods for b in pods if a is not b]


def judged_losses(out: str, judged: int) -> list[int]:
    """The echoes below ``judged`` that ping's output shows no reply for, unless ping's own
    count says each of them was answered (its unanswered are the unjudged tail's): a reply
    line lost on its way through the exec stream is no lost packet. Printed then. A
    duplicate reply fails here: it would hide a loss in the pod's counts."""
    match = STATS.search(out)
    assert match, out[-300:]
    assert "DUP!" not in out, out[-300:]
    transmitted, received = int(match.group(1)), int(match.group(2))
    replied = {int(seq) for seq, _ in REPLY.findall(out)}
    missing = sorted(set(range(judged)) - replied)  # busybox counts from 0
    unanswered_tail = len(set(range(judged, transmitted)) - replied)
    if missing and transmitted - received <= unanswered_tail:
        print(f"ping counted {received} of {transmitted} answered; no reply line for {missing}")
        return []
    return missing


def start_pings(lab: Lab, pods: list[dict[str, Any]], count: int) -> list[subprocess.Popen[str]]:
    """Every ordered pod pair: one ``ping`` of ``count`` echoes, run through kubectl exec."""
    binary = os.path.join(control_plane.record(lab.state)["bin_dir"], "kubectl")
    kubeconfig = control_plane.admin_kubeconfig(lab.state)
    return [
        subprocess.Popen(
            [
                binary,
                "--kubeconfig",
                kubeconfig,
                "exec",
                a["metadata"]["name"],
                "--",
                "ping",
                "-c",
                str(count),
                "-i",
                str(ECHO_INTERVAL),
                "-W",
                "1",
                b["status"]["podIP"],
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,  # apart: a kubectl warning must not split a reply line
            text=True,
            env=kube_api.proxyless_env(),
        )
        for a, b in pairs(pods)
    ]


@dataclass(frozen=True)
class EchoCount:
    requests_sent: int  # ICMP echo requests the pod's namespace sent (OutEchos)
    replies_arrived: int  # echo replies that reached it (InEchoReps), read or not


def parse_echo_count(snmp: str) -> EchoCount:
    """The ``Icmp:`` rows of a ``/proc/net/snmp``: a header row, then a value row."""
    rows = [line.split()[1:] for line in snmp.splitlines() if line.startswith("Icmp:")]
    assert len(rows) == 2, snmp[:300]
    fields = dict(zip(rows[0], rows[1], strict=True))
    return EchoCount(int(fields["OutEchos"]), int(fields["InEchoReps"]))


def echo_counts(lab: Lab, pods: list[dict[str, Any]]) -> dict[str, EchoCount]:
    """Each pod's namespace's echo counters, read inside the pod."""
    return {
        p["metadata"]["name"]: parse_echo_count(
            lab.kubectl("exec", p["metadata"]["name"], "--", "cat", "/proc/net/snmp").stdout
        )
        for p in pods
    }


def unanswered_in_network(
    lab: Lab, pods: list[dict[str, Any]], before: dict[str, EchoCount]
) -> dict[str, int]:
    """Per pod, the echo requests it sent since ``before`` whose replies never reached it
    (re-read for up to SETTLE_SECONDS while any is short, for a reply still in flight)."""
    deadline = time.monotonic() + SETTLE_SECONDS
    while True:
        after = echo_counts(lab, pods)
        short = {
            name: (now.requests_sent - before[name].requests_sent)
            - (now.replies_arrived - before[name].replies_arrived)
            for name, now in after.items()
        }
        if not any(short.values()) or time.monotonic() >= deadline:
            return {name: n for name, n in short.items() if n}
        time.sleep(0.5)


def report_socket_misses(missed: dict[str, Any]) -> None:
    """Echoes ping's output lacks while the pods' counters show every reply arrived."""
    if missed:
        print(
            f"ping's output lacks replies {missed}, yet every reply reached its pod (the pod's"
            " ICMP counters): dropped at ping's socket, not in the network"
        )
