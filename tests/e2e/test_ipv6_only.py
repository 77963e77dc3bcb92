"""IPv6-only on the lab (``EnableIPv4: false``): 3 nodes, vxlan, host-gw or wireguard over
the ULA underlay, real agents and etcd, one pod per node through the real CNI executable.

Every node pair (cni0's IPv6 address to cni0's) and every pod pair reaches over IPv6;
a DF packet of exactly the overlay MTU (vxlan: underlay 1500 - 70 = 1430; host-gw:
1500; wireguard, ``flannel-wg-v6`` alone: 1500 - 80 = 1420) crosses and one byte more
is refused on the sending side; each pod is IPv6-only (its CNI result holds one IPv6
address, the IPv6 gateway and a default route ``::/0``, and it has no IPv4 address);
subnet.env has no FLANNEL_NETWORK / FLANNEL_SUBNET; and the leases are Flannel's
IPv6-only keys (``0.0.0.0-0&<subnet6>``) with ``"PublicIP":"0.0.0.0"``. With
wireguard, the underlay carries the pods' packets only as UDP 51821 between the nodes,
never their payload.
"""

from __future__ import annotations

import json
import re
import subprocess
from functools import partial
from ipaddress import IPv6Interface, ip_interface
from pathlib import Path

import pytest
from flannelpy_lab import Lab, etcd, plan, pods, status, topology
from flannelpy_lab.state import NodeInfo, PodInfo

from tests.support.lab_util import lab_run_argv, running_lab, wait_until
from tests.support.underlay_capture import captured_flows, underlay_capture

pytestmark = [pytest.mark.lab]

V6_HEADERS = 48  # IPv6 + ICMPv6 headers: ping's payload = packet - 48
WG_PORT_V6 = 51821
MARKER = "FLPWG6ONLY-SECRT"  # 16 bytes: ping -p takes at most 16


def df_ping(ns: str, dst: str, packet: int) -> tuple[bool, str]:
    """One DF ping of ``packet`` bytes on the wire (no -q: see design.md's ping trap)."""
    argv = ["ping", "-c", "1", "-W", "2", "-M", "do", "-s", str(packet - V6_HEADERS), dst]
    proc = topology.run_in(ns, argv, timeout=10)
    return proc.returncode == 0, proc.stdout + proc.stderr


def subnet6(node: NodeInfo) -> IPv6Interface:
    found = re.search(r"FLANNEL_IPV6_SUBNET=(\S+)", Path(node.subnet_env).read_text())
    assert found, node.subnet_env
    return IPv6Interface(found[1])


def cni_result(node: NodeInfo, pod: PodInfo) -> dict[str, object]:
    (path,) = Path(node.cni_cache_dir).glob(f"*-{pod.container_id}-{pod.ifname}.json")
    doc = json.loads(path.read_text())
    assert isinstance(doc, dict)
    return doc


def lease_values(lab: Lab) -> dict[str, dict[str, object]]:
    """Every lease in etcd: key suffix → the stored JSON value."""
    raw = etcd.read_lease_values(lab.state.etcd_endpoints, lab.state.etcd_prefix)
    return {key: json.loads(value) for key, value in raw.items()}


# vxlan: 1500 - 70 (VXLAN over IPv6); host-gw: the underlay's MTU; wireguard: 1500 - 80.
@pytest.mark.parametrize(
    ("backend", "overlay_mtu"), [("vxlan", 1430), ("host-gw", 1500), ("wireguard", 1420)]
)
def test_ipv6_only_lab_reaches_over_ipv6_with_the_mtu_right(
    backend: str, overlay_mtu: int, tmp_path: Path
) -> None:
    with running_lab(
        3,
        backend,
        overlay_bridge=True,
        pods_per_node=1,
        net_conf_extra=plan.ip_family_net_conf("ipv6"),
    ) as lab:
        # subnet.env: the IPv6 keys only, as Flannel writes it IPv6-only.
        for node in lab.nodes:
            env = Path(node.subnet_env).read_text()
            assert "FLANNEL_NETWORK=" not in env and "FLANNEL_SUBNET=" not in env, env
            assert "FLANNEL_IPV6_NETWORK=fd10:244::/56\n" in env, env
            assert f"FLANNEL_MTU={overlay_mtu}\nFLANNEL_IPMASQ=true\n" in env, env
        # The leases: Flannel's IPv6-only key and value.
        leases = lease_values(lab)
        assert len(leases) == 3, leases
        for node in lab.nodes:
            key = f"0.0.0.0-0&{subnet6(node).network.network_address}-64"
            assert key in leases, (key, sorted(leases))
            value = leases[key]
            assert value["PublicIP"] == "0.0.0.0", value
            assert value["PublicIPv6"] == plan.ipv6_underlay_ip(node), value
            assert "BackendData" not in value, value
            assert bool(value.get("BackendV6Data")) == (backend != "host-gw"), value
            if backend == "wireguard":  # Flannel's: the key and the IPv6 port
                data = value["BackendV6Data"]
                assert isinstance(data, dict) and set(data) == {"PublicKey", "Port"}, value
                assert data["Port"] == WG_PORT_V6, value
        # Every node pair over the overlay, cni0's IPv6 address to cni0's.
        for a in lab.nodes:
            for b in lab.nodes:
                if a is not b:
                    src, dst = str(subnet6(a).ip), str(subnet6(b).ip)
                    # Agents start side by side: a node may see a peer's lease, and
                    # handshake with it, a moment after it is ready.
                    wait_until(
                        partial(status.ping, a, src, dst, 3),
                        30.0,
                        f"{a.name} reaching {b.name} over IPv6",
                    )
        # Pods: IPv6-only, and every pod pair reaches.
        assert len(lab.state.pods) == 3
        for pod in lab.state.pods:
            node = lab.node(pod.node)
            assert pod.address is None and pod.address6, pod
            result = cni_result(node, pod)
            ips = result["ips"]
            assert isinstance(ips, list) and len(ips) == 1, result
            assert IPv6Interface(ips[0]["address"]).network == subnet6(node).network, result
            assert ips[0]["gateway"] == str(subnet6(node).ip), result
            routes = result.get("routes")
            assert isinstance(routes, list), result
            assert any(r["dst"] == "::/0" for r in routes), result
            v4 = topology.run_in(
                pod.namespace, ["ip", "-4", "-o", "addr", "show", "dev", pod.ifname], timeout=10
            )
            assert v4.stdout.strip() == "", v4.stdout
        matrix = pods.pod_matrix(lab.state.pods, family=6)
        assert len(matrix) == 3 and status.all_reach(matrix), matrix
        # DF at exactly the overlay MTU crosses, one byte more is refused at the sender.
        a = next(p for p in lab.state.pods if p.node == "n1")
        b = next(p for p in lab.state.pods if p.node == "n2")
        assert b.address6
        dst = str(ip_interface(b.address6).ip)
        ok, out = df_ping(a.namespace, dst, overlay_mtu)
        assert ok, f"DF {overlay_mtu} to {dst}: {out}"
        ok, out = df_ping(a.namespace, dst, overlay_mtu + 1)
        assert not ok and re.search(r"[Mm]essage too long|mtu ?= ?\d+", out), out
        if backend == "wireguard":
            assert_only_wireguard_on_the_wire(lab, a.namespace, dst, str(tmp_path / "u6.pcap"))
        # lab status: the IPv6 matrices alone, and a verdict on them.
        doc = lab.status()
        assert doc["matrix"] is None and doc["pod_matrix"] is None, doc
        assert status.all_reach(doc["matrix_ipv6"]) and status.all_reach(doc["pod_matrix_ipv6"])
        assert doc["ok"], doc
        text = status.render_text(doc)
        assert "all 6 node pairs reach each other in IPv6" in text, text
        assert "all 6 pod pairs reach each other in IPv6" in text, text
        # The doctor reads the IPv6-only node as the agent plans it: no error. Its peer check
        # reports the agent's last probe round, which may predate the matrix's convergence:
        # a round every 5 s (--probe-interval), so it is clean within two of them.
        last: list[subprocess.CompletedProcess[str]] = []

        def doctor_clean() -> bool:
            last[:] = [
                subprocess.run(
                    lab_run_argv(lab.name, "doctor", node="n1"),
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
            ]
            return "ERROR" not in last[0].stdout

        try:
            wait_until(doctor_clean, 12.0, "the doctor finding no error on n1", interval=1.0)
        except AssertionError as e:
            raise AssertionError(f"{e}:\n{last[0].stdout}{last[0].stderr}") from None
        doctor = last[0]
        if backend == "wireguard":
            assert "WireGuard's flannel-wg-v6 runs in userspace" in doctor.stdout, doctor.stdout


def assert_only_wireguard_on_the_wire(lab: Lab, pod_ns: str, dst: str, pcap: str) -> None:
    """While a pod pings another with a marker, the IPv6 underlay carries UDP 51821
    between node addresses and never the marker."""
    no_ndp = "ip6 and not (icmp6[0] >= 133 and icmp6[0] <= 137)"
    with underlay_capture(lab.state.segments[0].switch_namespace, pcap, [no_ndp]):
        ping = topology.run_in(
            pod_ns, ["ping", "-c", "5", "-i", "0.1", "-p", MARKER.encode().hex(), dst], timeout=15
        )
        assert ping.returncode == 0, ping.stdout
    with open(pcap, "rb") as f:
        assert MARKER.encode() not in f.read()
    node_ips = {plan.ipv6_underlay_ip(n) for n in lab.nodes}
    tunnel = [
        line
        for line in captured_flows(pcap)
        if "UDP" in line
        and line.split()[2].rsplit(".", 1)[0] in node_ips
        and line.split()[2].endswith(f".{WG_PORT_V6}")
    ]
    assert tunnel, captured_flows(pcap)[:5]
