"""Dual stack across agent restarts: a 2-node vxlan lab with an IPv4 and an IPv6 underlay,
real agents and etcd, one pod per node through the real CNI executable.

- A restart (SIGTERM, start again) keeps the node's lease in etcd and both subnets in
  subnet.env (FLANNEL_SUBNET, FLANNEL_IPV6_SUBNET).
- With its lease deleted from etcd while the agent is down, the agent asks for the
  subnets subnet.env recorded, as Flannel does: the IPv4 lease is acquired with
  reason ``previous`` and the IPv6 subnet is FLANNEL_IPV6_SUBNET again (picked on its
  own, otherwise at random among the free /64s).
- The pod made before the restarts keeps both addresses on its interface and still
  reaches the pod of the other node in both families, both ways (real pings).
- After a pod's DEL, neither of its addresses is given to the next ADD within the
  cooldown, also across a restart: both stay "released" in the node's IPAM state, one
  per family.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from ipaddress import IPv4Interface, IPv6Interface, ip_interface
from pathlib import Path
from typing import Any

import pytest
from flannelpy_lab import Lab, plan, pods, topology
from flannelpy_lab import etcd as lab_etcd
from flannelpy_lab.state import NodeInfo, PodInfo

from flannelpy.ipam.store import pool_file_name
from tests.support.lab_util import print_agent_logs_if_failed, running_lab, wait_until

pytestmark = [pytest.mark.lab]

NODE = "n1"  # the node whose agent restarts
OTHER = "n2"
COOLDOWN = 30.0  # the IPAM's default ipCooldownSeconds; the lab's conflist sets none


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with running_lab(
        2,
        "vxlan",
        overlay_bridge=True,
        pods_per_node=1,
        net_conf_extra=plan.ip_family_net_conf("dual"),
    ) as lab:
        yield lab


@pytest.fixture(autouse=True)
def _logs_on_failure(request: pytest.FixtureRequest, lab: Lab) -> Iterator[None]:
    yield
    print_agent_logs_if_failed(request, lab)


def subnets(node: NodeInfo) -> tuple[IPv4Interface, IPv6Interface]:
    """subnet.env's FLANNEL_SUBNET and FLANNEL_IPV6_SUBNET."""
    text = Path(node.subnet_env).read_text()
    v4 = re.search(r"^FLANNEL_SUBNET=(\S+)$", text, re.M)
    v6 = re.search(r"^FLANNEL_IPV6_SUBNET=(\S+)$", text, re.M)
    assert v4 and v6, text
    return IPv4Interface(v4[1]), IPv6Interface(v6[1])


def lease_of(lab: Lab, node: str) -> dict[str, Any]:
    leases = lab_etcd.read_leases(lab.etcd_endpoints, lab.state.etcd_prefix)
    (lease,) = [x for x in leases if x["node_name"] == node]
    return lease


def pod_addresses(pod: PodInfo) -> set[str]:
    """The global addresses on the pod's eth0, read from the kernel."""
    proc = topology.run_in(
        pod.namespace, ["ip", "-j", "addr", "show", "dev", pod.ifname], timeout=10
    )
    assert proc.returncode == 0, proc.stderr
    (link,) = json.loads(proc.stdout)
    return {
        f"{a['local']}/{a['prefixlen']}" for a in link["addr_info"] if a.get("scope") == "global"
    }


def restart(lab: Lab, node: str) -> None:
    lab.kill_agent(node)
    lab.start_agent(node)
    lab.wait_ready(node)


def log_size(node: NodeInfo) -> int:
    return Path(node.agent_log).stat().st_size


def log_since(node: NodeInfo, offset: int) -> str:
    with open(node.agent_log, encoding="utf-8", errors="replace") as f:
        f.seek(offset)
        return f.read()


def assert_reach_both_ways(a: PodInfo, b: PodInfo) -> None:
    for family in (4, 6):
        for src, dst in ((a, b), (b, a)):
            assert pods.ping_pod(src, dst, attempts=5, family=family), (
                f"IPv{family} {src.name} -> {dst.name} after the restart"
            )


def first_pods(lab: Lab) -> tuple[PodInfo, PodInfo]:
    a = next(p for p in lab.pods if p.node == NODE)
    b = next(p for p in lab.pods if p.node == OTHER)
    assert a.address and a.address6 and b.address and b.address6, (a, b)
    return a, b


def test_a_restart_keeps_both_subnets_and_the_pod_both_addresses(lab: Lab) -> None:
    node = lab.node(NODE)
    a, b = first_pods(lab)
    before_env, before_lease, before_pod = subnets(node), lease_of(lab, NODE), pod_addresses(a)
    assert before_pod == {a.address, a.address6}
    assert before_lease["key"].endswith(f"&{before_env[1].network.network_address}-64")
    assert_reach_both_ways(a, b)

    restart(lab, NODE)
    assert subnets(node) == before_env
    after_lease = lease_of(lab, NODE)
    assert after_lease["key"] == before_lease["key"], (before_lease, after_lease)
    assert after_lease["public_ipv6"] == plan.ipv6_underlay_ip(node)
    assert pod_addresses(a) == before_pod
    assert_reach_both_ways(a, b)


def test_without_its_lease_a_restart_asks_for_the_subnets_of_subnet_env(lab: Lab) -> None:
    node = lab.node(NODE)
    a, b = first_pods(lab)
    v4, v6 = subnets(node)
    key = lease_of(lab, NODE)["key"]
    lab.kill_agent(NODE)
    # The lease is gone (as if expired while the node was down): only subnet.env remains.
    with lab_etcd.client(lab.etcd_endpoint, timeout=10.0) as c:
        assert c.delete(f"{lab.state.etcd_prefix.rstrip('/')}/subnets/{key}")
    assert all(
        x["node_name"] != NODE
        for x in lab_etcd.read_leases(lab.etcd_endpoints, lab.state.etcd_prefix)
    )
    offset = log_size(node)
    lab.start_agent(NODE)
    lab.wait_ready(NODE)
    log = log_since(node, offset)
    acquired = re.search(r"lease acquired subnet=(\S+) ipv6_subnet=(\S+) .*reason=(\w+)", log)
    assert acquired, log
    assert acquired.groups() == (str(v4.network), str(v6.network), "previous"), log
    assert subnets(node) == (v4, v6)
    assert lease_of(lab, NODE)["key"] == key
    assert pod_addresses(a) == {a.address, a.address6}
    assert_reach_both_ways(a, b)


def released_ips(node: NodeInfo, address: str) -> dict[str, float]:
    """The addresses the node's IPAM keeps as released in ``address``'s subnet, with
    the (wall-clock) time each was released."""
    subnet = ip_interface(address).network
    path = Path(node.node_dir, "state", "ipam", pool_file_name(subnet))
    doc = json.loads(path.read_text())
    return {entry["ip"]: entry["released_at"] for entry in doc["released"]}


def test_a_deleted_pods_addresses_cool_down_per_family_across_a_restart(lab: Lab) -> None:
    node = lab.node(NODE)
    gone = lab.add_pod(NODE)
    assert gone.address and gone.address6
    gone_ips = {str(ip_interface(gone.address).ip), str(ip_interface(gone.address6).ip)}
    lab.delete_pod(gone.name)
    # The agent releases both families just after the DEL's answer: wait for the file.
    for address in (gone.address, gone.address6):
        ip = str(ip_interface(address).ip)
        wait_until(lambda a=address, ip=ip: ip in released_ips(node, a), 10, what=f"{ip} released")

    restart(lab, NODE)  # the cooldown is on disk: a restart does not end it
    new = lab.add_pod(NODE)
    added_at = time.time()
    assert new.address and new.address6
    new_ips = {str(ip_interface(new.address).ip), str(ip_interface(new.address6).ip)}
    assert not new_ips & gone_ips, (gone, new)
    for address in (gone.address, gone.address6):  # still cooling, one per family
        released_at = released_ips(node, address)[str(ip_interface(address).ip)]
        assert added_at < released_at + COOLDOWN, (address, released_at, added_at)
    assert_reach_both_ways(new, first_pods(lab)[1])
