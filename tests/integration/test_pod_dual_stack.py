"""Dual-stack and IPv6-only pods in a real kernel, with real packets.

Same layout as test_cni_server: a throwaway node namespace running the CNI server
(here with an IPv4 and an IPv6 pod subnet, or the IPv6 one alone), one namespace
per pod. The reference ``bridge`` + ``host-local`` plugins (two ranges) set up the
same dual-stack pods in a second node namespace, and both are compared.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from collections.abc import Iterator
from ipaddress import (
    IPv4Network,
    IPv6Network,
    ip_address,
    ip_interface,
    ip_network,
)
from typing import Any

import pytest

from tests.integration.test_cni_server import MTU, Node, in_pod, make_node
from tests.support.netns_util import add_netns, is_root, sh, temp_netns, unique_name
from tests.support.waiting import wait_until

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(not is_root(), reason="network namespaces need root"),
]

SUBNET4 = IPv4Network("10.244.1.0/24")
SUBNET6 = IPv6Network("fc00:0:0:1::/64")
CLUSTER = (IPv4Network("10.244.0.0/16"), IPv6Network("fc00::/48"))
REFERENCE = "/usr/lib/cni"  # the Debian package containernetworking-plugins


@pytest.fixture
def dual() -> Iterator[Node]:
    with make_node(SUBNET4, SUBNET6, cluster_networks=lambda: CLUSTER) as n:
        yield n


def addresses(netns: str, dev: str, inside_pod: bool = True) -> list[dict[str, Any]]:
    """``ip -j addr`` entries of ``dev`` (addr_info items, both families)."""
    cmd = f"ip -j addr show dev {dev}"
    out = (
        in_pod(netns, cmd).stdout
        if inside_pod
        else sh(["ip", "netns", "exec", netns, *cmd.split()]).stdout
    )
    return [a for link in json.loads(out) for a in link["addr_info"]]


def routes(netns: str, family: str) -> set[tuple[str, str | None]]:
    """(destination, gateway) of the pod's main-table routes of one family, kernel
    prefix routes and link-local ones left out: what the plugin added."""
    out = in_pod(netns, f"ip -j {family} route show table main").stdout
    return {
        (r["dst"], r.get("gateway"))
        for r in json.loads(out)
        if r.get("protocol") != "kernel" and not r["dst"].startswith("fe80")
    }


def ping(netns: str, target: str, family: str = "-4") -> bool:
    return in_pod(netns, f"ping {family} -c1 -W2 {target}", check=False).returncode == 0


def pod_ip(result: dict[str, Any], version: int) -> str:
    (ip,) = [i for i in result["ips"] if ip_interface(i["address"]).version == version]
    return str(ip_interface(ip["address"]).ip)


def shape(result: dict[str, Any], netns: str) -> dict[str, Any]:
    """What must agree with the reference plugins: per family the pod address's prefix,
    the gateway (the subnet's first address), that the address sits on the pod's
    interface; the routes' destinations and gateways; and the pod's kernel state."""
    sandbox = [n for n, i in enumerate(result["interfaces"]) if i.get("sandbox") == netns]
    ips = []
    for entry in result["ips"]:
        address = ip_interface(entry["address"])
        ips.append(
            (
                address.version,
                address.network.prefixlen,
                ip_address(entry["gateway"]) == address.network.network_address + 1,
                [entry["interface"]] == sandbox,
            )
        )
    gateway = {ip_address(e["gateway"]).version: e["gateway"] for e in result["ips"]}
    result_routes = sorted(
        (r["dst"], r["gw"] == gateway[ip_network(r["dst"]).version]) for r in result["routes"]
    )
    pod_routes = {
        family: sorted(
            (dst, gw == gateway.get(4 if family == "-4" else 6))
            for dst, gw in routes(netns, family)
        )
        for family in ("-4", "-6")
    }
    global_addrs = sorted(
        (a["family"], a["prefixlen"]) for a in addresses(netns, "eth0") if a["scope"] == "global"
    )
    return {"ips": ips, "routes": result_routes, "pod_routes": pod_routes, "addrs": global_addrs}


def tentative(entries: list[dict[str, Any]], local: str | None = None) -> list[str]:
    """The IPv6 addresses among ``entries`` (only ``local``, if given) still tentative."""
    return [
        a["local"]
        for a in entries
        if a["family"] == "inet6" and a.get("tentative") and local in (None, a["local"])
    ]


# --- ours ------------------------------------------------------------------------------


def test_dual_stack_pods_reach_each_other_and_the_gateway_in_both_families(dual: Node) -> None:
    p1, p2 = dual.pod(), dual.pod()
    code, r1 = dual.add("c1", p1)
    assert code == 0, r1
    # Usable the moment ADD returns: nothing tentative, and the first ping -6 answers.
    assert tentative(addresses(p1, "eth0")) == []
    assert tentative(addresses(dual.ns.name, "cni0", inside_pod=False), "fc00:0:0:1::1") == []
    assert ping(p1, "fc00:0:0:1::1", "-6")
    assert ping(p1, "10.244.1.1")
    code, r2 = dual.add("c2", p2)
    assert code == 0, r2
    assert ping(p1, pod_ip(r2, 6), "-6") and ping(p2, pod_ip(r1, 6), "-6")
    assert ping(p1, pod_ip(r2, 4)) and ping(p2, pod_ip(r1, 4))
    # Full-size packets cross in IPv6 too (the pod's MTU is the overlay's).
    full = in_pod(p1, f"ping -6 -c1 -W2 -M do -s {MTU - 48} {pod_ip(r2, 6)}", check=False)
    assert full.returncode == 0
    # The result: one entry per family on the pod interface, both gateways, both defaults.
    assert r1["ips"] == [
        {"interface": 1, "address": "10.244.1.2/24", "gateway": "10.244.1.1"},
        {"interface": 1, "address": "fc00:0:0:1::2/64", "gateway": "fc00:0:0:1::1"},
    ]
    assert r1["routes"] == [
        {"dst": "0.0.0.0/0", "gw": "10.244.1.1"},
        {"dst": "::/0", "gw": "fc00:0:0:1::1"},
    ]
    assert [i["name"] for i in r1["interfaces"]][1] == "eth0"
    assert r1["interfaces"][1]["sandbox"] == p1
    assert in_pod(p1, "sysctl -n net.ipv6.conf.eth0.accept_dad").stdout.strip() == "0"
    # A pod that bounces its link keeps its IPv6 address, as its IPv4 one (keep_addr_on_down,
    # as the reference's IPAM sets it); the routes go with the link in both families, and
    # CHECK names both.
    in_pod(p2, "ip link set eth0 down")
    in_pod(p2, "ip link set eth0 up")
    assert "fc00:0:0:1::3" in [a["local"] for a in addresses(p2, "eth0")]
    code, err = dual.request("CHECK", "c2", p2)
    assert code == 1 and err["msg"] == (
        f"{p2} has no default route via 10.244.1.1 on eth0; "
        f"{p2} has no default route via fc00:0:0:1::1 on eth0"
    )
    assert dual.ns.exec("sysctl -n net.ipv6.conf.all.forwarding").stdout.strip() == "1"


def test_check_covers_both_families_and_del_releases_both(dual: Node) -> None:
    p1 = dual.pod()
    code, result = dual.add("c1", p1)
    assert code == 0, result
    assert dual.request("CHECK", "c1", p1) == (0, None)
    in_pod(p1, "ip -6 route del default")
    code, err = dual.request("CHECK", "c1", p1)
    assert code == 1 and err["msg"] == f"{p1} has no default route via fc00:0:0:1::1 on eth0"
    in_pod(p1, "ip -6 addr del fc00:0:0:1::2/64 dev eth0")
    code, err = dual.request("CHECK", "c1", p1)
    assert "eth0 lacks address fc00:0:0:1::2/64" in err["msg"]
    assert {a.ip.version for a in dual.ipam.find_all("c1", "eth0")} == {4, 6}
    assert dual.delete("c1", p1) == (0, None)
    assert dual.ipam.find_all("c1", "eth0") == []
    # Both addresses cool down: the next pod gets new ones in both families.
    code, again = dual.add("c2", dual.pod())
    assert [i["address"] for i in again["ips"]] == ["10.244.1.3/24", "fc00:0:0:1::3/64"]


def test_gc_releases_both_families_of_pods_the_runtime_dropped(dual: Node) -> None:
    p1, p2 = dual.pod(), dual.pod()
    assert dual.add("c1", p1)[0] == 0 and dual.add("c2", p2)[0] == 0
    valid = [{"containerID": "c2", "ifname": "eth0"}]
    config = dual.config(**{"cniVersion": "1.1.0", "cni.dev/valid-attachments": valid})
    assert dual.request("GC", config=config) == (0, None)
    assert dual.ipam.find_all("c1", "eth0") == []
    assert {a.ip.version for a in dual.ipam.find_all("c2", "eth0")} == {4, 6}
    assert in_pod(p1, "ip link show eth0", check=False).returncode != 0  # its veth is gone


def test_ipv6_only_pods_get_no_ipv4_address_and_no_ipv4_route() -> None:
    with make_node(SUBNET6, cluster_networks=lambda: CLUSTER) as node:
        # As the agent does on getting its lease: the bridge and its gateway come first,
        # with no port yet (no carrier); the gateway must still be usable at the first ADD.
        node.ns.call(node.pods.ensure_bridge, [ip_interface("fc00:0:0:1::1/64")], MTU)
        p1, p2 = node.pod(), node.pod()
        code, r1 = node.add("c1", p1)
        assert code == 0, r1
        assert r1["ips"] == [
            {"interface": 1, "address": "fc00:0:0:1::2/64", "gateway": "fc00:0:0:1::1"}
        ]
        assert r1["routes"] == [{"dst": "::/0", "gw": "fc00:0:0:1::1"}]
        assert [a for a in addresses(p1, "eth0") if a["family"] == "inet"] == []
        assert in_pod(p1, "ip -j -4 route show table main").stdout.strip() in ("[]", "")
        assert ping(p1, "fc00:0:0:1::1", "-6")
        code, r2 = node.add("c2", p2)
        assert code == 0 and ping(p1, pod_ip(r2, 6), "-6")
        assert node.request("CHECK", "c1", p1) == (0, None)
        # Without a default gateway the pod routes the IPv6 cluster network only.
        code, r3 = node.add("c3", node.pod(), config=node.config(isDefaultGateway=False))
        assert r3["routes"] == [{"dst": "fc00::/48", "gw": "fc00:0:0:1::1"}]
        # Every pod gone (the bridge loses its carrier), then a new one: usable at once.
        for n, pod in ((1, p1), (2, p2)):
            assert node.delete(f"c{n}", pod) == (0, None)
        node.delete("c3")
        p4 = node.pod()
        code, r4 = node.add("c4", p4)
        assert code == 0, r4
        assert tentative(addresses(p4, "eth0")) == []
        assert ping(p4, "fc00:0:0:1::1", "-6")


# --- against the reference plugins -------------------------------------------------------


def reference_add(node_ns: str, netns: str, cid: str, data_dir: str) -> dict[str, Any]:
    """ADD through the reference bridge plugin with host-local over two ranges (the
    delegate the flannel CNI plugin writes for a dual-stack node)."""
    config = {
        "cniVersion": "1.0.0",
        "name": "refnet",
        "type": "bridge",
        "bridge": "cni0",
        "isGateway": True,
        "isDefaultGateway": True,
        "hairpinMode": True,
        "mtu": MTU,
        "ipam": {
            "type": "host-local",
            "dataDir": data_dir,
            "ranges": [[{"subnet": str(SUBNET4)}], [{"subnet": str(SUBNET6)}]],
        },
    }
    env = {
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": cid,
        "CNI_NETNS": netns,
        "CNI_IFNAME": "eth0",
        "CNI_PATH": REFERENCE,
        "PATH": os.environ.get("PATH", ""),
    }
    proc = subprocess.run(
        ["ip", "netns", "exec", node_ns, f"{REFERENCE}/bridge"],
        input=json.dumps(config),
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout)
    return result


def test_same_shape_as_the_reference_bridge_and_host_local(dual: Node) -> None:
    ours = [dual.pod(), dual.pod()]
    our_results = [dual.add(f"c{n}", pod)[1] for n, pod in enumerate(ours)]
    with temp_netns("rf") as ref_node, tempfile.TemporaryDirectory(prefix="fphl") as data:
        theirs = []
        for _ in range(2):
            name = unique_name("fprfp", max_len=40)
            add_netns(name)
            dual.stack.callback(sh, ["ip", "netns", "del", name], False)
            theirs.append(f"/run/netns/{name}")
        started = time.monotonic()
        ref_results = [
            reference_add(ref_node.name, pod, f"r{n}", data) for n, pod in enumerate(theirs)
        ]
        assert shape(our_results[0], ours[0]) == shape(ref_results[0], theirs[0])
        assert shape(our_results[1], ours[1]) == shape(ref_results[1], theirs[1])
        assert [i["address"] for i in our_results[0]["ips"]] == [
            i["address"] for i in ref_results[0]["ips"]
        ]
        # Packets cross in both setups, in both families: pod to gateway and pod to pod.
        # The reference leaves the bridge's gateway tentative for a DAD round (ours is
        # usable at once, see above), so its pings wait for DAD first.
        wait_until(
            lambda: not tentative(addresses(ref_node.name, "cni0", inside_pod=False)),
            timeout=10,
            what="the reference bridge's addresses to finish DAD",
        )
        settle = time.monotonic() - started
        for pods, results in ((ours, our_results), (theirs, ref_results)):
            assert ping(pods[0], "fc00:0:0:1::1", "-6") and ping(pods[0], "10.244.1.1")
            assert ping(pods[0], pod_ip(results[1], 6), "-6")
            assert ping(pods[1], pod_ip(results[0], 4))
        print(f"reference bridge gateway left tentative after {settle:.2f} s")
