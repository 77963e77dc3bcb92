"""NetworkPolicy at scale against the real API server: an agent's first sync, its RSS, and
what one label change costs the kernel.

    python -m bench.netpol_scale [--pods 5000] [--policies 1000] [--namespaces 50]

A 1-node ``--kube --enable-network-policy`` lab (a real kube-apiserver). The bench
creates ``--namespaces`` Namespaces, ``--pods`` Pod objects (a ``--local`` share of them
bound to n1, the rest spread over 100 node names no kubelet serves: the API server
accepts them) with their status written as a kubelet writes it (Running, one address),
and ``--policies`` NetworkPolicies, each selecting one ``app`` of its namespace and
allowing ingress from another app and from a team of namespaces on a named port, and
egress to one tier. Then:

* **first sync**: n1's agent is restarted; seconds from its start until it logs the
  policy sync and until its table holds the compiled elements, and its CPU until then;
* **RSS** after settling;
* **one label change**: a pod that is a peer of n1's rules changes its ``app``; the nft
  set elements that differ in n1's table before and after (they must not grow with the
  cluster), the seconds until the kernel has it (the element's event on ``nft monitor``
  in n1's namespace, started before the change; also until a listing every 0.2 s shows
  it, which a listing of 10,000 elements itself delays), and the agent's CPU for it.

Everything goes with the lab. Over one kept-alive HTTPS connection, as ``bench.kube_scale``.
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from flannelpy_lab import Lab
from flannelpy_lab import kube as control_plane

from bench.common import lacks_root, load_average, say, table
from bench.kube_scale import Api
from bench.propagation import LAB_TIMEOUT
from bench.versus_flanneld import cpu_seconds, rss_mib

APPS = 20
TEAMS = 5
FAKE_NODES = 100
TABLE = ("inet", "flannelpy-policy")
POLL = 0.05
NFT_POLL = 0.2  # between two listings of the table: each costs CPU the agent competes for


def pod_doc(i: int, namespaces: int, node: str) -> dict[str, Any]:
    labels = {"app": f"app{i % APPS}", "tier": str(i % 3)}
    return control_plane.pod_manifest(f"ns{i % namespaces}", f"p{i}", node, labels, {"http": 8080})


def pod_ip(i: int) -> str:
    return f"10.{100 + i // 65536}.{(i // 256) % 256}.{i % 256}"


def policy_doc(j: int, namespaces: int) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"pol{j}", "namespace": f"ns{j % namespaces}"},
        "spec": {
            "podSelector": {"matchLabels": {"app": f"app{j % APPS}"}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": f"app{(j + 1) % APPS}"}}},
                                  {"namespaceSelector": {"matchLabels": {"team": str(j % TEAMS)}}}],
                         "ports": [{"port": "http"}, {"port": 5432}]}],
            "egress": [{"to": [{"podSelector": {"matchLabels": {"tier": str(j % 3)}}}]}],
        },
    }  # fmt: skip


def elements(lab: Lab) -> set[tuple[str, str]]:
    """(set, element) of every set and map of n1's policy table."""
    proc = lab.exec("n1", ["nft", "-j", "list", "table", *TABLE], check=False, timeout=60)
    if proc.returncode != 0:
        return set()
    found = set()
    for item in json.loads(proc.stdout)["nftables"]:
        body = item.get("set") or item.get("map")
        for element in (body or {}).get("elem", []):
            found.add((body["name"], json.dumps(element, sort_keys=True)))
    return found


class ElementEvents:
    """``nft monitor new elements`` in a node's namespace: each line with when it came."""

    def __init__(self, lab: Lab, node: str) -> None:
        argv = ["ip", "netns", "exec", lab.node(node).namespace, "nft", "monitor", "new",
                "elements"]  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True)  # fmt: skip
        self.lines: list[tuple[float, str]] = []
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line))

    def first(self, text: str) -> float | None:
        return next((t for t, line in list(self.lines) if text in line), None)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(10)
        self.thread.join(5)


def agent_log(lab: Lab) -> str:
    with open(lab.node("n1").agent_log, encoding="utf-8", errors="replace") as f:
        return f.read()


def wait(check: Callable[[], bool], timeout: float, what: str, poll: float = POLL) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise SystemExit(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(poll)
    return time.monotonic()


def populate(lab: Lab, api: Api, args: argparse.Namespace, say: Callable[[str], None]) -> None:
    t0 = time.monotonic()
    for n in range(args.namespaces):
        labels = {"team": str(n % TEAMS)}
        api.send(
            "POST",
            "/api/v1/namespaces",
            {"metadata": {"name": f"ns{n}", "labels": labels}},
            "application/json",
        )
        api.send("POST", f"/api/v1/namespaces/ns{n}/serviceaccounts",
                 {"metadata": {"name": "default"}}, "application/json")  # fmt: skip
    for i in range(args.pods):
        node = "n1" if i < args.local else f"fake-{i % FAKE_NODES}"  # n1's spread out
        doc = pod_doc(i, args.namespaces, node)
        ns, name = doc["metadata"]["namespace"], doc["metadata"]["name"]
        api.send("POST", f"/api/v1/namespaces/{ns}/pods", doc, "application/json")
        status = control_plane.pod_running_status(pod_ip(i))
        api.send("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}/status", status,
                 "application/merge-patch+json")  # fmt: skip
    for j in range(args.policies):
        doc = policy_doc(j, args.namespaces)
        ns = doc["metadata"]["namespace"]
        api.send("POST", f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies", doc,
                 "application/json")  # fmt: skip
    say(f"{args.pods} pods and {args.policies} policies created in {time.monotonic() - t0:.1f} s")


def run(args: argparse.Namespace, say: Callable[[str], None]) -> list[list[object]]:
    name = "np" + secrets.token_hex(2)
    say(f"bringing up lab {name}: 1 node, Kubernetes mode, NetworkPolicy on")
    lab = Lab.up(
        name, 1, "vxlan", kube=True, network_policy=True, timeout=LAB_TIMEOUT, progress=say
    )
    try:
        api = Api(lab)
        try:
            populate(lab, api, args, say)
            lab.kill_agent("n1")
            before = agent_log(lab).count("network policy synced")
            rebuilt = agent_log(lab).count("policy table rebuilt")
            t0 = time.monotonic()
            lab.start_agent("n1")
            pid = lab.node("n1").agent_pid
            assert pid is not None
            synced = wait(lambda: agent_log(lab).count("network policy synced") > before,
                          600, "the policy sync")  # fmt: skip
            count = {"n": 0}

            def written() -> bool:
                count["n"] = len(elements(lab))
                return agent_log(lab).count("policy table rebuilt") > rebuilt and count["n"] > 0

            in_kernel = wait(written, 600, "the table in the kernel", NFT_POLL)
            sync_cpu = cpu_seconds(pid)
            time.sleep(5.0)
            rss = rss_mib(pid)
            # One label change making a pod a peer of n1's rules: p<local> (of ns0, tier 2
            # with the default sizes) moves to tier 0, which pol0 (selecting n1's p0, app0
            # of ns0) lets its pods reach: one element more in that rule's set.
            first = elements(lab)
            events = ElementEvents(lab, "n1")
            try:
                time.sleep(0.5)  # the monitor subscribed
                cpu0 = cpu_seconds(pid)
                t1 = time.monotonic()
                target = args.local
                path = f"/api/v1/namespaces/ns{target % args.namespaces}/pods/p{target}"
                patch = {"metadata": {"labels": {"tier": "0"}}}
                api.send("PATCH", path, patch, "application/merge-patch+json")
                changed = {"d": 0}

                def shown() -> bool:
                    changed["d"] = len(first ^ elements(lab))
                    return changed["d"] > 0

                applied = wait(shown, 120, "the label change in the table", NFT_POLL)
                time.sleep(1.0)
                change_cpu = cpu_seconds(pid) - cpu0
                diff = len(first ^ elements(lab))
                in_kernel_exact = events.first(pod_ip(target))
            finally:
                events.stop()
            if in_kernel_exact is None:
                raise SystemExit(f"nft monitor showed no element for {pod_ip(target)}")
        finally:
            api.close()
    finally:
        lab.down()
    return [
        ["first sync: start -> policies, pods, namespaces read (s)", round(synced - t0, 2)],
        ["first sync: start -> table in the kernel (s)", round(in_kernel - t0, 2)],
        ["elements in n1's table", count["n"]],
        ["CPU from start until the table is in (s)", round(sync_cpu, 2)],
        ["RSS after settling (MiB)", round(rss, 1)],
        ["one label change -> in the kernel, nft monitor (s)", round(in_kernel_exact - t1, 3)],
        ["one label change -> seen by a listing every 0.2 s (s)", round(applied - t1, 3)],
        ["nft elements changed by it", diff],
        ["CPU for it, + 1 s (s)", round(change_cpu, 2)],
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.netpol_scale",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    for flag, default, text in (
        ("--pods", 5000, "Pod objects"),
        ("--policies", 1000, "NetworkPolicies"),
        ("--namespaces", 50, "namespaces they spread over"),
        ("--local", 50, "pods bound to n1"),
    ):
        parser.add_argument(flag, type=int, default=default, help=f"{text} (default {default})")
    args = parser.parse_args(argv)
    if lacks_root("bench.netpol_scale"):
        return 2

    load = load_average()
    rows = run(args, say)
    print(table(["", "ours"], rows))
    print(f"{args.pods} pods ({args.local} on n1), {args.policies} policies, "
          f"{args.namespaces} namespaces; load average at start {load}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
