"""The in-process ``nft``: command lines translated as the command reads them, and the
library's answers given back as the command's (the real library runs in the
integration tier, tests/integration/test_netpol_enforce.py)."""

from __future__ import annotations

from typing import Any

import pytest

from flannelpy.dataplane.libnft import (
    NFT_CTX_OUTPUT_JSON,
    NFT_CTX_OUTPUT_STATELESS,
    LibNftables,
    UnsupportedCommand,
    translate,
)


def test_a_script_on_stdin_and_words_on_the_command_line() -> None:
    assert translate(["nft", "-f", "-"], "add table inet t\n") == ("add table inet t\n", 0)
    assert translate(["nft", "-j", "list", "table", "inet", "t"], None) == (
        "list table inet t",
        NFT_CTX_OUTPUT_JSON,
    )
    assert translate(["nft", "-s", "list", "table", "inet", "t"], None) == (
        "list table inet t",
        NFT_CTX_OUTPUT_STATELESS,
    )


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["ip", "netns", "exec", "n1", "nft", "list", "ruleset"],
        ["nft", "-c", "-f", "-"],
        ["nft"],
    ],
)
def test_what_it_does_not_translate_is_refused_not_guessed(argv: list[str]) -> None:
    with pytest.raises(UnsupportedCommand):
        translate(argv, None)


class FakeLib:
    """libnftables' six calls, answering each command from ``answers``."""

    def __init__(self, answers: dict[str, tuple[int, bytes, bytes]]) -> None:
        self.answers = answers
        self.flags: list[int] = []
        self.last = (0, b"", b"")

    def nft_ctx_new(self, flags: int) -> int:
        return 1

    def nft_ctx_buffer_output(self, ctx: int) -> int:
        return 0

    nft_ctx_buffer_error = nft_ctx_buffer_output

    def nft_ctx_output_set_flags(self, ctx: int, flags: int) -> None:
        self.flags.append(flags)

    def nft_run_cmd_from_buffer(self, ctx: int, command: bytes) -> int:
        self.last = self.answers[command.decode()]
        return self.last[0]

    def nft_ctx_get_output_buffer(self, ctx: int) -> bytes:
        return self.last[1]

    def nft_ctx_get_error_buffer(self, ctx: int) -> bytes:
        return self.last[2]


def test_answers_come_back_as_the_commands_would_give_them() -> None:
    lib: Any = FakeLib(
        {
            "list table inet t": (0, b'{"nftables": []}', b""),
            "list table inet gone": (-1, b"", b"Error: No such file or directory\n"),
        }
    )
    nft = LibNftables(lib)
    done = nft(["nft", "-j", "list", "table", "inet", "t"], capture_output=True, text=True)
    assert (done.returncode, done.stdout, done.stderr) == (0, '{"nftables": []}', "")
    gone = nft(["nft", "list", "table", "inet", "gone"], timeout=5)
    assert gone.returncode == 1 and "No such file or directory" in gone.stderr
    assert lib.flags == [NFT_CTX_OUTPUT_JSON, 0]  # set per call: one context serves both
