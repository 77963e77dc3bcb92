"""Mixed clusters: two nodes of ours beside two real flanneld nodes, on one etcd.

flanneld is the pinned upstream build (``scripts/build-peers.sh``); it is never
skipped: without it these tests fail, naming the script. For each of vxlan,
host-gw and vxlan with DirectRouting, on a 4-node lab (n1, n2 ours; n3, n4
flanneld) with one pod per node:

- every node pair and every pod pair reaches (the lab's matrices);
- a DF ping at exactly the overlay MTU crosses between a pod of ours and a pod on
  a flanneld node, both ways, and one byte more does not leave the pod;
- each node's kernel holds exactly the entries the other nodes' leases ask for;
- flanneld's leases parse with our reader, and subnet.env reads the same from both.

Pods on flanneld nodes are made by the reference bridge + host-local plugins with
the flannel CNI plugin's delegate config (see ``flannelpy_lab.flanneld``).
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Iterator
from ipaddress import IPv4Address, IPv4Interface, IPv4Network

import pytest
from flannelpy_lab import Lab, LabError, flanneld
from flannelpy_lab.pods import pod_matrix
from flannelpy_lab.state import NodeInfo, PodInfo

from flannelpy.subnet import subnet_env
from tests.support.kernel_entries import (
    VXLAN_DEVICE,
    entry_mismatches,
    expected_entries,
    kernel_entries,
    read_leases,
)
from tests.support.lab_util import (
    print_agent_logs_if_failed,
    running_lab,
    running_mixed_lab,
    segment_ip,
    wait_until,
)

pytestmark = [pytest.mark.lab]

MODES = [  # (backend, DirectRouting, underlay segments)
    pytest.param(("vxlan", False, 1), id="vxlan"),
    pytest.param(("host-gw", False, 1), id="host-gw"),
    pytest.param(("vxlan", True, 1), id="vxlan-directrouting"),
    # n1, n2 (ours) and n3, n4 (flanneld) on two segments joined by a router: every
    # mixed pair is off-link, so both sides must encapsulate it.
    pytest.param(("vxlan", True, 2), id="vxlan-directrouting-2seg"),
]
OURS, THEIRS = ("n1", "n2"), ("n3", "n4")
CONVERGE = 20.0  # seconds for every agent to program every peer
ICMP_OVERHEAD = 28  # IPv4 header + ICMP header: ping's -s is the MTU minus this


@pytest.fixture(scope="module", params=MODES)
def mixed_lab(request: pytest.FixtureRequest) -> Iterator[Lab]:
    backend, direct_routing, segments = request.param
    with running_mixed_lab(
        backend, direct_routing=direct_routing, segments=segments, pods_per_node=1
    ) as lab:
        yield lab


@pytest.fixture
def lab(request: pytest.FixtureRequest, mixed_lab: Lab) -> Iterator[Lab]:
    """The module's mixed lab; a failing test prints every node's log tail."""
    yield mixed_lab
    print_agent_logs_if_failed(request, mixed_lab)


def _pod_on(lab: Lab, node: str) -> PodInfo:
    return next(p for p in lab.pods if p.node == node)


def _pod_mtu(pod: PodInfo) -> int:
    out = _in_pod(pod, ["ip", "-j", "link", "show", "eth0"]).stdout
    return int(json.loads(out)[0]["mtu"])


def _in_pod(pod: PodInfo, argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["ip", "netns", "exec", pod.namespace, *argv], capture_output=True, text=True, timeout=30
    )


def _df_ping(src: PodInfo, dst: PodInfo, payload: int) -> subprocess.CompletedProcess[str]:
    return _in_pod(src, ["ping", "-M", "do", "-s", str(payload), "-c", "1", "-W", "2", str(dst.ip)])


def _overlay_mtu(lab: Lab) -> int:
    mtus = {n.name: _subnet_env(lab, n.name).mtu for n in lab.nodes}
    assert len(set(mtus.values())) == 1, f"the nodes disagree on the overlay MTU: {mtus}"
    return next(iter(mtus.values()))


def _subnet_env(lab: Lab, node: str) -> subnet_env.SubnetEnv:
    env = subnet_env.read_subnet_env(lab.node(node).subnet_env)
    assert env is not None, f"{node} has no subnet.env"
    return env


def _direct_peers(lab: Lab, node: NodeInfo) -> set[IPv4Address]:
    """The peers ``node`` routes on the underlay with DirectRouting: those on its segment."""
    if not lab.state.direct_routing:
        return set()
    return {n.ip for n in lab.nodes if n.segment == node.segment}


def test_every_node_pair_and_pod_pair_reaches(lab: Lab) -> None:
    def all_reach() -> bool:
        return bool(lab.status()["ok"])

    wait_until(all_reach, timeout=CONVERGE, interval=1.0, what="every pair reaching")
    doc = lab.status()
    nodes = [ok for row in doc["matrix"].values() for ok in row.values()]
    pods = [ok for row in doc["pod_matrix"].values() for ok in row.values()]
    assert len(nodes) == 4 * 3 and all(nodes), doc["matrix"]
    assert len(pods) == 4 * 3 and all(pods), doc["pod_matrix"]
    assert {n["name"]: n["agent_kind"] for n in doc["nodes"]} == {
        "n1": "flannelpy",
        "n2": "flannelpy",
        "n3": "flanneld",
        "n4": "flanneld",
    }


def test_df_ping_at_the_overlay_mtu_crosses_between_ours_and_flanneld_both_ways(
    lab: Lab,
) -> None:
    mtu = _overlay_mtu(lab)
    assert mtu == (1450 if lab.state.backend == "vxlan" else 1500)
    ours, theirs = _pod_on(lab, OURS[0]), _pod_on(lab, THEIRS[0])
    assert (_pod_mtu(ours), _pod_mtu(theirs)) == (mtu, mtu)
    wait_until(
        lambda: pod_matrix([ours, theirs])[ours.name][theirs.name],
        timeout=CONVERGE,
        what=f"{ours.name} reaching {theirs.name}",
    )
    for src, dst in ((ours, theirs), (theirs, ours)):
        full = _df_ping(src, dst, mtu - ICMP_OVERHEAD)
        assert full.returncode == 0, f"DF ping of {mtu} bytes {src.name} -> {dst.name}: " + (
            full.stdout + full.stderr
        )
        over = _df_ping(src, dst, mtu - ICMP_OVERHEAD + 1)
        assert over.returncode != 0, f"{mtu + 1} bytes left {src.name} with DF set"


def test_each_kernel_holds_exactly_what_the_other_leases_ask_for(lab: Lab) -> None:
    backend = lab.state.backend

    def mismatches() -> dict[str, str]:
        leases = read_leases(lab)
        assert len(leases) == 4, [lease.key for lease in leases]
        return entry_mismatches(lab, leases, backend, lambda node: _direct_peers(lab, node))

    try:
        wait_until(
            lambda: not mismatches(),
            timeout=CONVERGE,
            interval=0.5,
            what="kernel entries matching the leases",
        )
    except AssertionError:
        pytest.fail(
            "kernel entries differ from the leases:\n"
            + "\n".join(f"  {where}: {diff}" for where, diff in mismatches().items())
        )


def test_flanneld_leases_parse_with_our_reader(lab: Lab) -> None:
    by_ip = {lease.attrs.public_ip: lease for lease in read_leases(lab)}
    for name in THEIRS:
        node = lab.node(name)
        lease = by_ip[node.ip]
        assert lease.attrs.backend_type == lab.state.backend
        assert (lease.attrs.node_name, lease.attrs.mtu) == (None, None)  # no extension
        assert lease.subnet == _subnet_env(lab, name).lease_subnet
        assert lease.etcd_lease_id != 0, "flanneld's lease key carries an etcd lease (24 h)"
        if lab.state.backend == "vxlan":
            link = json.loads(lab.exec(name, ["ip", "-j", "link", "show", VXLAN_DEVICE]).stdout)[0]
            assert lease.attrs.vtep_mac == link["address"]
            assert dict(lease.attrs.backend_data or {})["VNI"] == 1
        else:
            assert lease.attrs.backend_data is None
    for name in OURS:  # ours carry the extension, which flanneld ignores
        assert by_ip[lab.node(name).ip].attrs.node_name == name


def test_subnet_env_reads_the_same_from_both_sides(lab: Lab) -> None:
    texts = {}
    for node in lab.nodes:
        with open(node.subnet_env, encoding="ascii") as f:
            texts[node.name] = f.read()
        env = subnet_env.from_text(texts[node.name], node.subnet_env)
        assert str(env.network) == lab.state.network
        assert env.subnet == subnet_env.first_usable(env.lease_subnet)
        assert env.ipmasq is True
        assert env.subnet == IPv4Interface(node.overlay_address or "")
        # Our writer reproduces each file byte for byte: same keys, order and formats.
        assert subnet_env.render(env) == texts[node.name], node.name
    keys = {name: list(subnet_env.parse(text)) for name, text in texts.items()}
    assert keys["n1"] == keys["n3"], keys


def _iptables_rules(lab: Lab, node: str) -> list[str]:
    """iptables-save without comments and counters, the node's own subnet as <SUBNET>."""
    own = str(_subnet_env(lab, node).lease_subnet)
    out = lab.exec(node, ["iptables-save"]).stdout
    lines = [
        re.sub(r" \[\d+:\d+\]$", "", line) for line in out.splitlines() if not line.startswith("#")
    ]
    return [line.replace(own, "<SUBNET>") for line in lines]


def test_iptables_rules_are_flanneld_s_rule_for_rule(lab: Lab) -> None:
    """The same tables, chains, rules and order on a node of ours as flanneld installs."""
    wait_until(
        lambda: any("FLANNEL-FWD" in r for r in _iptables_rules(lab, OURS[0])),
        timeout=CONVERGE,
        what="our forward rules",
    )
    for ours, theirs in zip(OURS, THEIRS, strict=True):
        assert _iptables_rules(lab, ours) == _iptables_rules(lab, theirs)


RESERVED = {"n1": "10.244.201.0/24", "n3": "10.244.203.0/24"}  # one of ours, one flanneld
# A machine not in the lab: its subnet, host number on the segment and VTEP MAC.
FOREIGN = ("10.244.209.0/24", 99, "02:00:00:00:00:99")


def _reservation(public_ip: str, mac: str | None = None) -> str:
    """A lease value as an operator writes it with etcdctl: Flannel's JSON, no etcd lease;
    without a VTEP MAC for a node that has not run yet."""
    doc: dict[str, object] = {"PublicIP": public_ip, "PublicIPv6": None, "BackendType": "vxlan"}
    if mac:
        doc["BackendData"] = {"VNI": 1, "VtepMAC": mac}
    return json.dumps(doc)


def test_reservations_without_ttl_are_taken_and_read_by_both_sides() -> None:
    """Keys without an etcd lease: each node takes the one with its PublicIP, and every node
    of either kind programs a reservation of a machine outside the lab as a peer."""
    from flannelpy_lab import etcd

    from flannelpy.subnet.keys import subnet_to_key

    with running_lab(4, "vxlan", flanneld_nodes=2, start_agents=False) as lab:
        prefix = f"{lab.state.etcd_prefix.rstrip('/')}/subnets/"
        wanted = {lab.node(n).ip: s for n, s in RESERVED.items()}
        with etcd.client(lab.etcd_endpoint) as c:
            for name, subnet in RESERVED.items():
                key = subnet_to_key(IPv4Network(subnet))
                c.put(prefix + key, _reservation(str(lab.node(name).ip)))
            c.put(
                prefix + subnet_to_key(IPv4Network(FOREIGN[0])),
                _reservation(segment_ip(lab, FOREIGN[1]), FOREIGN[2]),
            )
        lab.start_agents()
        for name, subnet in RESERVED.items():
            assert str(_subnet_env(lab, name).lease_subnet) == subnet, name
        leases = {str(lease.subnet): lease for lease in read_leases(lab)}
        assert set(wanted.values()) | {FOREIGN[0]} <= set(leases)
        for ip, subnet in wanted.items():  # taken over: the owner's VTEP MAC is in it now
            assert leases[subnet].attrs.public_ip == ip
            assert leases[subnet].attrs.vtep_mac
        # Observed: ours keeps a reservation permanent; flanneld v0.28.9 attaches a 24 h
        # etcd lease to the one it takes (upstream issue #1329), its docs notwithstanding.
        assert leases[RESERVED["n1"]].etcd_lease_id == 0
        assert leases[RESERVED["n3"]].etcd_lease_id != 0
        assert leases[FOREIGN[0]].etcd_lease_id == 0

        def mismatches() -> list[str]:
            current = read_leases(lab)
            out = []
            for node in lab.nodes:
                have = kernel_entries(lab, node)
                want = expected_entries(node, current, "vxlan", set())
                if (have.routes, have.neighbours, have.fdb) != (
                    want.routes,
                    want.neighbours,
                    want.fdb,
                ):
                    out.append(f"{node.name}: have {have}, want {want}")
            return out

        try:
            wait_until(
                lambda: not mismatches(),
                timeout=CONVERGE,
                interval=0.5,
                what="kernel entries matching the leases",
            )
        except AssertionError:
            pytest.fail("\n".join(mismatches()))


def test_missing_flanneld_fails_naming_the_build_script(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(flanneld.BINARY_ENV, "/nonexistent/flanneld")
    with pytest.raises(LabError, match=r"scripts/build-peers\.sh"):
        flanneld.binary()
