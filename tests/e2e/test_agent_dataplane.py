"""The agent on the netns lab: real etcd, one real agent per node, real packets.

Each test asserts on what arrives (pings between overlay addresses) or on what
the kernel holds, within the time the issue promises.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from ipaddress import IPv4Interface, IPv4Network
from pathlib import Path

import pytest
from flannelpy_lab import Lab

from flannelpy.store.etcd.client import EtcdStore
from tests.support.lab_util import running_lab, wait_until

pytestmark = [pytest.mark.lab]

PREFIX = "/coreos.com/network"


# --- helpers -----------------------------------------------------------------------------


def store(lab: Lab) -> EtcdStore:
    return EtcdStore([lab.etcd_endpoint])


def lease_key(lab: Lab, node: str) -> str:
    info = lab.node(node)
    subnet = IPv4Interface(info.overlay_address).network  # type: ignore[arg-type]
    return f"{PREFIX}/subnets/{subnet.network_address}-{subnet.prefixlen}"


def subnet_of(lab: Lab, node: str) -> IPv4Network:
    return IPv4Interface(lab.node(node).overlay_address).network  # type: ignore[arg-type]


def ip_json(lab: Lab, node: str, *argv: str) -> list[dict]:  # type: ignore[type-arg]
    out = lab.exec(node, ["ip", "-j", *argv]).stdout
    return list(json.loads(out or "[]"))


def our_routes(lab: Lab, node: str) -> dict[str, dict]:  # type: ignore[type-arg]
    return {r["dst"]: r for r in ip_json(lab, node, "route", "show", "proto", "75")}


def vxlan_neighbours(lab: Lab, node: str) -> set[str]:
    return {
        n["dst"]
        for n in ip_json(lab, node, "neigh", "show", "dev", "flannel.1")
        if "PERMANENT" in n.get("state", [])
    }


def vxlan_fdb(lab: Lab, node: str) -> dict[str, str]:
    out = lab.exec(node, ["bridge", "-j", "fdb", "show", "dev", "flannel.1"]).stdout
    return {e["mac"]: e["dst"] for e in json.loads(out or "[]") if e.get("dst")}


def ping_df(lab: Lab, src: str, dst: str, payload: int) -> subprocess.CompletedProcess[str]:
    a, b = lab.node(src).overlay_ip, lab.node(dst).overlay_ip
    # Not -q: iputils 20221126 prints "message too long" only without it.
    return lab.exec(
        src,
        ["ping", "-c", "1", "-W", "1", "-M", "do", "-s", str(payload), "-I", str(a), str(b)],
        check=False,
    )


def start_ping(lab: Lab, src: str, dst: str, count: int, interval: float) -> subprocess.Popen[str]:
    a, b = lab.node(src).overlay_ip, lab.node(dst).overlay_ip
    return subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            lab.node(src).namespace,
            "ping",
            "-n",
            "-c",
            str(count),
            "-i",
            str(interval),
            "-W",
            "1",
            "-I",
            str(a),
            str(b),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def ping_counts(proc: subprocess.Popen[str], timeout: float) -> tuple[int, int]:
    out, _ = proc.communicate(timeout=timeout)
    m = re.search(r"(\d+) packets transmitted, (\d+) received", out)
    assert m, out
    return int(m.group(1)), int(m.group(2))


def matrix_ok(lab: Lab) -> dict[str, dict[str, bool]]:
    return lab.status()["matrix"]  # type: ignore[no-any-return]


def assert_all_pairs_reach(lab: Lab) -> None:
    matrix = matrix_ok(lab)
    failed = [(a, b) for a, row in matrix.items() for b, ok in row.items() if a != b and not ok]
    assert not failed, f"pairs that do not reach each other: {failed}"


def run_agent_once(
    lab: Lab, node: str, *extra: str, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    """Run an agent in the node's namespace with its own dirs; it is expected to exit."""
    info = lab.node(node)
    scratch = f"{info.node_dir}/scratch"
    argv = [
        "ip",
        "netns",
        "exec",
        info.namespace,
        *_python(),
        "-m",
        "flannelpy",
        "agent",
        "--iface",
        info.underlay_iface,
        "--node-name",
        f"{node}-probe",
        "--subnet-file",
        f"{scratch}/subnet.env",
        "--state-dir",
        f"{scratch}/state",
        "--run-dir",
        f"{scratch}/run",
        "--metrics-addr",
        "off",
        *extra,
    ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def _python() -> list[str]:
    import sys

    return [sys.executable]


# --- labs --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def vxlan_lab() -> Iterator[Lab]:
    with running_lab(3, "vxlan") as lab:
        yield lab


# --- connectivity per backend ------------------------------------------------------------


def test_vxlan_all_pairs_reach(vxlan_lab: Lab) -> None:
    assert_all_pairs_reach(vxlan_lab)


@pytest.mark.parametrize(("backend", "direct"), [("host-gw", False), ("vxlan", True)])
def test_other_backends_all_pairs_reach(backend: str, direct: bool) -> None:
    with running_lab(3, backend, direct_routing=direct) as lab:
        assert_all_pairs_reach(lab)
        routes = our_routes(lab, "n1")
        for peer in ("n2", "n3"):
            route = routes[str(subnet_of(lab, peer))]
            # host-gw and DirectRouting on one segment: straight to the peer, no tunnel.
            assert route["dev"] == "eth0" and route["gateway"] == str(lab.node(peer).ip)
        if backend == "host-gw":
            # No encapsulation: the full underlay MTU crosses with DF set.
            assert ping_df(lab, "n1", "n2", 1500 - 28).returncode == 0


def test_two_segments_host_gw_reports_what_it_cannot_reach() -> None:
    with running_lab(4, "host-gw", segments=2) as lab:
        segment = {n.name: n.segment for n in lab.nodes}

        def far_subnets(me: str) -> set[str]:
            return {str(subnet_of(lab, n.name)) for n in lab.nodes if n.segment != segment[me]}

        def unreachable(me: str) -> list[dict[str, str]]:
            status_file = Path(f"{lab.node(me).node_dir}/run/status.json")
            return json.loads(status_file.read_text())["unreachable"]  # type: ignore[no-any-return]

        # Ready means a node holds its own lease: the first ones learn of the later
        # peers over the watch, and report them at their next status write.
        wait_until(
            lambda: all({u["subnet"] for u in unreachable(n)} == far_subnets(n) for n in segment),
            timeout=20,
            what="every node reporting its far peers unreachable",
        )
        matrix = matrix_ok(lab)
        for a, row in matrix.items():
            for b, ok in row.items():
                if a != b:
                    assert ok == (segment[a] == segment[b]), (a, b, ok)
        far = [n.name for n in lab.nodes if n.segment != segment["n1"]]
        assert all(
            "host-gw needs every node on one L2 segment" in u["reason"] for u in unreachable("n1")
        )
        log = Path(lab.node("n1").agent_log).read_text()
        assert "peer unreachable" in log
        # Never a black hole: no route of ours points at the unreachable peers.
        assert not set(our_routes(lab, "n1")) & {str(subnet_of(lab, n)) for n in far}


def test_two_segments_hybrid_reaches_everyone_direct_or_encapsulated() -> None:
    with running_lab(4, "vxlan", direct_routing=True, segments=2) as lab:
        assert_all_pairs_reach(lab)
        me = lab.node("n1")
        routes = our_routes(lab, "n1")
        for peer in lab.nodes:
            if peer.name == "n1":
                continue
            route = routes[str(subnet_of(lab, peer.name))]
            if peer.segment == me.segment:
                assert (route["dev"], route["gateway"]) == ("eth0", str(peer.ip))
            else:
                assert route["dev"] == "flannel.1" and "onlink" in route.get("flags", [])


# --- MTU ---------------------------------------------------------------------------------


def test_vxlan_df_ping_at_overlay_mtu_crosses_and_one_more_byte_fails_loudly(
    vxlan_lab: Lab,
) -> None:
    mtu = int(Path(vxlan_lab.node("n1").subnet_env).read_text().split("FLANNEL_MTU=")[1].split()[0])
    assert mtu == 1450
    fits = ping_df(vxlan_lab, "n1", "n2", mtu - 28)  # 20 IPv4 + 8 ICMP
    assert fits.returncode == 0, fits.stdout
    too_big = ping_df(vxlan_lab, "n1", "n2", mtu - 28 + 1)
    assert too_big.returncode != 0
    assert "message too long" in (too_big.stdout + too_big.stderr).lower()


# --- self-healing ------------------------------------------------------------------------


def _restored_within(lab: Lab, seconds: float, probe) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    wait_until(probe, timeout=seconds, interval=0.02, what="restoration")
    return time.monotonic() - start


def test_entries_deleted_by_hand_come_back_within_a_second(vxlan_lab: Lab) -> None:
    lab = vxlan_lab
    peer_subnet = str(subnet_of(lab, "n2"))
    peer_vtep = str(subnet_of(lab, "n2").network_address)
    mac = next(m for m, dst in vxlan_fdb(lab, "n1").items() if dst == str(lab.node("n2").ip))

    lab.exec("n1", ["ip", "route", "del", peer_subnet])
    _restored_within(lab, 1.0, lambda: peer_subnet in our_routes(lab, "n1"))

    lab.exec("n1", ["ip", "neigh", "del", peer_vtep, "dev", "flannel.1"])
    _restored_within(lab, 1.0, lambda: peer_vtep in vxlan_neighbours(lab, "n1"))

    lab.exec("n1", ["bridge", "fdb", "del", mac, "dev", "flannel.1", "dst", str(lab.node("n2").ip)])
    _restored_within(lab, 1.0, lambda: mac in vxlan_fdb(lab, "n1"))

    lab.exec("n1", ["ip", "link", "del", "flannel.1"])
    _restored_within(
        lab,
        1.0,
        lambda: (
            peer_subnet in our_routes(lab, "n1")
            and mac in vxlan_fdb(lab, "n1")
            and peer_vtep in vxlan_neighbours(lab, "n1")
        ),
    )
    # The device came back with the same VTEP MAC: peers' entries stay valid.
    assert lab.ping("n2", "n1", attempts=3)
    assert lab.ping("n1", "n2", attempts=3)


def test_flushed_masquerade_chain_is_restored_within_one_resync(vxlan_lab: Lab) -> None:
    def chain() -> list[str]:
        out = vxlan_lab.exec("n1", ["iptables", "-w", "-t", "nat", "-S", "FLANNEL-POSTRTG"]).stdout
        return [line for line in out.splitlines() if line.startswith("-A")]

    before = chain()
    assert len(before) == 6
    vxlan_lab.exec("n1", ["iptables", "-w", "-t", "nat", "-F", "FLANNEL-POSTRTG"])
    assert chain() == []
    _restored_within(vxlan_lab, 5.0 + 1.0, lambda: chain() == before)


# --- restarts and leases -----------------------------------------------------------------


def test_sigkill_restart_keeps_lease_and_loses_no_packet(vxlan_lab: Lab) -> None:
    lab = vxlan_lab
    subnet_before = subnet_of(lab, "n2")
    ping = start_ping(lab, "n1", "n2", count=100, interval=0.05)  # 5 s of traffic
    try:
        time.sleep(0.5)
        lab.kill_agent("n2", signal.SIGKILL)
        lab.start_agent("n2")
        lab.wait_ready("n2")
    finally:
        sent, received = ping_counts(ping, timeout=30)
    assert subnet_of(lab, "n2") == subnet_before
    assert (sent, received) == (100, 100)


def test_own_lease_deleted_is_reacquired_not_fatal(vxlan_lab: Lab) -> None:
    lab = vxlan_lab
    key = lease_key(lab, "n3")
    kv = store(lab)
    try:
        found = kv.get(key)
        assert found is not None
        assert kv.delete_if_mod_revision(key, found.mod_revision)
        wait_until(
            lambda: kv.get(key) is not None,
            timeout=5,
            interval=0.05,
            what="n3 re-acquiring its lease",
        )
    finally:
        kv.close()
    assert "re-acquiring" in Path(lab.node("n3").agent_log).read_text()
    wait_until(lambda: lab.ping("n1", "n3"), timeout=5, what="n1 reaching n3 again")


def test_dead_peers_lease_removed_clears_every_node_within_2s(vxlan_lab: Lab) -> None:
    lab = vxlan_lab
    gone = subnet_of(lab, "n3")
    gone_ip = str(lab.node("n3").ip)
    lab.kill_agent("n3", signal.SIGKILL)
    kv = store(lab)
    try:
        found = kv.get(lease_key(lab, "n3"))
        assert found is not None
        assert kv.delete_if_mod_revision(lease_key(lab, "n3"), found.mod_revision)
        start = time.monotonic()
        for node in ("n1", "n2"):
            wait_until(
                lambda node=node: (
                    str(gone) not in our_routes(lab, node)
                    and str(gone.network_address) not in vxlan_neighbours(lab, node)
                    and gone_ip not in vxlan_fdb(lab, node).values()
                ),
                timeout=2.0 - (time.monotonic() - start),
                interval=0.02,
                what=f"{node} dropping n3's entries",
            )
    finally:
        kv.close()
        lab.start_agent("n3")
        lab.wait_ready("n3")
    wait_until(lambda: lab.ping("n1", "n3"), timeout=5, what="n3 back")


def test_recreated_node_with_new_address_leaves_no_route_to_the_old_one(vxlan_lab: Lab) -> None:
    lab = vxlan_lab
    old_ip = str(lab.node("n3").ip)
    subnet = subnet_of(lab, "n3")
    # A lease is taken over by name only from a holder proven gone: one whose etcd
    # lease has run well past its renewal point, as the old machine's lease shows once
    # it stopped renewing. Age it so (a live namesake is refused, not robbed).
    kv = store(lab)
    try:
        found = kv.get(lease_key(lab, "n3"))
        assert found is not None
        aged = kv.grant_lease(120)
        assert kv.put_if_mod_revision(
            lease_key(lab, "n3"), found.value, found.mod_revision, aged.id
        )
    finally:
        kv.close()
    info = lab.recreate_node("n3")
    assert str(info.ip) != old_ip
    assert subnet_of(lab, "n3") == subnet  # took its own lease over by node name
    for node in ("n1", "n2"):
        wait_until(
            lambda node=node: str(info.ip) in vxlan_fdb(lab, node).values(),
            timeout=3,
            interval=0.05,
            what=f"{node} learning n3's new address",
        )
        assert old_ip not in vxlan_fdb(lab, node).values()
    assert lab.ping("n1", "n3", attempts=3) and lab.ping("n3", "n2", attempts=3)


def test_etcd_outage_keeps_the_data_plane_and_agents_recover(vxlan_lab: Lab) -> None:
    lab = vxlan_lab
    lab.stop_etcd()
    try:
        ping = start_ping(lab, "n1", "n2", count=40, interval=0.05)
        sent, received = ping_counts(ping, timeout=20)
        assert (sent, received) == (40, 40)
        assert all(n.agent_pid and _alive(n.agent_pid) for n in lab.nodes)
    finally:
        lab.start_etcd()
    # After the outage the watch resumes: a restarted peer is seen again by everyone.
    lab.kill_agent("n2", signal.SIGKILL)
    kv = store(lab)
    try:
        found = kv.get(lease_key(lab, "n2"))
        assert found is not None and kv.delete_if_mod_revision(
            lease_key(lab, "n2"), found.mod_revision
        )
    finally:
        kv.close()
    wait_until(
        lambda: str(subnet_of(lab, "n2")) not in our_routes(lab, "n1"),
        timeout=10,
        what="n1 seeing n2's lease go after the outage",
    )
    lab.start_agent("n2")
    lab.wait_ready("n2")
    wait_until(lambda: lab.ping("n1", "n2"), timeout=10, what="n1 reaching n2 after the outage")


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False


# --- clear errors ------------------------------------------------------------------------


def _last_line(proc: subprocess.CompletedProcess[str]) -> str:
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def test_invalid_config_unreachable_etcd_and_full_pool_each_say_one_sentence(
    vxlan_lab: Lab,
) -> None:
    lab = vxlan_lab
    kv = store(lab)
    try:
        kv.put("/bad/config", b'{"Network": "10.244.0.0/16", "SubnetLen": 31}')
        bad = run_agent_once(
            lab, "n1", "--etcd-endpoints", lab.etcd_endpoint, "--etcd-prefix", "/bad"
        )
        assert bad.returncode == 2
        assert "SubnetLen" in _last_line(bad) and "Traceback" not in bad.stderr

        down = run_agent_once(
            lab, "n1", "--etcd-endpoints", "http://127.0.0.1:9", "--startup-timeout", "2"
        )
        assert down.returncode == 3, down.stderr
        assert "etcd" in _last_line(down) and "Traceback" not in down.stderr

        # /28 in /30s: SubnetMin is the second, so 3 subnets, all taken by others.
        kv.put(
            "/full/config",
            b'{"Network": "10.99.0.0/28", "SubnetLen": 30, "Backend": {"Type": "vxlan"}}',
        )
        for i, sub in enumerate(("10.99.0.4-30", "10.99.0.8-30", "10.99.0.12-30")):
            kv.put(
                f"/full/subnets/{sub}",
                json.dumps(
                    {
                        "PublicIP": f"100.127.0.{i + 1}",
                        "BackendType": "vxlan",
                        "BackendData": {"VNI": 1, "VtepMAC": f"02:00:00:00:00:0{i}"},
                    }
                ).encode(),
            )
        full = run_agent_once(
            lab, "n1", "--etcd-endpoints", lab.etcd_endpoint, "--etcd-prefix", "/full"
        )
        assert full.returncode == 4, full.stderr
        assert "no free subnet" in _last_line(full) and "Traceback" not in full.stderr
    finally:
        kv.close()
    # None of these touched the node: the lab still works.
    assert lab.ping("n1", "n2")


# --- many agents at once -----------------------------------------------------------------


def test_twenty_agents_started_together_get_distinct_leases() -> None:
    with running_lab(20, "vxlan", timeout=120) as lab:
        leases = lab.status()["leases"]
        subnets = [lease["subnet"] for lease in leases]
        assert len(leases) == 20 and len(set(subnets)) == 20
        assert {lease["node_name"] for lease in leases} == {f"n{i}" for i in range(1, 21)}
        assert lab.ping("n1", "n20") and lab.ping("n13", "n7")


def test_network_overlapping_a_route_on_the_node_is_refused_before_touching_it(
    vxlan_lab: Lab,
) -> None:
    lab = vxlan_lab
    kv = store(lab)
    lab.exec("n1", ["ip", "route", "add", "10.98.0.0/24", "dev", "eth0"])
    try:
        kv.put(
            "/overlap/config",
            b'{"Network": "10.98.0.0/16", "Backend": {"Type": "vxlan", "VNI": 7}}',
        )
        refused = run_agent_once(
            lab, "n1", "--etcd-endpoints", lab.etcd_endpoint, "--etcd-prefix", "/overlap"
        )
        assert refused.returncode == 2, refused.stderr
        line = _last_line(refused)
        assert "10.98.0.0/16 overlaps route 10.98.0.0/24" in line and "--allow-overlap" in line
        assert "flannel.7" not in lab.exec("n1", ["ip", "link", "show"]).stdout
        leases, _ = kv.get_prefix("/overlap/subnets/")
        assert leases == []
    finally:
        lab.exec("n1", ["ip", "route", "del", "10.98.0.0/24", "dev", "eth0"], check=False)
        kv.close()
