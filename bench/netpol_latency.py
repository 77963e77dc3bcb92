"""NetworkPolicy enforcement latency against the real API server: from a change to the
first new connection that reflects it.

    python -m bench.netpol_latency [--changes 100]

A 2-node ``--kube --enable-network-policy`` lab, one pod per node made by the real CNI
executable: a TCP server ("db", n1) and a client ("web", n2) opening a new connection
every 5 ms (``flannelpy_lab.tcp_probe``). Their Pod objects are written as a kubelet
would. The changes alternate in the order policy, policy, label, label: the policy
selecting db is edited between allowing web and allowing nothing, and web's ``app``
label between what the policy allows and something else, so each change flips whether
web may connect. Per change, the latency is the start of the first connection (after
the change was sent) whose outcome is the new one: a completed handshake after an
allowing change, a SYN dropped (no answer in 0.5 s) after a denying one. Resolution: the
5 ms between connections.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from flannelpy_lab import Lab
from flannelpy_lab import kube as control_plane
from flannelpy_lab.tcp_probe import Client, connect_loop, serve, stop_process

from bench.common import lacks_root, load_average, percentile, say, table
from bench.kube_scale import Api
from bench.propagation import LAB_TIMEOUT

NS = "bench"
PORT = 8080
INTERVAL = 0.005
GIVE_UP = 0.5
REFLECT_TIMEOUT = 30.0
POLICY_PATH = f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies"


def policy_doc(allow_web: bool) -> dict[str, Any]:
    ingress = [{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}]}] if allow_web else []
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "db", "namespace": NS},
        "spec": {
            "podSelector": {"matchLabels": {"app": "db"}},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def setup(lab: Lab, api: Api) -> dict[str, str]:
    """The namespace, the two Pod objects with their addresses, the allowing policy."""
    api.send("POST", "/api/v1/namespaces", {"metadata": {"name": NS}}, "application/json")
    api.send("POST", f"/api/v1/namespaces/{NS}/serviceaccounts",
             {"metadata": {"name": "default"}}, "application/json")  # fmt: skip
    ips = {}
    for name, node in (("db", "n1"), ("web", "n2")):
        pod = next(p for p in lab.pods if p.node == node)
        ip = (pod.address or "").split("/")[0]
        ips[name] = ip
        doc = control_plane.pod_manifest(NS, name, node, {"app": name})
        api.send("POST", f"/api/v1/namespaces/{NS}/pods", doc, "application/json")
        status = control_plane.pod_running_status(ip)
        api.send("PATCH", f"/api/v1/namespaces/{NS}/pods/{name}/status", status,
                 "application/merge-patch+json")  # fmt: skip
    api.send("POST", POLICY_PATH, policy_doc(True), "application/json")
    return ips


def reflected(client: Client, since: float, allowed: bool) -> float | None:
    """Start time of the first connection since ``since`` with the outcome ``allowed``
    gives; None while there is none (a dropped one shows only after GIVE_UP)."""
    for t, outcome in client.since(since):
        if (outcome == "ok") == allowed:
            return t
    return None


def run(changes: int) -> dict[str, list[float]]:
    name = "nl" + secrets.token_hex(2)
    say(f"bringing up lab {name}: 2 nodes, Kubernetes mode, NetworkPolicy on")
    lab = Lab.up(name, 2, "vxlan", kube=True, network_policy=True, pods_per_node=1,
                 timeout=LAB_TIMEOUT, progress=say)  # fmt: skip
    latencies: dict[str, list[float]] = {"policy edit": [], "label change": []}
    try:
        api = Api(lab)
        db = next(p for p in lab.pods if p.node == "n1")
        web = next(p for p in lab.pods if p.node == "n2")
        server = serve(db.namespace, PORT)
        try:
            ips = setup(lab, api)
            with tempfile.TemporaryDirectory() as tmp:
                client = connect_loop(web.namespace, ips["db"], PORT, Path(tmp), INTERVAL, GIVE_UP)
                try:
                    # Since a fixed time: a connection shows in the log only once it ended.
                    deadline, since = time.monotonic() + REFLECT_TIMEOUT, time.time()
                    while reflected(client, since, True) is None:
                        if time.monotonic() > deadline:
                            raise SystemExit("web never reached db under the allowing policy")
                        time.sleep(0.1)
                    measure(api, client, changes, latencies)
                finally:
                    client.stop()
        finally:
            stop_process(server)
            api.close()
    finally:
        lab.down()
    return latencies


def measure(api: Api, client: Client, changes: int, latencies: dict[str, list[float]]) -> None:
    policy_allows, label_allowed = True, True
    for i in range(changes):
        if i % 4 in (0, 1):
            kind = "policy edit"
            policy_allows = not policy_allows
            t0 = time.time()
            api.send("PUT", f"{POLICY_PATH}/db", policy_doc(policy_allows), "application/json")
        else:
            kind = "label change"
            label_allowed = not label_allowed
            patch = {"metadata": {"labels": {"app": "web" if label_allowed else "other"}}}
            t0 = time.time()
            api.send("PATCH", f"/api/v1/namespaces/{NS}/pods/web", patch,
                     "application/merge-patch+json")  # fmt: skip
        allowed = policy_allows and label_allowed
        deadline = time.monotonic() + REFLECT_TIMEOUT
        while (seen := reflected(client, t0, allowed)) is None:
            if time.monotonic() > deadline:
                raise SystemExit(f"change {i} ({kind}) not reflected in {REFLECT_TIMEOUT:g} s")
            time.sleep(0.05)
        latencies[kind].append(seen - t0)
        time.sleep(GIVE_UP + 0.1)  # the connections of the old state have ended


def report(latencies: dict[str, list[float]]) -> str:
    rows: list[list[object]] = []
    every = [v for values in latencies.values() for v in values]
    for kind, values in [*latencies.items(), ("all", every)]:
        ms = [v * 1000 for v in values]
        rows.append([kind, len(ms), round(percentile(ms, 50), 1), round(percentile(ms, 99), 1),
                     round(max(ms), 1)])  # fmt: skip
    return table(["change", "n", "p50 (ms)", "p99 (ms)", "max (ms)"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.netpol_latency",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--changes", type=int, default=100, help="changes (default 100)")
    args = parser.parse_args(argv)
    if lacks_root("bench.netpol_latency"):
        return 2
    load = load_average()
    print(report(run(args.changes)))
    print(json.dumps({"load_average_at_start": load}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
