"""build_agent refuses what it can before the host changes; open_store chooses once."""

from __future__ import annotations

import json
import subprocess
import sys
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path

import pytest

from flannelpy.agent.compose import build_agent
from flannelpy.agent.events import TICK_FIREWALL
from flannelpy.agent.firewall_sync import firewall_factory
from flannelpy.dataplane.firewall import SyncResult
from flannelpy.dataplane.kernel import ForeignRoute
from flannelpy.errors import ConfigError, DataplaneError
from flannelpy.observe.metrics import AgentMetrics
from flannelpy.store.etcd.config import put_network_config
from flannelpy.store.etcd.kv import FakeStore
from flannelpy.store.etcd.manager import EtcdSubnetManager
from flannelpy.store.open_store import ClusterStore, EtcdClusterStore
from flannelpy.subnet.keys import lease_key
from flannelpy.subnet.lease import LeaseAttrs
from tests.support.agent_fakes import PREFIX, AgentHarness, HostTouchingKernel, agent_settings


def opened(store: FakeStore, tmp: Path) -> ClusterStore:
    settings = agent_settings(tmp)
    return EtcdClusterStore(settings, store, EtcdSubnetManager(store, settings))


@pytest.mark.parametrize(
    ("doc", "says", "reads"),
    [
        # IPv6-only needs an interface with a global IPv6 address.
        (
            {"EnableIPv4": False, "EnableIPv6": True, "IPv6Network": "fd00::/56"},
            "no global IPv6 address",
            ["find_underlay"],
        ),
        # Dual stack needs an IPv6 underlay address: none on the interface, none given
        # (found by reading the interfaces, which changes nothing).
        (
            {"Network": "10.244.0.0/16", "EnableIPv6": True, "IPv6Network": "fd00::/56"},
            "has no global IPv6 address that is neither temporary nor deprecated; add a "
            "stable one, or choose another interface",
            ["find_underlay"],
        ),
    ],
)
def test_ipv6_config_the_node_cannot_run_is_refused_before_the_host_is_touched(
    tmp_path: Path, doc: dict[str, object], says: str, reads: list[str]
) -> None:
    store = FakeStore()
    put_network_config(store, PREFIX, json.dumps({**doc, "Backend": {"Type": "vxlan"}}))
    kernel = HostTouchingKernel()

    with pytest.raises(ConfigError, match=says):
        build_agent(agent_settings(tmp_path), opened(store, tmp_path), kernel)

    assert kernel.calls == reads
    assert not (tmp_path / "state").exists() and not (tmp_path / "run").exists()
    assert store.closed, "the manager is closed on the way out"


def test_a_config_without_backend_is_refused_before_the_host_is_touched(
    tmp_path: Path,
) -> None:
    """flanneld v0.28.9 runs udp without a Backend key (seen: "Found network config -
    Backend type: udp"); ours guessing vxlan would split a mixed cluster silently."""
    store = FakeStore()
    put_network_config(store, PREFIX, json.dumps({"Network": "10.244.0.0/16"}))
    kernel = HostTouchingKernel()

    with pytest.raises(ConfigError) as exc:
        build_agent(agent_settings(tmp_path), opened(store, tmp_path), kernel)
    assert 'has no "Backend": flanneld would run udp' in str(exc.value)
    assert '"Backend": {"Type": "vxlan"}' in str(exc.value)
    assert kernel.calls == []


def test_overlap_with_a_foreign_route_is_refused_before_anything_changes(tmp_path: Path) -> None:
    store = FakeStore()
    doc = {"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan"}}
    put_network_config(store, PREFIX, json.dumps(doc))

    class Overlapping(HostTouchingKernel):
        def survey(self, ignore_devices: object) -> list[ForeignRoute]:
            self.calls.append("survey")
            return [ForeignRoute(IPv4Network("10.244.7.0/24"), "route 10.244.7.0/24 dev docker0")]

    kernel = Overlapping()
    with pytest.raises(ConfigError, match="docker0"):
        build_agent(agent_settings(tmp_path), opened(store, tmp_path), kernel)
    assert kernel.calls == ["find_underlay", "survey"], "only looked, never changed"
    assert not (tmp_path / "state").exists()
    assert store.closed


@pytest.mark.parametrize(
    ("kube", "absent"),
    # etcd mode without a client certificate speaks to etcd's JSON gateway: no gRPC.
    [(False, ("kubernetes", "grpc", "pyetcd")), (True, ("grpc", "pyetcd"))],
)
def test_open_store_imports_only_the_chosen_client(kube: bool, absent: tuple[str, ...]) -> None:
    code = (
        "import sys\n"
        "from flannelpy.config.settings import AgentSettings\n"
        "from flannelpy.store.open_store import open_store\n"
        "import flannelpy.agent.compose\n"
        f"settings = AgentSettings(kube_subnet_mgr={kube}, kube_api_url='http://127.0.0.1:1',"
        " node_name='n1')\n"
        "try:\n"
        "    open_store(settings)\n"
        "except Exception:\n"
        "    pass\n"
        f"print(sorted(m for m in {absent!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


class LockedFirewall:
    """IptablesFirewall's surface; ``locked`` makes every sync fail as a held xtables
    lock does (``iptables -w`` gives up)."""

    random_fully = True

    def __init__(self) -> None:
        self.locked = False
        self.synced = 0

    def sync(self, rules: object) -> SyncResult:
        if self.locked:
            raise DataplaneError(
                "iptables cannot list nat/POSTROUTING: Another app is currently holding the "
                "xtables lock. Stopped waiting after 5s.; check that iptables works on this host"
            )
        self.synced += 1
        return SyncResult(False)


def firewalled_agent(tmp_path: Path, fw: LockedFirewall) -> AgentHarness:
    settings = agent_settings(tmp_path, ip_masq=True)
    firewall = firewall_factory(settings, AgentMetrics(), fw)  # type: ignore[arg-type]
    return AgentHarness(tmp_path, firewall=firewall, ip_masq=True)


def test_an_xtables_lock_timeout_during_lease_recovery_is_retried(tmp_path: Path) -> None:
    fw = LockedFirewall()
    agent = firewalled_agent(tmp_path, fw)
    agent.start()
    try:
        (subnet,) = agent.own_subnets()
        assert agent.writer.state.rules_in_place
        # Another node now holds our subnet: recovery moves us and rebuilds the rules
        # while kube-proxy holds the xtables lock.
        other = LeaseAttrs(public_ip=IPv4Address("192.168.1.99"), backend_type="vxlan")
        agent.store.put(lease_key(PREFIX, subnet), other.to_json().encode())
        fw.locked = True
        agent.deliver_leases()
        agent.reconcile()  # the pass for the new plan: the new subnet's rules, lock held
        agent.writer.publish_view()

        assert agent.own_subnets() != [subnet], "the lease moved"
        assert not agent.writer.state.rules_in_place
        assert agent.status()["ready"] is True

        fw.locked = False
        synced, resyncs = fw.synced, agent.writer.counts.firewall_resyncs
        agent.tick(TICK_FIREWALL)
        assert fw.synced > synced and agent.writer.state.rules_in_place
        # Counted, for tests that wait for resyncs instead of sleeping through them.
        assert agent.writer.counts.firewall_resyncs == resyncs + 1
    finally:
        agent.stop()


def test_iptables_that_never_worked_still_refuses_the_start(tmp_path: Path) -> None:
    fw = LockedFirewall()
    fw.locked = True
    agent = firewalled_agent(tmp_path, fw)
    with pytest.raises(DataplaneError, match="xtables lock"):
        agent.start()
    agent.stop()


def test_a_config_not_written_yet_is_waited_for_as_flanneld_does(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """flanneld retries every second until the config key exists (main.go getConfig);
    the wait is logged once, naming the key to write."""
    from flannelpy.agent.compose import _read_config_patiently
    from flannelpy.subnet.keys import config_key

    store = FakeStore()
    cluster = opened(store, tmp_path)
    waits: list[float] = []

    def sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) == 3:  # the operator writes it while the agent waits
            put_network_config(
                store,
                PREFIX,
                json.dumps({"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan"}}),
            )

    config = _read_config_patiently(cluster, 0.1, sleep=sleep)
    assert str(config.network) == "10.244.0.0/16"
    assert waits == [1.0, 1.0, 1.0]
    said = [
        r.getMessage() for r in caplog.records if "waiting for the network config" in r.getMessage()
    ]
    assert len(said) == 1 and "not found in etcd at /coreos.com/network/config" in said[0]
    # A config that is there but invalid is not waited for: its sentence stops the start.
    store.put(config_key(PREFIX), b'{"Network": "not a network"}')
    with pytest.raises(ConfigError, match="Network"):
        _read_config_patiently(cluster, 0.1, sleep=sleep)
    assert len(waits) == 3


VXLAN = {"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan"}}


def test_network_policy_on_a_store_without_policy_inputs_is_refused_before_any_change(
    tmp_path: Path,
) -> None:
    store = FakeStore()
    put_network_config(store, PREFIX, json.dumps(VXLAN))
    kernel = HostTouchingKernel()
    settings = agent_settings(tmp_path, enable_network_policy=True)  # past the flag check
    with pytest.raises(ConfigError, match=r"^--enable-network-policy needs Kubernetes mode"):
        build_agent(settings, opened(store, tmp_path), kernel)
    assert kernel.calls == ["find_underlay", "survey"], "only looked, never changed"
    assert store.closed


def test_network_policy_gives_the_agent_the_stores_inputs_and_the_policy_table(
    tmp_path: Path,
) -> None:
    from flannelpy.dataplane.policy_table import PolicyTable
    from flannelpy.store.policy_inputs import PolicyCache

    store = FakeStore()
    put_network_config(store, PREFIX, json.dumps(VXLAN))
    settings = agent_settings(tmp_path, enable_network_policy=True)
    refused: list[str] = []

    class WithPolicy(EtcdClusterStore):
        def policy_source(self, on_refused: object = None, on_restart: object = None) -> object:
            refused.append("asked")
            return PolicyCache()

    agent = build_agent(
        settings,
        WithPolicy(settings, store, EtcdSubnetManager(store, settings)),
        HostTouchingKernel(),
    )
    assert refused == ["asked"]
    assert isinstance(agent.parts.policy_source, PolicyCache)
    assert isinstance(agent.parts.policy_table, PolicyTable)
    assert agent.writer.netpol is not None
    agent.manager.close()
