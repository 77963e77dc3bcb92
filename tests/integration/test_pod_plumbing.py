"""Pod plumbing options and ownership in a real kernel: hairpinMode, isDefaultGateway,
routes the plugin did not add, and host veth names shared by two pods.

Same layout as test_cni_server: a throwaway node namespace running the CNI
server, one namespace per pod.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from ipaddress import IPv4Interface, IPv4Network

import pytest

from flannelpy.cni.context import CniSettings
from flannelpy.dataplane import podnet
from flannelpy.dataplane.podnames import IFNAMSIZ, host_veth_name, veth_owner
from tests.integration.test_cni_server import GATEWAY, MTU, NETWORK, Node, in_pod, make_node
from tests.support.netns_util import is_root

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(not is_root(), reason="network namespaces need root"),
]

CLUSTER = IPv4Network("10.244.0.0/16")


@pytest.fixture
def node() -> Iterator[Node]:
    with make_node() as n:
        yield n


def test_host_veth_names_use_the_whole_ifnamsiz_and_carry_their_owner(node: Node) -> None:
    pod = node.pod()
    code, result = node.add("c1", pod)
    assert code == 0
    host = result["interfaces"][0]["name"]
    assert host == host_veth_name(pod, "c1", "eth0") and len(host) == IFNAMSIZ
    assert node.links()[host]["ifalias"] == veth_owner(pod, "c1", "eth0")


def test_a_delete_spares_another_pods_veth_under_the_same_name(node: Node) -> None:
    # Simulate a name collision: the record's veth name now belongs to another pod.
    pod = node.pod()
    _, result = node.add("c1", pod)
    host = result["interfaces"][0]["name"]
    node.ns.ip(f"link del {host}")
    node.ns.ip(f"link add {host} type veth peer name fpother0")
    node.ns.ip(f"link set {host} alias flannelpy-someone-else")
    assert node.delete("c1", pod) == (0, None)
    assert host in node.links()  # not ours: left alone
    assert node.ipam.find("c1", "eth0") is None  # and our address released


def test_an_add_refuses_a_name_taken_by_another_pod(node: Node) -> None:
    pod = node.pod()
    host = host_veth_name(pod, "c1", "eth0")
    node.ns.ip(f"link add {host} type veth peer name fpother0")
    node.ns.ip(f"link set {host} alias flannelpy-someone-else")
    code, err = node.add("c1", pod)
    assert code == 1 and "taken by another pod" in err["msg"], err
    assert host in node.links() and node.ipam.allocations() == []


def test_hairpin_off_and_no_default_gateway() -> None:
    with make_node(cluster_networks=lambda: [CLUSTER]) as node:
        pod = node.pod()
        code, result = node.add(
            "c1",
            pod,
            config=node.config(
                hairpinMode=False,
                isDefaultGateway=False,
            ),
        )
        assert code == 0, result
        assert result["routes"] == [{"dst": str(CLUSTER), "gw": str(GATEWAY)}]
        veth = node.links()[result["interfaces"][0]["name"]]
        assert veth["linkinfo"]["info_slave_data"]["hairpin"] is False
        routes = in_pod(pod, "ip route").stdout
        assert "default" not in routes and f"{CLUSTER} via {GATEWAY} dev eth0" in routes
        check = node.config(hairpinMode=False, isDefaultGateway=False)
        assert node.request("CHECK", "c1", pod, config=check) == (0, None)
        code, err = node.request("CHECK", "c1", pod)  # expects a default route: none
        assert code == 1 and "no default route" in err["msg"]


def test_a_default_route_the_plugin_did_not_add_is_kept(node: Node) -> None:
    pod = node.pod()
    name = pod.rsplit("/", 1)[1]
    # Another network's interface already routes the pod's default.
    in_pod(pod, "ip link add other0 type veth peer name other1")
    in_pod(pod, "ip link set other0 up")
    in_pod(pod, "ip addr add 192.168.77.2/24 dev other0")
    in_pod(pod, "ip route add default via 192.168.77.1 dev other0")
    code, err = node.add("c1", pod)
    assert code == 1 and "isDefaultGateway" in err["msg"], err
    assert "default via 192.168.77.1 dev other0" in in_pod(pod, "ip route").stdout
    assert node.veths() == [] and node.ipam.allocations() == [], name
    # As a second network without a default gateway it attaches beside it.
    settings_node = node.handler.settings
    node.handler.settings = CniSettings(
        mtu_provider=lambda: MTU, cluster_networks=lambda: [CLUSTER]
    )
    try:
        code, result = node.add("c1", pod, config=node.config(isDefaultGateway=False))
        assert code == 0, result
    finally:
        node.handler.settings = settings_node
    assert "default via 192.168.77.1 dev other0" in in_pod(pod, "ip route").stdout
    record = node.records.read(NETWORK, "c1", "eth0")
    assert record is not None and json.dumps(record.result["routes"]) == json.dumps(
        [{"dst": str(CLUSTER), "gw": str(GATEWAY)}]
    )


def test_a_burst_asks_for_the_bridge_once_and_a_bridge_gone_meanwhile_costs_one_retry(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bridge found as wanted is used without asking the kernel for BRIDGE_TRUST_SECONDS
    (here made long, so the test does not race the clock). One deleted by hand within that
    time fails the ADD that finds it gone, with the kernel's reason; the runtime's retry
    asks again and re-creates it."""
    monkeypatch.setattr(podnet, "BRIDGE_TRUST_SECONDS", 600.0)
    assert node.add("c1", node.pod())[0] == 0
    index = node.links()["cni0"]["ifindex"]

    def no_socket(*args: object, **kwargs: object) -> None:
        raise AssertionError("ensure_bridge asked the kernel")

    with monkeypatch.context() as m:
        m.setattr(podnet.nl, "NetlinkSocket", no_socket)
        assert node.ns.call(node.pods.ensure_bridge, [IPv4Interface(f"{GATEWAY}/24")], MTU) == index

    node.ns.ip("link del cni0")
    pod = node.pod()
    code, err = node.add("c2", pod)
    assert code == 1 and "create veth pair" in err["msg"], err
    assert node.ipam.find("c2", "eth0") is None  # undone
    code, result = node.add("c2", pod)
    assert code == 0, result
    links = node.links()
    assert links["cni0"]["ifindex"] != index
    assert links[result["interfaces"][0]["name"]]["master"] == "cni0"
    assert f"{GATEWAY}/24" in node.ns.ip("-4 addr show dev cni0")
