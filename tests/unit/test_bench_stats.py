"""The benchmarks' pure helpers: percentiles, fake peers, route-event parsing, log fields."""

from __future__ import annotations

import socket
import struct
from datetime import datetime
from ipaddress import IPv4Address, IPv4Network

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench.common import (
    RTM_DELROUTE,
    RTM_NEWROUTE,
    fake_peers,
    log_field,
    log_time,
    parse_route_events,
    percentile,
    summary,
)
from flannelpy.subnet.lease import LeaseAttrs


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([5.0], 99, 5.0),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([4.0, 1.0, 3.0, 2.0], 0, 1.0),
        ([4.0, 1.0, 3.0, 2.0], 100, 4.0),
        ([float(i) for i in range(1, 101)], 90, 90.1),  # rank 89.1 between 90 and 91
        ([float(i) for i in range(1, 51)], 99, 49.51),
    ],
)
def test_percentile_interpolates_between_ranks(values: list[float], q: float, expected: float):
    assert percentile(values, q) == pytest.approx(expected)


def test_percentile_refuses_empty_input_and_bad_q():
    with pytest.raises(ValueError, match="no values"):
        percentile([], 50)
    with pytest.raises(ValueError, match="outside"):
        percentile([1.0], 101)


@given(st.lists(st.floats(min_value=0, max_value=1e6), min_size=1, max_size=60))
def test_summary_is_ordered_and_bounded(values: list[float]):
    s = summary(values)
    assert min(values) <= s["p50"] <= s["p90"] <= s["p99"] <= s["max"] == max(values)


def test_fake_peers_are_distinct_vxlan_leases():
    subnets = list(IPv4Network("10.1.0.0/22").subnets(new_prefix=24))
    peers = fake_peers(4, subnets, first_index=255)
    assert len({p.public_ip for p in peers}) == len({p.vtep_mac for p in peers}) == 4
    assert peers[1].public_ip == IPv4Address("172.16.1.1")  # base 172.16.0.1 + 256
    assert peers[0].vtep_mac == "02:fb:00:00:00:ff"
    assert peers[2].key == "10.1.2.0-24"
    attrs = LeaseAttrs.from_json(peers[3].lease_json())
    assert attrs.backend_type == "vxlan"
    assert attrs.vtep_mac == peers[3].vtep_mac
    with pytest.raises(ValueError, match="only 4 subnets"):
        fake_peers(5, subnets)


def _route_msg(msg_type: int, dst: str | None, dst_len: int, protocol: int) -> bytes:
    attrs = b""
    if dst is not None:
        attrs += struct.pack("=HH", 8, 1) + IPv4Address(dst).packed  # RTA_DST
    attrs += struct.pack("=HHI", 8, 4, 7)  # RTA_OIF, after the destination
    body = struct.pack("=BBBBBBBBI", socket.AF_INET, dst_len, 0, 0, 254, protocol, 0, 1, 0)
    return struct.pack("=IHHII", 16 + len(body) + len(attrs), msg_type, 0, 0, 0) + body + attrs


def test_parse_route_events_reads_every_route_message_in_a_datagram():
    link_msg = struct.pack("=IHHII", 20, 16, 0, 0, 0) + b"\0\0\0\0"  # RTM_NEWLINK: skipped
    buf = b"".join(
        [
            _route_msg(RTM_NEWROUTE, "10.244.7.0", 24, 75),
            link_msg,
            _route_msg(RTM_NEWROUTE, None, 0, 3),  # default route: no RTA_DST
            _route_msg(RTM_DELROUTE, "10.244.9.0", 24, 75),
        ]
    )
    events = parse_route_events(buf)
    assert [(e.added, str(e.dst), e.protocol) for e in events] == [
        (True, "10.244.7.0/24", 75),
        (False, "10.244.9.0/24", 75),
    ]


def test_parse_route_events_stops_at_a_truncated_message():
    whole = _route_msg(RTM_NEWROUTE, "10.244.7.0", 24, 75)
    assert parse_route_events(whole + whole[:20]) == parse_route_events(whole)
    assert len(parse_route_events(whole)) == 1


def test_log_helpers_read_the_agents_text_format():
    line = "2024-05-01T12:00:00.250 INFO flannelpy.agent: agent ready subnet=10.0.3.0/24 mtu=1450"
    assert log_time(line) == pytest.approx(datetime(2024, 5, 1, 12, 0, 0, 250000).timestamp())
    assert log_field(line, "mtu") == "1450"
    assert log_field(line, "program_seconds") is None
    assert log_time("--- lab: agent starting at 2024-05-01T12:00:00") is None
