"""``nfgen.RulesetGeneration`` against the kernel: every committed transaction of the
namespace, deleting ones included, moves the generation by one, and one socket serves
every question (a socket closed after a deleting transaction waits for its clean-up)."""

from __future__ import annotations

import pytest

from flannelpy.dataplane.libnft import LibNftables
from flannelpy.dataplane.nfgen import RulesetGeneration, ruleset_generation
from tests.support.netns_util import is_root, temp_netns

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(not is_root(), reason="network namespaces need root"),
]

SETUP = """add table inet gen-test
add set inet gen-test peers { type ipv4_addr; }
add chain inet gen-test forward { type filter hook forward priority filter; }
add rule inet gen-test forward ip saddr @peers accept
"""


def test_each_transaction_moves_the_generation_by_one_over_one_socket() -> None:
    with temp_netns("gen") as ns:
        nft = ns.call(LibNftables.load)
        assert nft is not None
        asker = RulesetGeneration()
        start = ns.call(asker)  # the socket is made, and stays, in the namespace
        assert start is not None
        assert ns.call(ruleset_generation) == start  # a one-off question agrees
        scripts = [
            SETUP,
            "add element inet gen-test peers { 10.0.0.1 }\n",
            "delete element inet gen-test peers { 10.0.0.1 }\n",
            "flush chain inet gen-test forward\n",
            "delete table inet gen-test\n",
        ]
        seen = []
        for script in scripts:
            assert nft(["nft", "-f", "-"], input=script).returncode == 0
            seen.append(asker())  # from this thread: the socket is the namespace's
        assert seen == [start + n for n in range(1, len(scripts) + 1)]
        ns.exec("nft add table inet someone-else")
        assert asker() == start + len(scripts) + 1  # a write by another process counts
        sock = asker._sock
        assert sock is not None and asker() is not None and asker._sock is sock
        asker.close()
