"""Migration between the real flanneld and our agent, node by node, with pods running.

A 4-node lab (n1, n2 ours; n3, n4 the pinned upstream flanneld and flannel CNI plugin),
one pod per node, continuous ICMP between every ordered pod pair and TCP streams
(tests/support/traffic).
Then, as an operator would: n3 from flanneld to ours, n2 from ours to flanneld
(``flannelpy_lab.migrate``), each under its own traffic session so each direction
reports its echoes sent and lost. Asserted, for vxlan and host-gw:

- no echo lost and no stream broken for the pods that existed before;
- each node keeps its lease subnet;
- the routes flanneld installed are of the shape we take over, and the old overlap
  check refused them (host-gw); after the take-over none of flanneld's is left;
- a peer that departed while neither agent ran on n3 leaves nothing behind there;
- new pods on both migrated nodes get addresses no existing pod holds, and every
  pod pair reaches;
- every node's kernel holds exactly the entries the other nodes' leases ask for.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from ipaddress import IPv4Address, IPv4Network

import pytest
from flannelpy_lab import Lab, etcd, flanneld
from flannelpy_lab.migrate import migrate
from flannelpy_lab.pods import pod_matrix
from flannelpy_lab.state import PodInfo

from flannelpy.dataplane.adopt import RTPROT_BOOT, FlannelRouteShape
from flannelpy.dataplane.kernel import ForeignRoute
from flannelpy.errors import ConfigError
from flannelpy.subnet.keys import subnet_to_key
from flannelpy.subnet.survey import check_no_overlap
from tests.support.kernel_entries import (
    VXLAN_DEVICE,
    entry_mismatches,
    read_leases,
)
from tests.support.lab_util import (
    print_agent_logs_if_failed,
    running_mixed_lab,
    segment_ip,
    wait_until,
)
from tests.support.traffic import PodTraffic, TrafficReport

pytestmark = [pytest.mark.lab]

CONVERGE = 20.0
RATE = 20.0  # echoes per second per ordered pair
SETTLE = 3.0  # seconds of traffic after each migration, before the session stops
# Never a lab node: the departed machine's subnet, host number on the segment and VTEP MAC.
DEPARTED = ("10.244.250.0/24", 99, "02:00:00:00:00:99")


MODES = [  # (backend, DirectRouting)
    pytest.param(("vxlan", False), id="vxlan"),
    pytest.param(("host-gw", False), id="host-gw"),
    pytest.param(("vxlan", True), id="vxlan-directrouting"),
]


@pytest.fixture(params=MODES)
def lab(request: pytest.FixtureRequest) -> Iterator[Lab]:
    backend, direct_routing = request.param
    with running_mixed_lab(backend, direct_routing=direct_routing, pods_per_node=1) as lab:
        yield lab
        print_agent_logs_if_failed(request, lab, lines=25)


def _lease_subnets(lab: Lab) -> dict[IPv4Address, IPv4Network]:
    return {lease.attrs.public_ip: lease.subnet for lease in read_leases(lab)}


def _network_routes(lab: Lab, node: str, protocol: str) -> list[dict[str, object]]:
    out = lab.exec(node, ["ip", "-j", "-4", "route", "show", "proto", protocol]).stdout
    network = IPv4Network(lab.state.network)
    return [
        r
        for r in json.loads(out or "[]")
        if "/" in str(r["dst"]) and IPv4Network(str(r["dst"])).subnet_of(network)
    ]


def _kernel_mismatches(lab: Lab) -> dict[str, str]:
    direct = _direct_peers(lab)
    return entry_mismatches(lab, read_leases(lab), lab.state.backend, lambda node: direct)


def _direct_peers(lab: Lab) -> set[IPv4Address]:
    """With DirectRouting every peer is on the one segment: routed on the underlay."""
    if not lab.state.direct_routing:
        return set()
    return {n.ip for n in lab.nodes} | {IPv4Address(_departed_ip(lab))}


def _vtep_macs(lab: Lab) -> dict[IPv4Address, str | None]:
    return {lease.attrs.public_ip: lease.attrs.vtep_mac for lease in read_leases(lab)}


def _wait_kernels_match(lab: Lab) -> None:
    try:
        wait_until(
            lambda: not _kernel_mismatches(lab),
            timeout=CONVERGE,
            interval=0.5,
            what="kernel entries matching the leases",
        )
    except AssertionError:
        pytest.fail(
            "kernel entries differ from the leases:\n"
            + "\n".join(f"  {where}: {diff}" for where, diff in _kernel_mismatches(lab).items())
        )


def _departed_ip(lab: Lab) -> str:
    return segment_ip(lab, DEPARTED[1])


def _departed_key(lab: Lab) -> str:
    prefix = f"{lab.state.etcd_prefix.rstrip('/')}/subnets/"
    return prefix + subnet_to_key(IPv4Network(DEPARTED[0]))


def _put_departed_peer(lab: Lab) -> None:
    """A lease of a machine outside the lab, as if a node had been there."""
    doc = {"PublicIP": _departed_ip(lab), "PublicIPv6": None, "BackendType": lab.state.backend}
    if lab.state.backend == "vxlan":
        doc["BackendData"] = {"VNI": 1, "VtepMAC": DEPARTED[2]}
    with etcd.client(lab.etcd_endpoint) as c:
        c.put(_departed_key(lab), json.dumps(doc))


def _drop_departed_peer(lab: Lab) -> None:
    with etcd.client(lab.etcd_endpoint) as c:
        c.delete(_departed_key(lab))


def _check_flanneld_routes_are_adoptable(lab: Lab, node: str) -> None:
    """What the real flanneld installed: protocol boot routes of Flannel's shape, which the
    overlap check refused before the take-over on host-gw (survey ignores flannel.1)."""
    routes = _network_routes(lab, node, "boot")
    assert len(routes) == 4, routes  # n1, n2, n4 and the departed peer
    info = lab.node(node)
    shape = FlannelRouteShape(IPv4Network(lab.state.network), 24, VXLAN_DEVICE, info.underlay_iface)
    foreign = []
    for r in routes:
        dst, gateway, dev = (
            IPv4Network(str(r["dst"])),
            IPv4Address(str(r["gateway"])),
            str(r["dev"]),
        )
        assert shape.adoptable(dst, gateway, dev, RTPROT_BOOT), r
        foreign.append(
            ForeignRoute(dst, f"route {dst} via {gateway} dev {dev}", RTPROT_BOOT, gateway, dev)
        )
    if lab.state.backend == "host-gw" or lab.state.direct_routing:  # on eth0: surveyed
        with pytest.raises(ConfigError, match="overlaps route"):
            check_no_overlap(IPv4Network(lab.state.network), foreign, allow_overlap=False)


def _session(lab: Lab, pods: list[PodInfo], action: Callable[[], None]) -> TrafficReport:
    with PodTraffic(lab, pods, rate=RATE, streams=2) as traffic:
        action()
        time.sleep(SETTLE)
        report = traffic.stop()
    return report


def test_migration_both_ways_under_traffic(lab: Lab) -> None:
    mode = lab.state.backend + ("+DirectRouting" if lab.state.direct_routing else "")
    before_pods = list(lab.pods)
    _put_departed_peer(lab)
    wait_until(
        lambda: len(_network_routes(lab, "n3", "boot")) == 4,
        timeout=CONVERGE,
        what="flanneld on n3 routing the departed peer",
    )
    _wait_kernels_match(lab)
    subnets = _lease_subnets(lab)
    macs = _vtep_macs(lab)
    _check_flanneld_routes_are_adoptable(lab, "n3")

    def to_ours() -> None:
        done = migrate(lab, "n3", "flannelpy", while_stopped=lambda: _drop_departed_peer(lab))
        print(f"n3 -> flannelpy ready after {done.seconds:.1f} s")
        _wait_kernels_match(lab)

    report_in = _session(lab, before_pods, to_ours)
    assert lab.node("n3").agent_kind == "flannelpy"
    # Every route of flanneld's is taken over (re-tagged) or, the departed peer's, gone.
    assert _network_routes(lab, "n3", "boot") == []
    assert len(_network_routes(lab, "n3", "75")) == 3

    def to_flanneld() -> None:
        done = migrate(lab, "n2", "flanneld")
        print(
            f"n2 -> flanneld ready after {done.seconds:.1f} s, {done.exported} "
            "allocations written for host-local"
        )
        assert done.exported == 1
        _wait_kernels_match(lab)

    report_out = _session(lab, before_pods, to_flanneld)
    assert lab.node("n2").agent_kind == "flanneld"

    print(
        f"[{mode}] flanneld -> flannelpy (n3): echoes sent {report_in.sent}, "
        f"lost {report_in.lost}; {report_in.summary()}"
    )
    print(
        f"[{mode}] flannelpy -> flanneld (n2): echoes sent {report_out.sent}, "
        f"lost {report_out.lost}; {report_out.summary()}"
    )

    assert _lease_subnets(lab) == {
        ip: s for ip, s in subnets.items() if str(ip) != _departed_ip(lab)
    }
    # Each side kept the other's vxlan device: no peer had to learn a new MAC.
    assert _vtep_macs(lab) == {ip: m for ip, m in macs.items() if str(ip) != _departed_ip(lab)}
    # New pods on both migrated nodes: addresses no existing pod holds.
    taken = {p.ip for p in before_pods}
    new = [lab.add_pod("n3"), lab.add_pod("n2")]
    for pod in new:
        assert pod.ip not in taken, f"{pod.name} got {pod.ip}, already a pod's"
        assert pod.ip in subnets[lab.node(pod.node).ip]
    assert len({p.ip for p in lab.pods}) == len(lab.pods)
    matrix = pod_matrix(lab.pods)
    unreachable = [(a, b) for a, row in matrix.items() for b, ok in row.items() if not ok]
    assert not unreachable, unreachable
    _wait_kernels_match(lab)
    doc = lab.status()
    assert {n["name"]: n["agent_kind"] for n in doc["nodes"]} == {
        "n1": "flannelpy",
        "n2": "flanneld",
        "n3": "flannelpy",
        "n4": "flanneld",
    }

    # A pod host-local made, deleted through our plugin now: its file there goes too.
    old_on_n3 = next(p for p in before_pods if p.node == "n3")
    lab.delete_pod(old_on_n3.name)
    held = f"{flanneld.host_local_network_dir(lab.node('n3'))}/{old_on_n3.ip}"
    assert not os.path.exists(held), held
    # One of ours, deleted through the flannel plugin now: its DEL replays the delegate
    # config the hand-back saved for it, and host-local releases the file we wrote.
    old_on_n2 = next(p for p in before_pods if p.node == "n2")
    exported = f"{flanneld.host_local_network_dir(lab.node('n2'))}/{old_on_n2.ip}"
    assert os.path.exists(exported), exported
    lab.delete_pod(old_on_n2.name)
    assert not os.path.exists(exported), exported

    for report in (report_in, report_out):
        assert report.lost == 0, report.summary()
        assert not report.broken_streams, report.summary()
