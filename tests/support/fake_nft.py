"""A stand-in for the ``nft`` command that holds one table as the scripts written to it:
enough for the policy table's adapter to list, compare and write, in the unit tier."""

from __future__ import annotations

import json
import subprocess
from typing import Any


class FakeNft:
    """Call it as ``subprocess.run``. ``scripts`` are the ``nft -f`` inputs, in order."""

    def __init__(self) -> None:
        self.table: list[str] | None = None  # the scripts that made the table; None: absent
        self.scripts: list[str] = []
        self.packets: dict[str, int] = {}  # what each named counter counted
        self.generation = 1  # bumped by every committed write, as the kernel's ruleset one

    def counters(self) -> list[str]:
        """The named counters the table's scripts declared."""
        return [line.split()[4] for line in self.table or [] if line.startswith("add counter ")]

    def __call__(self, argv: list[str], **kwargs: Any) -> subprocess.CompletedProcess[str]:
        args = argv[argv.index("nft") + 1 :]
        if args[:3] == ["-s", "list", "table"]:
            if self.table is None:
                return self._done(argv, 1, err="Error: No such file or directory")
            return self._done(argv, 0, out="\n".join([f"table {args[-1]}", *self.table]))
        if args[:3] == ["-j", "list", "counters"]:
            if self.table is None:
                return self._done(argv, 1, err="Error: No such file or directory")
            items = [
                {"counter": {"name": n, "packets": self.packets.get(n, 0)}} for n in self.counters()
            ]
            return self._done(argv, 0, out=json.dumps({"nftables": items}))
        if args == ["-f", "-"]:
            return self._write(argv, kwargs["input"])
        return self._done(argv, 1, err=f"Error: unexpected {args}")

    def _write(self, argv: list[str], script: str) -> subprocess.CompletedProcess[str]:
        self.scripts.append(script)
        lines = script.splitlines()
        if len(lines) >= 2 and lines[0].startswith("add table") and lines[1].startswith("delete"):
            self.table = lines[2:]
        elif self.table is None:
            return self._done(argv, 1, err="Error: No such file or directory")
        else:
            self.table = self.table + lines
        self.generation += 1
        return self._done(argv, 0)

    def delete_table(self) -> None:
        """What ``nft delete table`` by hand does."""
        self.table = None
        self.generation += 1

    def alter(self) -> None:
        """What a rule added by hand does to the listing."""
        assert self.table is not None
        self.table = [*self.table, "add rule by hand"]
        self.generation += 1

    def elsewhere(self) -> None:
        """Someone else's write to another table (kube-proxy's, say): a new generation."""
        self.generation += 1

    @staticmethod
    def _done(argv: list[str], rc: int, out: str = "", err: str = "") -> Any:
        return subprocess.CompletedProcess(argv, rc, out, err)
