"""The nftables ruleset generation of this network namespace, asked of the kernel.

Every committed nftables transaction in a namespace (``nft``, iptables-nft, kube-proxy,
ours) bumps one counter, the ruleset generation (``NFT_MSG_GETGEN``). When it still
reads what it read right after our last write, nothing in the namespace's nftables has
changed since, so our table is exactly as we left it: the policy table can skip
reading the whole table back (``nft -j list``, the costly part of a change) before
its next incremental write. One netlink round trip, well under a millisecond.

The socket is kept open (:class:`RulesetGeneration`): the kernel's release of a
netfilter netlink socket waits for the clean-up of the last transaction that deleted
anything (an RCU grace period, about 9 ms here), so a socket per question made every
read right after a policy change that removed an element or a rule 100 times slower.
"""

from __future__ import annotations

import socket
import struct
import threading

NETLINK_NETFILTER = 12
NFNL_SUBSYS_NFTABLES = 10
NFT_MSG_GETGEN = 16
NFT_MSG_NEWGEN = 15
NFTA_GEN_ID = 1
NLM_F_REQUEST = 0x1
NLMSG_ERROR = 2
NFNETLINK_V0 = 0

_HEADER = struct.Struct("=IHHII")  # nlmsghdr: length, type, flags, seq, pid
_NFGEN = struct.Struct("=BBH")  # nfgenmsg: family, version, res_id (big-endian, 0)


class RulesetGeneration:
    """The generation of the namespace this process was in at the first call, over one
    socket kept open; called, returns it, or None when the kernel does not answer (no
    nf_tables, no permission): the caller then reads the table back as it would without
    it. A failed call closes the socket and the next opens a new one."""

    def __init__(self, timeout: float = 1.0) -> None:
        self._timeout = timeout
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._seq = 0

    def __call__(self) -> int | None:
        with self._lock:
            try:
                return self._ask()
            except OSError:
                self._close()
                return None

    def close(self) -> None:
        with self._lock:
            self._close()

    def _ask(self) -> int | None:
        if self._sock is None:
            self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
            self._sock.settimeout(self._timeout)
        self._seq = self._seq % 0xFFFFFFFF + 1
        self._sock.sendto(request(self._seq), (0, 0))
        while True:  # an answer to an earlier question that timed out is skipped
            reply = self._sock.recv(4096)
            if len(reply) >= _HEADER.size and _HEADER.unpack_from(reply)[3] == self._seq:
                return parse_generation(reply)

    def _close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def ruleset_generation(timeout: float = 1.0) -> int | None:
    """The current generation over a socket of its own (a one-off question: a caller that
    asks again keeps a :class:`RulesetGeneration`)."""
    asker = RulesetGeneration(timeout)
    try:
        return asker()
    finally:
        asker.close()


def request(seq: int) -> bytes:
    """One ``NFT_MSG_GETGEN`` request with sequence number ``seq``."""
    request_type = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETGEN
    body = _NFGEN.pack(socket.AF_UNSPEC, NFNETLINK_V0, 0)
    return _HEADER.pack(_HEADER.size + len(body), request_type, NLM_F_REQUEST, seq, 0) + body


def parse_generation(reply: bytes) -> int | None:
    """``NFTA_GEN_ID`` from a ``NFT_MSG_NEWGEN`` reply; None for an error or anything else."""
    if len(reply) < _HEADER.size + _NFGEN.size:
        return None
    length, msg_type, _, _, _ = _HEADER.unpack_from(reply)
    if msg_type & 0xFF != NFT_MSG_NEWGEN or msg_type >> 8 != NFNL_SUBSYS_NFTABLES:
        return None
    offset, end = _HEADER.size + _NFGEN.size, min(length, len(reply))
    while offset + 4 <= end:
        attr_len, attr_type = struct.unpack_from("=HH", reply, offset)
        if attr_len < 4:
            return None
        if attr_type & 0x3FFF == NFTA_GEN_ID and attr_len >= 8:
            return int(struct.unpack_from("!I", reply, offset + 4)[0])
        offset += (attr_len + 3) & ~3
    return None
