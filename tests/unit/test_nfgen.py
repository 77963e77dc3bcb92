"""Decoding the kernel's answer to NFT_MSG_GETGEN (the real round trip is in the
integration tier, tests/integration/test_netpol_enforce.py)."""

from __future__ import annotations

import struct

from flannelpy.dataplane.nfgen import NFNL_SUBSYS_NFTABLES, NFT_MSG_NEWGEN, parse_generation


def reply(msg_type: int, attrs: bytes) -> bytes:
    body = struct.pack("=BBH", 0, 0, 0) + attrs
    return struct.pack("=IHHII", 16 + len(body), msg_type, 0, 1, 0) + body


def attr(kind: int, payload: bytes) -> bytes:
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + b"\0" * (-len(raw) % 4)


NEWGEN = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_NEWGEN


def test_the_generation_is_read_whatever_attributes_come_before_it() -> None:
    pid = attr(2, struct.pack("!I", 4242))
    name = attr(3, b"nft\0")
    assert parse_generation(reply(NEWGEN, pid + name + attr(1, struct.pack("!I", 77)))) == 77


def test_an_error_a_truncated_or_a_foreign_reply_is_unknown() -> None:
    gen = attr(1, struct.pack("!I", 5))
    assert parse_generation(reply(2, struct.pack("=iI", -1, 0))) is None  # NLMSG_ERROR
    assert parse_generation(reply(NEWGEN, gen)[:18]) is None
    assert parse_generation(reply((9 << 8) | NFT_MSG_NEWGEN, gen)) is None
    assert parse_generation(reply(NEWGEN, struct.pack("=HH", 2, 1))) is None  # bad length
