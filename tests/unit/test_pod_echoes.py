"""The echo judge's reading of a pod's ICMP counters (tests/support/pod_echoes.py)."""

from __future__ import annotations

import pytest

from tests.support.pod_echoes import EchoCount, parse_echo_count

_ICMP_FIELDS = (
    "InMsgs InErrors InCsumErrors InDestUnreachs InTimeExcds InParmProbs InSrcQuenchs"
    " InRedirects InEchos InEchoReps InTimestamps InTimestampReps InAddrMasks InAddrMaskReps"
    " OutMsgs OutErrors OutRateLimitGlobal OutRateLimitHost OutDestUnreachs OutTimeExcds"
    " OutParmProbs OutSrcQuenchs OutRedirects OutEchos OutEchoReps OutTimestamps"
    " OutTimestampReps OutAddrMasks OutAddrMaskReps"
)
_ICMP_VALUES = "1207 0 0 3 0 0 0 0 600 604 0 0 0 0 1210 0 0 0 0 0 0 0 0 610 600 0 0 0 0"
# A pod's /proc/net/snmp as the 6.x kernel writes it (the Ip rows cut short).
SNMP = (
    "Ip: Forwarding DefaultTTL InReceives\nIp: 2 64 1234\n"
    f"Icmp: {_ICMP_FIELDS}\nIcmp: {_ICMP_VALUES}\n"
    "IcmpMsg: InType0 InType3 InType8 OutType0 OutType8\nIcmpMsg: 604 3 600 600 610\n"
)


def test_requests_sent_and_replies_arrived_come_from_the_icmp_rows() -> None:
    assert parse_echo_count(SNMP) == EchoCount(requests_sent=610, replies_arrived=604)


def test_this_machines_own_counters_parse() -> None:
    with open("/proc/net/snmp", encoding="ascii") as f:
        count = parse_echo_count(f.read())
    assert count.requests_sent >= 0 and count.replies_arrived >= 0


def test_a_file_without_both_icmp_rows_is_refused() -> None:
    with pytest.raises(AssertionError):
        parse_echo_count(SNMP.replace("Icmp: 1207", "Icmpx: 1207"))
