"""Reading and comparing the firewall state of lab nodes (ours beside flanneld)."""

from __future__ import annotations

import re
import secrets
import subprocess
import sys
from ipaddress import IPv4Interface

from flannelpy_lab import Lab

# Prints the source address of the first datagram it receives (standard library only).
_LISTEN = (
    "import socket, sys\n"
    "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
    "s.bind(('0.0.0.0', int(sys.argv[1])))\n"
    "s.settimeout(float(sys.argv[2]))\n"
    "print(s.recvfrom(64)[1][0], flush=True)\n"
)
# Sends one datagram every 0.1 s for 3 s: the listener may start a little later.
_SEND = (
    "import socket, sys, time\n"
    "s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
    "for _ in range(30):\n"
    "    s.sendto(b'x', (sys.argv[1], int(sys.argv[2])))\n"
    "    time.sleep(0.1)\n"
)


def in_ns(namespace: str, argv: list[str], check: bool = True) -> str:
    proc = subprocess.run(
        ["ip", "netns", "exec", namespace, *argv], capture_output=True, text=True, timeout=30
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(argv)} in {namespace}: {proc.stderr.strip()}")
    return proc.stdout


def node_subnet(lab: Lab, node: str) -> str:
    address = lab.node(node).overlay_address
    assert address, f"{node} has no overlay address yet"
    return str(IPv4Interface(address).network)


def normalized(lab: Lab, node: str, text: str) -> str:
    """``text`` with the node's own subnet written as <subnet>: what is left must be the
    same on every node of one config."""
    return text.replace(node_subnet(lab, node), "<subnet>")


def iptables_save(lab: Lab, node: str, counters: bool = False) -> str:
    """``iptables-save`` of the node without its timestamped comment lines."""
    out = in_ns(lab.node(node).namespace, ["iptables-save", *(["-c"] if counters else [])])
    return "".join(line + "\n" for line in out.splitlines() if not line.startswith("#"))


def nft_ruleset(lab: Lab, node: str) -> str:
    return in_ns(lab.node(node).namespace, ["nft", "list", "ruleset"])


def nft_table(lab: Lab, node: str, family: str, table: str) -> str:
    return in_ns(lab.node(node).namespace, ["nft", "list", "table", family, table])


def counted_rules(saved: str) -> list[tuple[str, int, int]]:
    """(rule, packets, bytes) for every ``[p:b] -A ...`` line of ``iptables-save -c``."""
    rows = []
    for line in saved.splitlines():
        m = re.fullmatch(r"\[(\d+):(\d+)\] (-A .*)", line)
        if m:
            rows.append((m.group(3), int(m.group(1)), int(m.group(2))))
    return rows


def source_seen(listen_ns: str, send_ns: str, dst_ip: str, timeout: float = 10.0) -> str:
    """The source address a UDP listener in ``listen_ns`` sees for a datagram sent from
    ``send_ns`` to ``dst_ip``: the sender's own address, or its node's when masqueraded."""
    port = str(20000 + secrets.randbelow(20000))
    listener = subprocess.Popen(
        ["ip", "netns", "exec", listen_ns, sys.executable, "-c", _LISTEN, port, str(timeout)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        in_ns(send_ns, [sys.executable, "-c", _SEND, dst_ip, port])
        out, err = listener.communicate(timeout=timeout + 5)
    finally:
        if listener.poll() is None:
            listener.kill()
            listener.wait()
    assert listener.returncode == 0, f"nothing reached {dst_ip}:{port} from {send_ns}: {err}"
    return out.strip()


def log_count(lab: Lab, node: str, needle: str) -> int:
    with open(lab.node(node).agent_log, encoding="utf-8", errors="replace") as f:
        return f.read().count(needle)


def restart(lab: Lab, node: str) -> None:
    lab.kill_agent(node)
    lab.start_agent(node)
    lab.wait_ready(node)
