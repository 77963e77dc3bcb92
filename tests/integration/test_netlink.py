"""NetlinkKernel against a real kernel, each test in network namespaces it creates."""

from __future__ import annotations

import asyncio
import os
import queue
import re
import select
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from ipaddress import IPv4Address, IPv4Interface, IPv4Network, IPv6Address, IPv6Network
from typing import Any

import pytest

from flannelpy.dataplane import netlink_apply, netlink_events, nlfilter, rtnl
from flannelpy.dataplane import netns as netns_module
from flannelpy.dataplane import nlbatch as nl
from flannelpy.dataplane.kernel import ApplyResult, ForeignRoute
from flannelpy.dataplane.netlink import NetlinkKernel
from flannelpy.dataplane.netlink_events import event_kinds
from flannelpy.dataplane.netlink_host import sysctl_path
from flannelpy.dataplane.netns import (
    CannotEnterNetns,
    StrandedInNetns,
    run_in_netns,
    visiting_netns,
)
from flannelpy.dataplane.state import (
    Address,
    Changes,
    FdbEntry,
    Neighbour,
    ObservedState,
    Route,
    VxlanLink,
    blackhole_route,
)
from flannelpy.dataplane.underlay import Interface, choose_underlay
from flannelpy.errors import DataplaneError, InterfaceNotFound
from tests.support.netns_util import Netns, is_root, temp_netns
from tests.support.waiting import wait_until

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(not is_root(), reason="network namespaces need root"),
]

DEV = "flannel.1"
LOCAL = IPv4Address("192.168.50.2")
VTEP = Address(DEV, IPv4Interface("10.244.1.0/32"))


def vxlan(**over: object) -> VxlanLink:
    link = VxlanLink(DEV, 1, LOCAL, "u0", 8472, 1450, None)
    return replace(link, **over)  # type: ignore[arg-type]


def peer(i: int) -> tuple[Neighbour, FdbEntry, Route]:
    """Peer ``i``: subnet 10.(100+i/256).(i%256).0/24 behind public IP 192.168.x.y."""
    subnet = IPv4Network(f"10.{100 + i // 256}.{i % 256}.0/24")
    mac = f"02:aa:00:00:{i // 256:02x}:{i % 256:02x}"
    public = IPv4Address(int(IPv4Address("192.168.50.10")) + i)
    return (
        Neighbour(DEV, subnet.network_address, mac),
        FdbEntry(DEV, mac, public),
        Route(subnet, subnet.network_address, DEV, onlink=True),
    )


def add_peers(peers: list[tuple[Neighbour, FdbEntry, Route]], **extra: object) -> Changes:
    return Changes(
        neighbours_to_set=tuple(p[0] for p in peers),
        fdb_to_set=tuple(p[1] for p in peers),
        routes_to_set=tuple(p[2] for p in peers),
        **extra,  # type: ignore[arg-type]
    )


def remove_peers(peers: list[tuple[Neighbour, FdbEntry, Route]]) -> Changes:
    return Changes(
        routes_to_delete=tuple(p[2] for p in peers),
        neighbours_to_delete=tuple(p[0] for p in peers),
        fdb_to_delete=tuple(p[1] for p in peers),
    )


def expected(
    ns: Netns, peers: list[tuple[Neighbour, FdbEntry, Route]], link: VxlanLink | None = None
) -> ObservedState:
    """What observe must return; the MAC the kernel chose is read back with `ip`."""
    link = link or vxlan()
    mac = re.search(r"link/ether (\S+)", ns.ip(f"link show {link.name}"))
    assert mac is not None
    return ObservedState(
        links=frozenset({replace(link, mac=link.mac or mac.group(1))}),
        addresses=frozenset({VTEP}),
        neighbours=frozenset(p[0] for p in peers),
        fdb=frozenset(p[1] for p in peers),
        routes=frozenset(p[2] for p in peers),
    )


@pytest.fixture
def kernel() -> NetlinkKernel:
    return NetlinkKernel()


@pytest.fixture
def node() -> Iterator[Netns]:
    """A namespace with underlay u0 (192.168.50.2/24) and a default route through it."""
    with temp_netns("nl") as ns:
        ns.veth("u0", "192.168.50.2/24")
        ns.ip("route add default via 192.168.50.1")
        yield ns


@pytest.fixture
def overlay(node: Netns, kernel: NetlinkKernel) -> Netns:
    """``node`` with flannel.1 and its VTEP address, no peers."""
    result = node.call(kernel.apply, Changes(links_to_create=(vxlan(),), addresses_to_add=(VTEP,)))
    assert result.failures == ()
    return node


def observe(ns: Netns, kernel: NetlinkKernel) -> ObservedState:
    return ns.call(kernel.observe, [DEV], [DEV])


# --- pure helpers ----------------------------------------------------------------------

ETH0 = Interface("eth0", 2, 1500, (IPv4Interface("192.168.1.5/24"),))
ETH1 = Interface("eth1", 3, 9000, (IPv4Interface("10.0.0.7/16"), IPv4Interface("10.1.0.7/16")))
BARE = Interface("eth2", 4, 1500, ())
LO = Interface("lo", 1, 65536, (IPv4Interface("127.0.0.1/8"),))
IFACES = [LO, ETH0, ETH1, BARE]


@pytest.mark.parametrize(
    ("kwargs", "name", "ip"),
    [
        ({"default_oif": 2}, "eth0", "192.168.1.5"),
        ({"ifaces": ["eth1"], "default_oif": 2}, "eth1", "10.0.0.7"),
        ({"ifaces": ["10.1.0.7"]}, "eth1", "10.1.0.7"),
        ({"ifaces": ["eth9", "eth2", "eth0"]}, "eth0", "192.168.1.5"),
        # explicit names win over regexes, whatever the order of flags
        ({"ifaces": ["eth1"], "iface_regexes": ["^eth0$"]}, "eth1", "10.0.0.7"),
        # a regex is tried against addresses before names
        ({"iface_regexes": [r"^10\.1\."]}, "eth1", "10.1.0.7"),
        ({"iface_regexes": ["nomatch", "th0"]}, "eth0", "192.168.1.5"),
        (
            {"can_reach": IPv4Address("10.0.9.9"), "reach_route": (3, IPv4Address("10.1.0.7"))},
            "eth1",
            "10.1.0.7",
        ),
        # --public-ip is only advertised: the vxlan local address stays the interface's own
        ({"default_oif": 3, "public_ip": IPv4Address("203.0.113.9")}, "eth1", "10.0.0.7"),
    ],
)
def test_choose_underlay(kwargs: dict[str, object], name: str, ip: str) -> None:
    chosen = choose_underlay(IFACES, **kwargs)  # type: ignore[arg-type]
    assert (chosen.name, chosen.ip) == (name, IPv4Address(ip))
    iface = next(i for i in IFACES if i.name == name)
    assert chosen.mtu == iface.mtu and chosen.index == iface.index
    assert chosen.networks == tuple(a.network for a in iface.addresses)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"ifaces": ["eth9", "eth2"], "default_oif": 2},
            "no interface matches --iface eth9 or --iface eth2 (eth2 has no IPv4 address);"
            " the node has lo, eth0, eth1, eth2",
        ),
        ({"iface_regexes": ["^wl"]}, "no interface matches --iface-regex ^wl; the node has"),
        ({}, "there is no IPv4 default route"),
        ({"can_reach": IPv4Address("10.9.9.9")}, "no route to --iface-can-reach 10.9.9.9"),
        ({"iface_regexes": ["("]}, "is not a valid regular expression"),
    ],
)
def test_choose_underlay_errors(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(InterfaceNotFound, match=re.escape(message)):
        choose_underlay(IFACES, **kwargs)  # type: ignore[arg-type]


def test_event_kinds_and_sysctl_path() -> None:
    assert event_kinds(b"") == []
    assert sysctl_path("net.ipv4.ip_forward") == "/proc/sys/net/ipv4/ip_forward"
    assert sysctl_path("net/ipv4/conf/flannel.1/rp_filter") == (
        "/proc/sys/net/ipv4/conf/flannel.1/rp_filter"
    )


def kinds_while(node: Netns, change: str) -> list[str]:
    """The reconciler's event kinds for what the kernel reports while ``node`` runs the
    ``ip`` command ``change`` (notifications read until 0.3 s pass without one)."""

    def listen() -> list[str]:
        with nl.NetlinkSocket(groups=netlink_events._GROUPS) as sock:
            node.ip(change)
            kinds: list[str] = []
            while select.select([sock], [], [], 0.3)[0]:
                kinds += [k for k in event_kinds(sock.recv()) if k not in kinds]
            return kinds

    return node.call(listen)


def test_a_pod_veth_going_wakes_no_pass_and_a_global_address_going_does(node: Netns) -> None:
    """A DEL deletes a veth whose IPv6 link-local address and multicast neighbours go with
    it: none of that is the reconciler's, so it must not cost a pass (it cost one per DEL)."""
    with temp_netns("pod") as pod:
        node.ip("link add cnb0 type bridge")
        node.ip("link set cnb0 up")
        node.ip(f"link add cnv0 type veth peer name eth0 netns {pod.name}")
        node.ip("link set cnv0 master cnb0 up")
        pod.ip("link set eth0 up")
        wait_until(lambda: "fe80::" in node.ip("-6 addr show dev cnv0"), 10, "a link-local")
        wait_until(lambda: "ff02::" in node.ip("-6 neigh show dev cnv0 nud all"), 10, "ff02::")
        assert kinds_while(node, "link del cnv0") == []
    node.ip("addr add 10.251.0.1/24 dev cnb0")
    assert kinds_while(node, "addr del 10.251.0.1/24 dev cnb0") == ["address"]


# --- namespaces --------------------------------------------------------------------------


def test_run_in_netns_returns_and_raises(node: Netns) -> None:
    assert node.call(NetlinkKernel().find_underlay).name == "u0"  # the namespace's links

    def boom() -> None:
        raise ValueError("inside")

    with pytest.raises(ValueError, match="inside"):
        node.call(boom)
    with pytest.raises(DataplaneError, match="cannot be opened"):
        run_in_netns("fp-no-such-netns", lambda: None)


def test_visiting_a_namespace_returns_the_thread_to_its_own(node: Netns) -> None:
    """ADD's pod side runs in the request's thread: inside for the block (a netlink socket
    opened there sees the pod's links), back in its own afterwards, also when the block
    raises; a thread that cannot get back ends with StrandedInNetns."""

    def here() -> int:
        return os.stat("/proc/thread-self/ns/net").st_ino

    home = here()
    fd = os.open(f"/run/netns/{node.name}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        with visiting_netns(fd):
            assert here() == os.fstat(fd).st_ino
            with nl.NetlinkSocket() as sock:
                assert nl.get_link(sock, "u0") is not None  # the node namespace's link
        assert here() == home
        with pytest.raises(ValueError, match="inside"), visiting_netns(fd):
            raise ValueError("inside")
        assert here() == home
        null = os.open("/dev/null", os.O_RDONLY | os.O_CLOEXEC)
        try:
            with pytest.raises(CannotEnterNetns, match="cannot enter"), visiting_netns(null):
                pass
        finally:
            os.close(null)
        assert here() == home

        def stranded() -> None:
            real = netns_module._setns
            calls: list[int] = []

            def fails_on_the_way_back(target: int) -> None:
                calls.append(target)
                if len(calls) == 2:
                    raise OSError(12, "Cannot allocate memory")
                real(target)

            netns_module._setns = fails_on_the_way_back  # type: ignore[assignment]
            try:
                with visiting_netns(fd):
                    pass
            finally:
                netns_module._setns = real  # type: ignore[assignment]

        with pytest.raises(StrandedInNetns):
            run_in_netns(f"/run/netns/{node.name}", stranded)  # a thread that then ends
    finally:
        os.close(fd)


def test_find_underlay(node: Netns, kernel: NetlinkKernel) -> None:
    node.veth("u1", "10.77.0.5/16")
    node.ip("addr add 10.78.0.5/24 dev u1")
    node.ip("route add 172.31.0.0/16 via 10.77.0.1")

    default = node.call(kernel.find_underlay)
    assert (default.name, default.ip, default.mtu) == ("u0", LOCAL, 1500)
    assert default.networks == (IPv4Network("192.168.50.0/24"),)
    assert default.on_link(IPv4Address("192.168.50.77"))

    by_name = node.call(kernel.find_underlay, ["u1"])
    assert (by_name.name, by_name.ip) == ("u1", IPv4Address("10.77.0.5"))
    assert by_name.networks == (IPv4Network("10.77.0.0/16"), IPv4Network("10.78.0.0/24"))

    by_ip = node.call(kernel.find_underlay, ["10.78.0.5"])
    assert (by_ip.name, by_ip.ip) == ("u1", IPv4Address("10.78.0.5"))

    by_regex = node.call(kernel.find_underlay, [], [r"^u1$"])
    assert by_regex.name == "u1"

    reach = node.call(kernel.find_underlay, [], [], IPv4Address("172.31.4.4"))
    assert (reach.name, reach.ip) == ("u1", IPv4Address("10.77.0.5"))

    # --public-ip is only advertised; the interface keeps its own address for vxlan.
    public = node.call(kernel.find_underlay, ["u1"], [], None, IPv4Address("203.0.113.1"))
    assert (public.name, public.ip) == ("u1", IPv4Address("10.77.0.5"))

    with pytest.raises(InterfaceNotFound, match=r"no interface matches --iface eth9; .*lo, .*u0"):
        node.call(kernel.find_underlay, ["eth9"])
    node.ip("route del default")
    with pytest.raises(InterfaceNotFound, match="no IPv4 default route"):
        node.call(kernel.find_underlay)


def test_find_underlay_skips_temporary_and_deprecated_ipv6(
    node: Netns, kernel: NetlinkKernel
) -> None:
    """Flannel #2295: the IPv6 endpoint is a stable address. The kernel lists IPv6
    addresses newest first, so before this change the deprecated one, then the
    temporary one, was advertised to peers."""
    node.exec("sysctl -qw net.ipv6.conf.u0.use_tempaddr=2 net.ipv6.conf.u0.accept_dad=0")
    # A SLAAC-style address that manages privacy addresses: the kernel adds a temporary one.
    node.ip("-6 addr add fd00:51::5/64 dev u0 mngtmpaddr valid_lft 3600 preferred_lft 3600")
    wait_until(lambda: "temporary" in node.ip("-6 addr show dev u0"), 10, "a temporary address")
    node.ip("-6 addr add fd00:50::99/64 dev u0 nodad preferred_lft 0")  # deprecated at once
    listed = node.ip("-6 addr show dev u0")
    assert listed.index("deprecated") < listed.index("temporary") < listed.index("mngtmpaddr")

    stable = IPv6Address("fd00:51::5")
    assert node.call(kernel.find_underlay, ["u0"]).ip6 == stable  # dual stack
    assert node.call(kernel.find_underlay, ["u0"], ipv6_only=True).ip6 == stable
    # Only unstable addresses left: none is chosen, and the refusal says why.
    node.ip("-6 addr del fd00:51::5/64 dev u0")
    node.ip("-6 addr add fd00:51::6/64 dev u0 nodad preferred_lft 0")
    assert node.call(kernel.find_underlay, ["u0"]).ip6 is None
    with pytest.raises(InterfaceNotFound, match="neither temporary nor deprecated"):
        node.call(kernel.find_underlay, ["u0"], ipv6_only=True)


def test_survey(overlay: Netns, kernel: NetlinkKernel) -> None:
    overlay.ip("route add 10.96.0.0/12 via 192.168.50.1 proto static")
    overlay.call(kernel.apply, add_peers([peer(0)]))
    found = overlay.call(kernel.survey, ["lo", DEV])
    assert set(found) == {
        ForeignRoute(IPv4Network("10.96.0.0/12"), "route 10.96.0.0/12 via 192.168.50.1 dev u0"),
        ForeignRoute(IPv4Network("192.168.50.0/24"), "route 192.168.50.0/24 dev u0"),
        ForeignRoute(IPv4Network("192.168.50.0/24"), "address 192.168.50.2/24 on u0"),
    }  # not the default route, not our proto-75 route, not flannel.1's address, not lo


# --- apply / observe --------------------------------------------------------------------


def test_create_overlay_with_three_peers_observe_exact(node: Netns, kernel: NetlinkKernel) -> None:
    peers = [peer(i) for i in range(3)]
    changes = add_peers(peers, links_to_create=(vxlan(),), addresses_to_add=(VTEP,))

    result = node.call(kernel.apply, changes)

    assert result.failures == ()
    assert result.applied == {
        "links_to_create": 1,
        "addresses_to_add": 1,
        "neighbours_to_set": 3,
        "fdb_to_set": 3,
        "routes_to_set": 3,
    }
    assert observe(node, kernel) == expected(node, peers)
    details = node.ip(f"-d link show {DEV}")
    assert "nolearning" in details and "dstport 8472" in details
    assert "vxlan id 1 local 192.168.50.2 dev u0" in details
    assert "state UP" in details or "<BROADCAST,MULTICAST,UP" in details
    routes = node.ip("route show")
    assert "10.100.1.0/24 via 10.100.1.0 dev flannel.1 proto 75 onlink" in routes
    assert (
        "00:00 dst 192.168.50.10 self permanent" in node.exec(f"bridge fdb show dev {DEV}").stdout
    )
    (link,) = expected(node, peers).links
    assert node.call(kernel.link_mac, DEV) == link.mac
    assert node.call(kernel.link_mac, "nonexistent0") is None

    # Idempotent: the same changes again succeed and leave the kernel as it was.
    again = node.call(kernel.apply, changes)
    assert again.failures == () and again.applied == result.applied
    assert observe(node, kernel) == expected(node, peers)


def test_route_deleted_by_hand_is_observed_and_watched(
    overlay: Netns, kernel: NetlinkKernel
) -> None:
    peers = [peer(i) for i in range(3)]
    overlay.call(kernel.apply, add_peers(peers))
    events: queue.Queue[str] = queue.Queue()
    stop = threading.Event()
    watcher = overlay.start(kernel.watch, events.put, stop)
    try:
        wait_subscribed(overlay)
        overlay.ip("route del 10.100.1.0/24")
        assert _next_event(events, {"route"}) == "route"
        assert observe(overlay, kernel) == replace(
            expected(overlay, peers), routes=frozenset({peers[0][2], peers[2][2]})
        )
        overlay.ip(f"neigh del 10.100.2.0 dev {DEV}")
        assert _next_event(events, {"neighbour"}) == "neighbour"
        overlay.exec(f"bridge fdb del 02:aa:00:00:00:02 dev {DEV} dst 192.168.50.12")
        assert _next_event(events, {"fdb"}) == "fdb"
        overlay.ip(f"addr del {VTEP.address} dev {DEV}")
        assert _next_event(events, {"address"}) == "address"
    finally:
        stopped = time.monotonic()
        stop.set()
        watcher.join(timeout=5)
    assert not watcher.is_alive() and time.monotonic() - stopped < 1.5


def test_a_dump_that_finds_the_kernel_as_expected_reports_the_expected_sets(
    overlay: Netns, kernel: NetlinkKernel
) -> None:
    """Told what to expect, observe answers with those very sets when the kernel holds
    them (no entry of the dump's own is kept), and with the dump's truth otherwise: a
    route deleted by hand, a changed neighbour, a foreign entry of our protocol."""
    peers = [peer(i) for i in range(300)]
    overlay.call(kernel.apply, add_peers(peers))
    planned = expected(overlay, peers)

    def observed() -> ObservedState:
        return overlay.call(kernel.observe, [DEV], [DEV], planned)

    found = observed()
    assert found.routes is planned.routes
    assert found.neighbours is planned.neighbours
    assert found.fdb is planned.fdb
    assert found == planned

    overlay.ip("route del 10.100.7.0/24")
    overlay.ip(f"neigh replace 10.100.9.0 dev {DEV} lladdr 02:bb:00:00:00:09 nud permanent")
    overlay.ip(f"route add 10.250.0.0/24 via 10.250.0.0 dev {DEV} proto 75 onlink")
    found = observed()
    assert found.routes == planned.routes - {peers[7][2]} | {
        Route(IPv4Network("10.250.0.0/24"), IPv4Address("10.250.0.0"), DEV, onlink=True)
    }
    assert found.neighbours == planned.neighbours - {peers[9][0]} | {
        Neighbour(DEV, IPv4Address("10.100.9.0"), "02:bb:00:00:00:09")
    }
    assert found.fdb is planned.fdb
    assert found == observe(overlay, kernel)  # the same as a dump told nothing


def test_a_route_replaced_by_another_tool_is_watched(overlay: Netns, kernel: NetlinkKernel) -> None:
    """``ip route replace`` over one of ours reports only the new route (no deletion): the
    watch asks for a pass then, not at the next periodic resync. Our own writes, the
    kernel's own routes and other tables stay silent."""
    peers = [peer(i) for i in range(2)]
    with watching(overlay, kernel) as events:
        overlay.call(kernel.apply, add_peers(peers))
        overlay.ip("addr add 10.99.0.1/24 dev u0")  # a proto kernel route appears
        overlay.ip("route add 10.98.0.0/24 via 192.168.50.1 table 100 proto static")
        # Notifications keep their order: the address's deletion, reported after
        # everything above, proves none of it was.
        overlay.ip(f"addr del {VTEP.address} dev {DEV}")
        assert _next_event(events, {"route", "address"}) == "address", list(events.queue)
        overlay.ip("route replace 10.100.1.0/24 via 192.168.50.1 dev u0 proto static")
        assert _next_event(events, {"route"}) == "route"


def wait_subscribed(ns: Netns) -> None:
    """Wait until a watcher's netlink socket in ``ns`` listens to rtnetlink groups: only
    changes made after that reach it (a fresh namespace has no other listener)."""
    wait_until(ns.netlink_listeners, 5.0, f"a netlink watcher subscribed in {ns.name}")


@contextmanager
def watching(overlay: Netns, kernel: NetlinkKernel) -> Iterator[queue.Queue[str]]:
    """The kernel's watch running in ``overlay``, subscribed: the kinds it reports."""
    events: queue.Queue[str] = queue.Queue()
    stop = threading.Event()
    watcher = overlay.start(kernel.watch, events.put, stop)
    try:
        wait_subscribed(overlay)
        yield events
    finally:
        stop.set()
        watcher.join(timeout=5)
    assert not watcher.is_alive()


def _next_event(events: queue.Queue[str], wanted: set[str], timeout: float = 3.0) -> str:
    """The first event of a wanted kind (link events from the set-up may come first)."""
    deadline = time.monotonic() + timeout
    while True:
        kind = events.get(timeout=max(0.01, deadline - time.monotonic()))
        if kind in wanted:
            return kind


def _drain_until_quiet(events: queue.Queue[str], quiet: float, timeout: float = 10.0) -> None:
    """Take events until none has come for ``quiet`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            events.get(timeout=quiet)
        except queue.Empty:
            return
    raise AssertionError(f"netlink events kept coming for {timeout:g} s")


def test_removals_are_idempotent(overlay: Netns, kernel: NetlinkKernel) -> None:
    peers = [peer(i) for i in range(3)]
    overlay.call(kernel.apply, add_peers(peers))
    removal = remove_peers(peers[1:2])

    first = overlay.call(kernel.apply, removal)
    second = overlay.call(kernel.apply, removal)  # all already gone: still success

    for result in (first, second):
        assert result.failures == ()
        assert result.applied == {
            "routes_to_delete": 1,
            "neighbours_to_delete": 1,
            "fdb_to_delete": 1,
        }
    assert observe(overlay, kernel) == expected(overlay, [peers[0], peers[2]])


def test_foreign_routes_are_never_observed_or_deleted(
    overlay: Netns, kernel: NetlinkKernel
) -> None:
    overlay.ip("route add 10.100.0.0/24 via 192.168.50.1 proto static")
    overlay.ip(f"route add 10.200.0.0/24 via 10.200.0.0 dev {DEV} onlink proto 76")

    assert observe(overlay, kernel).routes == frozenset()
    # Deleting "our" route for those prefixes must leave the foreign ones alone.
    stale = Route(IPv4Network("10.100.0.0/24"), IPv4Address("10.100.0.0"), DEV, True)
    result = overlay.call(kernel.apply, Changes(routes_to_delete=(stale,)))
    assert result.failures == ()
    assert "10.100.0.0/24 via 192.168.50.1 dev u0 proto static" in overlay.ip("route show")
    assert "10.200.0.0/24 via 10.200.0.0 dev flannel.1 proto 76 onlink" in overlay.ip("route show")


@pytest.fixture(params=["one lookup per route", "lookups, no default route", "a dump of the table"])
def foreign_check(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, overlay: Netns
) -> list[int]:
    """The ways a route to set is checked for another protocol's route at its
    destination (lookups find the default route, or no route at all, where nothing is at
    the destination); yields the list the table's dumps are counted in."""
    if request.param == "a dump of the table":
        monkeypatch.setattr(netlink_apply, "LOOKUPS_AT_MOST", 0)
    if request.param == "lookups, no default route":
        overlay.ip("route del default")
    dumps: list[int] = []
    real = nl.dump_routes

    def counted(*args: Any, **kwargs: Any) -> Any:
        dumps.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(nl, "dump_routes", counted)
    return dumps


def test_a_route_of_another_protocol_is_never_replaced(
    overlay: Netns, kernel: NetlinkKernel, foreign_check: list[int]
) -> None:
    # Before: NLM_F_REPLACE overwrote the underlay's connected route with a peer's
    # (a lease for the underlay's subnet) and the node lost its underlay.
    connected = "192.168.50.0/24 dev u0 proto kernel scope link src 192.168.50.2"
    overlay.ip("route add 10.100.0.0/24 via 192.168.50.1 proto static")
    hostile = Route(IPv4Network("192.168.50.0/24"), IPv4Address("192.168.50.0"), DEV, True)
    static = Route(IPv4Network("10.100.0.0/24"), IPv4Address("10.100.0.0"), DEV, True)
    _, _, good = peer(1)
    result = overlay.call(kernel.apply, Changes(routes_to_set=(hostile, static, good)))
    dumps = len(foreign_check)
    assert len(result.failures) == 2
    assert all("not the agent's" in f for f in result.failures)
    routes = overlay.ip("route show")
    assert connected in routes
    assert "10.100.0.0/24 via 192.168.50.1 dev u0 proto static" in routes
    assert observe(overlay, kernel).routes == frozenset({good})
    assert dumps == (0 if netlink_apply.LOOKUPS_AT_MOST else 1)


def test_a_route_hidden_by_a_longer_one_is_still_found(
    overlay: Netns, kernel: NetlinkKernel, foreign_check: list[int]
) -> None:
    """A lookup of a destination's first address that finds a longer route cannot see
    what the destination itself holds: the table is dumped then, and a route without a
    route of its own beside the longer one is set."""
    overlay.ip("route add 10.100.0.0/24 via 192.168.50.1 proto static")
    overlay.ip("route add 10.100.0.0/25 via 192.168.50.1 proto static")
    overlay.ip("route add 10.100.1.0/25 via 192.168.50.1 proto static")
    hidden = Route(IPv4Network("10.100.0.0/24"), IPv4Address("10.100.0.0"), DEV, True)
    beside = Route(IPv4Network("10.100.1.0/24"), IPv4Address("10.100.1.0"), DEV, True)
    result = overlay.call(kernel.apply, Changes(routes_to_set=(hidden, beside)))
    dumps = len(foreign_check)
    assert len(result.failures) == 1, result.failures
    assert "a route to 10.100.0.0/24 of protocol 4, not the agent's" in result.failures[0]
    assert observe(overlay, kernel).routes == frozenset({beside})
    assert "10.100.0.0/24 via 192.168.50.1 dev u0 proto static" in overlay.ip("route show")
    assert dumps == 1, "the longer route sent the check to a dump"


def test_changed_fdb_dst_and_neighbour_mac(overlay: Netns, kernel: NetlinkKernel) -> None:
    neigh, fdb, route = peer(0)
    overlay.call(kernel.apply, add_peers([(neigh, fdb, route)]))
    moved = replace(fdb, dst=IPv4Address("192.168.50.99"))
    new_neigh = replace(neigh, mac="02:bb:00:00:00:01")
    new_fdb = replace(moved, mac=new_neigh.mac)
    changes = Changes(fdb_to_delete=(fdb,), neighbours_to_set=(new_neigh,), fdb_to_set=(new_fdb,))

    assert overlay.call(kernel.apply, changes).failures == ()

    seen = observe(overlay, kernel)
    assert seen.fdb == {new_fdb}
    assert seen.neighbours == {new_neigh}
    assert seen.routes == {route}


def test_a_peer_that_moves_with_its_vtep_mac_gets_its_fdb_entry_moved(
    overlay: Netns, kernel: NetlinkKernel
) -> None:
    """A node re-created at a new address keeps its VTEP MAC: the one plan sets the MAC's
    new remote and deletes the old one. A unicast MAC has one remote (the kernel ignores
    an append to it), so the entry is replaced, and the stale deletion finds nothing."""
    neigh, fdb, route = peer(0)
    overlay.call(kernel.apply, add_peers([(neigh, fdb, route)]))
    moved = replace(fdb, dst=IPv4Address("192.168.50.99"))

    result = overlay.call(kernel.apply, Changes(fdb_to_set=(moved,), fdb_to_delete=(fdb,)))

    assert result.failures == ()
    assert observe(overlay, kernel).fdb == {moved}
    shown = overlay.exec(f"bridge fdb show dev {DEV}").stdout
    assert f"{fdb.mac} dst 192.168.50.99 self permanent" in shown


def test_failures_are_collected_per_entry(overlay: Netns, kernel: NetlinkKernel) -> None:
    good = [peer(i) for i in range(3)]
    # Not onlink, and the gateway is not on any connected network: the kernel refuses it.
    bad_route = Route(IPv4Network("10.150.0.0/24"), IPv4Address("10.150.0.0"), DEV, onlink=False)
    ghost = Neighbour("nosuchdev0", IPv4Address("10.9.9.9"), "02:00:00:00:00:09")
    changes = Changes(
        neighbours_to_set=(good[0][0], ghost, good[1][0], good[2][0]),
        fdb_to_set=tuple(p[1] for p in good),
        routes_to_set=(good[0][2], bad_route, good[1][2], good[2][2]),
    )

    result = overlay.call(kernel.apply, changes)

    assert result.applied == {"neighbours_to_set": 3, "fdb_to_set": 3, "routes_to_set": 3}
    assert len(result.failures) == 2
    assert any(
        f.startswith("could not set neighbour 10.9.9.9") and "nosuchdev0 does not exist" in f
        for f in result.failures
    )
    assert any(
        f.startswith("could not set route 10.150.0.0/24 via 10.150.0.0 dev flannel.1:")
        for f in result.failures
    )
    assert observe(overlay, kernel).routes == {p[2] for p in good}


def test_link_update_in_place_and_recreate_on_vni_change(
    overlay: Netns, kernel: NetlinkKernel
) -> None:
    index_before = overlay.ip(f"-o link show {DEV}").split(":")[0]
    updated = vxlan(mtu=1400, mac="02:ff:00:00:00:01")
    result = overlay.call(kernel.apply, Changes(links_to_update=(updated,)))
    assert result.failures == () and result.applied == {"links_to_update": 1}
    assert overlay.ip(f"-o link show {DEV}").split(":")[0] == index_before
    assert {link for link in observe(overlay, kernel).links} == {updated}

    # Creating over an existing device with another VNI replaces it.
    vni2 = vxlan(vni=2, mac="02:ff:00:00:00:02")
    assert overlay.call(kernel.apply, Changes(links_to_create=(vni2,))).failures == ()
    assert observe(overlay, kernel).links == {vni2}

    with pytest.raises(DataplaneError, match="underlay interface nosuch0 does not exist"):
        overlay.call(kernel.apply, Changes(links_to_create=(vxlan(underlay="nosuch0"),)))
    deleted = overlay.call(kernel.apply, Changes(links_to_delete=(DEV, DEV)))
    assert deleted.failures == () and deleted.applied == {"links_to_delete": 2}
    assert observe(overlay, kernel) == ObservedState()


def test_bulk_2000_peers_round_trip(overlay: Netns, kernel: NetlinkKernel) -> None:
    peers = [peer(i) for i in range(2000)]

    result = overlay.call(kernel.apply, add_peers(peers))

    assert result.failures == ()
    assert result.applied == {"neighbours_to_set": 2000, "fdb_to_set": 2000, "routes_to_set": 2000}
    assert observe(overlay, kernel) == expected(overlay, peers)
    removed = overlay.call(kernel.apply, remove_peers(peers[:1500]))
    assert removed.failures == ()
    assert observe(overlay, kernel) == expected(overlay, peers[1500:])


def test_watch_overrun_asks_for_resync_and_keeps_going(overlay: Netns) -> None:
    kernel = NetlinkKernel(watch_buffer=4096)
    peers = [peer(i) for i in range(500)]
    overlay.call(kernel.apply, add_peers(peers))
    events: queue.Queue[str] = queue.Queue()
    release = threading.Event()

    def slow_consumer(kind: str) -> None:
        events.put(kind)
        release.wait(5)  # hold the watcher while the kernel fills its queue

    stop = threading.Event()
    watcher = overlay.start(kernel.watch, slow_consumer, stop)
    try:
        wait_subscribed(overlay)
        overlay.ip("route del 10.100.0.0/24")  # the first event blocks the consumer
        assert events.get(timeout=3) == "route"
        overlay.call(kernel.apply, remove_peers(peers[1:]))  # ~1500 notifications
        release.set()
        assert _next_event(events, {"resync"}) == "resync"
        # The rest of the burst may overrun the socket again (another resync): the watcher
        # keeps going once it is drained, so change the link only when events go quiet.
        _drain_until_quiet(events, quiet=0.5)
        overlay.ip(f"link set {DEV} mtu 1300")
        assert _next_event(events, {"link"}) == "link"
    finally:
        release.set()
        stop.set()
        watcher.join(timeout=5)
    assert not watcher.is_alive()


def test_sysctl_is_set_in_the_callers_namespace(node: Netns, kernel: NetlinkKernel) -> None:
    with open("/proc/sys/net/ipv4/ip_forward") as f:
        host_before = f.read()
    value = "0" if node.exec("cat /proc/sys/net/ipv4/ip_forward").stdout.strip() == "1" else "1"

    node.call(kernel.set_sysctl, "net.ipv4.ip_forward", value)
    node.call(kernel.set_sysctl, "net/ipv4/conf/u0/rp_filter", "2")

    assert node.exec("cat /proc/sys/net/ipv4/ip_forward").stdout.strip() == value
    assert node.exec("cat /proc/sys/net/ipv4/conf/u0/rp_filter").stdout.strip() == "2"
    with open("/proc/sys/net/ipv4/ip_forward") as f:
        assert f.read() == host_before
    with pytest.raises(DataplaneError, match=r"cannot set sysctl net\.ipv4\.no_such_knob"):
        node.call(kernel.set_sysctl, "net.ipv4.no_such_knob", "1")


def test_apply_works_from_inside_an_event_loop(overlay: Netns, kernel: NetlinkKernel) -> None:
    extra = Address(DEV, IPv4Interface("10.244.1.1/32"))

    async def apply_in_loop() -> ApplyResult:
        return kernel.apply(Changes(addresses_to_add=(extra,)))

    result = overlay.call(asyncio.run, apply_in_loop())

    assert result.failures == () and result.applied == {"addresses_to_add": 1}
    assert observe(overlay, kernel).addresses == {VTEP, extra}  # in the namespace, not the host


def test_watch_ignores_pod_links_and_reports_our_device(overlay: Netns) -> None:
    """Every pod's veth and the cni0 bridge come and go on a busy node; none of it is ours."""
    kernel = NetlinkKernel()
    events: queue.Queue[str] = queue.Queue()
    stop = threading.Event()
    watcher = overlay.start(kernel.watch, events.put, stop)
    try:
        wait_subscribed(overlay)
        overlay.ip("link add vethpod1 type veth peer name vethpod2")
        overlay.ip("link add cni0 type bridge")
        overlay.ip("link set vethpod1 master cni0")
        overlay.ip("link del vethpod1")
        overlay.ip("link del cni0")
        # The kernel delivers notifications in order: once the watcher has reported this
        # later change of another kind, it has read (and dropped) every pod-link event.
        overlay.ip(f"addr del {VTEP.address} dev {DEV}")
        assert events.get(timeout=3) == "address", list(events.queue)
        assert events.empty(), list(events.queue)
        overlay.ip(f"link set {DEV} mtu 1300")
        assert events.get(timeout=3) == "link"
    finally:
        stop.set()
        watcher.join(timeout=5)


def test_the_watch_filter_keeps_pod_links_out_of_the_socket(overlay: Netns) -> None:
    """The kernel itself drops a pod's link notifications (the watching thread does not
    even wake for them) and still delivers our device's."""

    def listen() -> list[str]:
        with nl.NetlinkSocket(groups=netlink_events._GROUPS) as sock:
            nlfilter.attach(sock.sock, nlfilter.watch_program())
            overlay.ip("link add vethpod1 type veth peer name vethpod2")
            overlay.ip("link set vethpod1 up")
            overlay.ip("link del vethpod1")
            overlay.ip(f"link set {DEV} mtu 1300")
            names = []
            while select.select([sock], [], [], 0.3)[0]:
                buf = sock.recv()
                for offset, length, msg_type, _f, _s in nl.messages(buf):
                    if msg_type in (rtnl.RTM_NEWLINK, rtnl.RTM_DELLINK):
                        names.append(rtnl.decode_link_stats(buf, offset, length).name)
            return names

    names = overlay.call(listen)
    assert DEV in names
    assert not [n for n in names if n.startswith("vethpod")], names


def test_blackhole_route_sits_beneath_cni0_drops_the_rest_and_is_repaired(
    node: Netns, kernel: NetlinkKernel
) -> None:
    """--ip-blackhole-route: traffic to an unused address of the node's own subnet is
    dropped here instead of leaving by the default route, and pods on cni0 keep their
    connected route whichever of the two came first (flanneld's metric-0 blackhole,
    added before cni0's address, shadows it)."""
    own = IPv4Network("10.244.1.0/24")
    hole = blackhole_route(own)
    node.ip("link add cni0 type bridge")
    node.ip("link set cni0 up")
    assert "via 192.168.50.1 dev u0" in node.ip("route get 10.244.1.7")  # out the default

    result = node.call(kernel.apply, Changes(routes_to_set=(hole,)))
    assert result.failures == () and result.applied == {"routes_to_set": 1}
    assert "blackhole 10.244.1.0/24 proto 75 metric 1024" in node.ip("route show")
    assert node.ip("route get 10.244.1.7", check=False) == ""  # no route: dropped
    assert observe(node, kernel).routes == frozenset({hole})

    node.ip("addr add 10.244.1.1/24 dev cni0")  # the first pod: cni0's connected route
    assert "dev cni0" in node.ip("route get 10.244.1.7")
    assert node.call(kernel.apply, Changes(routes_to_set=(hole,))).failures == ()
    assert "dev cni0" in node.ip("route get 10.244.1.7")  # set again: still beneath
    assert "10.244.1.0/24 dev cni0 proto kernel" in node.ip("route show")

    events: queue.Queue[str] = queue.Queue()
    stop = threading.Event()
    watcher = node.start(kernel.watch, events.put, stop)
    try:
        wait_subscribed(node)
        node.ip("route del blackhole 10.244.1.0/24")
        assert _next_event(events, {"route"}) == "route"
    finally:
        stop.set()
        watcher.join(timeout=5)
    assert observe(node, kernel).routes == frozenset()
    assert node.call(kernel.apply, Changes(routes_to_set=(hole,))).failures == ()
    node.ip("addr del 10.244.1.1/24 dev cni0")
    assert node.ip("route get 10.244.1.7", check=False) == ""
    # Deleted as ours by destination, the connected route of the same prefix untouched.
    node.ip("addr add 10.244.1.1/24 dev cni0")
    assert node.call(kernel.apply, Changes(routes_to_delete=(hole,))).failures == ()
    assert "blackhole" not in node.ip("route show")
    assert "10.244.1.0/24 dev cni0 proto kernel" in node.ip("route show")


def test_an_ipv6_pair_moves_from_a_direct_route_to_the_vtep(
    overlay: Netns, kernel: NetlinkKernel
) -> None:
    """The kernel refuses an IPv6 onlink route whose gateway it routes through another
    device (IPv4 does not check): a pair moving from direct (host-gw) to vxlan, or from
    flannel-wg-v6's route, gets its route through the VTEP all the same, and the route
    for its gateway alone that lets it in is gone after."""
    overlay.ip("-6 addr add fd00:50::2/64 dev u0 nodad")
    subnet6 = IPv6Network("fc00:0:0:2::/64")
    direct = Route(subnet6, IPv6Address("fd00:50::3"), "u0")
    assert overlay.call(kernel.apply, Changes(routes_to_set=(direct,))).failures == ()
    vxlan6 = Route(subnet6, subnet6.network_address, DEV, onlink=True)
    result = overlay.call(kernel.apply, Changes(routes_to_set=(vxlan6,)))
    assert (result.failures, result.applied) == ((), {"routes_to_set": 1})
    routes = overlay.ip("-6 route show proto 75")
    assert f"{subnet6} via fc00:0:0:2:: dev {DEV}" in routes, routes
    assert not [r for r in routes.splitlines() if r.startswith("fc00:0:0:2:: ")], routes


def test_our_own_deletions_wake_no_pass_and_the_same_deletions_by_hand_do(
    overlay: Netns, kernel: NetlinkKernel
) -> None:
    """A peer lease that goes deletes its route, neighbour and FDB entry; those
    notifications are the adapter's own deletions and call for no pass (each once cost a
    pass that read the whole kernel). The same deletions made by another tool still do."""
    peers = [peer(i) for i in range(4)]
    overlay.call(kernel.apply, add_peers(peers))
    with watching(overlay, kernel) as events:
        result = overlay.call(kernel.apply, remove_peers(peers[:2]))
        assert result.failures == ()
        assert result.applied == {
            "routes_to_delete": 2,
            "neighbours_to_delete": 2,
            "fdb_to_delete": 2,
        }
        # Notifications arrive in order: once this later one of another tool is reported,
        # the six of our deletions before it have been read, and none was reported.
        overlay.ip("route add blackhole 10.98.0.0/24 proto static")
        assert events.get(timeout=3) == "route", list(events.queue)
        assert events.empty(), list(events.queue)
        assert len(kernel.own_deletions) == 0, "every expected deletion was seen"

        overlay.ip(f"route del {peers[2][2].dst}")
        assert events.get(timeout=3) == "route"
        overlay.ip(f"neigh del {peers[2][0].ip} dev {DEV}")
        assert events.get(timeout=3) == "neighbour"
        overlay.exec(f"bridge fdb del {peers[2][1].mac} dev {DEV} dst {peers[2][1].dst}")
        assert events.get(timeout=3) == "fdb"


def test_a_deletion_of_ours_that_finds_nothing_leaves_no_expectation(
    overlay: Netns, kernel: NetlinkKernel
) -> None:
    """Deleting what is gone already sends no notification: nothing may stay expected,
    or a later deletion of the same entry by another tool would pass unnoticed."""
    gone = [peer(7)]
    result = overlay.call(kernel.apply, remove_peers(gone))
    assert result.failures == () and sum(result.applied.values()) == 3
    assert len(kernel.own_deletions) == 0
