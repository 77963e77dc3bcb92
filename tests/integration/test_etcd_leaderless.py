"""A member without a leader refuses our calls at once (etcd's ``hasleader`` metadata on
every request, not only on watches), so a store listing that member first fails over in
well under the request timeout instead of waiting it out (issue 12, item 7).

Real etcd: a local 3-member cluster on 127.0.0.1; two members are SIGKILLed, which
leaves the third without a leader (no majority) while it still answers on its port.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator

import pytest

from flannelpy.errors import StoreUnavailable
from flannelpy.store.etcd.client import EtcdStore
from tests.support.etcd_server import EtcdServer

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None, reason="etcd is not installed")

TIMEOUT = 5.0  # the store's per-request timeout: a refused call must take far less


class _Member(EtcdServer):
    def __init__(self, index: int) -> None:
        super().__init__()
        self.name = f"m{index}"


@pytest.fixture
def cluster() -> Iterator[list[_Member]]:
    members = [_Member(i) for i in range(3)]
    peers = ",".join(f"{m.name}=http://127.0.0.1:{m.peer_port}" for m in members)
    for member in members:
        token = f"leaderless-{members[0].peer_port}"
        member.extra_args = ("--initial-cluster", peers, "--initial-cluster-token", token)
    threads = [threading.Thread(target=m.start) for m in members]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    try:
        assert all(m.running for m in members), members[0].log_tail()
        yield members
    finally:
        for member in members:
            member.stop()


def _leaderless(store: EtcdStore) -> bool:
    try:
        store.get("/probe")
    except StoreUnavailable as e:
        return "no leader" in str(e)
    return False


def test_a_leaderless_member_refuses_at_once_and_the_call_fails_over(
    cluster: list[_Member],
) -> None:
    lonely, others = cluster[0], cluster[1:]
    writer = EtcdStore([m.endpoint for m in cluster], timeout=TIMEOUT)
    try:
        writer.put("/k", b"before")
    finally:
        writer.close()
    for member in others:
        member.kill()
    alone = EtcdStore([lonely.endpoint], timeout=TIMEOUT)
    try:
        deadline = time.monotonic() + 10.0
        while not _leaderless(alone):  # the member notices after an election timeout
            assert time.monotonic() < deadline, "the lone member never reported no leader"
        started = time.monotonic()
        with pytest.raises(StoreUnavailable, match="no leader"):
            alone.get("/k")
        assert time.monotonic() - started < 1.0  # refused, not timed out
    finally:
        alone.close()
    # With a majority back, a store that lists the leaderless-then-recovering member first
    # still gets its answer (from whichever member has a leader) within one timeout.
    others[0].start()
    both = EtcdStore([lonely.endpoint, others[0].endpoint], timeout=TIMEOUT)
    try:
        started = time.monotonic()
        kv = both.get("/k")
        assert kv is not None and kv.value == b"before"
        assert time.monotonic() - started < TIMEOUT
    finally:
        both.close()
