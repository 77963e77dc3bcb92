"""A tcpdump capture on a lab segment's switch bridge (``br0``), for tests that check
what the underlay carries."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from tests.support.lab_util import wait_until


@contextmanager
def underlay_capture(switch_namespace: str, pcap: str, bpf: Sequence[str]) -> Iterator[None]:
    """Capture ``br0`` in ``switch_namespace`` into ``pcap`` (filter ``bpf``) while the
    block runs; the capture is attached when the block starts and stopped when it ends."""
    sockets_before = _packet_sockets(switch_namespace)
    capture = subprocess.Popen(
        # --immediate-mode: libpcap otherwise hands packets over a ring block at a time
        # (up to 1 s late), and tcpdump stopped by SIGINT drops the block being filled.
        [
            "ip",
            "netns",
            "exec",
            switch_namespace,
            "tcpdump",
            "-i",
            "br0",
            "--immediate-mode",
            "-U",
            "-s",
            "0",
            "-w",
            pcap,
            *bpf,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_until(lambda: os.path.exists(pcap) and os.path.getsize(pcap) > 0, 5.0, "capture")
        # tcpdump writes the file's header before its socket is attached to br0, and on a
        # busy machine the gap passed 0.7 s: wait for its packet socket to be running.
        wait_until(
            lambda: _packet_sockets(switch_namespace) > sockets_before,
            5.0,
            "tcpdump attached to br0",
        )
        time.sleep(0.05)
        yield
    finally:
        capture.send_signal(signal.SIGINT)
        capture.wait(timeout=10)


def _packet_sockets(namespace: str) -> int:
    """Running AF_PACKET sockets in ``namespace`` (``/proc/net/packet``, column R)."""
    rows = subprocess.run(
        ["ip", "netns", "exec", namespace, "cat", "/proc/net/packet"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()[1:]
    return sum(1 for row in rows if len(row.split()) > 5 and row.split()[5] == "1")


def captured_flows(pcap: str) -> list[str]:
    """One line per captured packet, as ``tcpdump -nn -r`` prints it."""
    return subprocess.run(
        ["tcpdump", "-nn", "-r", pcap], capture_output=True, text=True, check=True
    ).stdout.splitlines()
