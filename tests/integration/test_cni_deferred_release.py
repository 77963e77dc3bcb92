"""A DEL answered before its release (the agent releases the address after the reply):
what is on disk at the reply is enough for the next start to release it, with the real
kernel, IPAM state and records. The agent "dies" between the reply and the release: the
work it left is never run, and a new IPAM, record store and handler are built from the
state directory, as a restarted agent builds them."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from ipaddress import IPv4Interface

import pytest

from cni_plugin import client
from flannelpy.cni import CniHandler, CniServer, CniSettings, PodNetwork, RecordStore, wire
from flannelpy.cni.context import Deferred
from flannelpy.ipam import NodeIpam
from tests.integration.test_cni_server import MTU, NETWORK, make_node
from tests.support.netns_util import is_root

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(not is_root(), reason="network namespaces need root"),
]


def test_an_agent_killed_after_answering_a_del_releases_the_address_at_its_next_start() -> None:
    with make_node() as node:
        pod = node.pod()
        code, added = node.add("c1", pod)
        assert code == 0, added
        address = IPv4Interface(added["ips"][0]["address"]).ip
        left: list[Deferred] = []

        def killed_after_reply(
            env: dict[str, str], stdin: bytes, fd: int | None = None
        ) -> tuple[int, bytes]:
            deferred: Deferred = []
            answer = node.handler.handle(env, stdin, fd, deferred)
            left.append(deferred)  # never run: the agent is gone before it gets there
            return answer

        folder = tempfile.mkdtemp(prefix="fpcnid")
        path = os.path.join(folder, "cni.sock")
        server = CniServer(path, killed_after_reply, netns=node.ns.name)
        server.start()
        try:
            env = {
                "CNI_COMMAND": "DEL",
                "CNI_CONTAINERID": "c1",
                "CNI_NETNS": pod,
                "CNI_IFNAME": "eth0",
                "CNI_PATH": "/opt/cni/bin",
            }
            request = wire.encode_request(env, json.dumps(node.config()).encode())
            assert client.forward(path, request, None) == (0, b"")
        finally:
            server.stop()
            shutil.rmtree(folder, ignore_errors=True)
        assert [len(d) for d in left] == [1]
        # At the reply: the veth is gone, the address and the record are still on disk.
        assert node.veths() == []
        ipam_dir, records_dir = node.ipam._store.directory, node.records.directory
        restarted_ipam = NodeIpam(ipam_dir)
        try:
            assert [(a.container_id, a.ip) for a in restarted_ipam.allocations()] == [
                ("c1", address)
            ]
            records = RecordStore(records_dir)
            assert [r.container_id for r in records.list(NETWORK)] == ["c1"]
            restarted = CniHandler(
                restarted_ipam, PodNetwork(), records, CniSettings(mtu_provider=lambda: MTU)
            )
            # The start-up GC, in the node's namespace: the record's veth is gone.
            assert node.ns.call(restarted.gc_dead) == [("c1", "eth0")]
            assert restarted_ipam.allocations() == [] and records.list() == []
        finally:
            restarted_ipam.close()
        # Released into cooldown, not handed out again to the next pod.
        code, second = node.add("c2", node.pod())
        assert code == 0, second
        assert IPv4Interface(second["ips"][0]["address"]).ip != address
