"""etcd as a distributed system: a 4-node vxlan lab on a 3-member etcd cluster
(``lab up --etcd-members 3``), with pod-to-pod traffic between every ordered pod pair
through each fault (issue 12, item 7):

a. the leader is SIGKILLed; a new one is elected; the old member comes back;
b. one member is cut off (iptables DROP in its namespace) from the other two and from
   half of the nodes; a peer lease written through the majority meanwhile must reach
   every node (its FDB entry appears) once the partition heals, and the agents that used
   the cut-off member must move to another endpoint;
c. all three members are down for 60 s, then back; every node's lease is renewed after.

Throughout: no echo is lost, no stream breaks, and no agent exits (same pids). Agents run
with a 120 s lease and a 1 minute renew margin, so each renews about once a minute and
a renewal falls due during the outage. The run prints one line per phase and a summary.

Also: ``down`` removes the members of a lab whose start failed half-way, or whose state
file is gone.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime
from ipaddress import IPv4Network

import pytest
from flannelpy_lab import Lab, agents, procs
from flannelpy_lab import etcd as lab_etcd
from flannelpy_lab.errors import LabError
from flannelpy_lab.lab import down as lab_down
from flannelpy_lab.state import EtcdMemberInfo, LabState

from flannelpy.errors import StoreUnavailable
from flannelpy.store.etcd.client import EtcdStore
from flannelpy.subnet.keys import lease_key, subnets_prefix
from flannelpy.subnet.lease import LeaseAttrs
from tests.support.kernel_entries import VXLAN_DEVICE
from tests.support.lab_util import (
    host_snapshot,
    lab_residue,
    running_lab,
    segment_ip,
    unique_lab_name,
    wait_until,
)
from tests.support.traffic import PodTraffic, TrafficReport

pytestmark = [
    pytest.mark.lab,
    pytest.mark.netns,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root to build the netns lab"),
]

NODES = 4
RATE = 20.0  # echoes per second per ordered pod pair
LEASE_TTL_S = 120
AGENT_ARGS = ["--subnet-lease-ttl", str(LEASE_TTL_S), "--subnet-lease-renew-margin", "1"]
OUTAGE_S = 60.0
# A peer that exists only as a lease: its FDB entry on a node proves the node's agent saw it.
PEER_SUBNET = IPv4Network("10.244.250.0/24")
PEER_HOST = 200  # its host number on the lab's segment (labs side by side differ)
PEER_MAC = "02:00:00:00:fa:01"
MOVED = re.compile(
    r"^(\S+) .*etcd requests moved to another endpoint "
    r"from=\S*?(http://[0-9.:]+)\S* to=\S*?(http://[0-9.:]+)",
    re.M,
)


def test_down_removes_members_after_a_partial_start_and_without_state(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A member that cannot start fails ``up``, which removes the members already running;
    ``down`` of a lab whose state file is gone sweeps its members by name."""
    before = host_snapshot()
    real_argv = lab_etcd.member_argv

    def third_member_fails(state: LabState, member: EtcdMemberInfo) -> list[str]:
        argv = real_argv(state, member)
        return [*argv, "--no-such-flag"] if member.name.endswith("-e3") else argv

    name = unique_lab_name()
    monkeypatch.setattr(lab_etcd, "member_argv", third_member_fails)
    with pytest.raises(LabError, match="etcd exited during start"):
        Lab.up(name, 2, etcd_members=3, start_agents=False)
    assert lab_residue(before, host_snapshot(), name) == []
    monkeypatch.undo()

    name = unique_lab_name()
    partial = Lab.up(name, 2, etcd_members=3, start_agents=False)
    try:
        assert len([d for d in partial.etcd_status() if d["running"]]) == 3
        os.remove(partial.state.state_path)
    finally:
        lab_down(name)
    assert lab_residue(before, host_snapshot(), name) == []
    assert not os.path.exists(partial.state.lab_dir)


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with running_lab(NODES, "vxlan", etcd_members=3, start_agents=False) as lab:
        lab.set_agent_args(AGENT_ARGS)
        lab.start_agents()
        lab.install_cni()
        for node in lab.nodes:
            lab.add_pod(node.name)
        yield lab


# -- observations -------------------------------------------------------------------


def agent_refs(lab: Lab) -> dict[str, procs.ProcessRef | None]:
    return {n.name: agents.agent_ref(n) for n in lab.nodes}


def restarts(lab: Lab, before: dict[str, procs.ProcessRef | None]) -> list[str]:
    """Nodes whose agent is not the process it was (exited, or another pid)."""
    now = agent_refs(lab)
    return [n for n, ref in before.items() if ref is None or now[n] != ref or not procs.alive(ref)]


def node_leases(store: EtcdStore, lab: Lab) -> dict[str, tuple[int, int]]:
    """Each node's lease as (mod_revision, etcd lease id), by node name."""
    kvs, _ = store.get_prefix(subnets_prefix(lab.state.etcd_prefix))
    by_ip = {}
    for kv in kvs:
        try:
            by_ip[str(LeaseAttrs.from_json(kv.value).public_ip)] = (kv.mod_revision, kv.lease_id)
        except ValueError:
            continue
    return {n.name: by_ip[str(n.ip)] for n in lab.nodes if str(n.ip) in by_ip}


def leases_or_none(store: EtcdStore, lab: Lab) -> dict[str, tuple[int, int]] | None:
    try:
        return node_leases(store, lab)
    except StoreUnavailable:
        return None


def has_peer(lab: Lab, node: str) -> bool:
    """Does the node's vxlan device hold the peer's FDB entry (one command, so polling
    all nodes in parallel times its arrival to a few tenths of a second)?"""
    proc = lab.exec(node, ["bridge", "-j", "fdb", "show", "dev", VXLAN_DEVICE], check=False)
    entries = json.loads(proc.stdout or "[]") if proc.returncode == 0 else []
    return any(
        e.get("mac", "").lower() == PEER_MAC and e.get("dst") == segment_ip(lab, PEER_HOST)
        for e in entries
    )


def nodes_with_peer(lab: Lab) -> set[str]:
    with ThreadPoolExecutor(max_workers=NODES) as pool:
        seen = pool.map(lambda n: (n.name, has_peer(lab, n.name)), lab.nodes)
        return {name for name, ok in seen if ok}


def current_endpoint(lab: Lab, node: str) -> str:
    """The endpoint the node's agent sends to: the last one its log says it moved to,
    else the first of its list."""
    with open(lab.node(node).agent_log, encoding="utf-8", errors="replace") as f:
        moves = MOVED.findall(f.read())
    return moves[-1][2] if moves else lab.etcd_endpoints[0]


def moves_since(lab: Lab, node: str, offset: int) -> list[tuple[float, str, str]]:
    """(unix time, from, to) of every move logged after ``offset`` in the agent's log."""
    with open(lab.node(node).agent_log, encoding="utf-8", errors="replace") as f:
        f.seek(offset)
        text = f.read()
    # The agent logs local time: read it back the same way.
    return [
        (datetime.fromisoformat(at).timestamp(), src, dst) for at, src, dst in MOVED.findall(text)
    ]


def wait_leader(lab: Lab, timeout: float, not_this: str | None = None) -> EtcdMemberInfo:
    def elected() -> EtcdMemberInfo | None:
        leader = lab.etcd_leader()
        return leader if leader is not None and leader.name != not_this else None

    return wait_until(elected, timeout, "an etcd leader election")


def wait_all_members_healthy(lab: Lab, timeout: float = 30.0, steady_s: float = 2.0) -> None:
    """Until every member runs and all name one leader, the same for ``steady_s``."""
    since: list[float] = []

    def healthy() -> bool:
        docs = lab.etcd_status()
        ids = {d["leader_id"] for d in docs}
        if not (all(d["running"] and not d["error"] for d in docs) and len(ids) == 1):
            since.clear()
            return False
        since.append(time.monotonic())
        return since[-1] - since[0] >= steady_s

    wait_until(healthy, timeout, "all etcd members agreeing on one leader")


@contextmanager
def partitioned(lab: Lab, member: EtcdMemberInfo, peers: list[str]) -> Iterator[None]:
    """DROP everything between ``member`` and ``peers`` (addresses), both ways, inside the
    member's namespace; removed on exit whatever happens."""
    rules = [
        r
        for ip in peers
        for r in (["INPUT", "-s", ip, "-j", "DROP"], ["OUTPUT", "-d", ip, "-j", "DROP"])
    ]
    added = []
    try:
        for rule in rules:
            lab.exec_etcd_member(member.name, ["iptables", "-w", "-I", *rule])
            added.append(rule)
        yield
    finally:
        for rule in added:
            lab.exec_etcd_member(member.name, ["iptables", "-w", "-D", *rule], check=False)


def fmt_times(times: dict[str, float]) -> str:
    return " ".join(f"{n}={t:.1f}" for n, t in sorted(times.items()))


def fmt_moves(moved: dict[str, list[tuple[float, str, str]]], since: float) -> str:
    return "; ".join(
        f"{n}: " + ", ".join(f"{a}->{b} at +{at - since:.1f} s" for at, a, b in m)
        for n, m in moved.items()
    )


def error_lines(lab: Lab) -> dict[str, int]:
    counts = {}
    for n in lab.nodes:
        with open(n.agent_log, encoding="utf-8", errors="replace") as f:
            counts[n.name] = sum(1 for line in f if " ERROR " in line or "Traceback" in line)
    return counts


def phase_line(name: str, report: TrafficReport) -> str:
    streams = len(report.broken_streams)
    return (
        f"{name}: {report.sent} echoes sent, {report.lost} lost, "
        f"{streams} of {len(report.streams)} streams broken"
    )


# -- the run ------------------------------------------------------------------------


def test_agents_outlive_leader_kill_partition_and_full_outage(lab: Lab) -> None:
    started = time.monotonic()
    pids = agent_refs(lab)
    assert all(pids.values())
    store = EtcdStore(lab.etcd_endpoints)
    admin: EtcdStore | None = None
    lines: list[str] = []

    def note(line: str) -> None:
        lines.append(line)
        print(line, flush=True)

    try:
        # (a) the leader dies.
        with PodTraffic(lab, rate=RATE, streams=3) as traffic:
            old = wait_leader(lab, 10.0)
            killed_at = time.monotonic()
            lab.kill_etcd_member(old.name)  # SIGKILL
            new = wait_leader(lab, 15.0, not_this=old.name)
            new_leader_s = time.monotonic() - killed_at
            lab.start_etcd_member(old.name)
            wait_all_members_healthy(lab)
            time.sleep(3.0)  # traffic keeps flowing over the settled cluster
            a = traffic.stop()
        note(
            phase_line("a) leader killed", a)
            + f"; new leader {new.name} after {new_leader_s:.1f} s"
        )
        assert a.lost == 0 and not a.broken_streams, a.summary()
        assert not restarts(lab, pids)

        # (b) one member cut off from the other two and from half of the nodes.
        using = {n.name: current_endpoint(lab, n.name) for n in lab.nodes}
        busiest = max(lab.etcd_endpoints, key=list(using.values()).count)
        lonely = next(m for m in lab.state.etcd_members if m.client_url == busiest)
        majority = [m for m in lab.state.etcd_members if m is not lonely]
        cut_nodes = lab.nodes[: NODES // 2]
        on_lonely = [n for n, url in using.items() if url == lonely.client_url]
        assert on_lonely, f"no agent uses {lonely.name}: {using}"
        log_offsets = {n.name: os.path.getsize(n.agent_log) for n in lab.nodes}
        admin = EtcdStore([m.client_url for m in majority])
        key = lease_key(lab.state.etcd_prefix, PEER_SUBNET)
        peer = LeaseAttrs.from_json(
            json.dumps(
                {
                    "PublicIP": segment_ip(lab, PEER_HOST),
                    "BackendType": "vxlan",
                    "BackendData": {"VNI": 1, "VtepMAC": PEER_MAC},
                }
            )
        )
        seen_at: dict[str, float] = {}  # node -> seconds from the write to its FDB entry

        def note_seen(seen: dict[str, float], since: float) -> int:
            now = time.monotonic() - since
            for name in nodes_with_peer(lab) - set(seen):
                seen[name] = now
            return len(seen)

        with PodTraffic(lab, rate=RATE, streams=3) as traffic:
            cut_at = time.time()
            with partitioned(
                lab, lonely, [str(m.ip) for m in majority] + [str(n.ip) for n in cut_nodes]
            ):
                wait_leader(lab, 15.0, not_this=lonely.name)
                time.sleep(3.0)  # the cut-off member notices it has no leader
                granted = admin.grant_lease(600)
                admin.put(key, peer.to_json().encode(), granted.id)
                written_at = time.monotonic()
                # Agents reach the majority (those that used the cut-off member move):
                # the change may arrive while the partition lasts; wait a little for it.
                deadline = written_at + 25.0
                while time.monotonic() < deadline and len(seen_at) < NODES:
                    note_seen(seen_at, written_at)
                    time.sleep(0.2)
            seen_during = dict(seen_at)
            healed_at = time.monotonic()
            wait_until(
                lambda: note_seen(seen_at, written_at) == NODES,
                30.0,
                "the lease written during the partition reaching every node",
            )
            seen_all_s = time.monotonic() - healed_at
            wait_all_members_healthy(lab)
            b = traffic.stop()
        moved = {n: moves_since(lab, n, log_offsets[n]) for n in on_lonely}
        note(
            phase_line(
                f"b) {lonely.name} cut off from 2 members and "
                f"{', '.join(n.name for n in cut_nodes)}",
                b,
            )
            + f"; peer lease on {len(seen_during)}/{NODES} nodes during the "
            f"partition, on all {seen_all_s:.1f} s after the heal; seconds from the "
            f"write per node: {fmt_times(seen_at)}; agents that used it: "
            f"{', '.join(on_lonely)}, moved: {fmt_moves(moved, cut_at)}"
        )
        assert b.lost == 0 and not b.broken_streams, b.summary()
        assert not restarts(lab, pids)
        for node, moves in moved.items():
            assert any(src == lonely.client_url for _, src, _ in moves), (
                f"the agent of {node} used {lonely.name} and did not move off it: {moves}"
            )

        # (c) every member down for a minute.
        before = wait_until(lambda: leases_or_none(store, lab), 15.0, "reading every lease")
        assert set(before) == {n.name for n in lab.nodes}
        with PodTraffic(lab, rate=RATE, streams=3) as traffic:
            lab.stop_etcd()
            time.sleep(OUTAGE_S)
            assert not restarts(lab, pids), "an agent exited while etcd was down"
            back_at = time.monotonic()
            lab.start_etcd()
            wait_leader(lab, 30.0)
            renewed_at: dict[str, float] = {}

            def all_renewed() -> bool:
                try:
                    now = node_leases(store, lab)
                except StoreUnavailable:  # a fresh cluster may hold another election
                    return False
                for node, (revision, lease_id) in now.items():
                    if node not in renewed_at and (revision, lease_id) != before[node]:
                        renewed_at[node] = time.monotonic() - back_at
                return len(renewed_at) == NODES

            wait_until(all_renewed, LEASE_TTL_S, "every lease renewed after the outage")
            # Watches work again: deleting the peer lease removes it from every node.
            admin.revoke_lease(granted.id)
            wait_until(
                lambda: not nodes_with_peer(lab),
                30.0,
                "a lease deleted after the outage leaving every node",
            )
            c = traffic.stop()
        after = wait_until(lambda: leases_or_none(store, lab), 15.0, "reading every lease")
        remaining = {n: store.lease_remaining(lease_id) for n, (_, lease_id) in after.items()}
        note(
            phase_line(f"c) all members down {OUTAGE_S:.0f} s", c)
            + f"; leases renewed {min(renewed_at.values()):.1f}-"
            f"{max(renewed_at.values()):.1f} s after etcd came back"
        )
        assert c.lost == 0 and not c.broken_streams, c.summary()
        assert all(r is not None and r > LEASE_TTL_S - 30 for r in remaining.values()), remaining
        gone = restarts(lab, pids)
        sent = a.sent + b.sent + c.sent
        lost = a.lost + b.lost + c.lost
        note(
            f"etcd 3-member fault run: {sent} echoes sent, {lost} lost, agent "
            f"restarts {len(gone)}, {time.monotonic() - started:.0f} s"
        )
        note(f"agent log lines at ERROR or above: {error_lines(lab)}")
        print("\n" + "\n".join(lines))  # the whole run's summary, together
        assert not gone
    finally:
        store.close()
        if admin is not None:
            admin.close()
