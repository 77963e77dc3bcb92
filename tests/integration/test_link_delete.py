"""``linkdelete.delete_link`` against the kernel: it returns once the pair has left both
namespaces (before the kernel's answer), and the answer still comes."""

from __future__ import annotations

import errno
import json

import pytest

from flannelpy.dataplane import linkdelete
from flannelpy.dataplane.nlbatch import NetlinkSocket
from flannelpy.dataplane.podnet import get_link
from tests.support.netns_util import is_root, temp_netns

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(not is_root(), reason="network namespaces need root"),
]


def _index(name: str) -> int:
    with NetlinkSocket() as sock:
        link = get_link(sock, name)
    assert link is not None
    return link.index


def test_a_bridged_veth_pair_is_gone_from_both_namespaces_when_it_returns() -> None:
    with temp_netns("ld") as node, temp_netns("ldp") as pod:
        node.ip("link add br0 type bridge")
        node.ip("link set br0 up")
        pod_sock = pod.call(NetlinkSocket)  # looks into the pod's namespace from any thread
        try:
            for i in range(5):
                node.ip(f"link add v{i} type veth peer name eth0 netns {pod.name}")
                node.ip(f"link set v{i} master br0 up")
                pod.ip("link set eth0 up")

                def delete(name: str) -> tuple[bool, linkdelete.PendingDelete, bool, bool]:
                    gone, pending = linkdelete.delete_link(_index(name))
                    with NetlinkSocket() as sock:
                        host_left = get_link(sock, name) is None
                    return gone, pending, host_left, get_link(pod_sock, "eth0") is None

                gone, pending, host_left, peer_left = node.call(delete, f"v{i}")
                assert (gone, host_left, peer_left) == (True, True, True)
                assert pending.wait().error == 0
        finally:
            pod_sock.close()
        assert json.loads(node.ip("-j link show master br0")) == []


def test_a_link_that_is_not_there_is_answered_with_its_error() -> None:
    with temp_netns("ld") as node:
        node.ip("link add v0 type veth peer name v0p")

        def delete_twice() -> list[tuple[bool, int]]:
            index = _index("v0")
            results = []
            for _ in range(2):
                gone, pending = linkdelete.delete_link(index)
                results.append((gone, pending.wait().error))
            return results

        (first, second) = node.call(delete_twice)
        assert first == (True, 0)
        assert second == (False, errno.ENODEV)
