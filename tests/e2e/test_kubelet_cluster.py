"""The DaemonSet on a real 3-node cluster: kubelets, containerd and the scheduler.

``Lab.up(..., kubelets=True)`` (``flannelpy-lab up --kubelet``) runs the real control
plane with kube-scheduler, and on every node namespace a real kubelet and containerd
(``flannelpy_lab.kubelet``); ``manifests/`` is applied with its DaemonSet (only the image,
the API server's address and the interface set by the lab's kustomization), and a
Deployment of busybox pods is spread over the nodes by the scheduler. Every check goes
through Kubernetes: Node conditions, pod status, ``kubectl exec`` (the kubelet's
streaming) for the echoes between pods, ``flannelpy rollout`` (Kubernetes mode, the
admin kubeconfig) for the backend rollout under cordon, the scheduler's bindings for
where new pods go meanwhile.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import datetime
from ipaddress import IPv4Address, IPv4Network
from typing import Any

import pytest
from flannelpy_lab import Lab, cgroups, images, kube_api, kubelet, procs
from flannelpy_lab import kube as control_plane
from flannelpy_lab.errors import LabError

from flannelpy.rollout import cordon
from tests.support.kube_rollout import start_rollout
from tests.support.lab_util import backlog_drops, unique_lab_name, wait_until
from tests.support.pod_echoes import (
    ECHO_INTERVAL,
    REPLY,
    STATS,
    echo_counts,
    judged_losses,
    pairs,
    report_socket_misses,
    start_pings,
    unanswered_in_network,
)

pytestmark = [pytest.mark.lab]

NODES = ("n1", "n2", "n3")
AGENT_SELECTOR = "app.kubernetes.io/component=agent"
# Exactly what the lab's kustomization adds to the agent's container.
LAB_ENV = {"KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT", "FLANNELD_IFACE"}


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    lab = Lab.up(unique_lab_name("k"), len(NODES), kubelets=True, progress=print)
    print("RSS KiB:", kubelet.component_rss(lab.state))
    try:
        yield lab
    finally:
        lab.down()


def items(lab: Lab, *args: str) -> list[dict[str, Any]]:
    found: list[dict[str, Any]] = json.loads(lab.kubectl("get", *args, "-o", "json").stdout)[
        "items"
    ]
    return found


def test_nodes_are_the_kubelets_and_ready(lab: Lab) -> None:
    nodes = {n["metadata"]["name"]: n for n in items(lab, "nodes")}
    assert set(nodes) == set(NODES)
    for name, node in nodes.items():
        assert kubelet.node_ready(node), node["status"]["conditions"]
        info = node["status"]["nodeInfo"]
        assert info["kubeletVersion"].startswith("v1.37"), info
        assert info["containerRuntimeVersion"].startswith("containerd://1.6"), info
        addresses = {a["type"]: a["address"] for a in node["status"]["addresses"]}
        assert addresses["InternalIP"] == str(lab.node(name).ip)
        assert node["spec"]["podCIDR"], f"{name} has no podCIDR"
        # The agent, run by the DaemonSet, reported the network up on the kubelet's Node.
        conditions = {c["type"]: c for c in node["status"]["conditions"]}
        assert conditions["NetworkUnavailable"]["status"] == "False"
        assert conditions["NetworkUnavailable"]["reason"] == "FlannelIsUp"


def test_daemonset_pods_run_the_manifests_unchanged(lab: Lab) -> None:
    pods = items(lab, "pods", "-n", control_plane.NAMESPACE, "-l", AGENT_SELECTOR)
    assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(NODES)
    assert all(p["status"]["phase"] == "Running" and kubelet.pod_ready(p) for p in pods)
    # The DaemonSet in the API is the manifests' one but for the lab's image and env.
    rendered = json.loads(
        lab.kubectl(
            "apply", "-k", control_plane.manifests_dir(), "--dry-run=client", "-o", "json"
        ).stdout
    )["items"]
    (want,) = [o for o in rendered if o["kind"] == "DaemonSet"]
    (have,) = items(lab, "daemonsets", "-n", control_plane.NAMESPACE)
    w, h = want["spec"]["template"]["spec"], have["spec"]["template"]["spec"]
    for key in ("hostNetwork", "serviceAccountName", "priorityClassName", "tolerations"):
        assert h.get(key) == w.get(key), key
    assert [v["name"] for v in h["volumes"]] == [v["name"] for v in w["volumes"]]
    for kind in ("initContainers", "containers"):
        for hc, wc in zip(h[kind], w[kind], strict=True):
            assert hc.get("securityContext") == wc.get("securityContext"), hc["name"]
            assert hc["volumeMounts"] == wc["volumeMounts"], hc["name"]
            assert hc["image"] == lab.state.extra["kubelet"]["image"]
            extra = {e["name"] for e in hc.get("env", [])} - {e["name"] for e in wc.get("env", [])}
            assert extra <= LAB_ENV, extra
    # The init containers installed the executable and conflist into each node's dirs.
    for name in NODES:
        node = lab.node(name)
        assert os.access(
            os.path.join(kubelet.host_source(node, "/opt/cni/bin"), "flannelpy"), os.X_OK
        )
        conflist = os.path.join(
            kubelet.host_source(node, "/etc/cni/net.d"), "10-flannelpy.conflist"
        )
        with open(conflist, encoding="utf-8") as f:
            assert json.load(f)["plugins"][0]["type"] == "flannelpy"


def workload_pods(lab: Lab) -> list[dict[str, Any]]:
    return [
        p
        for p in items(lab, "pods", "-l", f"app={kubelet.WORKLOAD}")
        if p["status"].get("phase") == "Running"
        and p["status"].get("podIP")
        and not p["metadata"].get("deletionTimestamp")
    ]


def test_the_scheduler_spreads_the_deployment_over_every_node(lab: Lab) -> None:
    pods = workload_pods(lab)
    assert sorted(p["spec"]["nodeName"] for p in pods) == sorted(NODES)
    cidrs = {n["metadata"]["name"]: IPv4Network(n["spec"]["podCIDR"]) for n in items(lab, "nodes")}
    for p in pods:  # each address from its node's lease, through our CNI
        assert IPv4Address(p["status"]["podIP"]) in cidrs[p["spec"]["nodeName"]], p["status"]


def exec_ping(lab: Lab, pod: str, ip: str) -> subprocess.CompletedProcess[str]:
    return lab.kubectl("exec", pod, "--", "ping", "-c", "1", "-W", "2", ip, check=False)


def unreachable_pairs(lab: Lab, pods: list[dict[str, Any]]) -> list[str]:
    failed = []
    for a in pods:
        for b in pods:
            if a is not b:
                proc = exec_ping(lab, a["metadata"]["name"], b["status"]["podIP"])
                if proc.returncode != 0:
                    failed.append(
                        f"{a['spec']['nodeName']} -> {b['spec']['nodeName']}: "
                        f"{(proc.stdout + proc.stderr).strip()[-200:]}"
                    )
    return failed


def test_every_pod_pair_reaches_through_kubectl_exec(lab: Lab) -> None:
    pods = workload_pods(lab)
    assert len(pods) == len(NODES)
    assert unreachable_pairs(lab, pods) == []


JUDGED = 600  # echoes of each pair judged in the rollout restart: 60 s


def test_rollout_restart_of_the_agent_loses_no_echo(lab: Lab) -> None:
    pods = workload_pods(lab)
    before = {
        p["metadata"]["uid"]
        for p in items(lab, "pods", "-n", control_plane.NAMESPACE, "-l", AGENT_SELECTOR)
    }
    # 60 s judged; 10 echoes more, so the last judged one has a second to come back
    # whatever ping's own wait after its last echo.
    drops_before = backlog_drops()
    counts_before = echo_counts(lab, pods)
    pingers = start_pings(lab, pods, count=JUDGED + 10)
    try:
        time.sleep(2)  # traffic flows before the first agent goes
        lab.kubectl(
            "rollout", "restart", "daemonset", kubelet.DAEMONSET, "-n", control_plane.NAMESPACE
        )
        # On a loaded machine (parallel labs) three agents take longer than kubectl's default
        # 30 s of process time: kubectl's own limit governs, with room for it to report.
        lab.kubectl(
            "rollout",
            "status",
            "daemonset",
            kubelet.DAEMONSET,
            "-n",
            control_plane.NAMESPACE,
            "--timeout",
            "90s",
            timeout=100,
        )
        agents = items(lab, "pods", "-n", control_plane.NAMESPACE, "-l", AGENT_SELECTOR)
        assert len(agents) == len(NODES) and not {p["metadata"]["uid"] for p in agents} & before
        results = [p.communicate(timeout=90) for p in pingers]
    finally:
        for p in pingers:
            if p.poll() is None:
                p.kill()
                p.wait()
    drops = backlog_drops() - drops_before
    unanswered = unanswered_in_network(lab, pods, counts_before)
    missed = {}
    for (a, b), (out, err) in zip(pairs(pods), results, strict=True):
        match = STATS.search(out)
        assert match, (out[-300:], err[-300:])
        assert int(match.group(1)) == JUDGED + 10, out[-300:]
        missing = judged_losses(out, JUDGED)
        if missing:
            missed[f"{a['metadata']['name']}->{b['status']['podIP']}"] = (missing, err[-300:])
    # The network's account: every echo request a pod sent had its reply reach the pod
    # (its namespace's ICMP counters), the unjudged tail's too.
    assert unanswered == {}, (
        f"echo replies that never reached their pod during the rollout, by pod: {unanswered};"
        f" echoes ping's output shows unanswered (sequence numbers, one every"
        f" {ECHO_INTERVAL} s from the start), by pair: {missed}; meanwhile the kernel dropped"
        f" {drops} packets machine-wide for a full input backlog"
    )
    report_socket_misses(missed)


REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def node_samples(lab: Lab, stop: threading.Event, out: list[tuple[float, dict[str, bool]]]) -> None:
    """Every 0.1 s: each Node's spec.unschedulable, with the time it was read (by HTTP: a
    kubectl process per look took seconds on a loaded machine, longer than some cordons)."""
    while not stop.is_set():
        before = time.monotonic()
        with contextlib.suppress(LabError):
            nodes = kube_api.api_json(lab.state, "/api/v1/nodes")["items"]
            out.append(
                (
                    (before + time.monotonic()) / 2,
                    {n["metadata"]["name"]: bool(n["spec"].get("unschedulable")) for n in nodes},
                )
            )
        stop.wait(0.1)


def cordon_spans(
    samples: list[tuple[float, dict[str, bool]]], node: str
) -> list[tuple[float, float]]:
    spans: list[tuple[float, float]] = []
    start: float | None = None
    last = 0.0
    for at, marks in samples:
        if marks.get(node) and start is None:
            start = at
        if not marks.get(node) and start is not None:
            spans.append((start, last))
            start = None
        last = at
    if start is not None:
        spans.append((start, last))
    return spans


class Bindings:
    """The probe pods' bindings as a watch reports them: pod -> (node, when first seen
    bound). A kubectl process per look (two pods, each waited for in turn) took longer
    than a node's cordon on a loaded machine, so the loop missed the next node."""

    def __init__(self, lab: Lab) -> None:
        binary = os.path.join(control_plane.record(lab.state)["bin_dir"], "kubectl")
        self.seen: dict[str, tuple[str, float]] = {}
        self._proc = subprocess.Popen(
            [
                binary,
                "--kubeconfig",
                control_plane.admin_kubeconfig(lab.state),
                "get",
                "pods",
                "-l",
                "app=sched-probe",
                "--watch",
                "-o",
                'jsonpath={.metadata.name} {.spec.nodeName}{"\\n"}',
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=kube_api.proxyless_env(),
        )
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            name, _, node = line.strip().partition(" ")
            if node and name not in self.seen:
                self.seen[name] = (node, time.monotonic())

    def close(self) -> None:
        self._proc.kill()
        self._proc.wait()
        self._thread.join(timeout=5)
        assert self._proc.stdout is not None
        self._proc.stdout.close()


def scheduled_at(lab: Lab, names: set[str]) -> dict[str, float]:
    """When the scheduler bound each of ``names``, on ``time.monotonic()``'s clock: the
    eventTime (microseconds) of its Scheduled event, taken once the binding succeeded.
    The watch in :class:`Bindings` sees a binding later, by seconds on a loaded machine."""
    offset = time.time() - time.monotonic()
    found = {}
    for event in items(lab, "events.v1.events.k8s.io", "-n", "default"):
        name = event.get("regarding", {}).get("name")
        if event.get("reason") == "Scheduled" and name in names and event.get("eventTime"):
            at = datetime.fromisoformat(event["eventTime"]).timestamp() - offset
            found[name] = min(at, found.get(name, at))
    return found


def probe_pod(name: str) -> dict[str, Any]:
    """A bare pod (no nodeName): where it runs is the scheduler's choice."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": "default", "labels": {"app": "sched-probe"}},
        "spec": {
            "terminationGracePeriodSeconds": 0,
            "containers": [
                {
                    "name": "main",
                    "image": images.BUSYBOX_IMAGE,
                    "imagePullPolicy": "Never",
                    "command": ["/bin/sleep", "2147483647"],
                }
            ],
        },
    }


def test_backend_rollout_under_cordon_loses_no_echo_and_the_scheduler_avoids_the_node(
    lab: Lab,
) -> None:
    pods = workload_pods(lab)
    assert len(pods) == len(NODES)
    samples: list[tuple[float, dict[str, bool]]] = []
    stop = threading.Event()
    poller = threading.Thread(target=node_samples, args=(lab, stop, samples), daemon=True)
    bound: list[tuple[str, str, float, float]] = []  # pod, node, created, seen bound
    bindings = Bindings(lab)  # when each probe pod was seen bound: a watch, not polls
    t0 = time.monotonic()
    drops_before = backlog_drops()
    counts_before = echo_counts(lab, pods)
    pingers = start_pings(lab, pods, count=100000)  # stopped by SIGINT once it is over
    rollout: subprocess.Popen[str] | None = None
    try:
        poller.start()
        time.sleep(2)  # traffic flows before the first node changes
        rollout = start_rollout(lab, "start", "--backend", "host-gw")
        probed: set[str] = set()
        made: dict[str, float] = {}  # probe pod -> when it was created
        deadline = time.monotonic() + 150
        while rollout.poll() is None and time.monotonic() < deadline:
            latest = samples[-1][1] if samples else {}
            fresh = [n for n, c in latest.items() if c and n not in probed]
            if fresh:  # while they are cordoned: two new pods each for the scheduler
                probed.update(fresh)
                for doc in (probe_pod(f"sched-probe-{n}-{i}") for n in fresh for i in range(2)):
                    created = time.monotonic()  # by HTTP: no process start before it
                    kube_api.api_json(lab.state, "/api/v1/namespaces/default/pods", body=doc)
                    made[doc["metadata"]["name"]] = created
            time.sleep(0.05)
        wait_until(lambda: set(bindings.seen) >= set(made), 30, "the probe pods bound")
        bound = [(p, node, made[p], seen) for p, (node, seen) in bindings.seen.items() if p in made]
        out = rollout.communicate(timeout=max(1.0, deadline - time.monotonic()))[0]
        print(f"--- rollout to host-gw ({time.monotonic() - t0:.1f} s)\n{out}")
        assert rollout.returncode == 0, out
        time.sleep(2)  # and traffic flows on after the last node
        for p in pods:
            lab.kubectl(
                "exec", p["metadata"]["name"], "--", "/bin/busybox", "killall", "-INT", "ping"
            )
        results = [p.communicate(timeout=30) for p in pingers]
        drops = backlog_drops() - drops_before
    finally:
        stop.set()
        poller.join(timeout=10)
        bindings.close()
        for proc in [*pingers, *([rollout] if rollout else [])]:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        lab.kubectl("delete", "pod", "-l", "app=sched-probe", "--wait=false", check=False)

    last = [ln for ln in out.splitlines() if ln.startswith("rollout ")][-1]
    assert f" done: {len(NODES)} of {len(NODES)} nodes switched to host-gw " in last, last
    # Zero lost echoes: every request a pod sent had its reply reach the pod (its ICMP
    # counters); ping's output, every sequence number but the one in flight at the SIGINT.
    unanswered = unanswered_in_network(lab, pods, counts_before)
    total, worst_rtt, missed = 0, 0.0, {}
    for (a, b), (pinger_out, pinger_err) in zip(pairs(pods), results, strict=True):
        match = STATS.search(pinger_out)
        assert match, (pinger_out[-300:], pinger_err[-300:])
        sent = int(match.group(1))
        replies = {int(s): float(t) for s, t in REPLY.findall(pinger_out)}
        missing = judged_losses(pinger_out, sent - 1)
        if missing:
            missed[f"{a['metadata']['name']}->{b['status']['podIP']}"] = missing[:20]
        total += sent
        worst_rtt = max(worst_rtt, *replies.values())
    assert unanswered == {}, (
        f"echo replies that never reached their pod, by pod: {unanswered}; ping's output"
        f" lacks, by pair: {missed}; meanwhile the kernel dropped {drops} packets"
        " machine-wide for a full input backlog"
    )
    report_socket_misses(missed)
    took = time.monotonic() - t0
    print(
        f"echoes: {total} sent over {len(results)} pairs in {took:.0f} s, 0 lost, "
        f"slowest reply {worst_rtt} ms"
    )
    assert total >= len(results) * (took - 10) / ECHO_INTERVAL * 0.5, total

    # The scheduler placed nothing on a node cordoned at the time: no probe pod's binding
    # (the scheduler's event, or the watch's sight of it if sooner) fell inside a span in
    # which its node was seen cordoned.
    scheduled = scheduled_at(lab, {p for p, _, _, _ in bound})
    print(
        "watch behind the scheduler (s):",
        {p: round(s - scheduled[p], 2) for p, _, _, s in bound if p in scheduled},
    )
    bound = [(p, n, c, min(seen, scheduled.get(p, seen))) for p, n, c, seen in bound]
    spans = {n: cordon_spans(samples, n) for n in NODES}
    print(
        "cordoned (s from start):",
        {n: [(round(a - t0, 1), round(b - t0, 1)) for a, b in s] for n, s in spans.items()},
    )
    print("bound:", [(p, n, round(c - t0, 1), round(b - t0, 1)) for p, n, c, b in bound])
    assert all(len(s) == 1 for s in spans.values()), spans
    every = sorted(s[0] for s in spans.values())
    assert all(b1 < a2 for (_, b1), (a2, _) in itertools.pairwise(every)), f"overlap: {every}"
    assert {p.split("-")[2] for p, _, _, _ in bound} == set(NODES), bound
    for name, node, created, seen in bound:
        # Seen cordoned both before and after the binding: the scheduler chose it cordoned.
        # (A binding between its last cordoned look and its first uncordoned one is not
        # told apart: the node may be out of its cordon by then.)
        inside = [(a, b) for a, b in spans[node] if a <= seen <= b]
        assert not inside, f"{name} bound to {node} at {seen - t0:.2f} s, cordoned {inside}"
        # ... while the node it was made for was out the whole time (the check meant it).
        target = name.split("-")[2]
        ((start, end),) = spans[target]
        assert start <= created and seen <= end, (name, target, (created, seen), (start, end))

    # Cordons gone; every node on host-gw: a route by the underlay to each peer's podCIDR
    # through the peer's address, no VTEP (fdb entry) for any peer.
    nodes = {n["metadata"]["name"]: n for n in items(lab, "nodes")}
    for name, obj in nodes.items():
        assert not obj["spec"].get("unschedulable"), name
        assert cordon.EXCLUDE_LABEL not in obj["metadata"].get("labels", {}), name
        assert cordon.CORDON_ANNOTATION not in obj["metadata"].get("annotations", {}), name
    for name in NODES:
        routes = {
            r["dst"]: r
            for r in json.loads(
                lab.exec(name, ["ip", "-j", "route", "show", "proto", "75"]).stdout or "[]"
            )
        }
        fdb = json.loads(lab.exec(name, ["bridge", "-j", "fdb", "show"]).stdout or "[]")
        for peer in NODES:
            if peer == name:
                continue
            route = routes.get(nodes[peer]["spec"]["podCIDR"])
            assert route, (name, peer, routes)
            assert route.get("dev") == lab.node(name).underlay_iface, (name, route)
            assert route.get("gateway") == str(lab.node(peer).ip), (name, route)
            assert not [e for e in fdb if e.get("dst") == str(lab.node(peer).ip)], (name, fdb)
    cm = items_one(lab, control_plane.CONFIG_MAP, "configmap", "-n", control_plane.NAMESPACE)
    assert json.loads(cm["data"][control_plane.NET_CONF_KEY])["Backend"]["Type"] == "host-gw"
    assert unreachable_pairs(lab, workload_pods(lab)) == []


def items_one(lab: Lab, name: str, kind: str = "pod", *args: str) -> dict[str, Any]:
    found: dict[str, Any] = json.loads(lab.kubectl("get", kind, name, *args, "-o", "json").stdout)
    return found


def our_routes(lab: Lab, node: str) -> set[str]:
    out = lab.exec(node, ["ip", "-j", "route", "show", "proto", "75"]).stdout
    return {r["dst"] for r in json.loads(out or "[]")}


def test_a_drained_and_deleted_node_moves_its_pods_and_leaves_every_peer(lab: Lab) -> None:
    cidr = next(n["spec"]["podCIDR"] for n in items(lab, "nodes") if n["metadata"]["name"] == "n3")
    assert all(cidr in our_routes(lab, n) for n in ("n1", "n2"))
    lab.kubectl(
        "drain", "n3", "--ignore-daemonsets", "--force", "--grace-period=1", "--timeout=60s"
    )

    def moved() -> bool:
        pods = workload_pods(lab)
        return len(pods) == len(NODES) and "n3" not in {p["spec"]["nodeName"] for p in pods}

    wait_until(moved, timeout=60, what="the drained node's pod running elsewhere")
    kubelet.stop_node(lab.state, lab.node("n3"))  # the machine goes away
    lab.kubectl("delete", "node", "n3")
    for node in ("n1", "n2"):

        def route_gone(node: str = node) -> bool:
            return cidr not in our_routes(lab, node)

        wait_until(route_gone, timeout=10, what=f"{node} dropping the deleted node's route")
    cidrs = {n["metadata"]["name"]: IPv4Network(n["spec"]["podCIDR"]) for n in items(lab, "nodes")}
    pods = workload_pods(lab)
    for p in pods:  # the moved pod's address is from its new node's lease
        assert IPv4Address(p["status"]["podIP"]) in cidrs[p["spec"]["nodeName"]], p["status"]
    assert unreachable_pairs(lab, pods) == []


def test_down_stops_every_kubelet_containerd_and_pod(lab: Lab) -> None:
    rec = lab.state.extra["kubelet"]
    refs = [r for r in (procs.ref_of(*v) for v in rec["processes"].values()) if procs.alive(r)]
    assert len(refs) >= 4  # n3's went with its machine
    parents = [kubelet.cgroup_parent(lab.state, n) for n in lab.nodes]
    pod_pids = set().union(*(cgroups.cgroup_pids(p) for p in parents))
    assert pod_pids, "no pod process in the nodes' cgroups"
    # By pid and start time: on a busy machine a pid freed by down() may soon be another's.
    pod_refs = [r for r in map(procs.current_ref, pod_pids) if r is not None]
    # The kubelets mounted the pods' volumes in the nodes' mount namespaces only.
    containerd = {
        k.split("/")[1]: r
        for k, r in ((k, procs.ref_of(*v)) for k, v in rec["processes"].items())
        if k.startswith("containerd/") and r and procs.alive(r)
    }
    assert set(containerd) == {"n1", "n2"}
    # Held open until the end: a freed namespace's inode number is soon another's (a
    # parallel lab's `ip netns exec` took one), and a held namespace is not freed.
    held = [os.open(f"/proc/{r.pid}/ns/mnt", os.O_RDONLY) for r in containerd.values()]
    try:
        namespaces = {(s.st_dev, s.st_ino) for s in map(os.fstat, held)}
        with open(f"/proc/{containerd['n1'].pid}/mountinfo", encoding="utf-8") as f:
            assert os.path.join(kubelet.node_base(lab.node("n1")), "kubelet", "pods") in f.read()
        lab.down()
        _assert_namespaces_emptied(namespaces)
    finally:
        for fd in held:
            os.close(fd)
    assert not any(procs.alive(r) for r in refs)
    assert procs.wait_gone(pod_refs, 15.0) == [], "pod processes outlived down()"
    for hierarchy in cgroups.hierarchies():
        assert not [d for d in os.listdir(hierarchy) if d.startswith(f"fpl-{lab.name}-")]
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        assert lab.state.lab_dir not in f.read()
    assert not os.path.exists(lab.state.lab_dir)


def _assert_namespaces_emptied(namespaces: set[tuple[int, int]]) -> None:
    """Every process in the given mount namespaces goes within 15 s."""

    def holders() -> list[str]:
        """Processes still in the nodes' mount namespaces, with their command lines."""
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            with contextlib.suppress(OSError):  # gone, or not ours to look at
                st = os.stat(f"/proc/{pid}/ns/mnt")
                if (st.st_dev, st.st_ino) in namespaces:
                    with open(f"/proc/{pid}/cmdline", "rb") as f:
                        argv = f.read().replace(b"\0", b" ").decode(errors="replace")
                    found.append(f"{pid}: {argv[:200]}")
        return found

    # The namespaces went with them: a process being killed may take a moment to go,
    # as the pods' processes may below.
    deadline = time.monotonic() + 15.0
    while (left := holders()) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], f"still in the nodes' mount namespaces 15 s after down(): {left}"
