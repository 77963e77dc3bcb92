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
    capture = subprocess.Popen(
        ["ip", "netns", "exec", switch_namespace, "tcpdump", "-i", "br0", "-U", "-s", "0",
         "-w", pcap, *bpf],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        wait_until(lambda: os.path.exists(pcap) and os.path.getsize(pcap) > 0, 5.0, "capture")
        time.sleep(0.3)  # tcpdump writes the header before it is attached to br0
        yield
    finally:
        capture.send_signal(signal.SIGINT)
        capture.wait(timeout=10)


def captured_flows(pcap: str) -> list[str]:
    """One line per captured packet, as ``tcpdump -nn -r`` prints it."""
    return subprocess.run(["tcpdump", "-nn", "-r", pcap], capture_output=True, text=True,
                          check=True).stdout.splitlines()  # fmt: skip
