"""Issue 7 on real agents: address pools, drain, cluster scope, and an older node.

Each test builds its own vxlan lab and drives the pools with the operator's
command (``flannelpy-lab run NAME -- flannelpy pools ...``), then reads what the agents did:
their leases in etcd, status.json and status records, routes, cni0 addresses,
logs, and pod-to-pod traffic.

Waits of about 30 s are real: a lease is released only once the addresses of
its last pods have finished their cooldown (the agent's default 30 s; a CNI
config asking for less does not shorten it, since a lease's emptiness follows
the longest cooldown ever asked for).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from ipaddress import IPv4Interface, IPv4Network
from typing import Any

import pytest
from flannelpy_lab import Lab, procs
from flannelpy_lab.pods import pod_matrix
from flannelpy_lab.state import PodInfo

import flannelpy
from flannelpy.control.records import NodeStatus
from flannelpy.store.etcd.client import EtcdStore
from flannelpy.subnet.keys import status_key
from tests.support.agent_events import (
    AgentNode,
    fresh_status,
    quiet_count,
    wait_for_capacity_round,
    wait_until_processed,
)
from tests.support.lab_util import (
    host_snapshot,
    lab_residue,
    lab_run_argv,
    running_lab,
    unique_lab_name,
    wait_until,
)
from tests.support.traffic import PodTraffic

pytestmark = [
    pytest.mark.lab,
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to build the netns lab"),
]

PRIMARY = IPv4Network("10.244.0.0/16")
NEW = IPv4Network("10.250.0.0/16")
OTHER = IPv4Network("10.251.0.0/16")
ROLE = "flannelpy.io/role"
COOLDOWN_S = 30.0  # the agent's default ipCooldownSeconds
CAPACITY_TICK_S = 5.0  # the agent looks at its leases at least this often
PREVIOUS_RELEASE = "542258e"  # the last commit before pools and several leases per node
EXHAUSTED = "cannot add a lease: no pool can take a new lease"


# --- the operator's command --------------------------------------------------------------------


def pools(lab: Lab, *args: str) -> str:
    """``flannelpy pools ARGS`` with the lab's store; its stdout. Fails the test on a
    non-zero exit."""
    proc = subprocess.run(
        lab_run_argv(lab.name, "pools", *args),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, f"pools {' '.join(args)}: {proc.stdout}{proc.stderr}"
    return proc.stdout


def pool_view(lab: Lab, network: IPv4Network, cluster: str | None = None) -> dict[str, Any]:
    """One pool's row of ``pools list --json`` (as agents of ``cluster`` see it)."""
    extra = ["--cluster-name", cluster] if cluster else []
    doc = json.loads(pools(lab, "list", "--json", *extra))
    return next(p for p in doc["pools"] if p["network"] == str(network))


# --- what the agents did -----------------------------------------------------------------------


_STORES: dict[str, EtcdStore] = {}  # lab name -> the test's one etcd client


@contextmanager
def pool_lab(nodes: int, **kwargs: Any) -> Iterator[Lab]:
    """``running_lab`` (vxlan) with one etcd client for the test's reads, closed with it:
    polling through a new client each time would add a connection per read."""
    with running_lab(nodes, "vxlan", **kwargs) as lab:
        _STORES[lab.name] = EtcdStore([lab.etcd_endpoint])
        try:
            yield lab
        finally:
            _STORES.pop(lab.name).close()


def lease_docs(lab: Lab) -> dict[IPv4Network, dict[str, Any]]:
    """Every lease in etcd: subnet -> its JSON value."""
    items, _ = _STORES[lab.name].get_prefix(f"{lab.state.etcd_prefix}/subnets/")
    out = {}
    for kv in items:
        address, _, length = kv.key.rsplit("/", 1)[1].partition("-")
        out[IPv4Network(f"{address}/{length}")] = json.loads(kv.value)
    return out


def etcd_leases(lab: Lab) -> dict[str, list[IPv4Network]]:
    """Node name -> its leases in etcd (by the lease's NodeName), sorted."""
    out: dict[str, list[IPv4Network]] = {}
    for subnet, doc in sorted(lease_docs(lab).items()):
        out.setdefault(doc["Flannelpy"]["NodeName"], []).append(subnet)
    return out


def in_pool(subnets: Sequence[IPv4Network], pool: IPv4Network) -> list[IPv4Network]:
    return [s for s in subnets if s.subnet_of(pool)]


def status_json(lab: Lab, node: str) -> dict[str, Any]:
    with open(os.path.join(lab.node(node).run_dir, "status.json"), encoding="utf-8") as f:
        doc: dict[str, Any] = json.load(f)
    return doc


def status_record(lab: Lab, node: str) -> NodeStatus | None:
    kv = _STORES[lab.name].get(status_key(lab.state.etcd_prefix, node))
    return NodeStatus.from_json(kv.value) if kv else None


def routes(lab: Lab, node: str) -> set[IPv4Network]:
    """The agent's routes (proto 75) on ``node``."""
    out = lab.exec(node, ["ip", "-j", "route", "show", "proto", "75"]).stdout
    return {IPv4Network(r["dst"]) for r in json.loads(out or "[]")}


def addresses(lab: Lab, node: str) -> dict[str, set[IPv4Interface]]:
    """Device -> its IPv4 addresses on ``node``."""
    out = lab.exec(node, ["ip", "-j", "-4", "addr", "show"]).stdout
    return {
        link["ifname"]: {
            IPv4Interface(f"{a['local']}/{a['prefixlen']}") for a in link.get("addr_info", [])
        }
        for link in json.loads(out or "[]")
    }


def log_since_start(lab: Lab, node: str) -> str:
    """The node's agent log since its last start (the lab marks each start)."""
    return procs.latest_run(lab.node(node).agent_log)


def net_of(pod: PodInfo) -> IPv4Network:
    """The subnet (lease) the pod's address came from."""
    assert pod.address is not None, pod
    return IPv4Interface(pod.address).network


def all_pods_reach_each_other(pods: Sequence[PodInfo]) -> None:
    matrix = pod_matrix(list(pods))
    missing = [f"{a}->{b}" for a, row in matrix.items() for b, ok in row.items() if not ok]
    assert not missing, f"pod pairs without connectivity: {', '.join(missing)}"


def agents(lab: Lab, nodes: Sequence[str]) -> list[AgentNode]:
    return [lab.node(n) for n in nodes]


def wait_pool_leases(
    lab: Lab, nodes: Sequence[str], pool: IPv4Network, timeout: float = 15.0
) -> dict[str, IPv4Network]:
    """Wait until each of ``nodes`` holds a lease in ``pool`` (etcd and status.json)."""

    def probe() -> dict[str, IPv4Network] | None:
        held = etcd_leases(lab)
        found = {}
        for node in nodes:
            mine = in_pool(held.get(node, []), pool)
            if len(mine) != 1 or str(mine[0]) not in status_json(lab, node)["leases"]:
                return None
            found[node] = mine[0]
        return found

    return wait_until(probe, timeout, what=f"{', '.join(nodes)} to lease in {pool}")


# --- 1. migration under traffic -----------------------------------------------------------------


def test_migration_to_a_new_pool_under_traffic_loses_nothing_and_releases_the_old_leases() -> None:
    """3 nodes, 2 pods each on 10.244.0.0/16 with traffic between all of them; the
    operator adds 10.250.0.0/16 with role 1 and drains the primary. New pods land in
    10.250, old pods keep address and connectivity; deleting the old pods releases the
    old leases once their cooldown ends, everywhere."""
    with pool_lab(3, pods_per_node=2) as lab:
        nodes = [n.name for n in lab.nodes]
        old_pods = lab.pods
        old_leases = {n: etcd_leases(lab)[n] for n in nodes}
        assert all(len(v) == 1 and v[0].subnet_of(PRIMARY) for v in old_leases.values())

        with PodTraffic(lab, old_pods, rate=20.0, streams=3) as traffic:
            time.sleep(1.0)  # counted before the change too
            pools(lab, "add", str(NEW))
            pools(lab, "tag", str(NEW), f"{ROLE}=1")
            changed_at = time.monotonic()
            pools(lab, "tag", str(PRIMARY), f"{ROLE}=0")
            new_leases = wait_pool_leases(lab, nodes, NEW)
            took = time.monotonic() - changed_at
            new_pods = [lab.add_pod(n) for n in nodes]
            time.sleep(2.0)  # traffic keeps flowing after the last change
            report = traffic.stop()
        print(f"\nmigration: every node leased in {NEW} {took:.1f} s after the drain")
        print(f"migration traffic between the old pods: {report.summary()}")
        assert report.lost == 0 and not report.broken_streams, report.summary()
        assert report.sent > 0 and report.received == report.sent

        for pod in new_pods:
            assert net_of(pod) == new_leases[pod.node], pod
        for pod in old_pods:  # unchanged addresses, still in their node's old lease
            assert net_of(pod) == old_leases[pod.node][0], pod
        for node in nodes:
            # Both leases held: the drained one keeps its pods, the new one serves.
            assert status_json(lab, node)["leases"] == [
                str(old_leases[node][0]),
                str(new_leases[node]),
            ]
            # subnet.env shows the lease new pods get (Flannel's single-lease view).
            env = lab.node(node).subnet_env
            with open(env, encoding="utf-8") as f:
                assert f"FLANNEL_SUBNET={new_leases[node][1]}/24" in f.read()
            peers = {new_leases[n] for n in nodes if n != node}
            peers |= {old_leases[n][0] for n in nodes if n != node}
            wait_until(
                lambda n=node, p=peers: routes(lab, n) == p,
                5,
                what=f"{node} to route to every lease of its peers",
            )
        view = pool_view(lab, PRIMARY)
        assert view["create_leases"] is False and view["allocate_addresses"] is False
        all_pods_reach_each_other(lab.pods)

        # Delete the old pods while the new ones talk: the old leases go once every
        # address on them has cooled down, and nothing the new pods use is touched.
        with PodTraffic(lab, new_pods, rate=20.0, streams=3) as traffic:
            deleted_at = time.monotonic()
            for pod in old_pods:
                lab.delete_pod(pod.name)
            gone_at: dict[str, float] = {}

            def released() -> bool:
                held = etcd_leases(lab)
                for node in nodes:
                    if node not in gone_at and not in_pool(held.get(node, []), PRIMARY):
                        gone_at[node] = time.monotonic() - deleted_at
                return len(gone_at) == len(nodes)

            wait_until(
                released,
                COOLDOWN_S + CAPACITY_TICK_S + 10,
                interval=0.5,
                what="the drained leases to be released",
            )
            time.sleep(1.0)
            report = traffic.stop()
        print(
            "release: old leases left etcd "
            + ", ".join(f"{n} {gone_at[n]:.1f} s" for n in nodes)
            + " after their pods were deleted"
        )
        print(f"release traffic between the new pods: {report.summary()}")
        assert report.lost == 0 and not report.broken_streams, report.summary()
        # Not before the cooldown: a cooling address keeps its lease (field notes §2/§3).
        assert min(gone_at.values()) >= COOLDOWN_S, gone_at

        assert etcd_leases(lab) == {n: [new_leases[n]] for n in nodes}
        assert pool_view(lab, PRIMARY)["leases"] == 0
        for node in nodes:
            wait_until(
                lambda n=node: status_json(lab, n)["leases"] == [str(new_leases[n])],
                5,
                what=f"{node}'s status.json to drop the old lease",
            )
            wait_until(
                lambda n=node: (
                    (s := status_record(lab, n)) is not None
                    and list(s.subnets) == [str(new_leases[n])]
                ),
                5,
                what=f"{node}'s status record to drop the old lease",
            )
            assert routes(lab, node) == {new_leases[n] for n in nodes if n != node}
            addrs = addresses(lab, node)
            assert addrs["cni0"] == {IPv4Interface(f"{new_leases[node][1]}/24")}, addrs
            assert addrs["flannel.1"] == {IPv4Interface(f"{new_leases[node][0]}/32")}, addrs
            table = lab.exec(node, ["ip", "-4", "route", "show", "table", "all"]).stdout
            assert "10.244." not in table, table
        all_pods_reach_each_other(lab.pods)


# --- 2. untagged pool, role removal -------------------------------------------------------------


def test_an_untagged_pool_takes_no_lease_and_removing_role_1_keeps_its_leases_serving() -> None:
    """The primary drained with nowhere to go: every node says so. An untagged pool
    changes nothing (creation fails closed). Tagged role 1 it takes leases; untagged
    again, those leases keep serving (existing pods and new ones) and no node gets a
    new lease there."""
    with pool_lab(3, pods_per_node=1) as lab:
        nodes = [n.name for n in lab.nodes]
        pools(lab, "tag", str(PRIMARY), f"{ROLE}=0")
        for node in nodes:
            wait_until(
                lambda n=node: EXHAUSTED in log_since_start(lab, n),
                10,
                what=f"{node} to say no pool takes a lease",
            )

        pools(lab, "add", str(NEW))
        untagged = f"{NEW} has no {ROLE} tag (untagged pools take no new leases)"
        for node in nodes:
            wait_until(
                lambda n=node: untagged in log_since_start(lab, n),
                10,
                what=f"{node} to refuse the untagged pool",
            )
        view = pool_view(lab, NEW)
        assert view["create_leases"] is False and view["leases"] == 0, view
        assert f"has no {ROLE} tag" in view["reason"]
        # Each node refused it while trying to add a lease: it knows the pool. Its next
        # capacity round must not take one either.
        wait_for_capacity_round(agents(lab, nodes))
        assert all(not in_pool(v, NEW) for v in etcd_leases(lab).values())

        # n3 is away while the pool is opted in: it comes back after the role is gone.
        lab.kill_agent("n3")
        pools(lab, "tag", str(NEW), f"{ROLE}=1")
        leased = wait_pool_leases(lab, ["n1", "n2"], NEW)
        first = {n: lab.add_pod(n) for n in ("n1", "n2")}
        for node, pod in first.items():
            assert net_of(pod) == leased[node]

        up = agents(lab, ["n1", "n2"])
        before = {node.name: quiet_count(node, "control") for node in up}
        out = pools(lab, "untag", str(NEW), ROLE)
        assert f"to drain it, tag it {ROLE}=0" in out, out
        view = pool_view(lab, NEW)
        assert view["create_leases"] is False and view["allocate_addresses"] is True, view
        for node in up:  # the untag reached the agents, then a capacity round ran
            wait_until_processed(node, "control", after=before[node.name])
        wait_for_capacity_round(up)
        # Fail open: the leases stay and still hand out addresses.
        second = lab.add_pod("n1")
        assert net_of(second) == leased["n1"], second
        assert {n: in_pool(v, NEW) for n, v in etcd_leases(lab).items() if in_pool(v, NEW)} == {
            n: [s] for n, s in leased.items()
        }

        # Fail closed: n3 returns with no serving lease and may not lease in NEW.
        lab.start_agent("n3")
        lab.wait_ready("n3")
        wait_until(
            lambda: untagged in log_since_start(lab, "n3"),
            10,
            what="n3 to refuse the pool whose role was removed",
        )
        wait_for_capacity_round(agents(lab, ["n3"]))
        assert not in_pool(etcd_leases(lab)["n3"], NEW)
        assert pool_view(lab, NEW)["leases"] == 2
        for node in ("n1", "n2"):
            wait_until(
                lambda n=node: routes(lab, "n3") >= {leased[n]},
                10,
                what=f"n3 to route to {node}'s lease in {NEW}",
            )
        all_pods_reach_each_other(lab.pods)


# --- 3. cluster scope ---------------------------------------------------------------------------


def test_a_cluster_scoped_pool_serves_only_the_agents_of_that_cluster() -> None:
    """Two clusters in one store: n1, n2 run with --cluster-name a, n3, n4 with b,
    all on the lab's one etcd and prefix. That is how two clusters share pools: the
    pool records live under the shared prefix, and a pool tagged
    flannelpy.io/cluster/<name> is for that cluster alone (untagged ones for all)."""
    with pool_lab(4, start_agents=False) as lab:
        for node, cluster in (("n1", "a"), ("n2", "a"), ("n3", "b"), ("n4", "b")):
            lab.set_node_agent_args(node, ["--cluster-name", cluster])
        lab.start_agents()
        for node in ("n1", "n2", "n3", "n4"):
            lab.add_pod(node)

        pools(lab, "add", str(NEW))
        pools(lab, "tag", str(NEW), "flannelpy.io/cluster/a=1")
        pools(lab, "tag", str(NEW), f"{ROLE}=1")
        pools(lab, "tag", str(PRIMARY), f"{ROLE}=0")
        assert pool_view(lab, NEW, "a")["create_leases"] is True
        view_b = pool_view(lab, NEW, "b")
        assert view_b["create_leases"] is False and "belongs to cluster(s) a" in view_b["reason"]

        in_a = wait_pool_leases(lab, ["n1", "n2"], NEW)
        refusal = f"{NEW} belongs to cluster(s) a, not b"
        for node in ("n3", "n4"):
            wait_until(
                lambda n=node: refusal in log_since_start(lab, n),
                10,
                what=f"{node} to refuse cluster a's pool",
            )
        # They refused it trying to add a lease, so they know every change above.
        wait_for_capacity_round(agents(lab, ["n3", "n4"]))
        held = etcd_leases(lab)
        for node in ("n3", "n4"):  # still on their drained primary lease alone
            assert len(held[node]) == 1 and held[node][0].subnet_of(PRIMARY), held

        # Cluster b's own pool: n3 and n4 lease there, and a's nodes never do.
        in_a_agents = agents(lab, ["n1", "n2"])
        before = {node.name: quiet_count(node, "control") for node in in_a_agents}
        pools(lab, "add", str(OTHER))
        pools(lab, "tag", str(OTHER), "flannelpy.io/cluster/b=1")
        pools(lab, "tag", str(OTHER), f"{ROLE}=1")
        in_b = wait_pool_leases(lab, ["n3", "n4"], OTHER)
        for node in in_a_agents:  # all three changes reached them, then a capacity round
            wait_until_processed(node, "control", after=before[node.name] + 2)
        wait_for_capacity_round(in_a_agents)
        held = etcd_leases(lab)
        assert all(not in_pool(held[n], OTHER) for n in ("n1", "n2")), held
        assert all(len(in_pool(held[n], NEW)) == 1 for n in ("n1", "n2")), held
        assert all(not in_pool(held[n], NEW) for n in ("n3", "n4")), held

        for node, lease in {**in_a, **in_b}.items():
            pod = lab.add_pod(node)
            assert net_of(pod) == lease, pod
        all_pods_reach_each_other(lab.pods)


# --- 4. a node on the previous release ----------------------------------------------------------


@pytest.fixture()
def previous_release() -> Iterator[str]:
    """The previous release's source tree (flannelpy/ and cni_plugin/), from git."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(flannelpy.__file__)))
    found = subprocess.run(
        ["git", "-C", root, "cat-file", "-e", f"{PREVIOUS_RELEASE}^{{commit}}"],
        capture_output=True,
        text=True,
    )
    if found.returncode != 0:
        pytest.fail(
            f"commit {PREVIOUS_RELEASE} (the previous release) is not in the checkout at {root}; "
            "this test needs the full history: run `git fetch --unshallow` (or clone without "
            f"--depth) and run it again ({found.stderr.strip()})"
        )
    tree = tempfile.mkdtemp(prefix="flannelpy-previous-")
    try:
        archive = subprocess.run(
            ["git", "-C", root, "archive", PREVIOUS_RELEASE, "flannelpy", "cni_plugin"],
            capture_output=True,
            check=True,
        )
        subprocess.run(["tar", "-x", "-C", tree], input=archive.stdout, check=True)
        yield tree
    finally:
        shutil.rmtree(tree, ignore_errors=True)


FLANNEL_LEASE_KEYS = {"PublicIP", "PublicIPv6", "BackendType", "BackendData"}


def test_a_node_on_the_previous_release_interoperates_with_multi_lease_nodes(
    previous_release: str,
) -> None:
    """n3 runs the release before pools (single lease, no pool records read); n1, n2
    this one. Draining the primary gives n1, n2 a second lease in the new pool, which
    n3 routes to because lease keys and JSON stay Flannel's; n3 keeps its one lease."""
    name = unique_lab_name("p")
    before = host_snapshot()
    with pool_lab(3, start_agents=False, name=name) as lab:
        lab.set_node_agent_source("n3", previous_release)
        lab.start_agents()
        for node in ("n1", "n2", "n3"):
            lab.add_pod(node)
        # It is the old agent: it started, writes no status record and no "leases".
        assert "agent ready subnet=" in log_since_start(lab, "n3")
        assert "leases" not in status_json(lab, "n3") and "leases" in status_json(lab, "n1")
        assert status_record(lab, "n3") is None and status_record(lab, "n1") is not None
        n3_lease = etcd_leases(lab)["n3"]
        assert len(n3_lease) == 1 and n3_lease[0].subnet_of(PRIMARY)

        pools(lab, "add", str(NEW))
        pools(lab, "tag", str(NEW), f"{ROLE}=1")
        pools(lab, "tag", str(PRIMARY), f"{ROLE}=0")
        second = wait_pool_leases(lab, ["n1", "n2"], NEW)
        wait_until(
            lambda: routes(lab, "n3") >= set(second.values()),
            10,
            what="the old node to route to the new pool's leases",
        )
        # The old agent counts no events: its status file, rewritten twice since, shows
        # that it went on running after the drain.
        for _ in range(2):
            fresh_status(lab.node("n3"))
        assert etcd_leases(lab)["n3"] == n3_lease  # the old agent never reads pools
        # Old and new leases alike: Flannel's key form and JSON, our extension apart.
        docs = lease_docs(lab)
        assert len(docs) == 5
        for subnet, doc in docs.items():
            assert FLANNEL_LEASE_KEYS <= set(doc) <= FLANNEL_LEASE_KEYS | {"Flannelpy"}, doc
            assert set(doc["BackendData"]) == {"VNI", "VtepMAC"}, (subnet, doc)
            assert set(doc["Flannelpy"]) <= {"NodeName", "MTU"}, (subnet, doc)

        for node in ("n1", "n2"):
            pod = lab.add_pod(node)
            assert net_of(pod) == second[node], pod
        # The old node ignores the drain (it knows no pools): its new pod still lands
        # in its primary lease. Upgrade every node before draining a pool.
        old_node_pod = lab.add_pod("n3")
        assert net_of(old_node_pod) == n3_lease[0]
        all_pods_reach_each_other(lab.pods)
        # Known limitation: the old node's masquerade rules know the primary pool only,
        # so its pods reach the new pool's pods from the node's address (masqueraded).
        nat = lab.exec("n3", ["iptables", "-t", "nat", "-S", "FLANNEL-POSTRTG"]).stdout
        print(f"\nthe old node's masquerade rules:\n{nat}")
        assert str(NEW) not in nat
        masq_before = masqueraded(lab, "n3")
        target = next(p for p in lab.pods if p.node == "n1" and net_of(p) == second["n1"])
        ping = ["ping", "-c", "1", "-W", "2", str(target.ip)]
        assert (
            subprocess.run(
                ["ip", "netns", "exec", old_node_pod.namespace, *ping],
                capture_output=True,
                timeout=10,
            ).returncode
            == 0
        )
        assert masqueraded(lab, "n3") > masq_before
    # `lab down` stops the old agent as any other: nothing of the lab is left.
    assert lab_residue(before, host_snapshot(), name) == []


def masqueraded(lab: Lab, node: str) -> int:
    """Packets the node's MASQUERADE rule for pod traffic leaving the pod network took."""
    out = lab.exec(node, ["iptables", "-t", "nat", "-L", "FLANNEL-POSTRTG", "-v", "-n", "-x"])
    rows = [line.split() for line in out.stdout.splitlines()]
    counts = [int(r[0]) for r in rows if "MASQUERADE" in r and "224.0.0.0/4" in " ".join(r)]
    assert len(counts) == 1, out.stdout
    return counts[0]
