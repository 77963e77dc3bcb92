"""NetworkPolicy against the real API server (``lab up --kube --enable-network-policy``).

Two nodes, one pod each, made by the real CNI executable: a TCP server ("db", on n1) and
a client ("web", on n2). The lab runs no kubelet, so the test writes their Pod objects as
a kubelet would (spec.nodeName, then the status with the pods' addresses) and the agents
read them, with the policies, from the real kube-apiserver. A client opens a new
connection every 10 ms from web to db for the whole module and logs each outcome; the
tests, in file order, read that log:

1. a policy allowing web lets every connection through, and ``flannelpy netpol explain``
   names its rule;
2. the policy edited to deny: after the first refused connection, no connection is
   accepted; the denials are counted under the policy's name in /metrics, and explain
   says which policy isolates db;
3. a pod attached on n1 before its Pod object shows its address is denied (its namespace
   has a policy, its labels are unknown) and let go once the object is read;
4. db's agent restarted: no connection is accepted while it is down or starting;
5. the policy edited to one the agent cannot represent (an allowing rule with more ports
   than a rule may hold): the edit is refused and counted, the doctor names it, and the
   kernel keeps the denying table it had, byte for byte, with no connection accepted.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from flannelpy_lab import Lab
from flannelpy_lab import kube as control_plane
from flannelpy_lab.tcp_probe import Client, connect_loop, serve, stop_process

from flannelpy.netpol.model import MAX_ITEMS
from tests.e2e.test_observability import scrape
from tests.support.lab_util import lab_run_argv, running_real_kube_lab, wait_until

pytestmark = [pytest.mark.lab, pytest.mark.netns]

NS = "shop"
PORT = 8080
ENFORCE = 30.0  # seconds allowed for a change to reach the kernel on a loaded machine


def pod_object(name: str, node: str) -> dict[str, Any]:
    return control_plane.pod_manifest(NS, name, node, {"app": name}, {"http": PORT})


def policy(ingress: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "db-from-web", "namespace": NS},
        "spec": {
            "podSelector": {"matchLabels": {"app": "db"}},
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


ALLOW_WEB = policy([{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}],
                     "ports": [{"port": "http"}]}])  # fmt: skip
DENY = policy([])


def connects(lab: Lab, src: str, ip: str) -> bool:
    """One TCP connect from pod ``src`` to ``ip``, answered within half a second."""
    code = f"import socket; socket.create_connection(('{ip}', {PORT}), timeout=0.5)"
    proc = subprocess.run(
        ["ip", "netns", "exec", lab.pod(src).namespace, "python3", "-c", code],
        capture_output=True,
        timeout=20,
    )
    return proc.returncode == 0


def apply(lab: Lab, doc: dict[str, Any]) -> float:
    """``kubectl apply``; returns when kubectl was started (the agents may see the change
    before kubectl has exited)."""
    started = time.time()
    lab.kubectl("apply", "-f", "-", stdin=json.dumps(doc))
    return started


def explain(lab: Lab) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "flannelpy", "netpol", "explain", "--from", f"{NS}/web",
            "--to", f"{NS}/db", "--port", f"{PORT}/TCP",
            "--kubeconfig-file", control_plane.admin_kubeconfig(lab.state)]  # fmt: skip
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


@pytest.fixture(scope="module")
def lab() -> Iterator[Lab]:
    with running_real_kube_lab(nodes=2, network_policy=True) as lab:
        yield lab


@pytest.fixture(scope="module")
def client(lab: Lab, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    db, web = (next(p for p in lab.pods if p.node == n) for n in ("n1", "n2"))
    ips = {p.name: (p.address or "").split("/")[0] for p in (db, web)}
    assert all(ips.values()), ips
    lab.kubectl("create", "namespace", NS)
    lab.kubectl("create", "serviceaccount", "default", "-n", NS)  # no controller makes it
    for pod, name in ((db, "db"), (web, "web")):
        lab.kubectl("apply", "-f", "-", stdin=json.dumps(pod_object(name, pod.node)))
        ip = ips[pod.name]
        status = control_plane.pod_running_status(ip)
        lab.kubectl("patch", "pod", name, "-n", NS, "--subresource=status", "--type=merge",
                    "-p", json.dumps(status))  # fmt: skip
    server = serve(db.namespace, PORT)
    try:
        conn = connect_loop(web.namespace, ips[db.name], PORT, tmp_path_factory.mktemp("netpol"))
        try:
            yield conn
        finally:
            conn.stop()
    finally:
        stop_process(server)


def test_an_allowing_policy_lets_every_connection_through_and_explain_names_its_rule(
    lab: Lab, client: Client
) -> None:
    wait_until(lambda: any(o == "ok" for _, o in client.attempts()), 20, "a first connection")
    t0 = apply(lab, ALLOW_WEB)
    # db is isolated now, its one rule naming web: nothing changes for web's connections.
    wait_until(lambda: "policy synced" in agent_log(lab, "n1"), ENFORCE, "n1's policy sync")
    time.sleep(1.0)  # a second of connections under the policy, to judge below
    after = client.since(t0)
    assert after and all(o == "ok" for _, o in after), after[-5:]
    answer = explain(lab)
    assert answer.returncode == 0, answer.stdout + answer.stderr
    assert f"allowed by {NS}/db-from-web ingress rule 0" in answer.stdout


def test_the_policy_edited_to_deny_accepts_no_connection_after_its_first_refusal(
    lab: Lab, client: Client
) -> None:
    t_change = apply(lab, DENY)
    wait_until(
        lambda: any(o != "ok" for _, o in client.since(t_change)), ENFORCE, "a denied connection"
    )
    time.sleep(2.0)  # two seconds of connections after the first denial
    after = client.since(t_change)
    first_denied = next(t for t, o in after if o != "ok")
    accepted_later = [t for t, o in after if t > first_denied and o == "ok"]
    print(f"\nkubectl apply started -> first denied connection: {first_denied - t_change:.3f} s")
    assert not accepted_later, f"{len(accepted_later)} connections accepted after the denial"
    answer = explain(lab)
    assert answer.returncode == 1, answer.stdout + answer.stderr
    assert f"denied, isolated by {NS}/db-from-web" in answer.stdout

    def denied() -> float:
        _, samples = scrape(lab, "n1")
        key = ("flannelpy_policy_denied_packets_total",
               frozenset({("namespace", NS), ("policy", "db-from-web"),
                          ("direction", "ingress")}))  # fmt: skip
        return samples.get(key, 0.0)

    wait_until(lambda: denied() > 0, 20, "denials counted under the policy's name")
    doctor = subprocess.run(
        lab_run_argv(lab.name, "doctor", "--json", node="n1"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    (finding,) = [f for f in json.loads(doctor.stdout)["findings"] if f["check"] == "netpol"]
    assert finding["severity"] == "ok", finding
    assert "1 pod(s) of this node isolated" in finding["message"]


def test_a_pod_attached_before_its_pod_object_is_read_is_denied_until_it_is(
    lab: Lab, client: Client
) -> None:
    web = next(p for p in lab.pods if p.node == "n2")
    web_ip = (web.address or "").split("/")[0]
    late = lab.add_pod("n1", "late", kube_pod=f"{NS}/late")  # CNI_ARGS name it shop/late
    servers = [serve(late.namespace, PORT), serve(web.namespace, PORT)]
    try:
        ip = (late.address or "").split("/")[0]
        assert connects(lab, late.name, "127.0.0.1")  # its server listens
        # No Pod object shows its address and shop has a policy: denied both ways.
        assert not any(connects(lab, web.name, ip) for _ in range(3))
        assert not any(connects(lab, late.name, web_ip) for _ in range(3))
        lab.kubectl("apply", "-f", "-", stdin=json.dumps(pod_object("late", "n1")))
        status = control_plane.pod_running_status(ip)
        lab.kubectl("patch", "pod", "late", "-n", NS, "--subresource=status", "--type=merge",
                    "-p", json.dumps(status))  # fmt: skip
        # Read: app=late, which no policy selects, so open both ways.
        wait_until(lambda: connects(lab, web.name, ip), ENFORCE, "late reachable once read")
        assert connects(lab, late.name, web_ip)
    finally:
        for server in servers:
            stop_process(server)
        lab.kubectl("delete", "pod", "late", "-n", NS, "--grace-period=0", "--force", check=False)
        lab.delete_pod(late.name)


def test_no_connection_is_accepted_while_the_enforcing_agent_restarts(
    lab: Lab, client: Client
) -> None:
    t0 = time.time()
    lab.kill_agent("n1")
    time.sleep(1.0)  # connections while no agent runs
    lab.start_agent("n1")
    lab.wait_ready("n1")
    wait_until(lambda: agent_log(lab, "n1").count("policy synced") >= 2, ENFORCE, "resync")
    time.sleep(1.0)
    during = client.since(t0)
    assert len(during) > 100  # a new connection every 10 ms went on the whole time
    assert all(o != "ok" for _, o in during), [a for a in during if a[1] == "ok"][:5]


# web allowed again, on more ports than the agent represents in one rule (the API server
# sets no limit): the agent refuses the edit and keeps the version before it, DENY.
TOO_MANY_PORTS = policy([{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}],
                          "ports": [{"port": PORT}] + [{"port": 20000 + i}
                                                       for i in range(MAX_ITEMS)]}])  # fmt: skip


def policy_table(lab: Lab, node: str) -> str:
    """The policy table as nft lists it, without counter values (``-s``)."""
    return lab.exec(node, ["nft", "-s", "list", "table", "inet", "flannelpy-policy"]).stdout


def refusals(lab: Lab, node: str) -> float:
    _, samples = scrape(lab, node)
    return sum(v for (name, _), v in samples.items()
               if name == "flannelpy_policy_refused_objects_total")  # fmt: skip


def test_a_policy_edit_the_agent_refuses_leaves_the_enforced_table_intact(
    lab: Lab, client: Client
) -> None:
    before, refused_before = policy_table(lab, "n1"), refusals(lab, "n1")
    assert "db-from-web" in before  # the denying version of the last test is enforced
    t_change = apply(lab, TOO_MANY_PORTS)
    wait_until(lambda: refusals(lab, "n1") > refused_before, ENFORCE, "the edit refused")
    assert policy_table(lab, "n1") == before
    wait_until(lambda: len(client.since(t_change)) >= 20, ENFORCE, "20 connections tried")
    after = client.since(t_change)
    assert all(o != "ok" for _, o in after), [a for a in after if a[1] == "ok"][:5]
    assert policy_table(lab, "n1") == before
    log = agent_log(lab, "n1")
    assert f"NetworkPolicy {NS}/db-from-web is refused" in log, log[-2000:]

    def netpol_warnings() -> list[str]:
        """The doctor's netpol warnings (it reads status.json, rewritten every 2 s)."""
        out = subprocess.run(lab_run_argv(lab.name, "doctor", "--json", node="n1"),
                             capture_output=True, text=True, timeout=60).stdout  # fmt: skip
        found = [f for f in json.loads(out)["findings"] if f["check"] == "netpol"]
        return [f["message"] for f in found if f["severity"] == "warning"]

    wait_until(
        lambda: any(f"{NS}/db-from-web" in m for m in netpol_warnings()),
        ENFORCE,
        "the doctor to warn of the refused edit",
    )
    assert policy_table(lab, "n1") == before
    apply(lab, DENY)  # accepted again: the refusal is gone from the doctor's findings
    wait_until(lambda: not netpol_warnings(), ENFORCE, "the refusal cleared once DENY is back")


def agent_log(lab: Lab, node: str) -> str:
    return Path(lab.node(node).agent_log).read_text(encoding="utf-8", errors="replace")
