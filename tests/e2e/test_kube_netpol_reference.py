"""kube-network-policies, Flannel's NetworkPolicy answer, enforces on flanneld nodes of the
lab (``lab up --kube --flanneld-nodes 2 --enable-network-policy``): the reference the
policy benches measure ours against must really decide.

Two flanneld nodes, each running kube-network-policies beside flanneld as Flannel's chart
does, one pod per node made by Flannel's CNI plugin: a TCP server ("db", n2) and a client
("web", n1). The test writes their Pod objects as a kubelet would. Real packets: a new
connection gets through with no policy, is dropped once a policy isolating db denies it,
and gets through again once the policy allows web; the verdicts were given in userspace
(db's node queued packets to kube-network-policies' NFQUEUE).
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flannelpy_lab import Lab, kube_netpol
from flannelpy_lab import kube as control_plane
from flannelpy_lab.tcp_probe import serve, stop_process

from tests.support.lab_util import running_lab, unique_lab_name, wait_until

pytestmark = [pytest.mark.lab, pytest.mark.netns]

NS = "shop"
PORT = 8080
ENFORCE = 30.0  # seconds allowed for a change to reach the kernel on a loaded machine


def policy(ingress: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "db", "namespace": NS},
        "spec": {"podSelector": {"matchLabels": {"app": "db"}}, "policyTypes": ["Ingress"],
                 "ingress": ingress},
    }  # fmt: skip


def connects(lab: Lab, src: str, ip: str) -> bool:
    """One new TCP connection from pod ``src`` to ``ip``, answered within half a second."""
    code = f"import socket; socket.create_connection(('{ip}', {PORT}), timeout=0.5)"
    argv = ["ip", "netns", "exec", lab.pod(src).namespace, "python3", "-c", code]
    return subprocess.run(argv, capture_output=True, timeout=20).returncode == 0


def queued(lab: Lab, node: str) -> int:
    """Packets the node's kernel has queued to kube-network-policies (id_sequence)."""
    path = "/proc/net/netfilter/nfnetlink_queue"
    out = lab.exec(node, ["cat", path]).stdout
    rows = [line.split() for line in out.splitlines()]
    return sum(int(r[7]) for r in rows if r and r[0] == str(kube_netpol.QUEUE))


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    name = unique_lab_name("kn")
    with running_lab(2, "vxlan", kube=True, flanneld_nodes=2, network_policy=True,
                     name=name) as lab:  # fmt: skip
        lab.install_cni()
        for node in lab.nodes:
            lab.add_pod(node.name)
        yield lab


def test_kube_network_policies_enforces_on_flanneld_nodes(lab: Lab) -> None:
    assert [n.agent_kind for n in lab.nodes] == ["flanneld", "flanneld"]
    web, db = (next(p for p in lab.pods if p.node == n) for n in ("n1", "n2"))
    ips = {p.name: (p.address or "").split("/")[0] for p in (web, db)}
    lab.kubectl("create", "namespace", NS)
    lab.kubectl("create", "serviceaccount", "default", "-n", NS)  # no controller makes it
    for pod, name in ((db, "db"), (web, "web")):
        doc = control_plane.pod_manifest(NS, name, pod.node, {"app": name})
        lab.kubectl("apply", "-f", "-", stdin=json.dumps(doc))
        lab.kubectl("patch", "pod", name, "-n", NS, "--subresource=status", "--type=merge",
                    "-p", json.dumps(control_plane.pod_running_status(ips[pod.name])))  # fmt: skip
    server = serve(db.namespace, PORT)
    try:
        assert connects(lab, web.name, ips[db.name]), "no policy: web must reach db"
        before = queued(lab, "n2")

        lab.kubectl("apply", "-f", "-", stdin=json.dumps(policy([])))
        wait_until(lambda: not connects(lab, web.name, ips[db.name]), timeout=ENFORCE,
                   what="the policy isolating db did not stop a new connection")  # fmt: skip
        time.sleep(1)  # settled: a denial is a state, not a moment
        assert not connects(lab, web.name, ips[db.name])
        assert queued(lab, "n2") > before, "db's node queued nothing: no userspace verdict"

        allow = [{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}]}]
        lab.kubectl("apply", "-f", "-", stdin=json.dumps(policy(allow)))
        wait_until(lambda: connects(lab, web.name, ips[db.name]), timeout=ENFORCE,
                   what="the policy allowing web did not let a new connection through")  # fmt: skip
        assert all(connects(lab, web.name, ips[db.name]) for _ in range(3))
        log = Path(kube_netpol.log_path(lab.node("n2"))).read_text(encoding="utf-8")
        assert "Evaluating packet" in log, "kube-network-policies logged no packet it decided"
    finally:
        stop_process(server)
