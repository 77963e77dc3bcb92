"""bench.versus_flanneld's accounting: process trees from /proc and the ratio table."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

from bench.versus_flanneld import (
    Propagation,
    Start,
    Steady,
    cpu_seconds,
    process_tree,
    report,
    rss_mib,
)

BUSY_CHILD = (
    "import subprocess, sys, time\n"
    "c = subprocess.Popen([sys.executable, '-c', 'while True: pass'])\n"
    "time.sleep(60)\n"
)


def test_cpu_and_rss_count_the_whole_process_tree() -> None:
    parent = subprocess.Popen([sys.executable, "-c", BUSY_CHILD])
    try:
        deadline = time.monotonic() + 10
        while len(process_tree(parent.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = process_tree(parent.pid)
        assert len(tree) == 2 and tree[0] == parent.pid
        before = cpu_seconds(parent.pid)
        # The spinning grandchild's CPU counts for the parent's tree (polled: on a loaded
        # machine a second of wall time may give it little CPU).
        deadline = time.monotonic() + 20
        while cpu_seconds(parent.pid) - before <= 0.2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert cpu_seconds(parent.pid) - before > 0.2
        assert rss_mib(parent.pid) > rss_mib(tree[1]) > 1
    finally:
        for pid in reversed(process_tree(parent.pid)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        parent.wait(5)


def test_report_gives_ours_over_flanneld_for_each_measure() -> None:
    starts = [Start("ours", 1000, s, 0.5, 60.0) for s in (1.0, 3.0, 2.0)]
    starts += [Start("flanneld", 1000, s, 0.2, 40.0) for s in (0.5, 0.4, 9.0)]
    steady = [
        Steady("ours", 1000, 1.0, 0.9, 0.6, 60.0),
        Steady("flanneld", 1000, 2.0, 0.3, 0.2, 60.0),
    ]
    props = [
        Propagation("ours", ["n1"], [0.04] * 10, [0.03] * 10),
        Propagation("flanneld", ["n2"], [0.02] * 10, [0.03] * 10),
    ]
    text = report(starts, steady, props, ["load average 5"])
    cells = [line.rsplit(None, 3) for line in text.splitlines() if line.startswith(" ")]
    rows = {c[0].strip(): c[1:] for c in cells if len(c) == 4}
    assert rows["start-to-ready, 1000 peers (s)"] == ["2.000", "0.500", "4.000"]  # medians
    assert rows["RSS at ready, 1000 peers (MiB)"] == ["60.000", "40.000", "1.500"]
    assert rows["CPU for the lease changes, 1000 peers (s)"] == ["0.900", "0.300", "3.000"]
    assert rows["idle CPU over 60 s, 1000 peers (s)"] == ["0.600", "0.200", "3.000"]
    assert rows["new lease -> route, last of own nodes, p95 (s)"] == ["0.040", "0.020", "2.000"]
    assert text.endswith("machine: load average 5")
