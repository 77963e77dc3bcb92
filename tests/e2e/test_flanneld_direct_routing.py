"""DirectRouting between our nodes and real flanneld nodes stays symmetric when one of
ours runs another DirectRouting than the network config (a per-node override).

flanneld's leases do not say whether it routes directly; it decides alone, from the
network config (it reads no override). So a node of ours routes a flanneld peer the
way that peer routes back: directly exactly when the config has DirectRouting, on
the same segment. With strict rp_filter on every node, an asymmetric pair drops its
replies: the pod pings prove the paths match, the route tables show both sides.

4-node lab: n1, n2 ours; n3, n4 flanneld; one segment; n1 gets the override.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from ipaddress import IPv4Network

import pytest
from flannelpy_lab import Lab
from flannelpy_lab.pods import pod_matrix

from flannelpy.control.records import NodeOverride
from flannelpy.store.etcd.client import EtcdStore
from flannelpy.subnet.keys import override_key
from tests.support.kernel_entries import read_leases
from tests.support.lab_util import lab_run_argv, running_mixed_lab, segment_ip, wait_until

pytestmark = [pytest.mark.lab]

CONVERGE = 30.0


@pytest.fixture(
    scope="module",
    params=[(True, False), (False, True)],
    ids=["config-dr_n1-without", "config-without_n1-dr"],
)
def dr_lab(request: pytest.FixtureRequest) -> Iterator[tuple[Lab, bool]]:
    config_dr, n1_dr = request.param
    with running_mixed_lab("vxlan", direct_routing=config_dr, pods_per_node=1) as lab:
        for node in lab.nodes:  # strict reverse-path filtering: asymmetry drops replies
            lab.exec(node.name, ["sysctl", "-qw", "net.ipv4.conf.all.rp_filter=1"])
        store = EtcdStore([lab.etcd_endpoint])
        try:
            override = NodeOverride({"Type": "vxlan", "DirectRouting": n1_dr}, generation=1)
            store.put(
                override_key(lab.state.etcd_prefix.rstrip("/"), "n1"), override.to_json().encode()
            )
        finally:
            store.close()
        n1_ip = lab.node("n1").ip

        def n1_advertises_its_override() -> bool:
            (n1,) = [x for x in read_leases(lab) if x.attrs.public_ip == n1_ip]
            return n1.attrs.direct_routing is (True if n1_dr else None)

        wait_until(
            n1_advertises_its_override,
            timeout=CONVERGE,
            interval=0.5,
            what="n1 running its override",
        )
        yield lab, config_dr


def _paths(lab: Lab) -> dict[tuple[str, str], str]:
    """(node, peer) -> "direct" | "vxlan" | "none": how ``node`` routes ``peer``'s subnet."""
    subnets = {str(lease.attrs.public_ip): lease.subnet for lease in read_leases(lab)}
    out: dict[tuple[str, str], str] = {}
    for node in lab.nodes:
        routes = json.loads(lab.exec(node.name, ["ip", "-j", "-4", "route", "show"]).stdout)
        by_dst = {IPv4Network(r["dst"]): r for r in routes if "/" in r.get("dst", "")}
        for peer in lab.nodes:
            if peer.name == node.name:
                continue
            route = by_dst.get(subnets.get(str(peer.ip), IPv4Network("0.0.0.0/32")))
            out[(node.name, peer.name)] = (
                "none"
                if route is None
                else "direct"
                if route.get("dev") == node.underlay_iface
                else "vxlan"
            )
    return out


def _asymmetric(paths: dict[tuple[str, str], str]) -> dict[str, str]:
    return {
        f"{a}->{b}": f"{p} but {b}->{a} {paths[(b, a)]}"
        for (a, b), p in paths.items()
        if p != paths[(b, a)] or p == "none"
    }


def test_every_pair_takes_one_path_both_ways(dr_lab: tuple[Lab, bool]) -> None:
    lab, config_dr = dr_lab
    try:
        wait_until(
            lambda: not _asymmetric(_paths(lab)),
            timeout=CONVERGE,
            interval=1.0,
            what="symmetric paths",
        )
    except AssertionError:
        pytest.fail(f"asymmetric paths: {_asymmetric(_paths(lab))}")
    paths = _paths(lab)
    want = "direct" if config_dr else "vxlan"
    # flanneld follows the config; so does n1 towards flanneld, whatever its override.
    for ours in ("n1", "n2"):
        for theirs in ("n3", "n4"):
            assert paths[(ours, theirs)] == paths[(theirs, ours)] == want, paths
    # Between our nodes, either one asking for direct is enough (both know both).
    assert paths[("n1", "n2")] == paths[("n2", "n1")] == "direct", paths


def test_every_pod_pair_reaches_under_strict_rp_filter(dr_lab: tuple[Lab, bool]) -> None:
    lab, _ = dr_lab
    wait_until(
        lambda: not _asymmetric(_paths(lab)), timeout=CONVERGE, interval=1.0, what="symmetric paths"
    )

    def failing() -> list[str]:
        matrix = pod_matrix(lab.pods)
        return [f"{a}->{b}" for a, row in matrix.items() for b, ok in row.items() if not ok]

    wait_until(lambda: not failing(), timeout=15.0, interval=1.0, what="every pod pair")
    assert len(lab.pods) == 4


def test_a_wireguard_peer_on_our_segment_gets_no_route_but_a_reason(
    dr_lab: tuple[Lab, bool],
) -> None:
    """A wireguard lease from an address on our segment, while our nodes run vxlan: a
    plain route would send its pods' traffic unencrypted; ours report it instead."""
    from pathlib import Path

    from flannelpy.subnet.keys import lease_key

    lab, _ = dr_lab
    subnet = IPv4Network("10.244.200.0/24")
    public_ip = segment_ip(lab, 99)
    doc = {
        "PublicIP": public_ip,
        "PublicIPv6": None,
        "BackendType": "wireguard",
        "BackendData": {"PublicKey": "x"},
    }
    store = EtcdStore([lab.etcd_endpoint])
    key = lease_key(lab.state.etcd_prefix.rstrip("/"), subnet)
    revision = store.put(key, json.dumps(doc).encode())
    try:

        def reasons() -> dict[str, str]:
            out = {}
            for node in ("n1", "n2"):
                status = json.loads(Path(lab.node(node).run_dir, "status.json").read_text())
                for u in status["unreachable"]:
                    if u["subnet"] == str(subnet):
                        out[node] = u["reason"]
            return out

        wait_until(
            lambda: len(reasons()) == 2,
            timeout=CONVERGE,
            interval=0.5,
            what="both of our nodes reporting the wireguard peer",
        )
        # status.json is written after the reconcile of the same plan: a route is in by now
        for node in ("n1", "n2"):
            routes = lab.exec(node, ["ip", "-4", "route", "show", str(subnet)]).stdout
            assert routes.strip() == "", f"{node} routes the wireguard peer: {routes}"
            assert "one node runs wireguard and the other neither runs it" in reasons()[node]
        # The doctor, run beside n1's agent, names it too.
        doctor = subprocess.run(
            lab_run_argv(lab.name, "doctor", node="n1"), capture_output=True, text=True, timeout=60
        )
        assert f"10.244.200.0/24 ({public_ip}) cannot be reached" in doctor.stdout, (
            doctor.stdout + doctor.stderr
        )
        assert "one node runs wireguard and the other neither runs it" in doctor.stdout
    finally:
        store.delete_if_mod_revision(key, revision)
        store.close()


def test_the_vtep_takes_no_router_adverts_on_both_kinds_of_node(
    dr_lab: tuple[Lab, bool],
) -> None:
    """flanneld sets accept_ra=0 on flannel.1 (device.go); ours does too."""
    lab, _ = dr_lab
    values = {
        node.name: lab.exec(
            node.name, ["cat", "/proc/sys/net/ipv6/conf/flannel.1/accept_ra"]
        ).stdout.strip()
        for node in lab.nodes
    }
    assert values == {"n1": "0", "n2": "0", "n3": "0", "n4": "0"}
