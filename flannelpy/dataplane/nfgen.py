"""The nftables ruleset generation of this network namespace, asked of the kernel.

Every committed nftables transaction in a namespace (``nft``, iptables-nft, kube-proxy,
ours) bumps one counter, the ruleset generation (``NFT_MSG_GETGEN``). When it still
reads what it read right after our last write, nothing in the namespace's nftables has
changed since, so our table is exactly as we left it: the policy table can skip
reading the whole table back (``nft -j list``, the costly part of a change) before
its next incremental write. One netlink round trip, well under a millisecond.
"""

from __future__ import annotations

import socket
import struct

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


def ruleset_generation(timeout: float = 1.0) -> int | None:
    """The current generation, or None when the kernel does not answer (no nf_tables,
    no permission): the caller then reads the table back as it would without it."""
    request_type = (NFNL_SUBSYS_NFTABLES << 8) | NFT_MSG_GETGEN
    body = _NFGEN.pack(socket.AF_UNSPEC, NFNETLINK_V0, 0)
    message = _HEADER.pack(_HEADER.size + len(body), request_type, NLM_F_REQUEST, 1, 0) + body
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER) as sock:
            sock.settimeout(timeout)
            sock.sendto(message, (0, 0))
            reply = sock.recv(4096)
    except OSError:
        return None
    return parse_generation(reply)


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
