"""The traffic harness's pure parts: echo packets, per-pair counting, stream checking,
stream choice and the report (the processes themselves run in tests/e2e)."""

from __future__ import annotations

import pytest
from flannelpy_lab.state import PodInfo
from hypothesis import given
from hypothesis import strategies as st

from tests.support import traffic_probe as tp
from tests.support.traffic import (
    TrafficError,
    TrafficReport,
    pair_counts,
    pick_streams,
    stream_result,
)


def _reply_of(request: bytes, ident: int | None = None) -> bytes:
    """The IPv4 packet a kernel would answer ``request`` with (type 0, same payload)."""
    kind, code, _, their_ident, seq16 = tp.ICMP_HEADER.unpack_from(request)
    assert (kind, code) == (tp.ICMP_ECHO_REQUEST, 0)
    body = tp.ICMP_HEADER.pack(0, 0, 0, their_ident if ident is None else ident, seq16)
    body += request[tp.ICMP_HEADER.size :]
    return bytes([0x45]) + bytes(19) + body  # a 20-byte IPv4 header


@given(ident=st.integers(0, 0xFFFF), seq=st.integers(0, 2**64 - 1))
def test_echo_request_checksums_to_zero_and_its_reply_gives_back_the_64_bit_seq(
    ident: int, seq: int
) -> None:
    request = tp.echo_request(ident, seq)
    assert tp.checksum(request) == 0  # a valid checksum sums the packet to zero
    assert tp.parse_echo_reply(_reply_of(request), ident) == seq
    assert tp.parse_echo_reply(_reply_of(request, ident ^ 1), ident) is None


def test_an_icmpv6_echo_reply_is_read_from_the_icmp_header_on() -> None:
    """A raw ICMPv6 socket hands over no IP header; the kernel checksums the request."""
    request = tp.echo_request(7, 2**40 + 3, ipv6=True)
    kind, _, _, ident, _ = tp.ICMP_HEADER.unpack_from(request)
    assert (kind, ident) == (tp.ICMP6_ECHO_REQUEST, 7)
    reply = tp.ICMP_HEADER.pack(tp.ICMP6_ECHO_REPLY, 0, 0, 7, 3) + request[tp.ICMP_HEADER.size :]
    assert tp.parse_echo_reply(reply, 7, ipv6=True) == 2**40 + 3
    assert tp.parse_echo_reply(reply, 7) is None  # not an IPv4 packet
    assert tp.parse_echo_reply(request, 7, ipv6=True) is None  # a request, not a reply


@pytest.mark.parametrize(
    "packet",
    [
        b"",
        bytes([0x45]) + bytes(19),  # header only
        bytes([0x45]) + bytes(19) + tp.ICMP_HEADER.pack(8, 0, 0, 7, 1) + bytes(12),  # a request
        bytes([0x45]) + bytes(19) + tp.ICMP_HEADER.pack(0, 0, 0, 7, 1) + b"XXXX" + bytes(8),
    ],
)
def test_packets_that_are_not_our_echo_replies_are_ignored(packet: bytes) -> None:
    assert tp.parse_echo_reply(packet, 7) is None


def test_pair_tracker_counts_only_after_the_mark_and_tells_lost_from_duplicate() -> None:
    t = tp.PairTracker(now=0.0)
    warm = [t.on_send(0.05 * i, ok=True) for i in range(3)]
    assert t.on_reply(warm[0], 0.06) is True  # first reply ever
    t.mark(now=0.2)
    assert t.on_reply(warm[1], 0.21) is False  # a warm-up echo answered late: not counted
    seqs = [t.on_send(0.2 + 0.05 * i, ok=i != 4) for i in range(6)]
    for seq in seqs:
        if seq not in (seqs[2], seqs[4]):
            t.on_reply(seq, 0.2 + 0.05 * (seq - seqs[0]) + 0.001)
    t.on_reply(seqs[0], 0.5)  # answered twice
    assert t.waiting()
    report = t.report(stopped_at=0.5)
    assert {k: report[k] for k in ("sent", "received", "lost", "duplicates", "send_errors")} == {
        "sent": 6,
        "received": 4,
        "lost": 2,
        "duplicates": 1,
        "send_errors": 1,
    }
    assert report["lost_seqs"] == [seqs[2], seqs[4]]  # warm-up's unanswered seq 2 not counted
    assert report["max_gap_ms"] == pytest.approx(100.0)  # the lost seq between two replies
    assert report["max_rtt_ms"] == pytest.approx(1.0)


def test_pair_tracker_gap_covers_a_silent_end_and_lost_seqs_are_capped() -> None:
    t = tp.PairTracker(now=0.0)
    seqs = [t.on_send(0.01 * i, ok=True) for i in range(tp.LOST_SEQS_CAP + 20)]
    t.on_reply(seqs[0], 0.002)
    report = t.report(stopped_at=2.0)
    assert report["lost"] == len(seqs) - 1
    assert report["lost_seqs"] == seqs[1 : tp.LOST_SEQS_CAP + 1]
    assert report["max_gap_ms"] == pytest.approx(1998.0)


def _frames(*seqs: int) -> bytes:
    return b"".join(tp.TCP_FRAME.pack(tp.TCP_MAGIC, s) for s in seqs)


def test_echo_checker_accepts_in_order_echoes_split_anywhere() -> None:
    c = tp.EchoChecker(timeout=1.0)
    sent = b"".join(c.next_frame(0.1 * i) for i in range(5))
    c.mark()
    sent += b"".join(c.next_frame(0.5 + 0.1 * i) for i in range(3))
    for i in range(0, len(sent), 5):  # TCP may cut the byte stream anywhere
        c.on_data(sent[i : i + 5], 1.0)
    c.check_stall(1.0)
    assert c.report() == {
        "sent": 3,
        "echoed": 3,
        "broken": False,
        "error": None,
        "max_stall_ms": pytest.approx(500.0),
    }


@pytest.mark.parametrize(
    ("echo", "error"),
    [
        (_frames(1), "echo of seq 1 where seq 0 was due"),
        (_frames(0, 1, 2), "echo of seq 2 that was never sent"),
        (b"JUNK" + bytes(8), "garbled echo b'JUNK' after 0 echoes"),
    ],
)
def test_echo_checker_breaks_on_a_wrong_echo(echo: bytes, error: str) -> None:
    c = tp.EchoChecker(timeout=1.0)
    c.next_frame(0.0)
    c.next_frame(0.0)
    c.on_data(echo, 0.1)
    assert c.report()["broken"] and c.error == error


def test_echo_checker_breaks_when_an_echo_is_later_than_the_timeout() -> None:
    c = tp.EchoChecker(timeout=2.0)
    c.next_frame(10.0)
    c.check_stall(11.9)
    assert c.error is None
    c.check_stall(12.1)
    assert c.error == "no echo of seq 0 within 2 s"
    assert c.report()["max_stall_ms"] == pytest.approx(2100.0)


def _pods(nodes: int, per_node: int) -> list[PodInfo]:
    return [
        PodInfo(f"n{n}-p{p}", f"n{n}", f"ns-n{n}-p{p}", f"c{n}{p}", address=f"10.0.{n}.{p}/24")
        for n in range(1, nodes + 1)
        for p in range(1, per_node + 1)
    ]


@pytest.mark.parametrize(("nodes", "per_node", "count"), [(5, 2, 3), (5, 2, 10), (2, 2, 4)])
def test_streams_are_distinct_cross_node_pairs_spread_over_the_nodes(
    nodes: int, per_node: int, count: int
) -> None:
    streams = pick_streams(_pods(nodes, per_node), count)
    names = [(c.name, s.name) for c, s in streams]
    assert len(set(names)) == count
    assert all(c.node != s.node for c, s in streams)
    assert {c.node for c, _ in streams} == {f"n{i}" for i in range(1, min(nodes, count) + 1)}


def test_streams_need_two_nodes_and_room() -> None:
    with pytest.raises(TrafficError, match="at least two nodes"):
        pick_streams(_pods(1, 3), 1)
    with pytest.raises(TrafficError, match="do not fit"):
        pick_streams(_pods(2, 1), 3)


def _icmp_doc(targets: dict[str, tuple[int, int]]) -> dict[str, object]:
    return {
        "measured_s": 10.0,
        "targets": {
            ip: {
                "sent": sent,
                "received": received,
                "lost": sent - received,
                "lost_seqs": list(range(sent - received)),
                "duplicates": 0,
                "send_errors": 0,
                "max_gap_ms": 60.0,
                "max_rtt_ms": 0.5,
            }
            for ip, (sent, received) in targets.items()
        },
    }


def test_report_totals_lost_pairs_broken_streams_and_a_summary_naming_them() -> None:
    names = {"10.0.1.1": "a", "10.0.2.1": "b", "10.0.3.1": "c"}
    pairs = pair_counts("a", _icmp_doc({"10.0.2.1": (200, 200), "10.0.3.1": (200, 190)}), names)
    pairs += pair_counts("b", _icmp_doc({"10.0.1.1": (201, 201), "10.0.3.1": (200, 200)}), names)
    stream_doc = {
        "sent": 500,
        "echoed": 120,
        "broken": True,
        "error": "no echo of seq 7 within 5 s",
        "max_stall_ms": 5001.0,
    }
    streams = (stream_result("a", "c", stream_doc),)
    report = TrafficReport(tuple(pairs), streams, 20.0, 50.0, 10.0, 0.5, 2.0, 10.0, ("x",))
    assert (report.sent, report.received, report.lost) == (801, 791, 10)
    assert report.lost_pairs == [("a", "c")]
    assert report.min_pair_rate == pytest.approx(20.0)
    assert report.broken_streams == list(streams)
    assert report.cpu_share == pytest.approx(0.2)
    text = report.summary()
    for part in (
        "801 echoes sent, 791 answered, 10 lost",
        "losses on 1 pairs: a->c 10/200",
        "1 broken",
        "a->c broke: no echo of seq 7 within 5 s",
        "20.0% of one core",
        "Notes: x.",
    ):
        assert part in text, text
    assert "backlog" not in text  # none dropped: nothing said


def test_a_summary_tells_the_machines_backlog_drops_from_the_data_planes() -> None:
    pairs = pair_counts("a", _icmp_doc({"10.0.2.1": (100, 99)}), {"10.0.2.1": "b", "1": "a"})
    report = TrafficReport(tuple(pairs), (), 20.0, 50.0, 5.0, 0.5, 1.0, 5.0, backlog_drops=812)
    text = report.summary()
    assert "1 lost" in text and "the kernel dropped 812 packets machine-wide" in text, text
