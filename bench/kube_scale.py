"""Kubernetes mode at scale: many Nodes arrive, ours and flanneld side by side in one run.

    python -m bench.kube_scale [--nodes 1000] [--idle-seconds 60] [--changes 1000]

A 2-node ``--kube`` lab (a real kube-apiserver and controller-manager; vxlan): n1 runs
our agent, n2 the real flanneld, both with ``--kube-subnet-mgr``. The bench then creates
``--nodes`` more Node objects on the API server, one POST each over one kept-alive
connection, as a kubelet registers a Node but with what an agent would have written
already: a ``spec.podCIDR`` from the lab network and Flannel's annotations (vxlan, a
VTEP MAC of its own, a public IP nobody uses; no kubelet runs for them). Measured for
both nodes in the same run:

* **arrival**: seconds from the last create until the node's kernel routes every new
  podCIDR (a netlink route-event socket in each node's namespace stamps each route);
* **CPU during arrival**: utime + stime of the agent's process tree from the first
  create until its last route, plus 1 s;
* **RSS** after settling (5 s), and **idle CPU** over ``--idle-seconds``;
* **annotation changes**: every new Node's backend-data rewritten with a new VTEP MAC
  (``--changes`` PATCHes); seconds until every neighbour on ``flannel.1`` carries its
  new MAC, and the CPU until then plus 1 s;
* **one more Node**: seconds from its create until its route is in each kernel.

Ratios are ours / flanneld. Everything the bench made goes with the lab (``lab.down``).
The fake Nodes' public IPs (from 172.16.0.1) are never sent to: lab nodes have no
default route.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from ipaddress import IPv4Network
from typing import Any

from flannelpy_lab import Lab
from flannelpy_lab import kube as control_plane

from bench.common import (
    FakePeer,
    compile_agent,
    fake_peers,
    lab_name,
    lacks_root,
    load_average,
    ratio,
    say,
    table,
)
from bench.propagation import LAB_TIMEOUT, RouteWatch, node_sockets
from bench.versus_flanneld import cpu_seconds, rss_mib

NETWORK = "10.192.0.0/11"  # 8,192 /24s: room for 5,000 Nodes beside the lab's own
PREFIX = "flannel.alpha.coreos.com/"
IMPLS = ("ours", "flanneld")
ARRIVAL_TIMEOUT = 600.0
SETTLE = 5.0
CHANGE_POLL = 0.1


class Api:
    """kube-apiserver as cluster admin over one kept-alive HTTPS connection."""

    def __init__(self, lab: Lab) -> None:
        state = lab.state
        url = control_plane.api_url(state)
        host, port = url.split("//", 1)[1].rsplit(":", 1)
        ca = os.path.join(control_plane.kube_dir(state), "pki", "ca.crt")
        with open(control_plane.admin_kubeconfig(state), encoding="utf-8") as f:
            self.token = json.load(f)["users"][0]["user"]["token"]
        self.conn = http.client.HTTPSConnection(
            host, int(port), context=ssl.create_default_context(cafile=ca), timeout=30
        )

    def _request(self, method: str, path: str, body: bytes | None, content_type: str) -> bytes:
        headers = {"Authorization": f"Bearer {self.token}", "Content-Type": content_type}
        try:
            self.conn.request(method, path, body=body, headers=headers)
            resp = self.conn.getresponse()
        except (http.client.HTTPException, OSError):  # the server closed an idle connection
            self.conn.close()
            self.conn.request(method, path, body=body, headers=headers)
            resp = self.conn.getresponse()
        data = resp.read()
        if resp.status >= 300:
            raise SystemExit(f"{method} {path}: {resp.status} {data[:300]!r}")
        return data

    def send(self, method: str, path: str, doc: Any, content_type: str) -> None:
        self._request(method, path, json.dumps(doc).encode(), content_type)

    def get_text(self, path: str) -> str:
        """GET ``path`` (``/metrics``, a list) as text."""
        return self._request("GET", path, None, "application/json").decode()

    def create_node(self, peer: FakePeer, name: str) -> None:
        self.send("POST", "/api/v1/nodes", node_manifest(peer, name), "application/json")

    def set_vtep_mac(self, peer: FakePeer, name: str) -> None:
        patch = {"metadata": {"annotations": {PREFIX + "backend-data": backend_data(peer)}}}
        path = f"/api/v1/nodes/{name}"
        self.send("PATCH", path, patch, "application/strategic-merge-patch+json")

    def close(self) -> None:
        self.conn.close()


def backend_data(peer: FakePeer) -> str:
    return json.dumps({"VNI": 1, "VtepMAC": peer.vtep_mac}, separators=(",", ":"))


def node_manifest(peer: FakePeer, name: str) -> dict[str, Any]:
    """A Node as its kubelet registers it, with the podCIDR and the annotations its
    agent would have written."""
    doc = control_plane.node_manifest(name, str(peer.public_ip))
    doc["metadata"]["annotations"].update(
        {
            PREFIX + "kube-subnet-manager": "true",
            PREFIX + "backend-type": "vxlan",
            PREFIX + "backend-data": backend_data(peer),
            PREFIX + "public-ip": str(peer.public_ip),
        }
    )
    doc["spec"] = {"podCIDR": str(peer.subnet), "podCIDRs": [str(peer.subnet)]}
    return doc


def fake_name(peer: FakePeer) -> str:
    return "fake-" + str(peer.subnet.network_address).replace(".", "-")


def free_subnets(lab: Lab, count: int) -> list[IPv4Network]:
    taken = {IPv4Network(c) for c in control_plane.pod_cidrs(lab.state).values() if c}
    free = []
    for subnet in IPv4Network(lab.state.network).subnets(new_prefix=24):
        if not any(subnet.overlaps(t) for t in taken):
            free.append(subnet)
        if len(free) == count:
            return free
    raise SystemExit(f"only {len(free)} free /24s in {lab.state.network} for {count} Nodes")


@dataclass
class Side:
    impl: str
    node: str
    pid: int
    created: float = 0.0  # seconds the creates took (the same for both sides)
    arrival: float = 0.0
    arrival_cpu: float = 0.0
    rss: float = 0.0
    idle_cpu: float = 0.0
    change_seconds: float = 0.0
    change_cpu: float = 0.0
    one_more: float = 0.0
    missing: list[str] = field(default_factory=list)


def neigh_macs(lab: Lab, node: str) -> dict[str, str]:
    """VTEP address -> MAC of the permanent neighbours on flannel.1 of ``node``."""
    out = subprocess.run(
        ["ip", "-n", lab.node(node).namespace, "-4", "neigh", "show", "dev", "flannel.1"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    macs = {}
    for line in out.splitlines():
        parts = line.split()
        if "lladdr" in parts and "PERMANENT" in parts:
            macs[parts[0]] = parts[parts.index("lladdr") + 1].lower()
    return macs


def arrive(
    lab: Lab, api: Api, peers: Sequence[FakePeer], sides: Sequence[Side], watch: RouteWatch
) -> float:
    """Create a Node per peer; each side's time from the last create to its last route."""
    cpu0 = {s.impl: cpu_seconds(s.pid) for s in sides}
    t0 = time.monotonic()
    for peer in peers:
        api.create_node(peer, fake_name(peer))
    created = time.monotonic()
    for side in sides:
        last = created
        for peer in peers:
            seen = watch.wait_all([side.node], peer.subnet, True, ARRIVAL_TIMEOUT)
            if not seen:
                side.missing.append(str(peer.subnet))
                continue
            last = max(last, seen[side.node])
        side.arrival = last - created
    time.sleep(1.0)
    for side in sides:  # CPU from the first create until the later of the two ended, + 1 s
        side.arrival_cpu = cpu_seconds(side.pid) - cpu0[side.impl]
    return created - t0


def change_macs(lab: Lab, api: Api, peers: Sequence[FakePeer], sides: Sequence[Side]) -> None:
    moved = [FakePeer(p.subnet, p.public_ip, "02:fc" + p.vtep_mac[5:]) for p in peers]
    want = {str(p.subnet.network_address): p.vtep_mac for p in moved}
    cpu0 = {s.impl: cpu_seconds(s.pid) for s in sides}
    t0 = time.monotonic()
    for peer in moved:
        api.set_vtep_mac(peer, fake_name(peer))
    pending = list(sides)
    while pending:
        for side in list(pending):
            macs = neigh_macs(lab, side.node)
            if all(macs.get(ip) == mac for ip, mac in want.items()):
                side.change_seconds = time.monotonic() - t0
                pending.remove(side)
        if time.monotonic() - t0 > ARRIVAL_TIMEOUT:
            raise SystemExit(f"neighbours kept their old MACs on {[s.node for s in pending]}")
        time.sleep(CHANGE_POLL)
    time.sleep(1.0)
    for side in sides:
        side.change_cpu = cpu_seconds(side.pid) - cpu0[side.impl]


def run(nodes: int, idle: float, changes: int, say: Callable[[str], None]) -> list[Side]:
    compile_agent()
    name = lab_name("ks")
    say(f"bringing up lab {name}: 2 nodes (n2 flanneld), Kubernetes mode, {NETWORK}")
    lab = Lab.up(
        name, 2, "vxlan", network=NETWORK, kube=True, flanneld_nodes=1,
        timeout=LAB_TIMEOUT, progress=say,
    )  # fmt: skip
    try:
        sides = []
        for impl, node in zip(IMPLS, ("n1", "n2"), strict=True):
            pid = lab.node(node).agent_pid
            assert pid is not None, f"{node} runs no agent"
            sides.append(Side(impl, node, pid))
        free = free_subnets(lab, nodes + 1)
        peers = fake_peers(nodes + 1, free)
        extra, peers = peers[-1], peers[:-1]
        api = Api(lab)
        try:
            with node_sockets(lab) as sockets, RouteWatch(sockets, None) as watch:
                say(f"creating {nodes} Nodes")
                took = arrive(lab, api, peers, sides, watch)
                for side in sides:
                    side.created = took
                say(f"{nodes} Nodes created in {took:.1f} s; " + ", ".join(
                    f"{s.impl} routed them all {s.arrival:.2f} s after the last" for s in sides
                ))  # fmt: skip
                time.sleep(SETTLE)
                for side in sides:
                    side.rss = rss_mib(side.pid)
                cpu0 = {s.impl: cpu_seconds(s.pid) for s in sides}
                say(f"idle for {idle:g} s")
                time.sleep(idle)
                for side in sides:
                    side.idle_cpu = cpu_seconds(side.pid) - cpu0[side.impl]
                say(f"rewriting {min(changes, nodes)} Nodes' VTEP MACs")
                change_macs(lab, api, peers[:changes], sides)
                time.sleep(SETTLE)
                t0 = time.monotonic()
                api.create_node(extra, fake_name(extra))
                for side in sides:
                    seen = watch.wait_all([side.node], extra.subnet, True, 30.0)
                    side.one_more = seen[side.node] - t0 if seen else float("nan")
                if watch.overflows:
                    say(f"warning: {watch.overflows} netlink receive overflows")
        finally:
            api.close()
        return sides
    finally:
        lab.down()


def report(sides: Sequence[Side], nodes: int, load: str) -> str:
    by = {s.impl: s for s in sides}
    rows: list[list[object]] = []
    for label, attr in (
        (f"{nodes} new Nodes' routes in the kernel, after the last create (s)", "arrival"),
        ("CPU from the first create until routed, + 1 s (s)", "arrival_cpu"),
        ("RSS after settling (MiB)", "rss"),
        ("idle CPU (s)", "idle_cpu"),
        ("annotation changes applied (s)", "change_seconds"),
        ("CPU for the annotation changes (s)", "change_cpu"),
        ("one more Node -> its route (s)", "one_more"),
    ):  # fmt: skip
        ours, theirs = getattr(by["ours"], attr), getattr(by["flanneld"], attr)
        rows.append([label, ours, theirs, ratio(ours, theirs)])
    lines = [
        "ratio = ours / flanneld",
        table(["", "ours", "flanneld", "ratio"], rows),
        f"{nodes} Nodes created in {sides[0].created:.1f} s; load average at start {load}",
    ]
    for s in sides:
        if s.missing:
            lines.append(f"{s.impl}: {len(s.missing)} routes never appeared")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.kube_scale",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--nodes", type=int, default=1000, help="Node objects created")
    parser.add_argument("--idle-seconds", type=float, default=60.0)
    parser.add_argument("--changes", type=int, default=1000, help="Nodes whose MAC changes")
    args = parser.parse_args(argv)
    if lacks_root("bench.kube_scale"):
        return 2
    if not 1 <= args.nodes <= 8000:
        print("--nodes must be between 1 and 8000", file=sys.stderr)
        return 2

    load = load_average()
    try:
        sides = run(args.nodes, args.idle_seconds, args.changes, say)
    except KeyboardInterrupt:  # the lab is gone already
        return 130
    print(report(sides, args.nodes, load))
    return 0


if __name__ == "__main__":
    sys.exit(main())
