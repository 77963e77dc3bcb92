"""--ip-blackhole-route in the netns lab: the node's own subnet gets a blackhole route.

n1 runs with the flag, n2 without (the control). Each node is given a default route
through the other (lab nodes have none), so a packet the node cannot deliver leaves
by it, as on a real host. With cni0 taken down (its connected route goes, as on a node
whose bridge is missing), a packet for an unused address of n1's subnet is dropped on
n1, while on n2 the same kind of packet goes out of its underlay by the default route.
cni0's connected route wins over the blackhole while it exists: pods keep working.
The route is the agent's: deleted by hand, it is back within a resync.

n1 also runs with --vxlan-tx-checksum-off: its VTEP has transmit checksum offload off,
again after the device is deleted and re-created; n2's keeps the driver's default.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from ipaddress import IPv4Address, IPv4Network

import pytest
from flannelpy_lab import Lab

from tests.support import pod_util as pu
from tests.support.lab_util import running_lab, wait_until

pytestmark = [pytest.mark.lab]

TABLE = "fpl_blackhole_test"  # a table of the test's own in the node namespaces
UNUSED = 200  # last octet of an address no pod has (the lab adds two pods)


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with running_lab(2, "vxlan", start_agents=False) as lab:
        lab.set_node_agent_args("n1", ["--ip-blackhole-route", "--vxlan-tx-checksum-off"])
        lab.start_agents()
        lab.install_cni()
        for node in ("n1", "n2"):
            lab.add_pod(node)
        yield lab


def subnet_of(lab: Lab, node: str) -> IPv4Network:
    return pu.node_lease(lab.node(node))


def blackholes(lab: Lab, node: str) -> list[dict[str, object]]:
    out = lab.exec(node, ["ip", "-j", "route", "show", "type", "blackhole"]).stdout
    return list(json.loads(out or "[]"))


@contextmanager
def counting(lab: Lab, node: str, dst: IPv4Address) -> Iterator[dict[str, int]]:
    """Counters in ``node`` for packets to ``dst``, filled in on exit: arrived
    (``pre``, prerouting) and sent out of the underlay (``post``); the table is removed."""
    iface = lab.node(node).underlay_iface
    rules = (
        f"table ip {TABLE} {{\n"
        f"  chain pre {{ type filter hook prerouting priority -300; ip daddr {dst} counter; }}\n"
        f"  chain post {{ type filter hook postrouting priority 300; ip daddr {dst} "
        f'oifname "{iface}" counter; }}\n'
        "}\n"
    )
    ns = lab.node(node).namespace
    subprocess.run(
        ["ip", "netns", "exec", ns, "nft", "-f", "-"],
        input=rules,
        text=True,
        check=True,
        capture_output=True,
    )
    counts: dict[str, int] = {}
    try:
        yield counts
    finally:
        listed = json.loads(lab.exec(node, ["nft", "-j", "list", "table", "ip", TABLE]).stdout)
        for item in listed["nftables"]:
            rule = item.get("rule")
            if rule:
                counter = next(e["counter"] for e in rule["expr"] if "counter" in e)
                counts[rule["chain"]] = int(counter["packets"])
        lab.exec(node, ["nft", "delete", "table", "ip", TABLE])


def ping_unused(lab: Lab, src_pod: str, dst_node: str) -> IPv4Address:
    target = subnet_of(lab, dst_node).network_address + UNUSED
    # A short TTL: without a blackhole the packet loops between the two nodes.
    pu.run_in(
        lab.pod(src_pod).namespace,
        ["ping", "-c", "3", "-i", "0.2", "-W", "1", "-t", "8", str(target)],
    )
    return target


def test_the_flagged_node_has_a_blackhole_for_its_subnet_beneath_cni0(lab: Lab) -> None:
    own = subnet_of(lab, "n1")
    (route,) = blackholes(lab, "n1")
    assert (route["dst"], route["protocol"], route["metric"]) == (str(own), "75", 1024)
    assert blackholes(lab, "n2") == []
    # cni0's connected route wins: the pods of n1 are reached.
    assert "dev cni0" in lab.exec("n1", ["ip", "route", "get", str(own.network_address + 5)]).stdout
    assert pu.ping(lab.pod("n2-p1").namespace, lab.pod("n1-p1").ip)


def test_a_deleted_blackhole_route_is_put_back(lab: Lab) -> None:
    own = subnet_of(lab, "n1")
    deleted = lab.exec("n1", ["ip", "route", "del", "blackhole", str(own)])
    # Deleted (the agent may put it back before a second look could see it gone).
    assert deleted.returncode == 0, deleted.stderr
    wait_until(lambda: blackholes(lab, "n1"), 10.0, "the blackhole route back on n1")
    assert "10.244" in lab.exec("n1", ["ip", "route", "show", "dev", "cni0"]).stdout


@pytest.mark.parametrize(
    ("node", "sender", "dropped"), [("n1", "n2-p1", True), ("n2", "n1-p1", False)]
)
def test_without_cni0_an_unused_address_is_dropped_only_with_the_flag(
    lab: Lab, node: str, sender: str, dropped: bool
) -> None:
    other = "n2" if node == "n1" else "n1"
    via = str(lab.node(other).ip)
    lab.exec(node, ["ip", "route", "add", "default", "via", via])
    lab.exec(node, ["ip", "link", "set", "cni0", "down"])  # its connected route goes
    try:
        with counting(lab, node, subnet_of(lab, node).network_address + UNUSED) as counts:
            ping_unused(lab, sender, node)
    finally:
        lab.exec(node, ["ip", "link", "set", "cni0", "up"])
        lab.exec(node, ["ip", "route", "del", "default", "via", via], check=False)
    assert counts["pre"] >= 3, counts  # the packets did reach the node
    if dropped:
        assert counts.get("post", 0) == 0, counts
    else:
        assert counts["post"] >= 3, counts  # the control: out by the default route
    # With cni0 back, pods reach each other again.
    wait_until(
        lambda: pu.ping(lab.pod(sender).namespace, lab.pod(f"{node}-p1").ip),
        15.0,
        f"{sender} reaching the pod on {node} again",
    )


def tx_offload(lab: Lab, node: str) -> bool | None:
    """Whether ``node``'s flannel.1 has transmit checksum offload on (None: no device)."""
    read = (
        "from flannelpy.dataplane.ethtool import tx_checksum\n"
        "try:\n    print(tx_checksum('flannel.1'))\nexcept Exception:\n    print('none')"
    )
    out = lab.exec(node, [sys.executable, "-c", read]).stdout.strip()
    return None if out == "none" else out == "True"


def test_the_flagged_node_s_vtep_sends_without_checksum_offload_even_re_created(lab: Lab) -> None:
    assert tx_offload(lab, "n2") is True  # the vxlan driver's default
    assert tx_offload(lab, "n1") is False
    lab.exec("n1", ["ip", "link", "del", "flannel.1"])
    # Re-created by the reconciler's next pass, which sets it again straight after.
    wait_until(lambda: tx_offload(lab, "n1") is False, 15.0, "flannel.1 back on n1, offload off")
