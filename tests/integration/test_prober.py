"""The prober with its real raw-ICMP transport between two network namespaces.

Namespace A runs the prober; namespace B holds the peers: one veth pair (MTU
1500) and twenty addresses on B's end, probed concurrently. Faults are made the
way they happen on an overlay: the peer side's MTU lowered (packets over it are
dropped without a word), our own route MTU lowered (the kernel refuses with
EMSGSIZE), random loss by iptables in B, and the peer's link going down.

The IPv6 side of a dual-stack peer: two namespaces joined by VXLAN over an IPv6
underlay, as ``flannel-v6.<VNI>`` is built; the full-size ICMPv6 echo (never
fragmented) passes at underlay − 70 and fails at flanneld's underlay − 50.

Also here: tx checksum offload on a vxlan device (--vxlan-tx-checksum-off).
"""

from __future__ import annotations

import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from ipaddress import IPv4Address, IPv6Address

import pytest

from flannelpy.dataplane.ethtool import set_tx_checksum, tx_checksum
from flannelpy.dataplane.icmp import DualTransport, Icmp6Transport, IcmpTransport
from flannelpy.dataplane.netns import run_in_netns
from flannelpy.errors import InterfaceNotFound
from flannelpy.observe.probe_verdict import ProbeResult
from flannelpy.observe.prober import Prober
from tests.support.lab_util import wait_until
from tests.support.netns_util import Netns, is_root, sh, temp_netns, unique_name

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(not is_root(), reason="network namespaces need root"),
]

OWN = IPv4Address("10.99.0.1")
PEERS = [IPv4Address("10.99.0.2") + i for i in range(20)]
INTERVAL = 0.2
WINDOW = 40


@dataclass
class Pair:
    a: Netns  # runs the prober
    b: Netns  # the peers
    a_if: str
    b_if: str
    prober: Prober
    mtu: list[int]  # what mtu_provider returns; a test may change it

    def results(self) -> dict[str, ProbeResult]:
        return self.prober.results()

    def when(
        self, ok: Callable[[dict[str, ProbeResult]], bool], timeout: float, what: str
    ) -> dict[str, ProbeResult]:
        """Results of all peers, as soon as ``ok`` holds for them."""

        def probe() -> dict[str, ProbeResult] | None:
            results = self.results()
            return results if len(results) == len(PEERS) and ok(results) else None

        found = wait_until(probe, timeout=timeout, what=what)
        assert found is not None
        return found

    def all_peers(self, min_probes: int) -> dict[str, ProbeResult]:
        """Results once every peer has completed ``min_probes`` rounds."""
        return self.when(
            lambda rs: all(r.probes >= min_probes for r in rs.values()),
            timeout=10,
            what=f"{min_probes} probe rounds to every peer",
        )

    def after(self, rounds: int) -> dict[str, ProbeResult]:
        """Results once every peer has completed ``rounds`` more rounds than now."""
        start = {k: r.probes for k, r in self.results().items()}
        return self.when(
            lambda rs: all(r.probes >= start.get(k, 0) + rounds for k, r in rs.items()),
            timeout=rounds * INTERVAL * 3 + 5,
            what=f"{rounds} more probe rounds to every peer",
        )


@pytest.fixture
def pair() -> Iterator[Pair]:
    with temp_netns("pra") as a, temp_netns("prb") as b:
        a_if, b_if = unique_name("pa"), unique_name("pb")
        sh(
            f"ip link add {a_if} netns {a.name} mtu 1500 type veth peer name {b_if} "
            f"netns {b.name} mtu 1500"
        )
        a.ip(f"addr add {OWN}/24 dev {a_if}")
        for addr in PEERS:
            b.ip(f"addr add {addr}/24 dev {b_if}")
        a.ip(f"link set {a_if} up")
        b.ip(f"link set {b_if} up")
        # the transport's socket belongs to the namespace of the thread that opens it
        transport = run_in_netns(a.name, IcmpTransport)
        mtu = [1500]
        prober = Prober(
            transport,
            mtu_provider=lambda: mtu[0],
            own_address_provider=lambda: OWN,
            interval_seconds=INTERVAL,
            timeout_seconds=0.15,
            window=WINDOW,
        )
        prober.set_peers({str(addr): (addr, f"peer-{addr}") for addr in PEERS})
        stop = threading.Event()
        thread = a.start(prober.run, stop)
        try:
            yield Pair(a, b, a_if, b_if, prober, mtu)
        finally:
            stop.set()
            thread.join(timeout=5)
            transport.close()
    assert not thread.is_alive()


def test_healthy_path_then_silent_mtu_drop_then_local_refusal(pair: Pair) -> None:
    results = pair.all_peers(min_probes=3)
    for key, r in results.items():
        assert r.reachable and r.mtu_ok is True, (key, r)
        assert r.loss_ratio == 0.0 and r.last_error is None
        assert r.rtt_seconds is not None and 0 < r.rtt_seconds < 0.1

    # The peer side's MTU drops below ours: full-size packets vanish at its end,
    # while ordinary echoes keep working. That is the silent-drop case.
    pair.b.ip(f"link set {pair.b_if} mtu 1400")
    results = pair.after(4)
    for key, r in results.items():
        assert r.reachable and r.mtu_ok is False, (key, r)
        assert r.loss_ratio == 0.0
        assert "1500-byte DF echo" in (r.last_error or "")

    pair.b.ip(f"link set {pair.b_if} mtu 1500")
    results = pair.after(2)
    assert all(r.mtu_ok is True and r.last_error is None for r in results.values()), results

    # Our own link below the overlay MTU: the kernel refuses the DF packet locally.
    pair.a.ip(f"link set {pair.a_if} mtu 1400")
    results = pair.after(2)
    for key, r in results.items():
        assert r.reachable and r.mtu_ok is False, (key, r)
        assert (r.last_error or "").startswith("message too long"), r.last_error

    # An overlay MTU that fits the path again is verified again.
    pair.mtu[0] = 1400
    results = pair.after(2)
    assert all(r.mtu_ok is True for r in results.values()), results


def test_loss_then_peer_down(pair: Pair) -> None:
    pair.all_peers(min_probes=1)
    pair.b.exec(
        "iptables -w -A INPUT -p icmp --icmp-type echo-request "
        "-m statistic --mode random --probability 0.3 -j DROP"
    )
    # a whole window of rounds sent after the rule went in
    results = pair.after(WINDOW + 1)
    losses = [r.loss_ratio for r in results.values()]
    # 20 peers x 40 echoes at 30 %: the mean is within a few points of 0.3
    assert 0.2 <= sum(losses) / len(losses) <= 0.4, losses
    assert all(0 < loss < 0.7 for loss in losses), losses
    # losing a packet now and then is loss, not an outage
    assert sum(r.reachable for r in results.values()) >= len(PEERS) - 2

    pair.b.exec("iptables -w -F INPUT")
    pair.b.ip(f"link set {pair.b_if} down")
    results = pair.when(
        lambda rs: not any(r.reachable for r in rs.values()),
        timeout=5,
        what="every peer reported unreachable",
    )
    for r in results.values():
        assert r.rtt_seconds is None and r.last_error is not None


# --- the IPv6 side over VXLAN on an IPv6 underlay ----------------------------------------

VTEP6_A, VTEP6_B = IPv6Address("fd10:244:0:1::"), IPv6Address("fd10:244:0:2::")
UNDERLAY6_A, UNDERLAY6_B = "fd00:99::1", "fd00:99::2"
V4_A, V4_B = IPv4Address("10.98.0.1"), IPv4Address("10.98.0.2")


@dataclass
class Vxlan6Pair:
    a: Netns
    vx_a: str
    prober: Prober
    mtu: list[int]

    def after(self, rounds: int) -> dict[str, ProbeResult]:
        start = {k: r.probes for k, r in self.prober.results().items()}

        def probe() -> dict[str, ProbeResult] | None:
            rs = self.prober.results()
            done = len(rs) == 2 and all(r.probes >= start.get(k, 0) + rounds for k, r in rs.items())
            return rs if done else None

        found = wait_until(
            probe,
            timeout=rounds * INTERVAL * 3 + 5,
            what=f"{rounds} more probe rounds to both families",
        )
        assert found is not None
        return found


@pytest.fixture
def vxlan6_pair() -> Iterator[Vxlan6Pair]:
    """A's VTEP is created without a lower device, as flanneld's can be set above the
    underlay's room; B's with one (the kernel then caps it at underlay − 70)."""
    with temp_netns("v6a") as a, temp_netns("v6b") as b:
        ua, ub = unique_name("u6a"), unique_name("u6b")
        vx_a, vx_b = unique_name("x6a"), unique_name("x6b")
        sh(
            f"ip link add {ua} netns {a.name} mtu 1500 type veth peer name {ub} "
            f"netns {b.name} mtu 1500"
        )
        mac_a, mac_b = "02:00:00:99:00:0a", "02:00:00:99:00:0b"
        for ns, under, me, peer, vx, mac, peer_mac, vtep, peer_vtep, v4, lower in (
            (a, ua, UNDERLAY6_A, UNDERLAY6_B, vx_a, mac_a, mac_b, VTEP6_A, VTEP6_B, V4_A, ""),
            (
                b,
                ub,
                UNDERLAY6_B,
                UNDERLAY6_A,
                vx_b,
                mac_b,
                mac_a,
                VTEP6_B,
                VTEP6_A,
                V4_B,
                f"dev {ub}",
            ),
        ):
            ns.ip(f"addr add {me}/64 dev {under} nodad")
            ns.ip(f"addr add {v4}/24 dev {under}")
            ns.ip(f"link set {under} up")
            ns.ip(
                f"link add {vx} address {mac} type vxlan id 1 local {me} dstport 8472 "
                f"nolearning {lower}"
            )
            ns.ip(f"link set {vx} mtu 1430 up")
            ns.ip(f"addr add {vtep}/128 dev {vx} nodad")
            ns.ip(f"neigh add {peer_vtep} lladdr {peer_mac} dev {vx} nud permanent")
            ns.exec(f"bridge fdb append {peer_mac} dev {vx} dst {peer}")
            ns.ip(f"route add {peer_vtep}/64 via {peer_vtep} dev {vx} onlink")
        transport = DualTransport(
            run_in_netns(a.name, IcmpTransport), run_in_netns(a.name, Icmp6Transport)
        )
        mtu = [1430]
        prober = Prober(
            transport,
            mtu_provider=lambda: mtu[0],
            own_address_provider=lambda: V4_A,
            own_address6_provider=lambda: VTEP6_A,
            interval_seconds=INTERVAL,
            timeout_seconds=0.15,
        )
        prober.set_peers({"10.244.2.0/24": (V4_B, "b"), "fd10:244:0:2::/64": (VTEP6_B, "b")})
        stop = threading.Event()
        thread = a.start(prober.run, stop)
        try:
            yield Vxlan6Pair(a, vx_a, prober, mtu)
        finally:
            stop.set()
            thread.join(timeout=5)
            transport.close()
    assert not thread.is_alive()


def test_ipv6_full_size_probe_over_vxlan6_fails_at_minus_50_passes_at_minus_70(
    vxlan6_pair: Vxlan6Pair,
) -> None:
    pair = vxlan6_pair
    results = pair.after(3)
    v4, v6 = results["10.244.2.0/24"], results["fd10:244:0:2::/64"]
    assert (v4.family, v6.family) == ("ipv4", "ipv6")
    assert v6.reachable and v6.mtu_ok is True and v6.last_error is None, v6
    assert v6.rtt_seconds is not None and 0 < v6.rtt_seconds < 0.1
    assert v4.mtu_ok is True, v4

    # flanneld's MTU over an IPv6 underlay: 1500 - 50 on our VTEP and as the overlay MTU.
    # 1450 bytes plus 70 of encapsulation do not fit the 1500-byte underlay.
    pair.a.ip(f"link set {pair.vx_a} mtu 1450")
    pair.mtu[0] = 1450
    results = pair.after(4)
    v4, v6 = results["10.244.2.0/24"], results["fd10:244:0:2::/64"]
    assert v6.reachable and v6.mtu_ok is False, v6
    assert v6.loss_ratio < 0.5  # the small echoes still pass: the silent large-packet case
    assert "1450" in (v6.last_error or ""), v6.last_error
    assert v4.mtu_ok is True, v4  # the IPv4 side, over the 1500-byte link, is fine

    # underlay - 70, as flannelpy computes it: the full-size echo crosses again
    pair.a.ip(f"link set {pair.vx_a} mtu 1430")
    pair.mtu[0] = 1430
    results = pair.after(2)
    v6 = results["fd10:244:0:2::/64"]
    assert v6.mtu_ok is True and v6.last_error is None, v6


# --- tx checksum offload on a vxlan device ---------------------------------------------


@pytest.fixture
def vxlan_ns() -> Iterator[tuple[Netns, str]]:
    with temp_netns("csum") as ns:
        name = unique_name("vx")
        ns.ip(f"link add {name} type vxlan id 42 dstport 8472 local 127.0.0.1 nolearning")
        yield ns, name


def _ethtool_says(ns: Netns, ifname: str) -> str | None:
    """``on``/``off`` for tx-checksumming as the ethtool program reads it, if installed."""
    if shutil.which("ethtool") is None:
        return None
    for line in ns.exec(["ethtool", "-k", ifname]).stdout.splitlines():
        if line.startswith("tx-checksumming:"):
            return line.split()[1]
    raise AssertionError(f"ethtool -k {ifname} shows no tx-checksumming line")


def test_tx_checksum_offload_off_and_on(vxlan_ns: tuple[Netns, str]) -> None:
    ns, name = vxlan_ns
    assert run_in_netns(ns.name, tx_checksum, name) is True  # the vxlan driver's default
    run_in_netns(ns.name, set_tx_checksum, name, False)
    assert run_in_netns(ns.name, tx_checksum, name) is False
    assert _ethtool_says(ns, name) in (None, "off")
    run_in_netns(ns.name, set_tx_checksum, name, False)  # idempotent
    run_in_netns(ns.name, set_tx_checksum, name, True)
    assert run_in_netns(ns.name, tx_checksum, name) is True
    assert _ethtool_says(ns, name) in (None, "on")


def test_tx_checksum_missing_interface(vxlan_ns: tuple[Netns, str]) -> None:
    ns, _ = vxlan_ns
    with pytest.raises(InterfaceNotFound, match="does not exist"):
        run_in_netns(ns.name, set_tx_checksum, "nosuchdev0", False)
