"""CniHandler without a kernel: real IPAM and records on disk, a recording fake PodNetwork."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from ipaddress import (
    IPv4Address,
    IPv4Interface,
    IPv4Network,
    IPv6Address,
    IPv6Interface,
)
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from flannelpy.cni.context import CniSettings, Deferred, KeyLocks
from flannelpy.cni.handler import CniHandler
from flannelpy.cni.records import Record, RecordStore
from flannelpy.cni.spec import CniError, Code
from flannelpy.dataplane.podnames import IPInterface, PodRoute, gateway_of, host_veth_name
from flannelpy.dataplane.podnet import LinkInfo, NetnsMissing, PodLink
from flannelpy.errors import DataplaneError, StoreError
from flannelpy.ipam import NodeIpam
from flannelpy.ipam.hostlocal import HostLocalEntry
from tests.support.waiting import wait_until

SUBNET = IPv4Network("10.244.1.0/24")
POD_NS = "/run/netns/pod1"
NETWORK = "fpnet"


@dataclass
class FakePods:
    """PodNetwork's surface, recording calls; links live in ``veths`` (host name → netns)."""

    veths: dict[str, str] = field(default_factory=dict)
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    bridges: dict[str, set[IPv4Interface]] = field(default_factory=dict)
    fail: dict[str, BaseException] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    options: list[tuple[bool, str | None, list[str]]] = field(default_factory=list)
    host_macs: dict[str, str] = field(default_factory=dict)  # host veth -> the MAC it got

    def _maybe_fail(self, name: str) -> None:
        if name in self.fail:
            raise self.fail[name]

    def ensure_bridge(self, gateways: list[IPv4Interface], mtu: int, bridge: str = "cni0") -> int:
        self._maybe_fail("ensure_bridge")
        self.bridges.setdefault(bridge, set()).update(gateways)
        return 7

    def add_pod(
        self,
        netns: str,
        ifname: str,
        host_veth: str,
        bridge_index: int,
        addresses: Sequence[IPInterface],
        routes: Sequence[PodRoute],
        mtu: int,
        hairpin: bool = True,
        owner: str | None = None,
        netns_fd: int | None = None,
        host_mac: str | None = None,
    ) -> PodLink:
        # Addresses and the gateways routes use, comma-joined: one family reads as before.
        gateways = ",".join(dict.fromkeys(str(gw) for _, gw in routes))
        shown = ",".join(str(a) for a in addresses)
        self.calls.append(("add_pod", netns, ifname, host_veth, shown, gateways, mtu))
        self.options.append((hairpin, owner, [str(dst) for dst, _ in routes]))
        self._maybe_fail("add_pod")
        self.veths[host_veth] = netns
        self.host_macs[host_veth] = host_mac or "02:00:00:00:00:01"
        return PodLink(host_veth, self.host_macs[host_veth], ifname, "0a:58:0a:f4:01:02")

    def delete_host_veth(self, host_veth: str, owner: str | None = None) -> None:
        self.calls.append(("delete_host_veth", host_veth))
        self._maybe_fail("delete_host_veth")
        self.veths.pop(host_veth, None)

    def start_delete_host_veth(self, host_veth: str, owner: str | None = None) -> Any:
        """The veth leaves at once; the kernel's answer comes when the caller waits."""
        self.calls.append(("delete_host_veth", host_veth))
        self._maybe_fail("delete_host_veth")
        self.veths.pop(host_veth, None)

        def answer() -> None:
            self.calls.append(("veth answer", host_veth))
            self._maybe_fail("veth answer")

        return answer

    def delete_in_netns(self, netns: str, ifname: str, netns_fd: int | None = None) -> None:
        self.calls.append(("delete_in_netns", netns, ifname))
        for name, ns in list(self.veths.items()):
            if ns == netns:
                del self.veths[name]

    def link(self, name: str) -> LinkInfo | None:
        if name not in self.veths:
            return None
        return LinkInfo(3, name, True, 1400, "02:00:00:00:00:01", "veth", 7)

    def check_pod(self, *args: object, netns_fd: int | None = None) -> list[str]:
        self.calls.append(("check_pod", *args))
        self._maybe_fail("check_pod")
        return list(self.problems)


@dataclass
class Env:
    handler: CniHandler
    ipam: NodeIpam
    records: RecordStore
    pods: FakePods
    namespaces: set[str]
    state: dict[str, Any]

    def call(
        self,
        command: str,
        cid: str = "c1",
        netns: str = POD_NS,
        ifname: str = "eth0",
        defer: Deferred | None = None,
        **config: Any,
    ) -> tuple[int, Any]:
        env = {
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": cid,
            "CNI_NETNS": netns,
            "CNI_IFNAME": ifname,
            "CNI_PATH": "/opt/cni/bin",
        }
        doc = {"cniVersion": "1.1.0", "name": NETWORK, "type": "flannelpy", **config}
        code, out = self.handler.handle(env, json.dumps(doc).encode(), defer=defer)
        return code, (json.loads(out) if out else None)


def make_env(directory: str, subnet: IPv4Network = SUBNET) -> Env:
    ipam = NodeIpam(os.path.join(directory, "ipam"), fsync=False)
    ipam.set_leases([subnet])
    records = RecordStore(os.path.join(directory, "records"))
    pods = FakePods()
    namespaces = {POD_NS, "/run/netns/pod2"}
    state: dict[str, Any] = {"ready": True, "mtu": 1400}
    cni = CniSettings(mtu_provider=lambda: state["mtu"], ready=lambda: bool(state["ready"]))

    def open_netns(path: str) -> int:
        # Stands in for a namespace: the handler only hands the fd on (and closes it).
        if path not in namespaces:
            raise FileNotFoundError(2, "No such file or directory")
        return os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    handler = CniHandler(
        ipam,
        pods,  # type: ignore[arg-type]
        records,
        cni,
        open_netns=open_netns,
        require_netns=lambda fd: None,
    )
    return Env(handler, ipam, records, pods, namespaces, state)


@pytest.fixture
def env(tmp_path: Any) -> Iterator[Env]:
    e = make_env(str(tmp_path))
    try:
        yield e
    finally:
        e.ipam.close()


def attachments(e: Env) -> tuple[list[Any], list[Any], dict[str, str]]:
    return e.ipam.allocations(), e.records.list(), dict(e.pods.veths)


# --- ADD ------------------------------------------------------------------------------


def test_add_allocates_plumbs_and_records(env: Env) -> None:
    code, result = env.call("ADD")
    assert code == 0
    host = host_veth_name(POD_NS, "c1", "eth0")
    # The MAC ADD chose before the veth existed (its record was on its way to disk) is
    # the one the host end got: a unicast, locally administered one.
    host_mac = env.pods.host_macs[host]
    assert int(host_mac[:2], 16) & 0b11 == 0b10
    assert result == {
        "cniVersion": "1.1.0",
        "interfaces": [
            {"name": host, "mac": host_mac},
            {"name": "eth0", "mac": "0a:58:0a:f4:01:02", "sandbox": POD_NS},
        ],
        "ips": [{"interface": 1, "address": "10.244.1.2/24", "gateway": "10.244.1.1"}],
        "routes": [{"dst": "0.0.0.0/0", "gw": "10.244.1.1"}],
        "dns": {},
    }
    assert env.pods.calls == [
        ("add_pod", POD_NS, "eth0", host, "10.244.1.2/24", "10.244.1.1", 1400)
    ]
    assert env.pods.bridges == {"cni0": {IPv4Interface("10.244.1.1/24")}}
    record = env.records.read(NETWORK, "c1", "eth0")
    assert record is not None and record.host_veth == host and record.netns == POD_NS
    assert record.address == IPv4Interface("10.244.1.2/24")


def test_add_uses_the_configured_bridge_and_passes_dns_through(env: Env) -> None:
    dns = {"nameservers": ["10.96.0.10"]}
    code, result = env.call("ADD", bridge="cbr9", dns=dns)
    assert code == 0 and result["dns"] == dns
    assert set(env.pods.bridges) == {"cbr9"}


def test_add_twice_is_idempotent_and_renders_the_requested_version(env: Env) -> None:
    _, first = env.call("ADD")
    code, again = env.call("ADD", cniVersion="0.4.0")
    assert code == 0
    assert again["cniVersion"] == "0.4.0"
    assert again["ips"] == [{"version": "4", **first["ips"][0]}]
    assert [c[0] for c in env.pods.calls] == ["add_pod"]


def test_add_rebuilds_a_vanished_veth_with_the_same_address(env: Env) -> None:
    _, first = env.call("ADD")
    env.pods.veths.clear()
    code, second = env.call("ADD")
    assert code == 0 and second["ips"] == first["ips"]
    assert [c[0] for c in env.pods.calls] == ["add_pod", "delete_host_veth", "add_pod"]


def test_add_in_a_new_namespace_replaces_the_old_attachment(env: Env) -> None:
    env.call("ADD")
    code, second = env.call("ADD", netns="/run/netns/pod2")
    assert code == 0 and second["interfaces"][1]["sandbox"] == "/run/netns/pod2"
    assert list(env.pods.veths.values()) == ["/run/netns/pod2"]


@pytest.mark.parametrize(
    ("step", "error", "code"),
    [
        ("ensure_bridge", DataplaneError("bridge broke"), 999),
        ("add_pod", DataplaneError("veth broke"), 999),
        ("add_pod", NetnsMissing("namespace went away"), 4),
    ],
)
def test_a_failed_add_undoes_its_steps(env: Env, step: str, error: Exception, code: int) -> None:
    env.pods.fail[step] = error
    status, err = env.call("ADD")
    assert status == 1 and err["code"] == code and err["msg"] == str(error)
    assert attachments(env) == ([], [], {})


@pytest.mark.parametrize("step", ["stage", "publish"])
def test_a_record_that_cannot_be_written_undoes_the_veth_and_address(
    env: Env, monkeypatch: pytest.MonkeyPatch, step: str
) -> None:
    def full(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(env.records, step, full)
    status, err = env.call("ADD")
    assert status == 1 and err["code"] == 5 and "No space left" in err["msg"]
    assert attachments(env) == ([], [], {})
    assert env.pods.calls[-1] == ("delete_host_veth", host_veth_name(POD_NS, "c1", "eth0"))


def test_the_record_is_published_only_once_the_address_is_durable(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The record's content is written beside IPAM's batch, but it appears (is renamed
    into place) only after the batch: never a durable record naming an address that a
    power cut could take back. A batch that fails leaves no record and no temp file."""
    from flannelpy.ipam import store as ipam_store

    order: list[str] = []
    real_commit, real_publish = ipam_store.IpamStore.commit, env.records.publish

    def commit(store: ipam_store.IpamStore, ticket: int) -> None:
        real_commit(store, ticket)
        order.append("address durable")

    def publish(staged: Any) -> None:
        order.append("record published")
        real_publish(staged)

    monkeypatch.setattr(ipam_store.IpamStore, "commit", commit)
    monkeypatch.setattr(env.records, "publish", publish)
    assert env.call("ADD")[0] == 0
    assert order == ["address durable", "record published"]

    def failing(store: ipam_store.IpamStore, ticket: int) -> None:
        raise StoreError("cannot write IPAM state file: No space left on device")

    monkeypatch.setattr(ipam_store.IpamStore, "commit", failing)
    status, err = env.call("ADD", cid="c2")
    assert status == 1 and "No space left" in err["msg"]
    assert not env.records.present(NETWORK, "c2", "eth0")
    folder = os.path.dirname(env.records.path(NETWORK, "c2", "eth0"))
    assert [n for n in os.listdir(folder) if n.endswith(".tmp")] == []


def test_a_failure_before_the_record_writer_still_writes_ipams_batch(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ADD that fails after its allocation but before the worker that commits it has
    started leaves IPAM's directory unlocked, its batch written (the release undone)."""
    from flannelpy.cni import add as add_module

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("rendering broke")

    monkeypatch.setattr(add_module, "build_result", broken)
    status, err = env.call("ADD")
    assert status == 1 and "rendering broke" in err["msg"]
    assert env.ipam.find("c1", "eth0") is None
    lock = os.open(os.path.join(env.ipam._store.directory, "lock"), os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # raises if IPAM still held it
    finally:
        os.close(lock)


def test_a_failed_retry_keeps_the_address_it_did_not_acquire(env: Env) -> None:
    _, first = env.call("ADD")
    env.pods.veths.clear()
    env.pods.fail["add_pod"] = DataplaneError("veth broke")
    assert env.call("ADD")[0] == 1
    assert [str(a.interface) for a in env.ipam.allocations()] == [first["ips"][0]["address"]]


def test_exhaustion_is_code_100_with_the_exact_sentence(tmp_path: Any) -> None:
    e = make_env(str(tmp_path), IPv4Network("10.244.9.0/30"))  # one pod address: .2
    try:
        assert e.call("ADD", cid="a")[0] == 0
        assert e.call("DEL", cid="a")[0] == 0
        status, err = e.call("ADD", cid="b")
        assert status == 1 and err["code"] == 100
        assert err["msg"] == (
            "no free address in 10.244.9.0/30: 0 assigned, 1 cooling down (next free in 30 s)"
        )
        assert "ipWaitSeconds" in err["details"]
        assert e.records.list() == [] and e.ipam.find("b", "eth0") is None
        assert e.call("ADD", cid="b", ipCooldownSeconds=0)[0] == 0
    finally:
        e.ipam.close()


@pytest.mark.parametrize(
    ("config", "code"),
    [
        ({"ipCooldownSeconds": -1}, 7),
        ({"ipCooldownSeconds": True}, 7),
        ({"ipCooldownSeconds": "30"}, 7),
        ({"ipWaitSeconds": 301}, 7),
        ({"bridge": ""}, 7),
        ({"bridge": "a-very-long-bridge"}, 7),
        ({"bridge": "br 0"}, 7),
        ({"bridge": 5}, 7),
    ],
)
def test_bad_settings_in_the_config_are_refused(
    env: Env, config: dict[str, Any], code: int
) -> None:
    status, err = env.call("ADD", **config)
    assert status == 1 and err["code"] == code and err["msg"]
    assert attachments(env) == ([], [], {})


def test_add_before_the_agent_is_ready_says_try_again(env: Env) -> None:
    env.state["ready"] = False
    assert env.call("ADD")[1]["code"] == 11
    env.state["ready"] = True
    env.state["mtu"] = None
    assert env.call("ADD")[1]["code"] == 11
    assert attachments(env) == ([], [], {})


def test_add_needs_an_existing_namespace(env: Env) -> None:
    status, err = env.call("ADD", netns="/run/netns/gone")
    assert status == 1 and err["code"] == 4 and "/run/netns/gone" in err["msg"]


def test_bridge_gets_the_gateway_of_every_lease(tmp_path: Any) -> None:
    e = make_env(str(tmp_path))
    try:
        second = IPv4Network("10.244.7.0/24")
        e.ipam.set_leases([SUBNET, second])
        e.call("ADD")
        assert e.pods.bridges["cni0"] == {gateway_of(SUBNET), gateway_of(second)}
    finally:
        e.ipam.close()


# --- DEL --------------------------------------------------------------------------------


def test_del_uses_the_record_and_is_idempotent(env: Env) -> None:
    env.call("ADD")
    env.namespaces.clear()  # DEL works without the namespace
    assert env.call("DEL", ifname="eth0", bridge="other") == (0, None)
    assert attachments(env) == ([], [], {})
    veth = host_veth_name(POD_NS, "c1", "eth0")
    assert env.pods.calls[-2:] == [("delete_host_veth", veth), ("veth answer", veth)]
    assert env.call("DEL") == (0, None)
    assert env.call("DEL", netns="") == (0, None)


def test_del_without_a_record_releases_and_cleans_the_namespace(env: Env) -> None:
    env.call("ADD")
    env.records.delete(NETWORK, "c1", "eth0")
    assert env.call("DEL") == (0, None)
    assert env.pods.calls[-1] == ("delete_in_netns", POD_NS, "eth0")
    assert attachments(env) == ([], [], {})


def test_del_with_an_unreadable_record_still_cleans_up(env: Env) -> None:
    env.call("ADD")
    with open(env.records.path(NETWORK, "c1", "eth0"), "w") as f:
        f.write("{not json")
    assert env.call("DEL") == (0, None)
    assert env.ipam.allocations() == []
    assert not os.path.exists(env.records.path(NETWORK, "c1", "eth0"))


def test_del_that_cannot_remove_the_veth_keeps_the_address_for_a_retry(env: Env) -> None:
    env.call("ADD")
    env.pods.fail["delete_host_veth"] = DataplaneError("cannot delete veth: busy")
    status, err = env.call("DEL")
    assert status == 1 and err["code"] == 999
    assert len(env.ipam.allocations()) == 1 and len(env.records.list()) == 1
    del env.pods.fail["delete_host_veth"]
    assert env.call("DEL") == (0, None)
    assert attachments(env) == ([], [], {})


def test_a_deferred_del_answers_once_the_veth_is_gone_and_releases_after_under_the_lock(
    env: Env,
) -> None:
    _, added = env.call("ADD")
    deferred: Deferred = []
    assert env.call("DEL", defer=deferred) == (0, None)
    # Answered: the veth is gone; the address and the record wait, the key locked.
    assert env.pods.veths == {}
    assert [str(a.ip) for a in env.ipam.allocations()] == [added["ips"][0]["address"][:-3]]
    assert [r.container_id for r in env.records.list()] == ["c1"]
    assert env.handler.locks.held(("c1", "eth0"))
    veth = host_veth_name(POD_NS, "c1", "eth0")
    assert env.pods.calls[-1] == ("delete_host_veth", veth)
    assert len(deferred) == 1
    deferred[0]()
    # The kernel's answer to the deletion is awaited before the address is released.
    assert env.pods.calls[-1] == ("veth answer", veth)
    assert attachments(env) == ([], [], {})
    assert not env.handler.locks.held(("c1", "eth0"))
    # Nothing else waits: a DEL that finds nothing defers only the (idempotent) rest.
    again: Deferred = []
    assert env.call("DEL", defer=again) == (0, None)
    for work in again:
        work()
    assert attachments(env) == ([], [], {})


def test_an_add_for_the_same_attachment_waits_for_the_deferred_release(env: Env) -> None:
    _, first = env.call("ADD")
    deferred: Deferred = []
    assert env.call("DEL", defer=deferred) == (0, None)
    result: list[tuple[int, Any]] = []
    adder = threading.Thread(target=lambda: result.append(env.call("ADD")))
    adder.start()
    # The ADD has counted itself a user of the key: it waits on the lock DEL still holds.
    locks = env.handler.locks._locks
    wait_until(lambda: locks[("c1", "eth0")][1] == 2, 5.0, "the ADD at the lock")
    assert result == [] and env.pods.veths == {}
    deferred[0]()
    adder.join(5)
    ((code, again),) = result
    assert code == 0
    # A new attachment, not the old record's answer, and the old address in cooldown.
    assert again["ips"][0]["address"] != first["ips"][0]["address"]
    assert [a.container_id for a in env.ipam.allocations()] == ["c1"]
    assert list(env.pods.veths) == [host_veth_name(POD_NS, "c1", "eth0")]


def test_a_veth_deletion_the_kernel_fails_late_keeps_the_address(env: Env) -> None:
    env.call("ADD")
    deferred: Deferred = []
    assert env.call("DEL", defer=deferred) == (0, None)
    env.pods.fail["veth answer"] = DataplaneError("cannot delete veth: busy")
    with pytest.raises(CniError):
        deferred[0]()
    assert len(env.ipam.allocations()) == 1 and len(env.records.list()) == 1
    assert not env.handler.locks.held(("c1", "eth0"))


def test_an_agent_killed_before_the_deferred_release_releases_at_start(tmp_path: Any) -> None:
    before = make_env(str(tmp_path))
    _, added = before.call("ADD")
    assert before.call("DEL", defer=[]) == (0, None)  # the work is never run: killed
    before.ipam.close()
    after = make_env(str(tmp_path))  # the restart: the same state, the veth gone
    try:
        assert [a.container_id for a in after.ipam.allocations()] == ["c1"]
        assert after.handler.gc_dead() == [("c1", "eth0")]
        assert attachments(after) == ([], [], {})
        # In cooldown, not handed out again.
        _, fresh = after.call("ADD", cid="c2")
        assert fresh["ips"][0]["address"] != added["ips"][0]["address"]
    finally:
        after.ipam.close()


def test_a_deferred_release_that_fails_still_unlocks_and_keeps_the_address(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    env.call("ADD")
    deferred: Deferred = []
    assert env.call("DEL", defer=deferred) == (0, None)

    def broken(container_id: str, ifname: str) -> None:
        raise StoreError("cannot write IPAM state file: No space left on device")

    monkeypatch.setattr(env.ipam, "release", broken)
    with pytest.raises(CniError) as raised:
        deferred[0]()
    assert raised.value.code == Code.IO_FAILURE and "No space left" in raised.value.msg
    assert not env.handler.locks.held(("c1", "eth0"))
    # The record still explains the address: a GC releases both, nothing is lost.
    assert [r.container_id for r in env.records.list()] == ["c1"]
    monkeypatch.undo()
    assert env.handler.gc_dead() == [("c1", "eth0")]
    assert attachments(env) == ([], [], {})


# --- CHECK, STATUS, VERSION -------------------------------------------------------------


def test_check(env: Env) -> None:
    assert env.call("CHECK")[1]["code"] == 3
    env.call("ADD")
    assert env.call("CHECK") == (0, None)
    env.pods.problems = ["eth0 lacks address 10.244.1.2/24 in /run/netns/pod1"]
    status, err = env.call("CHECK")
    assert status == 1 and err["code"] == 999 and err["msg"] == env.pods.problems[0]
    env.pods.problems = []
    env.ipam.release("c1", "eth0")
    assert "IPAM no longer assigns 10.244.1.2/24" in env.call("CHECK")[1]["msg"]
    assert env.call("CHECK", cniVersion="0.3.1")[1]["code"] == 1


def _flannel_cni_result(address: str, host_veth: str = "veth1a2b3c4d") -> dict[str, Any]:
    """What Flannel's CNI plugin (the reference bridge and host-local) returned at ADD:
    the runtime hands it back as prevResult on CHECK."""
    return {
        "cniVersion": "1.0.0",
        "interfaces": [
            {"name": "cni0", "mac": "02:00:00:00:00:aa"},
            {"name": host_veth, "mac": "02:00:00:00:00:bb"},
            {"name": "eth0", "mac": "02:00:00:00:00:cc", "sandbox": POD_NS},
        ],
        "ips": [{"interface": 2, "address": address, "gateway": "10.244.1.1"}],
        "routes": [{"dst": "0.0.0.0/0", "gw": "10.244.1.1"}],
    }


def test_check_of_a_pod_attached_before_the_take_over_checks_its_held_address(
    env: Env,
) -> None:
    """A pod Flannel's plugin attached has no record of ours; its address is held from
    host-local's data. Before: CHECK answered UNKNOWN_CONTAINER (3) for a live pod."""
    env.ipam.hold_foreign([HostLocalEntry(IPv4Address("10.244.1.7"), "old-pod", "eth0")])
    prev = _flannel_cni_result("10.244.1.7/24")
    assert env.call("CHECK", cid="old-pod", prevResult=prev) == (0, None)
    (call,) = [c for c in env.pods.calls if c[0] == "check_pod"]
    assert call[1:7] == (
        POD_NS,
        "eth0",
        "veth1a2b3c4d",
        "cni0",
        [IPv4Interface("10.244.1.7/24")],
        [(IPv4Network("0.0.0.0/0"), IPv4Address("10.244.1.1"))],
    )
    # What is broken is reported as for our own pods.
    env.pods.problems = ["host veth veth1a2b3c4d does not exist"]
    status, err = env.call("CHECK", cid="old-pod", prevResult=prev)
    assert (status, err["code"], err["msg"]) == (1, 999, env.pods.problems[0])
    env.pods.problems = []
    status, err = env.call("CHECK", cid="old-pod", prevResult=_flannel_cni_result("10.244.1.9/24"))
    assert status == 1
    assert "prevResult names 10.244.1.9/24, but IPAM holds 10.244.1.7/24" in err["msg"]
    status, err = env.call("CHECK", cid="old-pod", netns="/run/netns/pod2", prevResult=prev)
    assert status == 1 and f"made in {POD_NS}, not /run/netns/pod2" in err["msg"]
    status, err = env.call("CHECK", cid="old-pod")
    assert status == 1 and err["code"] == 999 and "no prevResult" in err["msg"]
    # A container neither we nor host-local know is still unknown.
    assert env.call("CHECK", cid="stranger", prevResult=prev)[1]["code"] == 3


def test_status_and_version(env: Env) -> None:
    assert env.call("STATUS") == (0, None)
    env.state["ready"] = False
    status, err = env.call("STATUS")
    assert status == 1 and err["code"] == 50
    code, out = env.call("VERSION", cniVersion="0.4.0")
    assert code == 0 and out["cniVersion"] == "0.4.0" and "1.1.0" in out["supportedVersions"]


# --- GC -------------------------------------------------------------------------------


def test_gc_keeps_listed_attachments_and_other_networks(env: Env) -> None:
    env.call("ADD", cid="keep")
    env.call("ADD", cid="drop", netns="/run/netns/pod2")
    env.call("ADD", cid="other", ifname="net1", name="othernet")
    env.ipam.allocate("orphan", "eth0")  # an ADD that died before its record
    config: dict[str, Any] = {
        "cni.dev/valid-attachments": [{"containerID": "keep", "ifname": "eth0"}]
    }
    assert env.call("GC", **config) == (0, None)
    assert sorted(a.container_id for a in env.ipam.allocations()) == ["keep", "other"]
    assert sorted(r.container_id for r in env.records.list()) == ["keep", "other"]
    assert host_veth_name("/run/netns/pod2", "drop", "eth0") not in env.pods.veths


@pytest.mark.parametrize("valid", [None, "keep", [{"containerID": "keep"}], [1]])
def test_gc_without_a_usable_valid_list_deletes_nothing(env: Env, valid: Any) -> None:
    env.call("ADD")
    config: dict[str, Any] = {} if valid is None else {"cni.dev/valid-attachments": valid}
    status, err = env.call("GC", **config)
    assert status == 1 and err["code"] == 7
    assert len(env.ipam.allocations()) == 1


def test_gc_dead(env: Env) -> None:
    env.call("ADD", cid="alive")
    env.call("ADD", cid="dead", netns="/run/netns/pod2")
    env.ipam.allocate("orphan", "eth0")
    released = env.handler.gc_dead(exists=lambda path: path == POD_NS)
    assert sorted(released) == [("dead", "eth0"), ("orphan", "eth0")]
    assert [a.container_id for a in env.ipam.allocations()] == ["alive"]
    assert [r.container_id for r in env.records.list()] == ["alive"]


def test_gc_dead_by_default_judges_a_pod_by_its_host_veth(env: Env) -> None:
    # Not by its CNI_NETNS path, which the agent's mount namespace may not show.
    env.call("ADD", cid="alive")
    env.call("ADD", cid="dead", netns="/run/netns/pod2")
    (dead,) = [r.host_veth for r in env.records.list() if r.container_id == "dead"]
    del env.pods.veths[dead]  # the kernel deleted it with the pod's namespace
    assert env.handler.gc_dead() == [("dead", "eth0")]
    assert [r.container_id for r in env.records.list()] == ["alive"]


@pytest.mark.parametrize("content", [b'{"network": "fpnet", "contai', b"\xff\xfe", b"[]"])
def test_an_unreadable_record_keeps_its_address_through_gc(
    env: Env, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    # A torn, garbled or foreign file: its pod may be alive, so nothing is released.
    env.call("ADD")
    path = env.records.path(NETWORK, "c1", "eth0")
    with open(path, "wb") as f:
        f.write(content)
    assert env.handler.gc_dead(exists=lambda path: True) == []
    assert [a.container_id for a in env.ipam.allocations()] == ["c1"]
    assert os.path.exists(path) and [p for p, _ in env.records.unreadable()] == [path]
    assert "address is kept" in caplog.text and path in caplog.text
    valid = {"cni.dev/valid-attachments": []}  # the runtime's GC keeps it as well
    assert env.call("GC", **valid) == (0, None)
    assert [a.container_id for a in env.ipam.allocations()] == ["c1"]
    assert env.call("DEL") == (0, None)  # only a DEL for that key releases it
    assert env.ipam.allocations() == [] and not os.path.exists(path)


def test_hairpin_and_default_gateway_follow_the_conflist(env: Env) -> None:
    code, result = env.call("ADD")
    assert code == 0 and result["routes"] == [{"dst": "0.0.0.0/0", "gw": "10.244.1.1"}]
    assert env.pods.options[-1][0] is True and env.pods.options[-1][2] == ["0.0.0.0/0"]
    owner = env.pods.options[-1][1]
    assert owner and owner.startswith("flannelpy ")
    env.handler.settings = CniSettings(
        mtu_provider=lambda: 1400, cluster_networks=lambda: [IPv4Network("10.244.0.0/16")]
    )
    code, result = env.call("ADD", cid="c2", hairpinMode=False, isDefaultGateway=False)
    assert code == 0, result
    assert result["routes"] == [{"dst": "10.244.0.0/16", "gw": "10.244.1.1"}]
    assert env.pods.options[-1][0] is False and env.pods.options[-1][2] == ["10.244.0.0/16"]


@pytest.mark.parametrize("key", ["hairpinMode", "isDefaultGateway"])
def test_plumbing_flags_must_be_booleans(env: Env, key: str) -> None:
    code, err = env.call("ADD", **{key: "yes"})
    assert code == 1 and err["code"] == 7 and key in err["msg"]
    assert attachments(env) == ([], [], {})


def test_no_default_gateway_waits_for_the_cluster_network(env: Env) -> None:
    code, err = env.call("ADD", isDefaultGateway=False)
    assert code == 1 and err["code"] == 11
    assert attachments(env) == ([], [], {})


# --- building blocks ----------------------------------------------------------------------


def test_key_locks_serialise_one_key_and_not_others() -> None:
    locks = KeyLocks()
    inside = threading.Event()
    release = threading.Event()
    order: list[str] = []

    def holder() -> None:
        with locks.hold(("c1", "eth0")):
            inside.set()
            release.wait(5)
            order.append("first")

    def waiter() -> None:
        with locks.hold(("c1", "eth0")):
            order.append("second")

    t1 = threading.Thread(target=holder)
    t1.start()
    inside.wait(5)
    t2 = threading.Thread(target=waiter)
    t2.start()
    with locks.hold(("c2", "eth0")):  # another key is free meanwhile
        order.append("other")
    # The waiter has counted itself a user of the key: it waits on the held lock.
    wait_until(lambda: locks._locks[("c1", "eth0")][1] == 2, 5.0, "the waiter at the lock")
    release.set()
    t1.join(5)
    t2.join(5)
    assert order == ["other", "first", "second"]
    assert locks._locks == {}


def test_record_round_trip_and_validation(tmp_path: Any) -> None:
    store = RecordStore(str(tmp_path))
    record = Record(
        network=NETWORK,
        container_id="abc.1-x_y",
        ifname="net@1",
        netns=POD_NS,
        host_veth="veth12345678",
        bridge="cni0",
        addresses=(IPv4Interface("10.244.1.9/24"), IPv6Interface("fc00:0:0:1::9/64")),
        gateways=(IPv4Address("10.244.1.1"), IPv6Address("fc00:0:0:1::1")),
        result={"cniVersion": "1.1.0"},
    )
    store.write(record)
    assert store.read(NETWORK, "abc.1-x_y", "net@1") == record
    assert store.list() == [record] and store.list("othernet") == []
    assert os.stat(store.path(*record.key)).st_mode & 0o777 == 0o600
    for bad in [("../x", "c", "eth0"), (NETWORK, "../c", "eth0"), (NETWORK, "c", "a/b")]:
        with pytest.raises(ValueError):
            store.path(*bad)
    # A record written before dual stack (one IPv4 address) still reads.
    old = {k: v for k, v in record.to_doc().items() if k not in ("addresses", "gateways")}
    assert Record.from_doc(old).addresses == (IPv4Interface("10.244.1.9/24"),)
    with pytest.raises(ValueError, match="lacks gateway, result"):
        Record.from_doc(
            {k: v for k, v in record.to_doc().items() if k not in ("gateway", "result")}
        )
    assert store.delete(*record.key) and not store.delete(*record.key)


# --- anything goes in, a spec answer comes out, and a refusal changes nothing -------------

# Valid values are listed several times so that many examples get past the first check.
_names = st.sampled_from(["c1"] * 20 + ["", "../x", "a" * 300, "c 1", "c1;rm", "ÿ"])
_ifnames = st.sampled_from(["eth0"] * 20 + ["", "e" * 16, "a/b", "a:b", ".", "..", "eth 0"])
_netns = st.sampled_from([POD_NS] * 12 + ["", "/run/netns/gone", "../../etc"])
_commands = st.sampled_from(["ADD"] * 4 + ["DEL", "CHECK", "GC", "STATUS", "VERSION", "", "X"])
_json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner),
    max_leaves=8,
)


def _mostly(valid: list[Any], other: list[Any]) -> st.SearchStrategy[Any]:
    return st.sampled_from(valid * 6 + other) | _json_values


_configs = st.builds(
    lambda base, extra: {**base, **extra},
    st.fixed_dictionaries(
        {
            "cniVersion": _mostly(["1.1.0", "1.0.0", "0.3.1"], ["0.2.0", "", "x"]),
            "name": _mostly([NETWORK], ["", "../up", "a/b"]),
            "type": _mostly(["flannelpy"], [""]),
        },
    ),
    st.fixed_dictionaries(
        {},
        optional={
            "bridge": _mostly(["cni0"], ["", "x" * 20, "a b"]),
            "ipCooldownSeconds": _mostly([0, 30, 2.5], [-1, "30"]),
            "ipWaitSeconds": _mostly([0, 1], [-1, 1e9]),
            "prevResult": _json_values,
            "dns": _json_values,
            "cni.dev/valid-attachments": _json_values,
        },
    ),
)
_stdin = (
    _configs.map(lambda d: json.dumps(d).encode())
    | st.binary(max_size=64)
    | st.sampled_from([b"", b"{", b"[]", b"null", b'{"cniVersion": 1}', b"\xff\xfe"])
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    command=_commands,
    cid=_names,
    ifname=_ifnames,
    netns=_netns,
    stdin=_stdin,
    args=st.sampled_from([""] * 6 + ["K=V", "K=V;A=B", "bad", "K=V=W", ";"]),
)
def test_fuzzed_requests_get_a_spec_answer_and_refusals_change_nothing(
    command: str, cid: str, ifname: str, netns: str, stdin: bytes, args: str
) -> None:
    directory = tempfile.mkdtemp(prefix="fpcnifuzz")
    e = make_env(directory)
    try:
        env = {
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": cid,
            "CNI_NETNS": netns,
            "CNI_IFNAME": ifname,
            "CNI_PATH": "/opt/cni/bin",
            "CNI_ARGS": args,
        }
        code, out = e.handler.handle(env, stdin)
        assert code in (0, 1)
        if code == 1:
            err = json.loads(out)
            assert isinstance(err["code"], int) and err["code"] != 999, err
            assert isinstance(err["msg"], str) and err["msg"]
            assert attachments(e) == ([], [], {})
            assert e.pods.calls == [] and e.pods.bridges == {}
        elif command in ("ADD", "VERSION"):
            assert isinstance(json.loads(out), dict)
        else:
            assert out == b""
    finally:
        e.ipam.close()
        shutil.rmtree(directory, ignore_errors=True)
