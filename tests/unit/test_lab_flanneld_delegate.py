"""The conflist of the lab's flanneld nodes (kube-flannel.yml's, with the node's paths), and
the delegate config the lab renders for the flannel CNI plugin's DEL of pods it did not add,
as the plugin does from subnet.env: one host-local range per family, a route to each
family's network."""

from __future__ import annotations

from flannelpy_lab import flanneld
from flannelpy_lab.agents import parse_subnet_env
from flannelpy_lab.state import KIND_FLANNELD, NodeInfo

NODE = NodeInfo(
    name="n3",
    namespace="fpl-n3",
    segment=1,
    underlay_iface="eth0",
    underlay_address="100.64.0.3/24",
    switch_port="fpl-n3-p",
    node_dir="/tmp/n3",
    subnet_env="/tmp/n3/subnet.env",
    agent_log="/tmp/n3/agent.log",
    agent_kind=KIND_FLANNELD,
)
IPV4_ENV = (
    "FLANNEL_NETWORK=10.244.0.0/16\nFLANNEL_SUBNET=10.244.3.1/24\n"
    "FLANNEL_MTU=1450\nFLANNEL_IPMASQ=true\n"
)


def test_ipv4_only_has_one_range_and_the_network_route() -> None:
    ipam = flanneld.delegate_conf(NODE, parse_subnet_env(IPV4_ENV), "cbr0")["ipam"]
    assert ipam["ranges"] == [[{"subnet": "10.244.3.0/24"}]]
    assert ipam["routes"] == [{"dst": "10.244.0.0/16"}]


def test_dual_stack_adds_the_ipv6_range_and_route() -> None:
    env = parse_subnet_env(
        IPV4_ENV + "FLANNEL_IPV6_NETWORK=fd10:244::/56\nFLANNEL_IPV6_SUBNET=fd10:244:0:3::1/64\n"
    )
    conf = flanneld.delegate_conf(NODE, env, "cbr0")
    assert conf["ipam"]["ranges"] == [
        [{"subnet": "10.244.3.0/24"}],
        [{"subnet": "fd10:244:0:3::/64"}],
    ]
    assert conf["ipam"]["routes"] == [{"dst": "10.244.0.0/16"}, {"dst": "fd10:244::/56"}]
    # The pods' default routes of both families come from the bridge plugin.
    assert conf["isDefaultGateway"] is True and conf["isGateway"] is True


def test_the_conflist_is_kube_flannels_with_the_nodes_paths() -> None:
    conflist = flanneld.conflist_doc(NODE, "cbr0")
    assert conflist["cniVersion"] == "0.3.1"  # the v0.9.1 plugin refuses 1.0.0
    flannel, portmap = conflist["plugins"]
    assert flannel == {
        "type": "flannel",
        "subnetFile": "/tmp/n3/subnet.env",
        "dataDir": "/tmp/n3/cni/flannel",
        "ipam": {"dataDir": "/tmp/n3/cni/networks"},
        "delegate": {"hairpinMode": True, "isDefaultGateway": True},
    }
    assert portmap["type"] == "portmap"
