"""TCP connections that show what a firewall lets through, new connection by new
connection: a server that accepts everything in one pod's namespace, and a client in
another that opens a new connection every ``interval`` seconds and logs each outcome.

The client's connects are non-blocking and started on time whatever happens to the
earlier ones: a dropped SYN waits ``give_up`` seconds (less than the kernel's first
retransmission, 1 s) and is logged as ``lost``; an answered one is ``ok`` (the
handshake completed: the server's kernel accepted it), a reset ``refused``.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

SERVER = """
import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1])))
s.listen(4096)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.close()
"""

CLIENT = """
import os, selectors, socket, sys, time
host, port, out, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
interval, give_up = float(sys.argv[5]), float(sys.argv[6])
sel = selectors.DefaultSelector()
log = open(out, "w", buffering=1)
due = time.time()
while not os.path.exists(stop):
    now = time.time()
    if now >= due:
        s = socket.socket()
        s.setblocking(False)
        s.connect_ex((host, port))
        sel.register(s, selectors.EVENT_WRITE, now)
        due += interval
    for key, _ in sel.select(timeout=max(0.0, min(due - time.time(), interval))):
        err = key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        log.write(f"{key.data:.4f} {'ok' if err == 0 else 'refused'}\\n")
        sel.unregister(key.fileobj)
        key.fileobj.close()
    for key in list(sel.get_map().values()):
        if time.time() - key.data > give_up:
            log.write(f"{key.data:.4f} lost\\n")
            sel.unregister(key.fileobj)
            key.fileobj.close()
"""


def serve(netns: str, port: int) -> subprocess.Popen[str]:
    """The server in ``netns``, once it listens."""
    server = subprocess.Popen(
        ["ip", "netns", "exec", netns, "python3", "-c", SERVER, str(port)],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None
    if server.stdout.readline().strip() != "ready":
        stop_process(server)
        raise RuntimeError(f"the TCP server in {netns} did not start")
    return server


def stop_process(proc: subprocess.Popen[str]) -> None:
    proc.kill()
    proc.wait(timeout=10)
    if proc.stdout is not None:
        proc.stdout.close()


@dataclass
class Client:
    """The client's process and its log: (start time, outcome) of every connection."""

    proc: subprocess.Popen[str]
    log: Path
    stop_file: Path

    def attempts(self) -> list[tuple[float, str]]:
        out = []
        for line in self.log.read_text().splitlines():
            t, _, outcome = line.partition(" ")
            if outcome:
                out.append((float(t), outcome))
        return sorted(out)

    def since(self, t0: float) -> list[tuple[float, str]]:
        return [a for a in self.attempts() if a[0] >= t0]

    def stop(self) -> None:
        self.stop_file.touch()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def connect_loop(
    netns: str,
    host: str,
    port: int,
    workdir: Path,
    interval: float = 0.01,
    give_up: float = 0.9,
) -> Client:
    """Start the client in ``netns`` towards ``host:port``; its log goes to ``workdir``."""
    log, stop_file = workdir / "client.log", workdir / "stop"
    log.touch()
    argv = ["ip", "netns", "exec", netns, "python3", "-c", CLIENT, host, str(port), str(log),
            str(stop_file), str(interval), str(give_up)]  # fmt: skip
    return Client(subprocess.Popen(argv, text=True), log, stop_file)
