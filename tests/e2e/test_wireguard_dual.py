"""The wireguard backend dual stack in the netns lab: ``flannel-wg-v6`` over the IPv6 underlay.

As Flannel's ``Mode: separate`` (the default): each node runs a second WireGuard device
``flannel-wg-v6`` (wireguard-go here: no kernel module) listening on 51821, with the
same key as ``flannel-wg``, one peer per node at ``[PublicIPv6]:51821`` of its lease's
BackendV6Data, MTU underlay−80, and the IPv6 network routed through it. Shown with
real packets:

- every node pair and pod pair reaches in both families;
- a DF IPv6 ping of exactly the overlay MTU (1500−80: the pods' MTU is the smaller
  family's) crosses, one byte more is refused on the sending pod;
- the underlay switch carries the pods' IPv6 traffic only as UDP 51821 between the
  nodes' IPv6 underlay addresses, and the marker in its payload is never on the wire
  (a plain IPv6 underlay ping with another marker is seen in the same capture).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from ipaddress import IPv6Address, ip_interface

import pytest
from flannelpy_lab import Lab, plan, status
from flannelpy_lab import etcd as lab_etcd

from tests.support import pod_util as pu
from tests.support.lab_util import lab_run_argv, running_lab, wait_until
from tests.support.underlay_capture import captured_flows, underlay_capture

pytestmark = [pytest.mark.lab]

PORT_V6 = 51821
V6_MTU = 1500 - 80
V6_HEADERS = 48  # IPv6 40 + ICMPv6 8
POD_MARKER = "FLPWG6-POD-SECRT"  # 16 bytes: ping -p takes at most 16
UNDERLAY_MARKER = "FLPWG6-UNDERLAY!"
DEVICE_V6 = "flannel-wg-v6"


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with running_lab(
        3,
        "wireguard",
        overlay_bridge=True,
        pods_per_node=1,
        net_conf_extra=plan.ip_family_net_conf("dual"),
    ) as lab:
        started = time.monotonic()
        last: dict[str, object] = {}

        def reaching() -> bool:
            last.update(lab.status())
            return bool(last["ok"]) and all(
                bool(last.get(key)) and status.all_reach(last[key])  # type: ignore[arg-type]
                for key in ("matrix_ipv6", "pod_matrix_ipv6")
            )

        try:
            wait_until(reaching, 30.0, "every pair reaching in both families")
        except AssertionError as e:
            matrices = (last.get("matrix_ipv6"), last.get("pod_matrix_ipv6"))
            raise AssertionError(f"{e}: {matrices}") from e
        print(f"all pairs reach in both families {time.monotonic() - started:.1f} s after ready")
        yield lab


def wg_pid(lab: Lab, node: str, device: str) -> int:
    path = os.path.join(lab.node(node).node_dir, "run", "wireguard", f"{device}.pid")
    with open(path) as f:
        return int(f.read())


def wg(lab: Lab, node: str, device: str, *args: str) -> str:
    """``wg show <device> ...`` inside that device's wireguard-go namespaces."""
    out = subprocess.run(
        ["nsenter", "-t", str(wg_pid(lab, node, device)), "-m", "-n", "wg", "show", device, *args],
        capture_output=True,
        text=True,
        check=True,
        timeout=10,
    )
    return out.stdout


def pod6(lab: Lab, pod: str) -> str:
    address = lab.pod(pod).address6
    assert address is not None
    return str(ip_interface(address).ip)


def test_every_pair_reaches_in_both_families_over_the_ipv6_device(lab: Lab) -> None:
    doc = lab.status()
    for key in ("matrix", "pod_matrix", "matrix_ipv6", "pod_matrix_ipv6"):
        assert doc[key] and status.all_reach(doc[key]), (key, doc[key])
    with lab_etcd.client(lab.etcd_endpoint) as c:
        values = [json.loads(v) for v, _ in c.get_prefix(f"{lab.state.etcd_prefix}/subnets/")]
    leases = {attrs["PublicIP"]: attrs for attrs in values}
    for node in lab.nodes:
        attrs = leases[str(node.ip)]
        # Flannel's lease: the same key in both families, the IPv6 port in BackendV6Data.
        assert attrs["PublicIPv6"] == plan.ipv6_underlay_ip(node), attrs
        assert attrs["BackendV6Data"] == {
            "PublicKey": attrs["BackendData"]["PublicKey"],
            "Port": PORT_V6,
        }, attrs
        assert wg(lab, node.name, "flannel-wg-v6", "listen-port").strip() == str(PORT_V6)
        endpoints = wg(lab, node.name, "flannel-wg-v6", "endpoints").split()
        others = {f"[{plan.ipv6_underlay_ip(n)}]:{PORT_V6}" for n in lab.nodes if n != node}
        assert set(endpoints[1::2]) == others
        routes = lab.exec(node.name, ["ip", "-6", "route", "show", "dev", "flannel-wg-v6"])
        assert plan.DEFAULT_IPV6_NETWORK in routes.stdout, routes.stdout


def test_df_ping_at_exactly_the_ipv6_overlay_mtu_crosses_and_one_more_is_refused(
    lab: Lab,
) -> None:
    mtu6 = int(lab.exec("n1", ["cat", "/sys/class/net/flannel-wg-v6/mtu"]).stdout)
    mtu4 = int(lab.exec("n1", ["cat", "/sys/class/net/flannel-wg/mtu"]).stdout)
    assert (mtu4, mtu6) == (1500 - 60, V6_MTU)
    src, dst = lab.pod("n1-p1").namespace, pod6(lab, "n2-p1")
    base = ["ping", "-c", "1", "-W", "2", "-M", "do", "-s"]
    full = pu.run_in(src, [*base, str(V6_MTU - V6_HEADERS), dst])
    assert full.returncode == 0, full.stdout + full.stderr
    over = pu.run_in(src, [*base, str(V6_MTU - V6_HEADERS + 1), dst])
    assert over.returncode != 0
    out = (over.stdout + over.stderr).lower()
    assert "message too long" in out or f"mtu={V6_MTU}" in out.replace(" ", ""), out


def test_the_ipv6_underlay_carries_only_wireguard_and_never_the_payload(lab: Lab, tmp_path) -> None:
    seg = lab.state.segments[0]
    pcap = str(tmp_path / "underlay6.pcap")
    no_ndp = "ip6 and not (icmp6[0] >= 133 and icmp6[0] <= 137)"
    with underlay_capture(seg.switch_namespace, pcap, [no_ndp]):
        a, b = lab.pod("n1-p1"), lab.pod("n3-p1")
        ping = pu.run_in(
            a.namespace,
            ["ping", "-c", "5", "-i", "0.1", "-p", POD_MARKER.encode().hex(), pod6(lab, b.name)],
        )
        assert ping.returncode == 0, ping.stdout
        n1, n2 = lab.node("n1"), lab.node("n2")
        under_hex = UNDERLAY_MARKER.encode().hex()
        plain = lab.exec(
            "n1", ["ping", "-c", "2", "-i", "0.2", "-p", under_hex, plan.ipv6_underlay_ip(n2)]
        )
        assert plain.returncode == 0
        time.sleep(0.5)
    with open(pcap, "rb") as f:
        raw = f.read()
    assert UNDERLAY_MARKER.encode() in raw  # the capture sees plaintext when there is some
    assert POD_MARKER.encode() not in raw
    flows = captured_flows(pcap)
    node_ips = {IPv6Address(plan.ipv6_underlay_ip(n)) for n in lab.nodes}
    control = {IPv6Address(plan.ipv6_underlay_ip(n)) for n in (n1, n2)}

    def ends(line: str) -> tuple[str, str]:  # "IP6 fd00::1.51821 > fd00::3.51821: UDP, ..."
        fields = line.split()
        return fields[2], fields[4].rstrip(":")

    def tunnel(line: str) -> bool:
        if "UDP" not in line:
            return False
        (src, sport), (dst, dport) = (end.rsplit(".", 1) for end in ends(line))
        return (
            IPv6Address(src) in node_ips
            and IPv6Address(dst) in node_ips
            and sport == dport == str(PORT_V6)
        )

    def underlay_control(line: str) -> bool:
        return "ICMP6, echo" in line and {IPv6Address(e) for e in ends(line)} == control

    assert any(tunnel(line) for line in flows), flows[:5]
    others = [line for line in flows if not tunnel(line) and not underlay_control(line)]
    assert not others, others[:5]


def test_the_doctor_reads_both_devices_and_names_a_missing_ipv6_peer(lab: Lab) -> None:
    """The doctor checks ``flannel-wg-v6`` as it checks ``flannel-wg``: all peers as the
    leases say, and a peer removed by hand from the IPv6 device only is named."""

    def doctor() -> str:
        out = subprocess.run(
            lab_run_argv(lab.name, "doctor", node="n1"), capture_output=True, text=True, timeout=60
        )
        return out.stdout + out.stderr

    text = doctor()
    assert "WireGuard runs in userspace (wireguard-go" in text, text
    assert "WireGuard's flannel-wg-v6 runs in userspace (wireguard-go" in text, text
    assert "with all 2 peer(s) as the leases say" in text, text
    # The agent is paused (it would repair the device within a second), so the doctor
    # sees the device as it is: a peer removed from flannel-wg-v6 alone is named there.
    key = wg(lab, "n1", DEVICE_V6, "peers").split()[0]
    lab.kill_agent("n1", signal.SIGSTOP, wait=False)
    try:
        subprocess.run(
            [
                "nsenter",
                "-t",
                str(wg_pid(lab, "n1", DEVICE_V6)),
                "-m",
                "-n",
                "wg",
                "set",
                DEVICE_V6,
                "peer",
                key,
                "remove",
            ],
            check=True,
            timeout=10,
        )
        text = doctor()
        assert f"WireGuard's {DEVICE_V6} runs in userspace" in text, text
        assert "1 peer(s) missing or different" in text, text
    finally:
        lab.kill_agent("n1", signal.SIGCONT, wait=False)
    wait_until(lambda: key in wg(lab, "n1", DEVICE_V6, "peers"), 15.0, "the peer back")
