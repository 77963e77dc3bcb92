"""The Kubernetes subnet manager, with the real ``kubernetes`` client, against the
API server stand-in (tests/kube_standin.py) on 127.0.0.1.

Every test's requests are checked against RBAC_RULES when it ends, and one test
runs every code path and asserts that the verbs used are exactly RBAC_RULES (the
ClusterRole's; the manager makes no call that the namespaced Role grants).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path
from typing import Any

import pytest

from flannelpy.config.settings import AgentSettings
from flannelpy.errors import ConfigError, StoreError
from flannelpy.store.kube.api import NAMESPACED_RBAC_RULES, RBAC_RULES
from flannelpy.store.kube.client import build_api_client
from flannelpy.store.kube.manager import KubeSubnetManager
from flannelpy.subnet.lease import Lease, LeaseAttrs
from tests.support.kube_standin import STRATEGIC, KubeStandin, Request
from tests.support.waiting import wait_until

P = "flannel.alpha.coreos.com/"
NETCONF = '{"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan"}}'
OWN = "node-a"
MAC_A = "0e:00:00:00:00:0a"
RBAC = {(group, resource, verb) for group, resource, verbs in RBAC_RULES for verb in verbs}


def attrs(ip: str = "192.168.50.1", mac: str = MAC_A, mtu: int = 1450) -> LeaseAttrs:
    return LeaseAttrs(
        public_ip=IPv4Address(ip),
        backend_type="vxlan",
        backend_data={"VNI": 1, "VtepMAC": mac},
        node_name="hostname-not-node-name",
        mtu=mtu,
    )


def peer_annotations(ip: str, mac: str) -> dict[str, str]:
    """What flanneld (or flannelpy) writes on a peer node."""
    return {
        P + "kube-subnet-manager": "true",
        P + "backend-type": "vxlan",
        P + "backend-data": json.dumps({"VNI": 1, "VtepMAC": mac}),
        P + "public-ip": ip,
    }


def patches(standin: KubeStandin) -> list[Request]:
    return [r for r in standin.requests if r.method == "PATCH"]


def node_reads(standin: KubeStandin, name: str = OWN) -> int:
    """How many times the Node ``name`` was read (GET) so far."""
    return sum(r.method == "GET" and r.path == f"/api/v1/nodes/{name}" for r in standin.requests)


def lists(standin: KubeStandin) -> list[Request]:
    return [r for r in standin.requests if r.rbac == ("", "nodes", "list")]


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    # The client honours proxy variables; stand-in traffic must stay on loopback.
    for name in (
        "http_proxy",
        "https_proxy",
        "all_proxy",
        "HTTP_PROXY",
        "HTTPS_PROXY",
        "ALL_PROXY",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def standin() -> Iterator[KubeStandin]:
    server = KubeStandin(bookmark_interval=0.5).start()
    try:
        yield server
        # Whatever a test did, the manager used no verb the ClusterRole lacks (it never
        # writes the Leases only the namespaced Role grants).
        assert server.rbac_usage() <= RBAC, server.rbac_usage() - RBAC
    finally:
        server.stop()


@pytest.fixture
def netconf(tmp_path: Path) -> Path:
    path = tmp_path / "net-conf.json"
    path.write_text(NETCONF)
    return path


MakeManager = Callable[..., KubeSubnetManager]


@pytest.fixture
def make_manager(standin: KubeStandin, netconf: Path) -> Iterator[MakeManager]:
    made: list[KubeSubnetManager] = []

    def make(
        node_name: str | None = OWN,
        environ: Mapping[str, str] | None = None,
        server: KubeStandin | None = None,
        **kwargs: Any,
    ) -> KubeSubnetManager:
        settings = AgentSettings(
            kube_subnet_mgr=True,
            kube_api_url=(server or standin).url,
            net_config_path=str(netconf),
            node_name=node_name,
            startup_timeout=3.0,
        )
        kwargs.setdefault("watch_timeout", 5)
        manager = KubeSubnetManager(settings, environ=environ or {}, **kwargs)
        made.append(manager)
        return manager

    try:
        yield make
    finally:
        for manager in made:
            manager.close()


class Watcher:
    """watch_leases in a thread; records every callback."""

    def __init__(self, manager: KubeSubnetManager) -> None:
        self.calls: list[tuple[dict[str, Lease], int]] = []
        self.stop = threading.Event()
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(manager,), daemon=True)

    def _run(self, manager: KubeSubnetManager) -> None:
        try:
            manager.watch_leases(self._record, self.stop)
        except BaseException as e:
            self.error = e

    def _record(self, leases: Mapping[str, Lease], revision: int) -> None:
        with self._lock:
            self.calls.append((dict(leases), revision))

    @property
    def latest(self) -> dict[str, Lease]:
        with self._lock:
            return self.calls[-1][0] if self.calls else {}

    def wait_for(
        self, predicate: Callable[[dict[str, Lease]], bool], what: str, timeout: float = 1.0
    ) -> dict[str, Lease]:
        def matching() -> dict[str, Lease] | None:
            latest = self.latest
            return latest if predicate(latest) else None

        return wait_until(matching, timeout, what)

    def subnets(self) -> dict[str, str]:
        """node name → subnet of the latest map."""
        return {str(lease.attrs.node_name): str(lease.subnet) for lease in self.latest.values()}

    def wait_subnets(self, expected: dict[str, str], timeout: float = 1.0) -> None:
        wait_until(lambda: self.subnets() == expected, timeout, f"lease map {expected}")

    def __enter__(self) -> Watcher:
        self._thread.start()
        wait_until(lambda: self.calls, 3.0, "the first lease list")
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        started = time.monotonic()
        self._thread.join(3.0)
        assert not self._thread.is_alive(), "watch_leases did not return after stop"
        assert time.monotonic() - started < 1.0, "watch_leases took over 1 s to stop"
        if self.error is not None and exc == (None, None, None):
            raise self.error


# =============================================================================
# acquire / renew
# =============================================================================


def test_acquire_writes_flannels_annotations_and_condition(
    standin: KubeStandin, make_manager: MakeManager
) -> None:
    standin.add_node(OWN, "10.244.7.0/24", annotations={"keep.example.com/x": "1"})
    manager = make_manager()

    lease = manager.acquire_lease(attrs(), None)

    assert lease.subnet == IPv4Network("10.244.7.0/24")
    assert lease.key == "10.244.7.0-24"
    assert lease.expiration is None
    assert lease.attrs.public_ip == IPv4Address("192.168.50.1")
    assert lease.attrs.node_name == OWN  # the Node's name, not the hostname
    node = standin.node(OWN)
    assert node is not None
    assert node["metadata"]["annotations"] == {
        "keep.example.com/x": "1",
        P + "kube-subnet-manager": "true",
        P + "backend-type": "vxlan",
        P + "backend-data": '{"VNI":1,"VtepMAC":"0e:00:00:00:00:0a"}',
        P + "public-ip": "192.168.50.1",
        P + "flannelpy-mtu": "1450",
        P + "flannelpy-direct-routing": "false",
    }
    conditions = {c["type"]: c for c in node["status"]["conditions"]}
    assert conditions["Ready"]["status"] == "True"  # the kubelet's condition stays
    unavailable = conditions["NetworkUnavailable"]
    assert (unavailable["status"], unavailable["reason"]) == ("False", "FlannelIsUp")
    assert unavailable["lastTransitionTime"].endswith("Z")
    sent = patches(standin)
    assert [(r.path, r.content_type) for r in sent] == [(f"/api/v1/nodes/{OWN}/status", STRATEGIC)]


def test_nothing_changed_means_no_patch(standin: KubeStandin, make_manager: MakeManager) -> None:
    standin.add_node(OWN, "10.244.7.0/24")
    manager = make_manager()
    lease = manager.acquire_lease(attrs(), None)
    rv = standin.resource_version
    standin.clear_requests()

    again = manager.acquire_lease(attrs(), lease.subnet)
    renewed = manager.renew_lease(again)
    manager.renew_lease(renewed)

    assert renewed == lease
    assert patches(standin) == []
    assert [r.method for r in standin.requests] == ["GET"] * 3
    assert standin.resource_version == rv


def test_only_what_differs_is_patched(standin: KubeStandin, make_manager: MakeManager) -> None:
    standin.add_node(OWN, "10.244.7.0/24")
    manager = make_manager()
    manager.acquire_lease(attrs(), None)
    standin.clear_requests()

    lease = manager.acquire_lease(attrs(mac="0e:00:00:00:00:0b"), None)

    (sent,) = patches(standin)
    assert json.loads(sent.body) == {
        "metadata": {"annotations": {P + "backend-data": '{"VNI":1,"VtepMAC":"0e:00:00:00:00:0b"}'}}
    }
    assert lease.attrs.vtep_mac == "0e:00:00:00:00:0b"


def test_renew_repairs_a_hand_edited_annotation_and_condition(
    standin: KubeStandin, make_manager: MakeManager
) -> None:
    standin.add_node(OWN, "10.244.7.0/24")
    manager = make_manager()
    lease = manager.acquire_lease(attrs(), None)
    standin.set_annotations(OWN, {P + "public-ip": "10.9.9.9", P + "kube-subnet-manager": None})
    node = standin.node(OWN)
    assert node is not None
    standin.clear_requests()

    manager.renew_lease(lease)

    (sent,) = patches(standin)
    assert json.loads(sent.body)["metadata"]["annotations"] == {
        P + "public-ip": "192.168.50.1",
        P + "kube-subnet-manager": "true",
    }
    assert "status" not in json.loads(sent.body)  # the condition was still right


def test_renew_raises_when_the_pod_cidr_changed(
    standin: KubeStandin, make_manager: MakeManager
) -> None:
    standin.add_node(OWN, "10.244.7.0/24")
    manager = make_manager()
    lease = manager.acquire_lease(attrs(), None)
    standin.set_pod_cidr(OWN, "10.244.8.0/24")
    with pytest.raises(StoreError, match=r"pod cidr is now 10\.244\.8\.0/24, not 10\.244\.7\.0/24"):
        manager.renew_lease(lease)


def test_public_ip_overwrite_is_advertised(standin: KubeStandin, make_manager: MakeManager) -> None:
    standin.add_node(OWN, "10.244.7.0/24", annotations={P + "public-ip-overwrite": "203.0.113.7"})
    manager = make_manager()

    lease = manager.acquire_lease(attrs(), None)

    assert lease.attrs.public_ip == IPv4Address("203.0.113.7")
    node = standin.node(OWN)
    assert node is not None
    assert node["metadata"]["annotations"][P + "public-ip"] == "203.0.113.7"
    # Removing the overwrite goes back to our own address at the next renewal.
    standin.set_annotations(OWN, {P + "public-ip-overwrite": None})
    renewed = manager.renew_lease(lease)
    assert renewed.attrs.public_ip == IPv4Address("192.168.50.1")
    node = standin.node(OWN)
    assert node is not None
    assert node["metadata"]["annotations"][P + "public-ip"] == "192.168.50.1"


def test_acquire_waits_for_the_pod_cidr_and_says_why(
    standin: KubeStandin, make_manager: MakeManager, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="flannelpy.store.kube.manager")
    standin.add_node(OWN)
    manager = make_manager()
    result: list[Lease] = []
    thread = threading.Thread(target=lambda: result.append(manager.acquire_lease(attrs(), None)))
    thread.start()
    try:
        wait_until(lambda: "pod cidr not assigned" in caplog.text, 2.0, "the warning")
        # A read after the next one proves the manager handled another missing podCIDR.
        reads = node_reads(standin)
        wait_until(lambda: node_reads(standin) >= reads + 2, 5.0, "two more reads of the Node")
        assert not result, "acquire returned without a pod cidr"
        assert patches(standin) == []  # nothing is advertised before there is a subnet
        standin.set_pod_cidr(OWN, "10.244.9.0/24")
        thread.join(3.0)
    finally:
        manager.close()  # ends the wait if the assertions above failed
        thread.join(3.0)
    assert result and result[0].subnet == IPv4Network("10.244.9.0/24")
    assert (
        f"pod cidr not assigned to node {OWN} yet; waiting for the controller-manager "
        "(is --allocate-node-cidrs set?)"
    ) in caplog.text
    # Logged once, not once per poll (the next one is due after 30 s).
    assert caplog.text.count("pod cidr not assigned") == 1


def test_close_ends_the_wait_for_a_pod_cidr(
    standin: KubeStandin, make_manager: MakeManager
) -> None:
    standin.add_node(OWN)
    manager = make_manager()
    errors: list[BaseException] = []

    def acquire() -> None:
        try:
            manager.acquire_lease(attrs(), None)
        except StoreError as e:
            errors.append(e)

    thread = threading.Thread(target=acquire)
    thread.start()
    # The second read means the first found no podCIDR and the manager is pausing.
    wait_until(lambda: node_reads(standin) >= 2, 5.0, "two reads of the Node")
    started = time.monotonic()
    manager.close()
    thread.join(3.0)
    assert errors and "stopped while waiting" in str(errors[0])
    assert time.monotonic() - started < 1.0


def test_pod_cidr_outside_network_is_a_config_error(
    standin: KubeStandin, make_manager: MakeManager
) -> None:
    standin.add_node(OWN, "10.99.1.0/24")
    with pytest.raises(ConfigError, match=r"10\.99\.1\.0/24, which is outside Network"):
        make_manager().acquire_lease(attrs(), None)
    assert patches(standin) == []


def test_node_name_from_pod_name_and_namespace(
    standin: KubeStandin, make_manager: MakeManager
) -> None:
    standin.add_node(OWN, "10.244.7.0/24")
    standin.add_pod("kube-flannel", "kube-flannel-ds-x7k2p", OWN)
    import socket

    # The flag parser fills --node-name with the hostname; the pod's nodeName wins.
    manager = make_manager(
        node_name=socket.gethostname(),
        environ={"POD_NAME": "kube-flannel-ds-x7k2p", "POD_NAMESPACE": "kube-flannel"},
    )
    lease = manager.acquire_lease(attrs(), None)
    assert manager.node_name == OWN
    assert lease.attrs.node_name == OWN
    pod_gets = [r for r in standin.requests if r.rbac == ("", "pods", "get")]
    assert [r.path for r in pod_gets] == [
        "/api/v1/namespaces/kube-flannel/pods/kube-flannel-ds-x7k2p"
    ]


def test_node_name_env_beats_the_pod(standin: KubeStandin, make_manager: MakeManager) -> None:
    manager = make_manager(
        node_name=None, environ={"NODE_NAME": OWN, "POD_NAME": "p", "POD_NAMESPACE": "ns"}
    )
    assert manager.node_name == OWN
    assert standin.requests == []


def test_missing_pod_is_a_clear_error(standin: KubeStandin, make_manager: MakeManager) -> None:
    import socket

    manager = make_manager(
        node_name=socket.gethostname(), environ={"POD_NAME": "gone", "POD_NAMESPACE": "ns"}
    )
    with pytest.raises(StoreError, match=r"get pod ns/gone: not found"):
        _ = manager.node_name


def test_vtep_mac_and_node_public_ip_are_read_back(
    standin: KubeStandin, make_manager: MakeManager
) -> None:
    notes = peer_annotations("192.168.50.1", MAC_A)
    # As another writer might spell it: other key order, spaces.
    notes[P + "backend-data"] = '{"VtepMAC": "0e:00:00:00:00:aa", "VNI": 1}'
    notes[P + "node-public-ip"] = "198.51.100.4"
    standin.add_node(OWN, "10.244.7.0/24", annotations=notes)
    manager = make_manager()

    mac = manager.own_vtep_mac()
    assert mac == "0e:00:00:00:00:aa"
    assert manager.node_public_ip() == IPv4Address("198.51.100.4")
    standin.clear_requests()
    # Re-advertising the same MAC (same JSON, other spelling) rewrites no backend-data.
    manager.acquire_lease(attrs(mac=mac), None)
    (sent,) = patches(standin)
    assert P + "backend-data" not in json.loads(sent.body)["metadata"]["annotations"]


def test_no_annotation_means_no_mac(standin: KubeStandin, make_manager: MakeManager) -> None:
    standin.add_node(OWN, "10.244.7.0/24")
    assert make_manager().own_vtep_mac() is None


# =============================================================================
# watch
# =============================================================================


@pytest.fixture
def cluster(standin: KubeStandin, make_manager: MakeManager) -> KubeSubnetManager:
    """Our node (acquired), a managed peer, an unmanaged node, a managed node with
    no podCIDR yet."""
    standin.add_node(OWN, "10.244.1.0/24")
    standin.add_node("node-b", "10.244.2.0/24", peer_annotations("192.168.50.2", MAC_A))
    standin.add_node("other", "10.244.3.0/24")
    standin.add_node("node-c", None, peer_annotations("192.168.50.3", MAC_A))
    manager = make_manager()
    manager.acquire_lease(attrs(), None)
    return manager


def test_watch_lists_only_managed_nodes_with_a_pod_cidr(
    standin: KubeStandin, cluster: KubeSubnetManager
) -> None:
    with Watcher(cluster) as watcher:
        leases, revision = watcher.calls[0]
    assert set(leases) == {"10.244.1.0-24", "10.244.2.0-24"}
    peer = leases["10.244.2.0-24"]
    assert peer.attrs == LeaseAttrs(
        public_ip=IPv4Address("192.168.50.2"),
        backend_type="vxlan",
        backend_data={"VNI": 1, "VtepMAC": MAC_A},
        node_name="node-b",
    )
    own = leases["10.244.1.0-24"]
    assert own.attrs.public_ip == IPv4Address("192.168.50.1") and own.attrs.mtu == 1450
    assert revision == standin.resource_version


def test_hostile_annotations_never_end_the_watch(
    standin: KubeStandin, cluster: KubeSubnetManager
) -> None:
    # Before: "²".isdigit() passed, int() raised ValueError and the watch thread died.
    with Watcher(cluster) as w:
        w.wait_subnets({OWN: "10.244.1.0/24", "node-b": "10.244.2.0/24"})
        standin.set_annotations("node-b", {P + "flannelpy-mtu": "²"})
        standin.add_node(
            "node-d",
            "10.244.6.0/24",
            {
                **peer_annotations("192.168.50.4", MAC_A),
                P + "backend-data": "[" * 3000 + "]" * 3000,
            },
        )
        standin.add_node("node-e", "10.244.7.0/24", peer_annotations("192.168.50.5", MAC_A))
        w.wait_for(
            lambda m: "10.244.7.0-24" in m, "node-e added after the hostile nodes", timeout=5.0
        )
        latest = w.calls[-1][0]
        assert latest["10.244.2.0-24"].attrs.mtu is None
        assert "10.244.6.0-24" not in latest


def test_watch_follows_node_changes(standin: KubeStandin, cluster: KubeSubnetManager) -> None:
    with Watcher(cluster) as w:
        w.wait_subnets({OWN: "10.244.1.0/24", "node-b": "10.244.2.0/24"})

        standin.set_pod_cidr("node-c", "10.244.4.0/24")  # the controller assigns it
        w.wait_subnets({OWN: "10.244.1.0/24", "node-b": "10.244.2.0/24", "node-c": "10.244.4.0/24"})

        standin.set_pod_cidr("node-b", "10.244.5.0/24")  # Flannel ignores this one
        w.wait_subnets({OWN: "10.244.1.0/24", "node-b": "10.244.5.0/24", "node-c": "10.244.4.0/24"})

        standin.set_annotations("node-b", {P + "public-ip-overwrite": "203.0.113.2"})
        w.wait_for(
            lambda m: m["10.244.5.0-24"].attrs.public_ip == IPv4Address("203.0.113.2"),
            "the overwrite of node-b",
        )

        standin.add_node("node-d", "10.244.6.0/24", peer_annotations("192.168.50.4", MAC_A))
        w.wait_for(lambda m: "10.244.6.0-24" in m, "node-d added")

        standin.delete_node("node-b")
        w.wait_subnets({OWN: "10.244.1.0/24", "node-c": "10.244.4.0/24", "node-d": "10.244.6.0/24"})

        calls = len(w.calls)
        standin.set_annotations("other", {"unrelated.example.com/x": "y"})  # not a peer
        standin.set_annotations("node-c", {"unrelated.example.com/x": "y"})  # no lease change
        standin.set_annotations("node-d", {P + "public-ip": "192.168.50.44"})  # a change
        w.wait_for(
            lambda m: m["10.244.6.0-24"].attrs.public_ip == IPv4Address("192.168.50.44"),
            "node-d's new address",
        )
        assert len(w.calls) == calls + 1, "a change that moves no lease caused a callback"


@pytest.mark.parametrize("gone_as", ["event", "status"])
def test_410_relists_and_loses_no_event(
    make_manager: MakeManager, netconf: Path, gone_as: str
) -> None:
    with KubeStandin(bookmark_interval=0.5, gone_as=gone_as) as server:
        server.add_node(OWN, "10.244.1.0/24", peer_annotations("192.168.50.1", MAC_A))
        server.add_node("node-b", "10.244.2.0/24", peer_annotations("192.168.50.2", MAC_A))
        manager = make_manager(server=server)
        with Watcher(manager) as w:
            wait_until(lambda: server.active_watches == 1, 2.0, "the watch")
            before = len(lists(server))

            def change_then_compact() -> None:
                # Never sent on the old stream, and compacted: only a re-list sees it.
                server.set_pod_cidr("node-b", "10.244.22.0/24")
                server.delete_node(OWN)
                server.add_node(OWN, "10.244.1.0/24", peer_annotations("192.168.50.9", MAC_A))
                server.compact()

            server.inject_watch_410(then=change_then_compact)
            w.wait_subnets({OWN: "10.244.1.0/24", "node-b": "10.244.22.0/24"})
            assert w.latest["10.244.1.0-24"].attrs.public_ip == IPv4Address("192.168.50.9")
            assert len(lists(server)) == before + 1
            server.set_pod_cidr("node-b", "10.244.23.0/24")  # and the new watch works
            w.wait_subnets({OWN: "10.244.1.0/24", "node-b": "10.244.23.0/24"})
        assert server.rbac_usage() <= RBAC


@pytest.mark.parametrize(
    ("gone_as", "compact"), [("event", False), ("event", True), ("status", True)]
)
def test_watch_recovers_after_the_api_is_unreachable(
    make_manager: MakeManager, gone_as: str, compact: bool, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="flannelpy.store.kube.manager")
    with KubeStandin(bookmark_interval=0.5, gone_as=gone_as) as server:
        server.add_node(OWN, "10.244.1.0/24", peer_annotations("192.168.50.1", MAC_A))
        server.add_node("node-b", "10.244.2.0/24", peer_annotations("192.168.50.2", MAC_A))
        manager = make_manager(server=server)
        with Watcher(manager) as w:
            wait_until(lambda: server.active_watches == 1, 2.0, "the watch")
            lists_before = len(lists(server))
            failed_before = caplog.text.count("node watch failed")
            server.set_unreachable(True)
            server.set_pod_cidr("node-b", "10.244.12.0/24")  # while nobody can see it
            if compact:
                server.compact()
            # The cut stream and the retries at 0.2, 0.6 and 1.4 s into the outage all fail.
            wait_until(
                lambda: caplog.text.count("node watch failed") >= failed_before + 4,
                5.0,
                "four failed watch attempts",
            )
            assert w.subnets()["node-b"] == "10.244.2.0/24"
            server.set_unreachable(False)
            # Retries came at 0.2, 0.6 and 1.4 s into the outage; the next is 1.6 s later.
            w.wait_subnets({OWN: "10.244.1.0/24", "node-b": "10.244.12.0/24"}, timeout=2.5)
            server.set_pod_cidr("node-b", "10.244.13.0/24")
            w.wait_subnets({OWN: "10.244.1.0/24", "node-b": "10.244.13.0/24"})
        # Without compaction the watch resumes from its resourceVersion; with it, it re-lists.
        assert len(lists(server)) == lists_before + (1 if compact else 0)
        assert "node watch failed; retrying after a delay" in caplog.text


def test_a_watch_that_served_and_then_broke_is_resumed_at_once(
    make_manager: MakeManager, caplog: pytest.LogCaptureFixture
) -> None:
    """An outage escalates the backoff; once a watch has served again, the next break
    (an API server restart, say) starts from the first delay, not where the last outage
    left off (it used to wait 3.2 s here, and up to 10 s after longer outages)."""
    caplog.set_level(logging.WARNING, logger="flannelpy.store.kube.manager")
    with KubeStandin(bookmark_interval=0.5) as server:
        server.add_node(OWN, "10.244.1.0/24", peer_annotations("192.168.50.1", MAC_A))
        server.add_node("node-b", "10.244.2.0/24", peer_annotations("192.168.50.2", MAC_A))
        manager = make_manager(server=server)
        with Watcher(manager) as w:
            wait_until(lambda: server.active_watches == 1, 2.0, "the watch")
            failed = caplog.text.count("node watch failed")
            server.set_unreachable(True)  # the cut stream and retries at 0.2, 0.6, 1.4 s
            wait_until(
                lambda: caplog.text.count("node watch failed") >= failed + 4,
                5.0,
                "four failed watch attempts",
            )
            server.set_unreachable(False)  # the next retry, 1.6 s later, succeeds
            server.set_pod_cidr("node-b", "10.244.12.0/24")
            w.wait_subnets({OWN: "10.244.1.0/24", "node-b": "10.244.12.0/24"}, timeout=3.0)
            failed = caplog.text.count("node watch failed")
            server.set_unreachable(True)
            wait_until(
                lambda: caplog.text.count("node watch failed") > failed,
                2.0,
                "the served watch breaking",
            )
            server.set_unreachable(False)
            server.set_pod_cidr("node-b", "10.244.13.0/24")
            w.wait_subnets({OWN: "10.244.1.0/24", "node-b": "10.244.13.0/24"}, timeout=1.0)


def test_list_is_paged_and_delivered_once(standin: KubeStandin, make_manager: MakeManager) -> None:
    for i in range(1, 8):
        standin.add_node(
            f"node-{i}", f"10.244.{i}.0/24", peer_annotations(f"192.168.50.{i}", MAC_A)
        )
    manager = make_manager(node_name="node-1", page_size=3)
    with Watcher(manager) as w:
        # The manager watches only after it has delivered the whole list.
        wait_until(lambda: standin.active_watches == 1, 2.0, "the watch after the list")
        assert len(w.calls) == 1  # one callback for the whole snapshot
        assert len(w.calls[0][0]) == 7
    pages = lists(standin)
    assert [r.query.get("limit") for r in pages] == ["3", "3", "3"]
    assert "continue" not in pages[0].query and all("continue" in r.query for r in pages[1:])


def test_expired_continue_token_restarts_the_list(
    standin: KubeStandin, make_manager: MakeManager
) -> None:
    for i in range(1, 6):
        standin.add_node(
            f"node-{i}", f"10.244.{i}.0/24", peer_annotations(f"192.168.50.{i}", MAC_A)
        )
    done = threading.Event()

    def compact_between_pages(request: Request) -> None:
        if "continue" in request.query and not done.is_set():
            done.set()
            standin.set_pod_cidr("node-5", "10.244.55.0/24")
            standin.compact()

    standin.before_request = compact_between_pages
    manager = make_manager(node_name="node-1", page_size=2)
    with Watcher(manager) as w:
        assert len(w.calls) == 1
        assert w.subnets()["node-5"] == "10.244.55.0/24"
    # The first page, the refused continue, then all three pages again.
    assert len(lists(standin)) == 1 + 1 + 3


def test_two_nodes_claiming_one_cidr_keep_ours(
    standin: KubeStandin, make_manager: MakeManager
) -> None:
    standin.add_node("node-0", "10.244.1.0/24", peer_annotations("192.168.50.7", MAC_A))
    standin.add_node(OWN, "10.244.1.0/24")
    manager = make_manager()
    manager.acquire_lease(attrs(), None)
    with Watcher(manager) as w:
        assert w.subnets() == {OWN: "10.244.1.0/24"}


def test_watch_stops_quickly_while_idle(standin: KubeStandin, make_manager: MakeManager) -> None:
    standin.add_node(OWN, "10.244.1.0/24")
    manager = make_manager(watch_timeout=300)
    with Watcher(manager):
        wait_until(lambda: standin.active_watches == 1, 2.0, "the watch")
        time.sleep(0.3)
    # Watcher.__exit__ asserts the return within 1 s; the server saw the stream end.
    wait_until(lambda: standin.active_watches == 0, 2.0, "the stream to close")


# =============================================================================
# client configuration
# =============================================================================

KUBECONFIG = """
apiVersion: v1
kind: Config
clusters:
- name: c
  cluster: {{server: "{server}"}}
users:
- name: u
  user: {{token: "tok-123"}}
contexts:
- name: ctx
  context: {{cluster: c, user: u}}
current-context: ctx
"""


def _settings(netconf: Path, **kwargs: Any) -> AgentSettings:
    return AgentSettings(
        kube_subnet_mgr=True,
        net_config_path=str(netconf),
        node_name=OWN,
        startup_timeout=1.0,
        **kwargs,
    )


def test_kubeconfig_file_gives_server_and_token(
    standin: KubeStandin, netconf: Path, tmp_path: Path
) -> None:
    standin.add_node(OWN, "10.244.1.0/24")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG.format(server=standin.url))
    manager = KubeSubnetManager(_settings(netconf, kubeconfig_file=str(kubeconfig)), environ={})
    try:
        assert manager.own_vtep_mac() is None
    finally:
        manager.close()
    assert [r.authorization for r in standin.requests] == ["Bearer tok-123"]


def test_kube_api_url_overrides_the_kubeconfig_server(
    standin: KubeStandin, netconf: Path, tmp_path: Path
) -> None:
    standin.add_node(OWN, "10.244.1.0/24")
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(KUBECONFIG.format(server="http://127.0.0.1:9"))  # nothing there
    settings = _settings(netconf, kubeconfig_file=str(kubeconfig), kube_api_url=standin.url)
    manager = KubeSubnetManager(settings, environ={})
    try:
        manager.own_vtep_mac()
    finally:
        manager.close()
    assert [r.authorization for r in standin.requests] == ["Bearer tok-123"]


def test_kube_api_url_alone_sends_no_credentials(
    standin: KubeStandin, make_manager: MakeManager
) -> None:
    standin.add_node(OWN, "10.244.1.0/24")
    make_manager().own_vtep_mac()
    assert [r.authorization for r in standin.requests] == [None]


def test_client_configuration_errors(
    netconf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.delenv("KUBERNETES_SERVICE_PORT", raising=False)
    with pytest.raises(ConfigError, match="give --kubeconfig-file or --kube-api-url"):
        build_api_client(_settings(netconf))
    with pytest.raises(ConfigError, match=r"--kubeconfig-file .*missing: cannot load it"):
        build_api_client(_settings(netconf, kubeconfig_file=str(tmp_path / "missing")))
    with pytest.raises(ConfigError, match="--kube-api-url 'localhost:6443' is not a URL"):
        build_api_client(_settings(netconf, kube_api_url="localhost:6443"))


# =============================================================================
# RBAC
# =============================================================================


def test_rbac_rules_are_exactly_the_calls_made(
    standin: KubeStandin, make_manager: MakeManager
) -> None:
    import socket

    standin.add_node(OWN, "10.244.1.0/24")
    standin.add_node("node-b", "10.244.2.0/24", peer_annotations("192.168.50.2", MAC_A))
    standin.add_pod("kube-flannel", "ds-pod", OWN)
    manager = make_manager(
        node_name=socket.gethostname(),
        environ={"POD_NAME": "ds-pod", "POD_NAMESPACE": "kube-flannel"},
    )
    manager.own_vtep_mac()
    manager.node_public_ip()
    lease = manager.acquire_lease(attrs(), None)
    manager.renew_lease(lease)
    with Watcher(manager) as w:
        standin.delete_node("node-b")
        w.wait_subnets({OWN: "10.244.1.0/24"})
    # Events (flannelpy.store.kube.events) are exercised against the real API server,
    # in tests/e2e/test_kube_live_config.py; so is the status Lease (written by the
    # agent, not the manager, under the namespaced Role), in tests/e2e/test_kube_rollout.py.
    assert standin.rbac_usage() == {r for r in RBAC if r[0] != "events.k8s.io"}
    # No rule is in both scopes (a cluster-wide one would make the Role's moot).
    assert not {(g, r) for g, r, _ in NAMESPACED_RBAC_RULES} & {(g, r) for g, r, _ in RBAC}


def test_flanneld_s_condition_opt_out_and_a_prefix_with_slash_and_underscore(
    standin: KubeStandin, netconf: Path
) -> None:
    """--set-node-network-unavailable=false leaves NetworkUnavailable alone, as flanneld
    does; a prefix valid for Flannel (a slash, an underscore) names the annotations."""
    standin.add_node(OWN, "10.244.7.0/24")
    settings = AgentSettings(
        kube_subnet_mgr=True,
        kube_api_url=standin.url,
        net_config_path=str(netconf),
        node_name=OWN,
        startup_timeout=3.0,
        set_node_network_unavailable=False,
        kube_annotation_prefix="example.com/flannel_",
    )
    manager = KubeSubnetManager(settings, environ={}, watch_timeout=5)
    try:
        manager.acquire_lease(attrs(), None)
    finally:
        manager.close()
    node = standin.node(OWN)
    assert node is not None
    assert [c["type"] for c in node["status"]["conditions"]] == ["Ready"]
    notes = node["metadata"]["annotations"]
    assert notes["example.com/flannel_-public-ip"] == "192.168.50.1"
    assert notes["example.com/flannel_-kube-subnet-manager"] == "true"


def test_the_node_public_ip_annotation_wins_over_the_flag(
    standin: KubeStandin, netconf: Path, tmp_path: Path
) -> None:
    """flanneld: an annotated node-public-ip replaces --public-ip (main.go)."""
    from flannelpy.agent.compose import build_agent
    from flannelpy.store.open_store import KubeClusterStore
    from tests.support.agent_fakes import HostTouchingKernel

    standin.add_node(OWN, "10.244.7.0/24", annotations={P + "node-public-ip": "198.51.100.4"})
    settings = AgentSettings(
        kube_subnet_mgr=True,
        kube_api_url=standin.url,
        net_config_path=str(netconf),
        node_name=OWN,
        startup_timeout=3.0,
        public_ip=IPv4Address("192.0.2.9"),
        state_dir=str(tmp_path / "state"),
        run_dir=str(tmp_path / "run"),
        subnet_file=str(tmp_path / "subnet.env"),
    )
    manager = KubeSubnetManager(settings, environ={}, watch_timeout=5)
    try:
        agent = build_agent(settings, KubeClusterStore(manager), HostTouchingKernel())
        assert agent.parts.ctx.public_ip == IPv4Address("198.51.100.4")
    finally:
        manager.close()
