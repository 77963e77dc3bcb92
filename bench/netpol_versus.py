"""NetworkPolicy, ours beside Flannel's own answer (kube-network-policies) in one lab and one
run: enforcement latency, and the cost on the packet path.

    python -m bench.netpol_versus [--changes 104] [--connects 2000] [--repeat 3]

One 4-node ``--kube --enable-network-policy --flanneld-nodes 2`` lab: n1 and n2 run our
agent (policy in nftables, in the kernel), n3 and n4 run the real flanneld with
kube-network-policies beside it as Flannel's chart runs it (``flannelpy_lab.kube_netpol``:
the first packet of each connection of a selected pod goes to an NFQUEUE and is decided in
userspace). Two pods per node, made by each side's CNI plugin; their Pod objects are
written as a kubelet would. Ours and the reference see the same API server, the same
objects and the same changes, under the same load.

Latency (namespace ``bench``): a server "db" on n1 and on n3, a client "web" on n2 and on
n4 opening a new connection to its side's db every 5 ms (``flannelpy_lab.tcp_probe``).
One policy ``db`` selects both dbs. A cycle of eight changes, each flipping whether web may
connect: the policy edited to allow nothing, edited back to allow ``app=web``, web's
label changed to ``other``, the policy deleted (db not isolated), created again allowing
``app=web`` (db isolated, web's label not allowed), web's label back to ``web``, web's Pod
object deleted (its address no longer a pod's), and web as a new pod: its Pod object
created again, then given its address as a kubelet does after the CNI ADD. A policy
change is one API write both sides see; a pod change is one write per web pod (sent back
to back, the order alternating), each timed from its own write (a new pod from the write
of its address, before which no implementation can know it). Per change and side: the
start of the first connection after the write whose outcome is the new one (a completed
handshake, or a SYN dropped: no answer in 0.5 s). Resolution 5 ms.

Packet path (namespace ``perf``): a server pod on n1 and n3, a client pod on n2 and n4,
all ``app=perf``. Two conditions: no policy, and ``--policies`` policies each selecting
all four pods for ingress and egress (each allows ``app=perf`` on the bench's ports and one
port of its own). A condition is in force on both sides once a connection to a port no
policy allows is dropped (with policies) or refused (without). Per condition, side and
repeat: ``--connects`` sequential TCP connects from client to server (``connect()`` to
its return, a new connection each), then one ``iperf3`` TCP stream for ``--seconds``, then
that stream again at the same time as one between a second pair of pods on the same
nodes that no policy selects (namespace ``perf0``): both share the same cores at the
same moment, so the ratio of the two is the policies' cost to throughput without the
drift between runs that a shared machine gives a sequential comparison (with no policy
it shows what the method's own bias is).
Conditions and sides alternate their order between repeats.
"""

from __future__ import annotations

import argparse
import json
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from flannelpy_lab import Lab, kube_netpol, procs
from flannelpy_lab import kube as control_plane
from flannelpy_lab.state import PodInfo
from flannelpy_lab.tcp_probe import Client, connect_loop, serve, stop_process

from bench import throughput
from bench.common import lacks_root, load_average, median, percentile, say, table
from bench.kube_scale import Api
from bench.netpol_latency import GIVE_UP, INTERVAL, PORT, REFLECT_TIMEOUT, policy_doc, reflected
from bench.propagation import LAB_TIMEOUT

SIDES = ("ours", "kube-network-policies")
NODES = {"ours": ("n1", "n2"), "kube-network-policies": ("n3", "n4")}  # (server, client)
T = TypeVar("T")
NS, PERF_NS, PERF0_NS = "bench", "perf", "perf0"
POLICY_PATH = f"/apis/networking.k8s.io/v1/namespaces/{NS}/networkpolicies"
PERF_POLICY_PATH = f"/apis/networking.k8s.io/v1/namespaces/{PERF_NS}/networkpolicies"
DELETE = {"apiVersion": "v1", "kind": "DeleteOptions"}
CLOSED_PORT = 9  # no policy allows it and nothing listens: dropped when isolated, else RST
# One cycle: (kind, what it does); each change flips whether web may connect.
CYCLE = (
    ("policy edit", "deny"),
    ("policy edit", "allow"),
    ("label change", "other"),
    ("policy delete", ""),
    ("policy create", "allow"),
    ("label change", "web"),
    ("pod delete", ""),
    ("new pod", "web"),
)
KINDS = ("policy edit", "label change", "policy create", "policy delete", "pod delete", "new pod")
POD_KINDS = ("label change", "pod delete", "new pod")  # one write per side's web pod
FORCE_DELETE = {**DELETE, "gracePeriodSeconds": 0}  # no kubelet here to confirm a graceful one

CONNECTS = """
import json, socket, sys, time
host, port, count = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
times, failed = [], 0
for _ in range(count):
    s = socket.socket()
    s.settimeout(2.0)
    t = time.perf_counter()
    try:
        s.connect((host, port))
        times.append(time.perf_counter() - t)
    except OSError:
        failed += 1
    s.close()
    time.sleep(0.001)
print(json.dumps({"times": times, "failed": failed}))
"""

PROBE = """
import socket, sys
s = socket.socket()
s.settimeout(0.5)
try:
    s.connect((sys.argv[1], int(sys.argv[2])))
    print("ok")
except ConnectionRefusedError:
    print("refused")
except OSError:
    print("lost")
"""


def ip_of(pod: PodInfo) -> str:
    return (pod.address or "").split("/")[0]


def perf_policy(index: int) -> dict[str, Any]:
    perf = [{"podSelector": {"matchLabels": {"app": "perf"}}}]
    ports = [{"port": PORT}, {"port": throughput.PORT}, {"port": 20000 + index}]
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": f"perf-{index:03d}", "namespace": PERF_NS},
        "spec": {
            "podSelector": {"matchLabels": {"app": "perf"}},
            "policyTypes": ["Ingress", "Egress"],
            "ingress": [{"from": perf, "ports": ports}],
            "egress": [{"to": perf, "ports": ports}],
        },
    }


def write_pod(api: Api, ns: str, name: str, pod: PodInfo, labels: dict[str, str]) -> float:
    """Create the Pod object, then give it its address; returns when that second write began."""
    api.send(
        "POST",
        f"/api/v1/namespaces/{ns}/pods",
        control_plane.pod_manifest(ns, name, pod.node, labels),
        "application/json",
    )
    addressed = time.time()
    api.send("PATCH", f"/api/v1/namespaces/{ns}/pods/{name}/status",
             control_plane.pod_running_status(ip_of(pod)),
             "application/merge-patch+json")  # fmt: skip
    return addressed


def setup(lab: Lab, api: Api) -> dict[str, dict[str, PodInfo]]:
    """Both namespaces with their Pod objects; the pods by side and role."""
    roles: dict[str, dict[str, PodInfo]] = {}
    for ns in (NS, PERF_NS, PERF0_NS):
        api.send("POST", "/api/v1/namespaces", {"metadata": {"name": ns}}, "application/json")
        api.send("POST", f"/api/v1/namespaces/{ns}/serviceaccounts",
                 {"metadata": {"name": "default"}}, "application/json")  # fmt: skip
    for side in SIDES:
        server, client = ([p for p in lab.pods if p.node == n] for n in NODES[side])
        roles[side] = {"db": server[0], "web": client[0], "srv": server[1], "cli": client[1],
                       "srv0": server[2], "cli0": client[2]}  # fmt: skip
        suffix = "o" if side == "ours" else "k"
        write_pod(api, NS, f"db-{suffix}", server[0], {"app": "db"})
        write_pod(api, NS, f"web-{suffix}", client[0], {"app": "web"})
        write_pod(api, PERF_NS, f"srv-{suffix}", server[1], {"app": "perf"})
        write_pod(api, PERF_NS, f"cli-{suffix}", client[1], {"app": "perf"})
        write_pod(api, PERF0_NS, f"srv-{suffix}", server[2], {"app": "perf"})
        write_pod(api, PERF0_NS, f"cli-{suffix}", client[2], {"app": "perf"})
    api.send("POST", POLICY_PATH, policy_doc(True), "application/json")
    return roles


# -- enforcement latency -------------------------------------------------------------------


def wait_allowed(clients: dict[str, Client]) -> None:
    deadline, since = time.monotonic() + REFLECT_TIMEOUT, time.time()
    for side, client in clients.items():
        while reflected(client, since, True) is None:
            if time.monotonic() > deadline:
                raise SystemExit(f"{side}: web never reached db under the allowing policy")
            time.sleep(0.1)


def send_change(
    api: Api, roles: dict[str, dict[str, PodInfo]], i: int, kind: str, arg: str
) -> dict[str, float]:
    """Send change ``i``; the time of the write each side's outcome is timed from."""
    if kind in POD_KINDS:
        order = SIDES if i % 2 == 0 else SIDES[::-1]
        sent = {}
        for side in order:
            name = "web-o" if side == "ours" else "web-k"
            path = f"/api/v1/namespaces/{NS}/pods/{name}"
            if kind == "new pod":
                sent[side] = write_pod(api, NS, name, roles[side]["web"], {"app": arg})
                continue
            sent[side] = time.time()
            if kind == "pod delete":
                api.send("DELETE", path, FORCE_DELETE, "application/json")
            else:
                api.send("PATCH", path, {"metadata": {"labels": {"app": arg}}},
                         "application/merge-patch+json")  # fmt: skip
        return sent
    t0 = time.time()
    if kind == "policy edit":
        api.send("PUT", f"{POLICY_PATH}/db", policy_doc(arg == "allow"), "application/json")
    elif kind == "policy delete":
        api.send("DELETE", f"{POLICY_PATH}/db", DELETE, "application/json")
    else:
        api.send("POST", POLICY_PATH, policy_doc(True), "application/json")
    return dict.fromkeys(SIDES, t0)


# The policy ("allow" app=web, "deny", None: none), web's label, whether web's Pod exists.
State = tuple[str | None, str, bool]
START: State = ("allow", "web", True)


def after(state: State, kind: str, arg: str) -> State:
    """The state a change of CYCLE leaves."""
    policy, label, exists = state
    if kind == "label change":
        return policy, arg, exists
    if kind in ("pod delete", "new pod"):
        return policy, label, kind == "new pod"
    return (None if kind == "policy delete" else arg), label, exists


def may_connect(state: State) -> bool:
    """May web connect to db: db is not isolated, or its policy allows web's label (and
    web's address is a pod's: an address no Pod object holds matches no selector)."""
    policy, label, exists = state
    return policy is None or (policy == "allow" and label == "web" and exists)


def measure_latency(
    api: Api, roles: dict[str, dict[str, PodInfo]], clients: dict[str, Client], changes: int
) -> dict[str, dict[str, list[float]]]:
    latencies: dict[str, dict[str, list[float]]] = {s: {k: [] for k in KINDS} for s in SIDES}
    state = START
    for i in range(changes):
        kind, arg = CYCLE[i % len(CYCLE)]
        sent = send_change(api, roles, i, kind, arg)
        state = after(state, kind, arg)
        allowed = may_connect(state)
        deadline = time.monotonic() + REFLECT_TIMEOUT
        for side, client in clients.items():
            while (seen := reflected(client, sent[side], allowed)) is None:
                if time.monotonic() > deadline:
                    raise SystemExit(f"{side}: change {i} ({kind}) not reflected in time")
                time.sleep(0.05)
            latencies[side][kind].append(seen - sent[side])
        if (i + 1) % 12 == 0:
            say(f"      {i + 1}/{changes} changes")
        time.sleep(GIVE_UP + 0.1)  # the connections of the old state have ended
    return latencies


def run_latency(
    roles: dict[str, dict[str, PodInfo]], api: Api, changes: int
) -> dict[str, dict[str, list[float]]]:
    servers = [serve(roles[side]["db"].namespace, PORT) for side in SIDES]
    try:
        with tempfile.TemporaryDirectory() as tmp:
            clients: dict[str, Client] = {}
            try:
                for side in SIDES:
                    workdir = Path(tmp) / side
                    workdir.mkdir()
                    web, db = roles[side]["web"], roles[side]["db"]
                    clients[side] = connect_loop(web.namespace, ip_of(db), PORT, workdir,
                                                 INTERVAL, GIVE_UP)  # fmt: skip
                wait_allowed(clients)
                return measure_latency(api, roles, clients, changes)
            finally:
                for client in clients.values():
                    client.stop()
    finally:
        for server in servers:
            stop_process(server)


# -- packet path ---------------------------------------------------------------------------


def in_pod(pod: PodInfo, code: str, *args: str, timeout: float = 120.0) -> str:
    argv = ["ip", "netns", "exec", pod.namespace, "python3", "-c", code, *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                          check=True).stdout.strip()  # fmt: skip


def set_condition(
    api: Api, roles: dict[str, dict[str, PodInfo]], policies: int, current: int
) -> None:
    """Go from ``current`` to ``policies`` policies in ``perf`` (0: none) and wait until
    both sides enforce the condition."""
    if policies != current:
        api.send("DELETE", PERF_POLICY_PATH, DELETE, "application/json")
        for index in range(policies):
            api.send("POST", PERF_POLICY_PATH, perf_policy(index), "application/json")
    expected = "lost" if policies else "refused"
    deadline = time.monotonic() + REFLECT_TIMEOUT
    for side in SIDES:
        cli, srv = roles[side]["cli"], roles[side]["srv"]
        while in_pod(cli, PROBE, ip_of(srv), str(CLOSED_PORT)) != expected:
            if time.monotonic() > deadline:
                raise SystemExit(f"{side}: {policies} policies not in force in time")
            time.sleep(0.2)
    time.sleep(2.0)  # the last of the policies, past the first one that isolates


def connect_times(roles: dict[str, PodInfo], connects: int) -> tuple[list[float], int]:
    out = in_pod(roles["cli"], CONNECTS, ip_of(roles["srv"]), str(PORT), str(connects))
    doc = json.loads(out)
    return [t * 1000 for t in doc["times"]], int(doc["failed"])


def at_once(selected: Callable[[], T], unselected: Callable[[], T]) -> tuple[T, T]:
    """Both measurements started together on their own threads; their results (a failure
    of either is raised here)."""
    with ThreadPoolExecutor(2) as pool:
        first, second = pool.submit(selected), pool.submit(unselected)
        return first.result(), second.result()


def paired_connects(roles: dict[str, PodInfo], connects: int) -> tuple[float, float]:
    """Connect p50 and p99 of the perf pair over those of the perf0 pair, both loops at once."""

    def loop(client: str, server: str) -> list[float]:
        times = connect_times({"cli": roles[client], "srv": roles[server]}, connects)[0]
        if not times:
            raise SystemExit(f"no connection of {client} to {server} succeeded")
        return times

    a, b = at_once(lambda: loop("cli", "srv"), lambda: loop("cli0", "srv0"))
    return percentile(a, 50) / percentile(b, 50), percentile(a, 99) / percentile(b, 99)


def paired_ratio(roles: dict[str, PodInfo], seconds: int) -> float:
    """Gbit/s of the perf pair over that of the perf0 pair, both streams at once."""

    def stream(server: str, client: str) -> float:
        srv, cli = roles[server], roles[client]
        return throughput.iperf3_once(server, srv.namespace, cli.namespace, ip_of(srv),
                                      seconds, []).gbit_per_s  # fmt: skip

    selected, unselected = at_once(lambda: stream("srv", "cli"), lambda: stream("srv0", "cli0"))
    return selected / unselected


def run_packet_path(
    roles: dict[str, dict[str, PodInfo]], api: Api, policies: int, connects: int,
    seconds: int, repeat: int,
) -> dict[tuple[str, int], dict[str, list[float]]]:  # fmt: skip
    results: dict[tuple[str, int], dict[str, list[float]]] = {
        (s, c): {"connect": [], "failed": [], "gbit": [], "paired": [], "p50s": [], "p99s": []}
        for s in SIDES
        for c in (0, policies)
    }
    servers = [serve(roles[side][srv].namespace, PORT) for side in SIDES for srv in ("srv", "srv0")]
    current = 0
    try:
        for r in range(repeat):
            conditions = (0, policies) if r % 2 == 0 else (policies, 0)
            sides = SIDES if r % 2 == 0 else SIDES[::-1]
            for condition in conditions:
                set_condition(api, roles, condition, current)
                current = condition
                say(f"      repeat {r + 1}/{repeat}: {condition} policies in force")
                for side in sides:
                    times, failed = connect_times(roles[side], connects)
                    results[side, condition]["connect"] += times
                    results[side, condition]["failed"].append(failed)
                for side in sides:
                    srv, cli = roles[side]["srv"], roles[side]["cli"]
                    sample = throughput.iperf3_once(side, srv.namespace, cli.namespace,
                                                    ip_of(srv), seconds, [])  # fmt: skip
                    results[side, condition]["gbit"].append(sample.gbit_per_s)
                for side in sides:
                    results[side, condition]["paired"].append(paired_ratio(roles[side], seconds))
                    p50, p99 = paired_connects(roles[side], connects)
                    results[side, condition]["p50s"].append(p50)
                    results[side, condition]["p99s"].append(p99)
    finally:
        for server in servers:
            stop_process(server)
    return results


# -- the run and its report ----------------------------------------------------------------


def run(args: argparse.Namespace) -> None:
    """Both parts in one lab; each report is printed as soon as its part is done."""
    name = "kn" + secrets.token_hex(2)
    say(f"bringing up lab {name}: 4 nodes, Kubernetes mode, NetworkPolicy on; n1, n2 ours; "
        "n3, n4 flanneld + kube-network-policies")  # fmt: skip
    lab = Lab.up(name, 4, "vxlan", kube=True, network_policy=True, flanneld_nodes=2,
                 pods_per_node=3, timeout=LAB_TIMEOUT, progress=say)  # fmt: skip
    try:
        api = Api(lab)
        try:
            roles = setup(lab, api)
            if "latency" in args.parts:
                say(f"latency: {args.changes} changes, a new connection every 5 ms per side")
                print(latency_report(run_latency(roles, api, args.changes)), flush=True)
            api.send("DELETE", f"{POLICY_PATH}/db", DELETE, "application/json")
            if "path" in args.parts:
                say(f"packet path: {args.policies} policies vs none, {args.repeat} repeats")
                path = run_packet_path(roles, api, args.policies, args.connects, args.seconds,
                                       args.repeat)  # fmt: skip
                print(path_report(path, args.policies), flush=True)
        except BaseException:
            diagnose(lab)
            raise
        finally:
            api.close()
    finally:
        lab.down()


def diagnose(lab: Lab) -> None:
    """On a failure, before the lab goes: what kube-network-policies logged and holds."""
    for node in lab.nodes:
        if node.runs_flanneld:
            say(f"--- {node.name}: the end of {kube_netpol.log_path(node)}")
            say(procs.log_tail(kube_netpol.log_path(node), 15))
            table = lab.exec(node.name, ["nft", "list", "table", "inet", kube_netpol.TABLE],
                             check=False)  # fmt: skip
            say(table.stdout[-1500:] + table.stderr)


def ms(values: list[float], q: float) -> float:
    return round(percentile(values, q), 3) if values else float("nan")


def latency_report(latencies: dict[str, dict[str, list[float]]]) -> str:
    rows: list[list[object]] = []
    for kind in (*KINDS, "all"):
        got = {s: [v * 1000 for k, vs in latencies[s].items() if kind in (k, "all") for v in vs]
               for s in SIDES}  # fmt: skip
        o, k = got["ours"], got["kube-network-policies"]
        rows.append([kind, len(o), ms(o, 50), ms(k, 50), ms(o, 99), ms(k, 99),
                     round(ms(o, 99) / ms(k, 99), 2) if k else "-",
                     round(max(o), 1), round(max(k), 1)])  # fmt: skip
    header = ["change", "n", "ours p50", "knp p50", "ours p99", "knp p99", "p99 ours/knp",
              "ours max", "knp max"]  # fmt: skip
    return "latency (ms, from the write to the first connection reflecting it)\n" + table(
        header, rows
    )


def path_report(path: dict[tuple[str, int], dict[str, list[float]]], policies: int) -> str:
    rows: list[list[object]] = []
    base: dict[str, tuple[float, float, float]] = {}
    for side in SIDES:
        for condition in (0, policies):
            r = path[side, condition]
            p50, p99, gbit = ms(r["connect"], 50), ms(r["connect"], 99), median(r["gbit"])
            if condition == 0:
                base[side] = (p50, p99, gbit)
            b = base[side]
            rows.append([side, condition, len(r["connect"]), int(sum(r["failed"])), p50, p99,
                         round(gbit, 2), round(p50 / b[0], 3), round(p99 / b[1], 3),
                         round(gbit / b[2], 3), round(median(r["p50s"]), 3),
                         round(median(r["p99s"]), 3), round(median(r["paired"]), 3)])  # fmt: skip
    header = ["side", "policies", "connects", "failed", "connect p50 ms", "p99 ms", "Gbit/s",
              "p50 / none", "p99 / none", "Gbit/s / none", "at once with perf0: p50",
              "p99", "Gbit/s"]  # fmt: skip
    o, k = path["ours", policies], path["kube-network-policies", policies]
    cross = (
        f"with {policies} policies, ours / kube-network-policies: connect p50 "
        f"{ms(o['connect'], 50) / ms(k['connect'], 50):.3f}, p99 "
        f"{ms(o['connect'], 99) / ms(k['connect'], 99):.3f}, throughput "
        f"{median(o['gbit']) / median(k['gbit']):.3f}"
    )
    gbits = {f"{s} {c}": [round(g, 2) for g in path[s, c]["gbit"]] for s, c in path}
    kinds = ("p50s", "p99s", "paired")
    paired = {f"{s} {c}": {k: [round(g, 3) for g in path[s, c][k]] for k in kinds}
              for s, c in path}  # fmt: skip
    lines = ["packet path", table(header, rows), cross, f"Gbit/s per repeat: {json.dumps(gbits)}",
             f"perf / perf0 at once per repeat: {json.dumps(paired)}"]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.netpol_versus",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--changes", type=int, default=104, help="changes (default 104)")
    parser.add_argument("--policies", type=int, default=100, help="policies (default 100)")
    parser.add_argument("--connects", type=int, default=2000,
                        help="connects per condition, side and repeat (default 2000)")  # fmt: skip
    parser.add_argument("--seconds", type=int, default=5, help="per iperf3 run (default 5)")
    parser.add_argument("--repeat", type=int, default=3, help="packet-path repeats (default 3)")
    parser.add_argument("--parts", nargs="+", choices=("latency", "path"),
                        default=["latency", "path"], help="what to run (default both)")  # fmt: skip
    args = parser.parse_args(argv)
    if lacks_root("bench.netpol_versus"):
        return 2
    load_start = load_average()
    run(args)
    print(json.dumps({"load_average_at_start": load_start, "load_average_at_end": load_average()}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
