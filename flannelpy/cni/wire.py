"""The request/reply framing between the thin CNI executable and the agent.

Kept trivial so that a C forwarder can speak it too (cni_plugin/forwarder.c):

    request := MAGIC  u32be(len(env))  env  stdin-bytes...  (client shuts down writing)
    env     := ("CNI_NAME=value" NUL)*   -- only the CNI_* variables
    reply   := u32be(exit_code)  stdout-bytes...            (agent closes)

The executable prints the reply's bytes on stdout and exits with its code: all
CNI logic (validation, results, errors) lives in the agent. Standard library only.

For ADD, CHECK and DEL the first send also carries, as SCM_RIGHTS ancillary
data, one open descriptor of CNI_NETNS, opened by the executable in the
runtime's mount namespace (where the path means something; in the agent's it
may name nothing, or an empty file). It is optional: an executable that
could not open the path, or predates it, sends none. The byte stream is
unchanged, so MAGIC stays: an agent that reads with recv() drops the
descriptor (the kernel closes it) and reads the request as before.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping

MAGIC = b"FPCNI1\n"
DEFAULT_SOCKET = "/run/flannelpy/cni.sock"
# The network config key that names the agent's socket (several agents share a
# host in the lab; in production the default is right).
SOCKET_CONFIG_KEY = "agentSocket"
MAX_REQUEST_BYTES = 4 << 20  # a CNI config with a large prevResult stays far below this


class WireError(Exception):
    pass


def encode_request(env: Mapping[str, str], stdin: bytes) -> bytes:
    block = b"".join(
        f"{k}={v}".encode() + b"\0" for k, v in sorted(env.items()) if k.startswith("CNI_")
    )
    return MAGIC + struct.pack(">I", len(block)) + block + stdin


def decode_request(data: bytes) -> tuple[dict[str, str], bytes]:
    if not data.startswith(MAGIC) or len(data) < len(MAGIC) + 4:
        raise WireError("not a flannelpy CNI request")
    (size,) = struct.unpack(">I", data[len(MAGIC) : len(MAGIC) + 4])
    start = len(MAGIC) + 4
    block = data[start : start + size]
    if len(block) != size:
        raise WireError("truncated environment block")
    env: dict[str, str] = {}
    for item in block.split(b"\0"):
        if not item:
            continue
        key, sep, value = item.decode("utf-8", "replace").partition("=")
        if not sep or not key.startswith("CNI_"):
            raise WireError(f"bad environment entry {item[:40]!r}")
        env[key] = value
    return env, data[start + size :]


def encode_reply(exit_code: int, stdout: bytes) -> bytes:
    return struct.pack(">I", exit_code) + stdout


def decode_reply(data: bytes) -> tuple[int, bytes]:
    if len(data) < 4:
        raise WireError("truncated reply")
    (code,) = struct.unpack(">I", data[:4])
    return code, data[4:]
