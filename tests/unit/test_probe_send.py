"""What the prober keeps per address instead of building per echo: the texts of a silent
round, the socket address and IP_PKTINFO, the echo's two buffers."""

from __future__ import annotations

from ipaddress import IPv4Address, IPv6Address

import pytest

from flannelpy.dataplane import icmp
from flannelpy.dataplane.icmp import Icmp6Transport, IcmpTransport, echo_parts, icmp_checksum
from flannelpy.observe import probe_rounds
from flannelpy.observe.probe_rounds import _format_timeout, _timeout_text

V4 = IPv4Address("10.0.0.1")
V6 = IPv6Address("::a00:1")  # the same integer as V4


@pytest.mark.parametrize("df", [False, True])
def test_timeout_texts_are_the_formatted_ones_per_family(df: bool) -> None:
    for target in (V4, V6, V4):
        assert _timeout_text(1450, target, df, 1.0) == _format_timeout(1450, target, df, 1.0)
    assert _timeout_text(84, V4, df, 1.0) != _timeout_text(84, V6, df, 1.0)
    assert _timeout_text(84, V4, df, 1.0) != _timeout_text(84, V4, df, 0.5)


def test_timeout_texts_kept_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(probe_rounds, "MAX_TIMEOUT_TEXTS", 4)
    monkeypatch.setattr(probe_rounds, "_TIMEOUT_TEXTS", {})
    for n in range(10):
        _timeout_text(84, IPv4Address(n), False, 1.0)
        assert len(probe_rounds._TIMEOUT_TEXTS) <= 4


def test_the_two_buffers_are_one_valid_echo() -> None:
    header, payload = echo_parts(0x1234, 7, 1422)
    assert len(header) == 8 and len(payload) == 1422
    assert icmp_checksum(header + payload) == 0
    assert header + payload == icmp.echo_request(0x1234, 7, 1422)
    assert echo_parts(0x1234, 8, 1422)[1] is payload  # the same bytes, not copied


def unopened(cls: type[IcmpTransport]) -> IcmpTransport:
    """A transport's per-address state without its socket and thread."""
    transport = cls.__new__(cls)
    transport._sockaddrs = {}
    transport._source = None
    return transport


def test_sockaddr_and_pktinfo_per_address(monkeypatch: pytest.MonkeyPatch) -> None:
    v4 = unopened(IcmpTransport)
    assert v4._sockaddr(V4) == ("10.0.0.1", 0)
    assert v4._sockaddr(IPv4Address("10.0.0.1")) is v4._sockaddr(V4)
    assert v4._pktinfo(V4) == b"\0\0\0\0" + V4.packed + bytes(4)
    assert v4._pktinfo(IPv4Address("10.0.0.2"))[4:8] == IPv4Address("10.0.0.2").packed
    v6 = unopened(Icmp6Transport)
    assert v6._sockaddr(V6) == ("::a00:1", 0)
    assert v6._pktinfo(V6)[:16] == V6.packed
    monkeypatch.setattr(icmp, "MAX_KEPT_ADDRESSES", 3)
    for n in range(10):
        assert v4._sockaddr(IPv4Address(n)) == (str(IPv4Address(n)), 0)
        assert len(v4._sockaddrs) <= 3
