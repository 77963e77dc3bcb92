"""build_agent refuses what it can before the host changes; open_store chooses once."""

from __future__ import annotations

import json
import subprocess
import sys
from ipaddress import IPv4Network
from pathlib import Path

import pytest

from flannelpy.agent.compose import build_agent
from flannelpy.dataplane.kernel import ForeignRoute
from flannelpy.errors import ConfigError
from flannelpy.subnet.etcd.config import put_network_config
from flannelpy.subnet.etcd.kv import FakeStore
from flannelpy.subnet.etcd.manager import EtcdSubnetManager
from flannelpy.subnet.open_store import OpenedStore
from tests.support.agent_fakes import PREFIX, HostTouchingKernel, agent_settings


def opened(store: FakeStore, tmp: Path) -> OpenedStore:
    return OpenedStore(manager=EtcdSubnetManager(store, agent_settings(tmp)), etcd=store)


def test_ipv6_config_is_refused_before_the_host_is_touched(tmp_path: Path) -> None:
    store = FakeStore()
    doc = {"Network": "10.244.0.0/16", "EnableIPv6": True, "IPv6Network": "fd00::/56",
           "Backend": {"Type": "vxlan"}}  # fmt: skip
    put_network_config(store, PREFIX, json.dumps(doc))
    kernel = HostTouchingKernel()

    with pytest.raises(ConfigError, match="EnableIPv6 is not supported"):
        build_agent(agent_settings(tmp_path), opened(store, tmp_path), kernel)

    assert kernel.calls == []
    assert not (tmp_path / "state").exists() and not (tmp_path / "run").exists()
    assert store.closed, "the manager is closed on the way out"


def test_overlap_with_a_foreign_route_is_refused_before_anything_changes(tmp_path: Path) -> None:
    store = FakeStore()
    put_network_config(store, PREFIX, json.dumps({"Network": "10.244.0.0/16"}))

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


def test_a_missing_network_config_names_the_key_to_write(tmp_path: Path) -> None:
    store = FakeStore()
    kernel = HostTouchingKernel()
    with pytest.raises(ConfigError, match="network config not found"):
        build_agent(agent_settings(tmp_path), opened(store, tmp_path), kernel)
    assert kernel.calls == []


@pytest.mark.parametrize(
    ("kube", "absent"),
    [(False, ("kubernetes",)), (True, ("grpc", "pyetcd"))],
)
def test_open_store_imports_only_the_chosen_client(kube: bool, absent: tuple[str, ...]) -> None:
    code = (
        "import sys\n"
        "from flannelpy.config.settings import AgentSettings\n"
        "from flannelpy.subnet.open_store import open_store\n"
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
