"""Issue 31 on a dual-stack lab: warm capacity and a pool drain judged per family.

One 2-node vxlan lab (IPv4 /24 leases, IPv6 /122 leases so that IPv6 is the family
that runs low: 61 pod addresses against IPv4's 253), ``MinFreeAddresses`` 32:

1. A burst of ADDs on n1 leaves IPv4 with room and IPv6 short: n1 takes a second
   (dual-stack) lease for IPv6's sake before any ADD fails; the later pods get their
   IPv6 address from it and their IPv4 address still from the first lease, and a pod
   on n2 reaches one of them over IPv6.
2. The IPv6 primary pool is drained with no other IPv6 pool: no lease may serve, so
   an ADD is refused and the agents say no IPv6 pool takes a lease. An IPv6 pool
   opted in: every node takes a lease with its IPv4 subnet from Network and its IPv6
   subnet from the new pool; new pods land there, old pods keep their addresses and
   reach the new ones; n2's drained lease is released once its pod is gone and its
   addresses have cooled down.

And beside 2 real flanneld nodes (v0.28.9), our lease with its IPv6 half in an IPv6
pool is a Flannel dual key they read and route: every pod pair reaches over IPv6.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from ipaddress import IPv4Network, IPv6Interface, IPv6Network, ip_interface
from typing import Any

import pytest
from flannelpy_lab import Lab, pods, status
from flannelpy_lab import plan as lab_plan
from flannelpy_lab.state import NodeInfo

from flannelpy.store.etcd.client import EtcdStore
from flannelpy.subnet.keys import key_to_subnet
from tests.support import pod_util as pu
from tests.support.agent_events import agent_log
from tests.support.lab_util import lab_run_argv, running_lab, running_mixed_lab, wait_until

pytestmark = [pytest.mark.lab]

IPV6_PRIMARY = IPv6Network(lab_plan.DEFAULT_IPV6_NETWORK)
IPV6_NEW = IPv6Network("fd10:250::/56")
ROLE = "flannelpy.io/role"
MIN_FREE = 32
USABLE_V6 = 61  # a /122: 64 addresses less the network's, the gateway's and the last
BURST = 80  # with the lab's pod, 81 on n1: 20 beyond the first IPv6 subnet
COOLDOWN_S = 30.0  # the agent's default ipCooldownSeconds
CAPACITY_TICK_S = 5.0

Lease = tuple[IPv4Network | None, IPv6Network | None]


def pools(lab: Lab, *args: str) -> str:
    proc = subprocess.run(
        lab_run_argv(lab.name, "pools", *args), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, f"pools {' '.join(args)}: {proc.stdout}{proc.stderr}"
    return proc.stdout


@contextmanager
def dual_lab() -> Iterator[tuple[Lab, EtcdStore]]:
    extra = {
        **lab_plan.ip_family_net_conf("dual"),
        "IPv6SubnetLen": 122,
        "MinFreeAddresses": MIN_FREE,
        "MaxLeasesPerNode": 3,
    }
    with running_lab(2, "vxlan", pods_per_node=1, net_conf_extra=extra) as lab:
        store = EtcdStore([lab.etcd_endpoint])
        try:
            yield lab, store
        finally:
            store.close()


def leases_of(lab: Lab, store: EtcdStore, node: str) -> list[Lease]:
    """``node``'s leases in etcd (by NodeName), oldest first."""
    items, _ = store.get_prefix(f"{lab.state.etcd_prefix}/subnets/")
    mine = [kv for kv in items if _node_name(kv.value) == node]
    return [key_to_subnet(kv.key.rsplit("/", 1)[1]) for kv in sorted(mine, key=_created)]


def _node_name(value: bytes) -> str | None:
    """A lease's NodeName (a flanneld node's lease has none)."""
    ours = json.loads(value).get("Flannelpy") or {}
    name = ours.get("NodeName")
    return name if isinstance(name, str) else None


def _created(kv: Any) -> int:
    return int(kv.create_revision)


def lease_in(lab: Lab, store: EtcdStore, node: str, pool: IPv6Network) -> Lease | None:
    """``node``'s lease whose IPv6 subnet lies in ``pool``, if any."""
    found = [x for x in leases_of(lab, store, node) if x[1] and x[1].subnet_of(pool)]
    return found[0] if found else None


def masq_rules_cover(lab: Lab, node: str, pool: IPv6Network) -> bool:
    argv = ["ip6tables", "-w", "-t", "nat", "-S", "FLANNEL-POSTRTG"]
    return f"-d {pool} " in lab.exec(node, argv).stdout


def said(node: NodeInfo, text: str) -> bool:
    return text in agent_log(node)


def addresses(call: pu.CniCall) -> tuple[IPv4Network, IPv6Interface]:
    """An ADD's IPv4 subnet and IPv6 address."""
    doc = call.doc
    assert call.returncode == 0 and doc is not None, call
    found = [ip_interface(ip["address"]) for ip in doc["ips"]]
    v4 = next(a for a in found if a.version == 4)
    v6 = next(a for a in found if a.version == 6)
    assert isinstance(v4.network, IPv4Network) and isinstance(v6, IPv6Interface)
    return v4.network, v6


def test_warm_capacity_and_a_drain_are_judged_per_family_in_dual_stack() -> None:
    with (
        dual_lab() as (lab, store),
        pu.pod_namespaces(lab, "b", BURST) as burst_names,
        pu.pod_namespaces(lab, "m", 2) as more_names,
    ):
        n1, n2 = lab.node("n1"), lab.node("n2")
        ((first4, first6),) = leases_of(lab, store, "n1")
        assert first4 is not None and first6 is not None and first6.prefixlen == 122

        # 1. The burst: IPv6 runs low first, and a second lease comes before any failure.
        fleet = pu.PodFleet(lab, "n1", burst_names, pu.plugin_config(n1), "b")
        began = time.monotonic()
        calls = fleet.burst(BURST, workers=16)
        took = time.monotonic() - began
        failed = [c for c in calls if c.returncode != 0]
        assert not failed, failed[:3]
        held = leases_of(lab, store, "n1")
        assert len(held) == 2, held
        second6 = held[1][1]
        assert second6 is not None and second6.subnet_of(IPV6_PRIMARY)
        added = [line for line in agent_log(n1).splitlines() if "lease added" in line]
        assert len(added) == 1, added
        assert "free IPv6 addresses < MinFreeAddresses 32: acquire lease 2" in added[0], added
        print(f"\nburst: {BURST} ADDs in {took:.1f} s, 0 failed; {added[0].split('reason=')[1]}")
        got = [addresses(c) for c in calls]
        # IPv4 kept room: every pod's IPv4 address is from the first lease (oldest first).
        assert {v4 for v4, _ in got} == {first4}
        in_second = [v6 for _, v6 in got if v6.network == second6]
        assert {v6.network for _, v6 in got} == {first6, second6}
        assert len(in_second) == BURST + 1 - USABLE_V6
        # A real packet from n2's pod to a pod on the new IPv6 subnet, across the overlay.
        (n2_pod,) = [p for p in lab.pods if p.node == "n2"]
        wait_until(
            lambda: pu.ping(n2_pod.namespace, str(in_second[0].ip)),
            15,
            what=f"n2's pod to reach {in_second[0].ip} on n1's second lease",
        )

        # 2. Drain the IPv6 primary with nowhere to go: no lease serves, ADD is refused.
        pools(lab, "tag", str(IPV6_PRIMARY), f"{ROLE}=0")
        for node in (n1, n2):
            wait_until(
                partial(said, node, "cannot add a lease: no IPv6 pool can take a new lease"),
                15,
                what=f"{node.name} to say no IPv6 pool takes a lease",
            )
        late = pu.PodFleet(lab, "n2", more_names, pu.plugin_config(n2), "m")
        refused = late.add()
        assert refused.returncode != 0 and "every lease is draining" in refused.error_msg
        print(f"\nADD on a node whose only lease drains in IPv6: {refused.error_msg}")

        # An IPv6 pool opted in: each node leases IPv4 from Network, IPv6 from it.
        pools(lab, "add", str(IPV6_NEW))
        pools(lab, "tag", str(IPV6_NEW), f"{ROLE}=1")

        fresh = {
            n: wait_until(partial(lease_in, lab, store, n, IPV6_NEW), 15, what=f"{n} to lease")
            for n in ("n1", "n2")
        }
        for name, (v4, _) in fresh.items():
            assert v4 is not None and v4.subnet_of(IPv4Network(lab.state.network)), name
        # The operator's view, and the masquerade rules: pod-to-pod traffic into the new
        # IPv6 pool keeps its source address.
        doc = json.loads(pools(lab, "list", "--json"))
        row = {p["network"]: p for p in doc["pools"]}[str(IPV6_NEW)]
        assert (row["leases"], row["create_leases"], row["subnet_len"]) == (2, True, 122), row
        assert {p["network"]: p for p in doc["pools"]}[str(IPV6_PRIMARY)]["create_leases"] is False
        wait_until(
            partial(masq_rules_cover, lab, "n2", IPV6_NEW),
            15,
            what=f"n2's IPv6 masquerade rules to cover {IPV6_NEW}",
        )
        new_pod = late.add()
        v4, v6 = addresses(new_pod)
        assert (v4, v6.network) == fresh["n2"], new_pod
        # Old pods keep their addresses on the drained leases and reach the new pod.
        assert pu.ping(fleet.live[0].netns.rsplit("/", 1)[1], str(v6.ip))
        assert pu.ping(n2_pod.namespace, str(in_second[0].ip))
        assert (
            n2_pod.address6 is not None
            and IPv6Interface(n2_pod.address6).network == (leases_of(lab, store, "n2")[0][1])
        )

        # n2's drained lease goes once its pod is gone and its addresses have cooled.
        (old,) = [x for x in leases_of(lab, store, "n2") if x != fresh["n2"]]
        deleted_at = time.monotonic()
        lab.delete_pod(n2_pod.name)
        wait_until(
            lambda: leases_of(lab, store, "n2") == [fresh["n2"]],
            COOLDOWN_S + CAPACITY_TICK_S + 15,
            interval=0.5,
            what=f"n2's drained lease {old} to be released",
        )
        took = time.monotonic() - deleted_at
        print(f"n2's drained lease {old} left etcd {took:.1f} s after its pod was deleted")
        assert took >= COOLDOWN_S - 1
        # n1 still holds its two drained leases (their pods live) and the new one.
        assert len(leases_of(lab, store, "n1")) == 3
        assert pu.ping(fleet.live[-1].netns.rsplit("/", 1)[1], str(v6.ip))


def test_flanneld_peers_route_to_our_lease_whose_ipv6_half_is_in_an_ipv6_pool() -> None:
    extra = lab_plan.ip_family_net_conf("dual")
    with running_mixed_lab(
        "vxlan", overlay_bridge=True, pods_per_node=1, net_conf_extra=extra
    ) as lab:
        store = EtcdStore([lab.etcd_endpoint])
        try:
            pools(lab, "add", str(IPV6_NEW))
            pools(lab, "tag", str(IPV6_NEW), f"{ROLE}=1")
            pools(lab, "tag", str(IPV6_PRIMARY), f"{ROLE}=0")
            fresh = wait_until(
                partial(lease_in, lab, store, "n1", IPV6_NEW), 15, what=f"n1 to lease in {IPV6_NEW}"
            )
        finally:
            store.close()
        new_pod = lab.add_pod("n1")
        assert new_pod.address6 is not None
        assert IPv6Interface(new_pod.address6).network == fresh[1], (new_pod, fresh)
        # flanneld on n3 and n4 reads the dual key and routes its IPv6 half.
        for theirs in ("n3", "n4"):
            wait_until(
                partial(routes_to, lab, theirs, fresh[1]),
                15,
                what=f"flanneld on {theirs} to route to {fresh[1]}",
            )
        matrix = pods.pod_matrix(lab.state.pods, family=6)
        assert len(matrix) == 5 and status.all_reach(matrix), matrix


def routes_to(lab: Lab, node: str, subnet: IPv6Network) -> bool:
    out = lab.exec(node, ["ip", "-6", "route", "show", "exact", str(subnet)]).stdout
    return bool(out.strip())
