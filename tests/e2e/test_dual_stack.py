"""Dual stack on the lab: 3 nodes with an IPv4 and an IPv6 (ULA) underlay, real agents and
etcd, one pod per node through the real CNI executable.

Per backend (vxlan, host-gw, vxlan with DirectRouting), and vxlan with 2 real flanneld
nodes beside 2 of ours in one etcd: every node pair and pod pair
reaches in both families; the leases are Flannel's dual keys with PublicIPv6; and a DF
packet of exactly the overlay MTU crosses in each family while one byte more is refused
on the sending side (VXLAN over IPv6 costs 70 bytes, so the vxlan overlay MTU is 1430
on a 1500-byte underlay). The mixed lab runs in nftables mode: ``nft list ruleset`` of
our nodes is a flanneld node's byte for byte, subnets aside, ``ip6 flannel-ipv6`` included.
"""

from __future__ import annotations

import re
import subprocess
from ipaddress import IPv6Interface, ip_interface
from pathlib import Path

import pytest
from flannelpy_lab import Lab, plan, pods, status, topology
from flannelpy_lab.state import PodInfo

from tests.support.firewall_lab import nft_ruleset, normalized
from tests.support.lab_util import converged_status, lab_run_argv, running_lab, running_mixed_lab

pytestmark = [pytest.mark.lab]

# ping's payload = packet - IP header - ICMP header
V4_HEADERS, V6_HEADERS = 28, 48


def df_ping(ns: str, src: str | None, dst: str, packet: int) -> tuple[bool, str]:
    """One DF ping of ``packet`` bytes on the wire (no -q: see design.md's ping trap)."""
    headers = V6_HEADERS if ":" in dst else V4_HEADERS
    argv = ["ping", "-c", "1", "-W", "2", "-M", "do", "-s", str(packet - headers)]
    argv += ["-I", src] if src else []
    proc = topology.run_in(ns, [*argv, dst], timeout=10)
    return proc.returncode == 0, proc.stdout + proc.stderr


def refused_locally(out: str) -> bool:
    return re.search(r"[Mm]essage too long|mtu ?= ?\d+", out) is not None


def pods_of(lab: Lab) -> tuple[PodInfo, PodInfo]:
    first = next(p for p in lab.state.pods if p.node == "n1")
    second = next(p for p in lab.state.pods if p.node == "n2")
    return first, second


@pytest.mark.parametrize(
    ("backend", "direct_routing", "overlay_mtu"),
    [("vxlan", False, 1430), ("host-gw", False, 1500), ("vxlan", True, 1430)],
    ids=["vxlan", "host-gw", "vxlan-directrouting"],
)
def test_dual_stack_lab_reaches_in_both_families_with_the_mtu_right(
    backend: str, direct_routing: bool, overlay_mtu: int
) -> None:
    with running_lab(
        3,
        backend,
        direct_routing=direct_routing,
        overlay_bridge=True,
        pods_per_node=1,
        net_conf_extra=plan.ip_family_net_conf("dual"),
    ) as lab:
        doc = converged_status(lab, ("matrix", "matrix_ipv6", "pod_matrix", "pod_matrix_ipv6"))
        # Flannel's dual lease keys, with each node's IPv6 underlay address advertised.
        for node in lab.nodes:
            env = Path(node.subnet_env).read_text()
            assert f"FLANNEL_MTU={overlay_mtu}\n" in env
            assert "FLANNEL_IPV6_NETWORK=fd10:244::/56\n" in env
            found = re.search(r"FLANNEL_IPV6_SUBNET=(\S+)", env)
            assert found, env
            v6 = IPv6Interface(found[1]).network
            (lease,) = [x for x in doc["leases"] if x["node_name"] == node.name]
            assert lease["key"].endswith(f"&{v6.network_address}-64"), lease
            assert lease["public_ipv6"] == plan.ipv6_underlay_ip(node), lease

        # DF at exactly the overlay MTU crosses, one byte more is refused at the sender.
        a, b = pods_of(lab)
        assert a.address and b.address and a.address6 and b.address6
        for dst in (str(ip_interface(b.address).ip), str(ip_interface(b.address6).ip)):
            ok, out = df_ping(a.namespace, None, dst, overlay_mtu)
            assert ok, f"{backend}: DF {overlay_mtu} to {dst}: {out}"
            ok, out = df_ping(a.namespace, None, dst, overlay_mtu + 1)
            assert not ok and refused_locally(out), f"{backend}: DF {overlay_mtu + 1}: {out}"


def subnet6(node_env: str) -> IPv6Interface:
    """A node's FLANNEL_IPV6_SUBNET (its IPv6 lease, with cni0's gateway address)."""
    found = re.search(r"FLANNEL_IPV6_SUBNET=(\S+)", Path(node_env).read_text())
    assert found, node_env
    return IPv6Interface(found[1])


def vtep6(node_env: str) -> str:
    """A node's IPv6 VTEP address: its IPv6 lease's network address (on flannel-v6.1)."""
    return str(subnet6(node_env).network.network_address)


def test_dual_stack_with_the_real_flanneld_reaches_and_its_ipv6_mtu_is_named() -> None:
    """2 of our nodes and 2 real flanneld nodes sharing one etcd, dual stack, vxlan,
    nftables mode."""
    with running_mixed_lab(
        "vxlan",
        overlay_bridge=True,
        pods_per_node=1,
        net_conf_extra={**plan.ip_family_net_conf("dual"), "EnableNFTables": True},
    ) as lab:
        doc = converged_status(lab, ("matrix", "pod_matrix"))

        # Both tables of ours are flanneld's, byte for byte, with each node's subnets
        # (IPv4 and IPv6) written as placeholders.
        def ruleset(node: str) -> str:
            text = normalized(lab, node, nft_ruleset(lab, node))
            return text.replace(str(subnet6(lab.node(node).subnet_env).network), "<subnet6>")

        for ours_name, theirs_name in (("n1", "n3"), ("n2", "n4")):
            assert ruleset(ours_name) == ruleset(theirs_name)
        assert "ip6 saddr <subnet6> ip6 daddr fd10:244::/56 return" in ruleset("n1")
        flanneld_leases = [x for x in doc["leases"] if x["node_name"] is None]
        assert len(flanneld_leases) == 2 and all("&" in x["key"] for x in flanneld_leases)
        assert all(x["public_ipv6"] for x in flanneld_leases), flanneld_leases
        # IPv6 over the IPv6 underlay, each of ours to and from each flanneld node's VTEP.
        # flanneld adds its VTEP address with duplicate address detection: it is tentative
        # (unusable) for a second or two after start, hence a few tries.
        ours = [n for n in lab.nodes if not n.runs_flanneld]
        theirs = [n for n in lab.nodes if n.runs_flanneld]
        for a in ours:
            for b in theirs:
                for src, dst in ((a, b), (b, a)):
                    argv = ["ping", "-c", "1", "-W", "1", vtep6(dst.subnet_env)]
                    tries = [topology.run_in(src.namespace, argv, timeout=10)]
                    while tries[-1].returncode != 0 and len(tries) < 6:
                        tries.append(topology.run_in(src.namespace, argv, timeout=10))
                    assert tries[-1].returncode == 0, (src.name, dst.name, tries[-1].stdout)
        # Pods on flanneld nodes get an IPv6 address too (the flannel plugin's second
        # host-local range), and every pod pair of the 4 nodes reaches in IPv6.
        assert all(p.address6 for p in lab.state.pods), lab.state.pods
        pods6 = pods.pod_matrix(lab.state.pods, family=6)
        assert len(pods6) == 4 and status.all_reach(pods6), pods6
        doctor = subprocess.run(
            lab_run_argv(lab.name, "doctor", node="n1"), capture_output=True, text=True, timeout=60
        )
        assert "2 flanneld peer(s) run VXLAN over IPv6 with pod MTU 1450" in doctor.stdout, (
            doctor.stdout + doctor.stderr
        )
        assert "only 1430 fits" in doctor.stdout
