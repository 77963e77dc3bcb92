"""``nft`` in-process: libnftables, the library the ``nft`` command is built on.

Why not the command: an ``nft`` process reads the namespace's ruleset into its cache
before every transaction, kube-proxy's and iptables-nft's tables included, so one
small policy change costs 10-20 ms on a node with a few hundred rules, and more
with more Services. One library context keeps its cache between commands and
re-reads only when the ruleset generation moved: a small transaction takes about
0.2 ms and a listing of the policy table 0.4 ms (bench/README.md, "policy table").

:class:`LibNftables` is called like ``subprocess.run`` with an ``nft`` command line
(``nft -f -`` with the script as ``input``, ``nft -j list ...``), so the policy table's
adapter does not care which one it drives; the exit status is 0 or 1 and the messages
are the command's own (``Error: No such file or directory``, ...). The context's
netlink socket belongs to the namespace the process was in when it was made.
"""

from __future__ import annotations

import ctypes
import logging
import subprocess
import threading
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)

LIBRARY = "libnftables.so.1"  # Debian's libnftables1, a dependency of the nftables package
NFT_CTX_DEFAULT = 0
NFT_CTX_OUTPUT_STATELESS = 1 << 2  # nft -s: no counter values
NFT_CTX_OUTPUT_JSON = 1 << 4  # nft -j
OUTPUT_OPTIONS = {"-s": NFT_CTX_OUTPUT_STATELESS, "-j": NFT_CTX_OUTPUT_JSON}


class UnsupportedCommand(ValueError):
    """A command line the in-process runner does not translate (a bug of the caller)."""


class LibNftables:
    """One libnftables context, used by one thread at a time (a lock serialises callers)."""

    def __init__(self, lib: Any) -> None:
        self._lib = lib
        self._lock = threading.Lock()
        self._ctx = lib.nft_ctx_new(NFT_CTX_DEFAULT)
        if not self._ctx:
            raise OSError("nft_ctx_new returned no context")
        lib.nft_ctx_buffer_output(self._ctx)
        lib.nft_ctx_buffer_error(self._ctx)

    @classmethod
    def load(cls) -> LibNftables | None:
        """The library's context, or None (said once in the log) when it cannot be loaded:
        the caller then runs the ``nft`` command."""
        try:
            lib = ctypes.CDLL(LIBRARY)
            lib.nft_ctx_new.restype = ctypes.c_void_p
            lib.nft_ctx_new.argtypes = [ctypes.c_uint32]
            lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
            lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
            lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
            lib.nft_run_cmd_from_buffer.restype = ctypes.c_int
            for name in ("nft_ctx_get_output_buffer", "nft_ctx_get_error_buffer"):
                getattr(lib, name).argtypes = [ctypes.c_void_p]
                getattr(lib, name).restype = ctypes.c_char_p
            return cls(lib)
        except (OSError, AttributeError) as e:
            log.info("libnftables not usable (%s); running the nft command instead", e)
            return None

    def __call__(
        self, argv: Sequence[str], input: str | None = None, **_: Any
    ) -> subprocess.CompletedProcess[str]:
        """What ``subprocess.run(argv, input=..., capture_output=True, text=True)`` of the
        ``nft`` command line ``argv`` would give (no namespace prefix: this process's)."""
        command, flags = translate(argv, input)
        lib = self._lib
        with self._lock:
            lib.nft_ctx_output_set_flags(self._ctx, flags)
            rc = lib.nft_run_cmd_from_buffer(self._ctx, command.encode())
            out = lib.nft_ctx_get_output_buffer(self._ctx) or b""
            err = lib.nft_ctx_get_error_buffer(self._ctx) or b""
        return subprocess.CompletedProcess(
            list(argv), 0 if rc == 0 else 1, out.decode(errors="replace"), err.decode()
        )


def translate(argv: Sequence[str], input: str | None) -> tuple[str, int]:
    """The command text and output flags of an ``nft`` command line: ``nft -f -`` runs
    ``input``; ``nft [-s] [-j] WORDS...`` runs the words joined, as the command joins
    them, stateless (``-s``) and as JSON (``-j``) as asked."""
    if not argv or argv[0] != "nft":
        raise UnsupportedCommand(f"not an nft command line: {list(argv)}")
    args = list(argv[1:])
    flags = 0
    while args and args[0] in OUTPUT_OPTIONS:
        flags |= OUTPUT_OPTIONS[args.pop(0)]
    if args == ["-f", "-"]:
        return input or "", flags
    if not args or any(a.startswith("-") for a in args):
        raise UnsupportedCommand(f"nft options other than -s, -j and -f - : {list(argv)}")
    return " ".join(args), flags
