"""Run ``flannelpy`` with a control socket that reports on its heap (a bench's wrapper).

    python [-X tracemalloc=N] -m bench.heap_probe SOCKET flannelpy-args...

A thread serves SOCKET (a unix stream socket): each connection sends one command line
and reads one JSON line back:

* ``rss``: VmRSS and VmHWM (KiB), tracemalloc's current and peak (bytes, 0 untraced);
* ``trim``: VmRSS before and after glibc's ``malloc_trim(0)`` in this process;
* ``snapshot PATH``: a tracemalloc snapshot dumped to PATH (traced runs only).

The agent itself is unchanged: this is how :mod:`bench.peer_memory` looks inside it.
"""

from __future__ import annotations

import ctypes
import json
import os
import socket
import sys
import threading
import time
import tracemalloc
from typing import Any


def vm_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next((int(line.split()[1]) for line in f if line.startswith(field + ":")), 0)


def answer(command: str) -> dict[str, Any]:
    verb, _, arg = command.strip().partition(" ")
    if verb == "rss":
        current, peak = tracemalloc.get_traced_memory() if tracemalloc.is_tracing() else (0, 0)
        return {"rss": vm_kib("VmRSS"), "hwm": vm_kib("VmHWM"), "current": current, "peak": peak}
    if verb == "trim":
        before, t0 = vm_kib("VmRSS"), time.monotonic()
        released = ctypes.CDLL("libc.so.6").malloc_trim(0)
        seconds = time.monotonic() - t0
        after = vm_kib("VmRSS")
        return {"before": before, "after": after, "released": released, "seconds": seconds}
    if verb == "snapshot" and tracemalloc.is_tracing():
        tracemalloc.take_snapshot().dump(arg)
        return {"path": arg}
    return {"error": f"unknown command {command.strip()!r}"}


def serve(path: str) -> None:
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    while True:
        conn, _ = server.accept()
        with conn, conn.makefile("rw") as f:
            f.write(json.dumps(answer(f.readline())) + "\n")


def ask(path: str, command: str, timeout: float = 60.0) -> dict[str, Any]:
    """One command to a running wrapper (the bench's side)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(timeout)
        s.connect(path)
        with s.makefile("rw") as f:
            f.write(command + "\n")
            f.flush()
            reply: dict[str, Any] = json.loads(f.readline())
            return reply


def main() -> int:
    path, argv = sys.argv[1], sys.argv[2:]
    if os.path.exists(path):
        os.unlink(path)
    threading.Thread(target=serve, args=(path,), name="heap-probe", daemon=True).start()
    from flannelpy.cli import main as flannelpy_main

    if os.environ.get("XX_NO_SETTLE"):
        import flannelpy.agent.compose as c

        c.settle_heap = lambda: None

    return flannelpy_main(argv)


if __name__ == "__main__":
    sys.exit(main())
