"""host-local's data dir (ipam.hostlocal) and the holds our IPAM keeps for its pods."""

from __future__ import annotations

import logging
import os
from ipaddress import IPv4Address, IPv4Network, IPv6Address
from pathlib import Path

import pytest

from flannelpy.ipam import hostlocal
from flannelpy.ipam.hostlocal import HostLocalEntry, parse_entry
from flannelpy.ipam.manager import NodeIpam

SUBNET = IPv4Network("10.244.13.0/24")


def entry(last: int, cid: str, ifname: str = "eth0") -> HostLocalEntry:
    return HostLocalEntry(SUBNET.network_address + last, cid, ifname)


@pytest.mark.parametrize(
    ("name", "content", "parsed"),
    [
        ("10.244.13.2", "mx-n3-p1\r\neth0", entry(2, "mx-n3-p1")),  # host-local >= 0.8
        ("10.244.13.3", "abc\r\nnet1", entry(3, "abc", "net1")),
        ("10.244.13.4", "legacyid", entry(4, "legacyid")),  # before 0.8: the id alone
        ("10.244.13.5", "  id5 \r\n eth0 \n", entry(5, "id5")),
        ("last_reserved_ip.0", "10.244.13.5", None),
        ("lock", "", None),
        # A dual-stack node's IPv6 range: the same format, named by the IPv6 address.
        ("fd00::5", "id\r\neth0", HostLocalEntry(IPv6Address("fd00::5"), "id", "eth0")),
        ("10.244.13.6", "", None),
    ],
)
def test_parse_entry(name: str, content: str, parsed: HostLocalEntry | None) -> None:
    assert parse_entry(name, content) == parsed


def test_render_is_host_locals_format_and_parses_back() -> None:
    entries = [entry(2, "a"), entry(3, "b", "net1")]
    files = hostlocal.render(entries)
    assert files == {"10.244.13.2": "a\r\neth0", "10.244.13.3": "b\r\nnet1"}
    assert [parse_entry(n, c) for n, c in files.items()] == entries


def test_within_keeps_the_leases_addresses_in_order() -> None:
    other = HostLocalEntry(IPv4Address("10.244.99.2"), "x", "eth0")
    assert hostlocal.within([entry(9, "b"), other, entry(2, "a")], [SUBNET]) == [
        entry(2, "a"),
        entry(9, "b"),
    ]


def test_read_write_and_remove_on_disk(tmp_path: Path) -> None:
    directory = str(tmp_path / "cbr0")
    assert hostlocal.read_dir(directory) == []
    written = hostlocal.write_allocations(
        directory, [entry(2, "a"), entry(3, "b")], last=IPv4Address("10.244.13.3")
    )
    assert written == 2
    assert (tmp_path / "cbr0" / "10.244.13.2").read_bytes() == b"a\r\neth0"
    assert (tmp_path / "cbr0" / "last_reserved_ip.0").read_text() == "10.244.13.3"
    (tmp_path / "cbr0" / "lock").write_text("")
    # An existing file is host-local's: never overwritten.
    assert hostlocal.write_allocations(directory, [entry(2, "other")]) == 0
    assert sorted(hostlocal.read_dir(directory), key=lambda e: e.ip) == [
        entry(2, "a"),
        entry(3, "b"),
    ]
    hostlocal.remove_entry(directory, entry(2, "someone-else"))  # not that pod's: kept
    hostlocal.remove_entry(directory, entry(3, "b"))
    assert hostlocal.read_dir(directory) == [entry(2, "a")]


@pytest.fixture
def host_local(tmp_path: Path) -> str:
    directory = str(tmp_path / "cni" / "networks" / "cbr0")
    hostlocal.write_allocations(directory, [entry(2, "flanneld-pod"), entry(3, "second")])
    return directory


def make_ipam(tmp_path: Path, host_local: str) -> NodeIpam:
    ipam = NodeIpam(
        str(tmp_path / "ipam"), cooldown_seconds=0, fsync=False, host_local_dir=host_local
    )
    ipam.set_leases([SUBNET])
    return ipam


def test_held_addresses_are_never_handed_out(tmp_path: Path, host_local: str) -> None:
    with make_ipam(tmp_path, host_local) as ipam:
        # Before the take-over (the old behaviour): our IPAM gave the first pod .2, which
        # host-local had given already.
        assert ipam.allocate("new-0", "eth0").ip == SUBNET.network_address + 2
        ipam.release("new-0", "eth0")
        held = ipam.hold_foreign(hostlocal.read_dir(host_local))
        assert {e.ip for e in held} == {SUBNET.network_address + 2, SUBNET.network_address + 3}
        got = {ipam.allocate(f"new-{i}", "eth0").ip for i in range(1, 20)}
        assert not got & {e.ip for e in held}
        usage = ipam.accounting()[0]
        assert usage.assigned == 19 + 2
        # Held ones are not our allocations: GC (which releases allocations no CNI record
        # explains) never sees them.
        assert all(a.container_id.startswith("new-") for a in ipam.allocations())


def test_a_del_through_our_plugin_frees_a_held_address_and_host_locals_file(
    tmp_path: Path, host_local: str
) -> None:
    with make_ipam(tmp_path, host_local) as ipam:
        ipam.hold_foreign(hostlocal.read_dir(host_local))
        released = ipam.release("flanneld-pod", "eth0")
        assert released is not None and released.ip == SUBNET.network_address + 2
        assert not os.path.exists(os.path.join(host_local, "10.244.13.2"))
        assert ipam.release("flanneld-pod", "eth0") is None
        assert ipam.accounting()[0].assigned == 1


def test_holds_follow_host_locals_files_and_survive_a_restart(
    tmp_path: Path, host_local: str
) -> None:
    with make_ipam(tmp_path, host_local) as ipam:
        ipam.hold_foreign(hostlocal.read_dir(host_local))
        # host-local's own DEL (a runtime with the cached config) removed one file:
        os.unlink(os.path.join(host_local, "10.244.13.3"))
        held = ipam.hold_foreign(hostlocal.read_dir(host_local))
        assert [e.container_id for e in held] == ["flanneld-pod"]
        assert ipam.accounting()[0].assigned == 1
    with make_ipam(tmp_path, host_local) as again:
        assert again.hold_foreign(hostlocal.read_dir(host_local)) == [entry(2, "flanneld-pod")]
        assert again.allocate("x", "eth0").ip != SUBNET.network_address + 2


def test_an_address_we_gave_is_not_held_and_a_clash_is_logged(
    tmp_path: Path, host_local: str, caplog: pytest.LogCaptureFixture
) -> None:
    with make_ipam(tmp_path, host_local) as ipam:
        ours = ipam.allocate("ours", "eth0")  # .2: host-local's "flanneld-pod" has it too
        with caplog.at_level(logging.WARNING, logger="flannelpy.ipam"):
            held = ipam.hold_foreign(hostlocal.read_dir(host_local))
        assert [e.container_id for e in held] == ["second"]
        assert "both gave an address ip=10.244.13.2" in caplog.text
        assert ipam.find("ours", "eth0") == ours


def test_host_local_entries_lists_ours_and_held_for_the_way_back(
    tmp_path: Path, host_local: str
) -> None:
    with make_ipam(tmp_path, host_local) as ipam:
        ipam.hold_foreign(hostlocal.read_dir(host_local))
        ipam.allocate("ours", "eth0")
        entries = ipam.host_local_entries()
    assert [(str(e.ip), e.container_id) for e in entries] == [
        ("10.244.13.2", "flanneld-pod"),
        ("10.244.13.3", "second"),
        ("10.244.13.4", "ours"),
    ]
