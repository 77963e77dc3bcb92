"""--ip-blackhole-route: ours beside the real flanneld's, each in a namespace of its own.

flanneld v0.28.9 adds ``blackhole <lease>`` with metric 0 every --iptables-resync
seconds. With the bridge's connected route present the kernel refuses it (file
exists); added before the bridge's address, it shadows that route and every pod of
the node is unreachable. Ours is the same route (main table, no device) at metric
1024: the connected route wins whichever came first.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from collections.abc import Iterator
from ipaddress import IPv4Network
from pathlib import Path

import pytest
from flannelpy_lab import flanneld

from flannelpy.dataplane.netlink import NetlinkKernel
from flannelpy.dataplane.state import Changes, blackhole_route
from tests.support.etcd_server import ETCD_BINARY
from tests.support.netns_util import Netns, is_root, temp_netns
from tests.support.waiting import wait_until

pytestmark = [
    pytest.mark.netns,
    pytest.mark.skipif(not is_root(), reason="network namespaces need root"),
]

NET_CONF = '{"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan"}}'


def _put(ns: Netns, key: str, value: str) -> None:
    """A put through etcd's HTTP gateway, from inside ``ns`` (where etcd listens)."""
    body = json.dumps(
        {
            "key": base64.b64encode(key.encode()).decode(),
            "value": base64.b64encode(value.encode()).decode(),
        }
    )
    code = (
        "import sys, urllib.request as u; "
        "u.urlopen(u.Request('http://127.0.0.1:2379/v3/kv/put', sys.argv[1].encode()), "
        "timeout=5).read()"
    )
    ns.exec([sys.executable, "-c", code, body])


@pytest.fixture
def flanneld_node(tmp_path: Path) -> Iterator[tuple[Netns, Path]]:
    """A namespace running etcd and flanneld --ip-blackhole-route; (ns, subnet.env)."""
    binary = flanneld.binary()
    procs: list[subprocess.Popen[bytes]] = []
    with temp_netns("bhf") as ns:
        ns.veth("u0", "192.168.77.2/24")
        ns.ip("route add default via 192.168.77.1")
        try:
            with open(tmp_path / "etcd.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [
                            "ip",
                            "netns",
                            "exec",
                            ns.name,
                            ETCD_BINARY,
                            "--data-dir",
                            str(tmp_path / "etcd"),
                            "--listen-client-urls",
                            "http://127.0.0.1:2379",
                            "--advertise-client-urls",
                            "http://127.0.0.1:2379",
                            "--listen-peer-urls",
                            "http://127.0.0.1:2380",
                        ],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
            wait_until(
                lambda: (
                    ns.exec(
                        [
                            sys.executable,
                            "-c",
                            "import socket; socket.create_connection(('127.0.0.1', 2379), 1)",
                        ],
                        check=False,
                    ).returncode
                    == 0
                ),
                15.0,
                "etcd listening in the namespace",
            )
            _put(ns, "/coreos.com/network/config", NET_CONF)
            env = tmp_path / "subnet.env"
            with open(tmp_path / "flanneld.log", "wb") as log:
                procs.append(
                    subprocess.Popen(
                        [
                            "ip",
                            "netns",
                            "exec",
                            ns.name,
                            binary,
                            "--etcd-endpoints",
                            "http://127.0.0.1:2379",
                            "--iface",
                            "u0",
                            "--ip-blackhole-route",
                            "--iptables-resync",
                            "1",
                            "--subnet-file",
                            str(env),
                            "--healthz-port",
                            "0",
                        ],
                        stdout=log,
                        stderr=subprocess.STDOUT,
                    )
                )
            yield ns, env
        finally:
            for proc in reversed(procs):
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


def _blackholes(ns: Netns) -> list[dict[str, object]]:
    return list(json.loads(ns.ip("-j route show type blackhole") or "[]"))


def _subnet(env: Path) -> IPv4Network:
    line = next(ln for ln in env.read_text().splitlines() if ln.startswith("FLANNEL_SUBNET="))
    return IPv4Network(line.split("=", 1)[1], strict=False)


def test_flanneld_blackhole_shadows_the_bridge_and_ours_does_not(
    flanneld_node: tuple[Netns, Path],
) -> None:
    ns, env = flanneld_node
    wait_until(lambda: env.exists() and _blackholes(ns), 20.0, "flanneld's blackhole route")
    subnet = _subnet(env)
    (theirs,) = _blackholes(ns)
    # Main table, no device, no gateway, metric 0 (ip leaves protocol boot unnamed).
    assert theirs == {"type": "blackhole", "dst": str(subnet), "flags": []}
    pod_ip = str(subnet.network_address + 5)
    ns.ip("link add cni0 type bridge")
    ns.ip("link set cni0 up")
    ns.ip(f"addr add {subnet.network_address + 1}/{subnet.prefixlen} dev cni0")
    # flanneld's came first: it wins over the bridge's connected route.
    assert ns.ip(f"route get {pod_ip}", check=False) == ""

    with temp_netns("bho") as ours:
        ours.ip("link add cni0 type bridge")
        ours.ip("link set cni0 up")
        kernel = NetlinkKernel()
        result = ours.call(kernel.apply, Changes(routes_to_set=(blackhole_route(subnet),)))
        assert result.failures == ()
        ours.ip(f"addr add {subnet.network_address + 1}/{subnet.prefixlen} dev cni0")
        (mine,) = _blackholes(ours)
        assert {k: v for k, v in mine.items() if k not in ("protocol", "metric")} == theirs
        assert (mine["protocol"], mine["metric"]) == ("75", 1024)
        assert "dev cni0" in ours.ip(f"route get {pod_ip}")

    # The other order on flanneld's node: its next add is refused while cni0 routes.
    ns.ip(f"route del blackhole {subnet}")
    log = env.parent / "flanneld.log"
    wait_until(
        lambda: "Failed to setup blackhole route, file exists" in log.read_text(),
        10.0,
        "flanneld failing to add its blackhole route",
    )
    assert _blackholes(ns) == []
    assert "dev cni0" in ns.ip(f"route get {pod_ip}")
