"""Decoding the kernel's answer to NFT_MSG_GETGEN (the real round trip is in the
integration tier, tests/integration/test_netpol_enforce.py)."""

from __future__ import annotations

import struct
from typing import ClassVar

import pytest

from flannelpy.dataplane import nfgen
from flannelpy.dataplane.nfgen import (
    NFNL_SUBSYS_NFTABLES,
    NFT_MSG_NEWGEN,
    RulesetGeneration,
    parse_generation,
)


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


class FakeSocket:
    """A netlink socket answering from ``replies`` (shared by every socket made); a None
    reply is a timeout."""

    replies: ClassVar[list[bytes | None]] = []
    made: ClassVar[list[FakeSocket]] = []

    def __init__(self, *_: object) -> None:
        self.sent: list[int] = []  # the sequence numbers asked
        self.closed = False
        FakeSocket.made.append(self)

    def settimeout(self, _: float) -> None:
        pass

    def sendto(self, message: bytes, _: object) -> None:
        self.sent.append(struct.unpack_from("=I", message, 8)[0])

    def recv(self, _: int) -> bytes:
        answer = FakeSocket.replies.pop(0)
        if answer is None:
            raise TimeoutError("timed out")
        return answer

    def close(self) -> None:
        self.closed = True


def numbered(seq: int, generation: int) -> bytes:
    raw = bytearray(reply(NEWGEN, attr(1, struct.pack("!I", generation))))
    struct.pack_into("=I", raw, 8, seq)
    return bytes(raw)


@pytest.fixture
def sockets(monkeypatch: pytest.MonkeyPatch) -> list[FakeSocket]:
    FakeSocket.made, FakeSocket.replies = [], []
    monkeypatch.setattr(nfgen.socket, "socket", FakeSocket)
    return FakeSocket.made


def test_one_socket_is_kept_for_every_question(sockets: list[FakeSocket]) -> None:
    """Closing a netfilter socket waits for the last deleting transaction's clean-up."""
    asker = RulesetGeneration()
    FakeSocket.replies += [numbered(1, 10), numbered(2, 11), numbered(3, 11)]
    assert [asker(), asker(), asker()] == [10, 11, 11]
    assert len(sockets) == 1 and not sockets[0].closed
    assert sockets[0].sent == [1, 2, 3]


def test_a_late_answer_to_a_question_that_timed_out_is_skipped(
    sockets: list[FakeSocket],
) -> None:
    asker = RulesetGeneration()
    FakeSocket.replies += [numbered(1, 7), numbered(2, 8), numbered(3, 9)]
    assert asker() == 7
    FakeSocket.replies[:0] = [numbered(1, 7)]  # the kernel answered question 1 twice
    assert asker() == 8
    assert asker() == 9


def test_a_failed_question_is_unknown_and_the_next_opens_a_new_socket(
    sockets: list[FakeSocket],
) -> None:
    asker = RulesetGeneration()
    FakeSocket.replies += [None, numbered(2, 4)]
    assert asker() is None
    assert sockets[0].closed
    assert asker() == 4
    assert len(sockets) == 2 and not sockets[1].closed
