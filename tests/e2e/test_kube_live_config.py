"""Issue 6 in Kubernetes mode: live config from the ConfigMap file and the Node annotation.

The etcd-mode twin is tests/e2e/test_live_config.py. Here the network config is
the lab's net-conf.json file (the mounted ConfigMap; the kubelet swaps it
atomically, so the tests replace it with ``os.replace``), this node's override
is the Node annotation ``flannelpy.io/override`` written over HTTP as ``kubectl
annotate`` does (a merge patch of the Node's metadata), and a forced change
leaves a core/v1 Event on the Node. The API server is tests/kube_standin.py.

The lab tests run in file order on one lab: a blocked ConfigMap change, then a
forced override on n2 past it, then the policy opened so the blocked change
lands everywhere, then an agent restarted under an override. Each writes the
config it needs, so each also holds alone.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from flannelpy_lab import Lab
from flannelpy_lab.agents import kube_net_conf_path
from kubernetes import client as kclient
from kubernetes.client.exceptions import ApiException

from flannelpy.config.settings import AgentSettings
from flannelpy.subnet.kube.manager import OVERRIDE_ANNOTATION, KubeSubnetManager
from tests.e2e.test_observability import scrape
from tests.support.agent_events import processed_mark, wait_until_processed
from tests.support.kube_standin import MERGE, KubeStandin
from tests.support.lab_util import wait_until

F = TypeVar("F", bound=Callable[..., Any])

PREFIX = "flannel.alpha.coreos.com"
NODES = ("n1", "n2", "n3")
REASON = "incident 4711: vxlan offload bug on n2"
# How long an agent may take to react to a change it watches (the ConfigMap file is
# polled every 2 s; a node watch event arrives at once). Generous on purpose: two CI
# rehearsals saw a reaction take over 20 s once, never reproduced since; the
# autouse fixture below prints every agent's log when a test fails.
REACT = 60


def lab_test(fn: F) -> F:
    """The marks of a test on the netns lab (the API-level tests need none of them)."""
    for mark in (
        pytest.mark.skipif(os.geteuid() != 0, reason="needs root to build the netns lab"),
        pytest.mark.netns,
        pytest.mark.lab,
    ):
        fn = mark(fn)
    return fn


@pytest.fixture(autouse=True)
def agent_logs_on_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    """A failed lab test prints the tail of every agent's log (pytest shows it)."""
    yield
    report = getattr(request.node, "rep_call", None)
    if report is None or not report.failed or "kube_lab" not in request.fixturenames:
        return
    lab, _ = request.getfixturevalue("kube_lab")
    for node in lab.nodes:
        tail = "".join(agent_log(lab, node.name).splitlines(keepends=True)[-40:])
        print(f"--- last lines of {node.name}'s agent log:\n{tail}")


def core_api(url: str) -> kclient.CoreV1Api:
    cfg = kclient.Configuration(host=url)
    cfg.proxy = None  # the stand-in is on this host: never through a proxy from the env
    return kclient.CoreV1Api(kclient.ApiClient(cfg))


def annotate(api: KubeStandin, node: str, value: str | None) -> dict[str, Any]:
    """``kubectl annotate node <node> flannelpy.io/override=<value>`` (None: ``...-``)."""
    core = core_api(api.url)
    try:
        body = {"metadata": {"annotations": {OVERRIDE_ANNOTATION: value}}}
        node_obj = core.patch_node(node, body, _content_type=MERGE)
        return dict(core.api_client.sanitize_for_serialization(node_obj))
    finally:
        core.api_client.close()


# --- the net-conf.json file, and what the agents show ------------------------------------


def write_net_conf(lab: Lab, backend: dict[str, Any], policy: dict[str, Any] | None) -> None:
    """Replace the ConfigMap file in one step (the kubelet's symlink swap is atomic)."""
    path = kube_net_conf_path(lab.state)
    doc = {k: v for k, v in json.loads(Path(path).read_text()).items()
           if k.lower() not in ("backend", "disruptionpolicy")}  # fmt: skip
    doc["Backend"] = backend
    if policy is not None:
        doc["DisruptionPolicy"] = policy
    tmp = f"{path}.tmp"
    Path(tmp).write_text(json.dumps(doc))
    os.replace(tmp, path)


def status_json(lab: Lab, node: str) -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(Path(lab.node(node).run_dir, "status.json").read_text())
    return doc


def node_annotation(api: KubeStandin, node: str, key: str) -> str | None:
    obj = api.node(node)
    assert obj is not None, f"node {node} is gone from the stand-in"
    value: str | None = obj["metadata"].get("annotations", {}).get(key)
    return value


def routes(lab: Lab, node: str) -> dict[str, str]:
    out = lab.exec(node, ["ip", "-j", "route", "show", "proto", "75"]).stdout
    return {r["dst"]: r["dev"] for r in json.loads(out or "[]")}


def vxlan_links(lab: Lab, node: str) -> str:
    return lab.exec(node, ["ip", "-br", "link", "show", "type", "vxlan"]).stdout.strip()


def all_pods_reach_each_other(lab: Lab) -> bool:
    doc = lab.status()
    return bool(doc["ok"] and doc["pod_matrix"])


def blocked_count(lab: Lab, node: str) -> float:
    _, samples = scrape(lab, node)
    key = ("flannelpy_blocked_operations_total", frozenset({("kind", "backend_change")}))
    return samples.get(key, 0.0)


def overridden_events(api: KubeStandin, node: str) -> list[dict[str, Any]]:
    return [e for e in api.events
            if e.get("reason") == "DisruptionPolicyOverridden"
            and e["involvedObject"].get("kind") == "Node"
            and e["involvedObject"].get("name") == node]  # fmt: skip


def agent_log(lab: Lab, node: str) -> str:
    return Path(lab.node(node).agent_log).read_text(encoding="utf-8", errors="replace")


# --- the lab tests -----------------------------------------------------------------------


@lab_test
def test_configmap_change_under_block_keeps_every_node_on_vxlan(
    kube_lab: tuple[Lab, KubeStandin],
) -> None:
    lab, api = kube_lab
    assert {status_json(lab, n)["backend"] for n in NODES} == {"vxlan"}
    before = {node: blocked_count(lab, node) for node in NODES}
    routes_before = {node: routes(lab, node) for node in NODES}
    write_net_conf(lab, {"Type": "host-gw"}, {"Mode": "Block"})
    for node in NODES:
        doc = wait_until(lambda n=node: (d := status_json(lab, n))["blocked"] and d, REACT,
                         what=f"{node} to report the blocked change")  # fmt: skip
        (blocked,) = doc["blocked"]
        # The overlay MTU changes with it (no VXLAN header on host-gw).
        assert blocked["change"] == "backend vxlan -> host-gw, MTU 1450 -> 1500", blocked
        assert blocked["sentence"].startswith(
            f"disruptive change ({blocked['change']}) blocked by DisruptionPolicy Block; "
        ), blocked
        assert doc["backend"] == "vxlan" and doc["vtep"] is True
        assert blocked_count(lab, node) == before[node] + 1
        assert node_annotation(api, node, f"{PREFIX}/backend-type") == "vxlan"
        assert "blocked by DisruptionPolicy Block" in agent_log(lab, node)
    assert {node: routes(lab, node) for node in NODES} == routes_before
    assert all(dev == "flannel.1" for node in NODES for dev in routes(lab, node).values())
    assert all_pods_reach_each_other(lab)
    assert not overridden_events(api, "n1") + overridden_events(api, "n3")


@lab_test
def test_forced_override_annotation_switches_one_node_and_leaves_an_event(
    kube_lab: tuple[Lab, KubeStandin],
) -> None:
    lab, api = kube_lab
    write_net_conf(lab, {"Type": "host-gw"}, {"Mode": "Block"})  # as the previous test left it
    override = {
        "Backend": {"Type": "host-gw"}, "Generation": 1,
        "Force": {"Reason": REASON, "By": "tester@lab", "At": "2026-11-30T00:00:00Z"},
    }  # fmt: skip
    patched = annotate(api, "n2", json.dumps(override))
    assert json.loads(patched["metadata"]["annotations"][OVERRIDE_ANNOTATION]) == override
    doc = wait_until(lambda: (d := status_json(lab, "n2"))["applied_generation"] == 1 and d, REACT,
                     what="n2 to apply the forced override")  # fmt: skip
    assert doc["backend"] == "host-gw" and doc["blocked"] == []
    wait_until(lambda: node_annotation(api, "n2", f"{PREFIX}/backend-type") == "host-gw", 10,
               what="n2's Node to advertise host-gw")  # fmt: skip
    (event,) = wait_until(lambda: overridden_events(api, "n2"), REACT, what="the Event on n2")
    assert event["type"] == "Warning" and event["metadata"]["namespace"] == "default"
    assert REASON in event["message"] and "vxlan -> host-gw" in event["message"]
    assert event["source"]["component"] == "flannelpy"
    log = agent_log(lab, "n2")
    assert "disruptive change forced past the disruption policy" in log and REASON in log
    assert "could not record the forced change" not in log
    # Mixed backends: n1 and n3 stay on vxlan (still blocked) and reach n2 directly on
    # the shared segment; n2 keeps its VTEP while peers may still encapsulate to it.
    for node in ("n1", "n3"):
        peer = status_json(lab, node)
        assert peer["backend"] == "vxlan" and peer["blocked"], peer
        wait_until(lambda n=node: routes(lab, n).get("10.244.2.0/24") == "eth0", 10,
                   what=f"{node}'s route to n2 to go direct")  # fmt: skip
    assert status_json(lab, "n2")["vtep"] is True and vxlan_links(lab, "n2")
    assert set(routes(lab, "n2").values()) == {"eth0"}
    assert all_pods_reach_each_other(lab)


@lab_test
def test_policy_back_to_allow_applies_the_blocked_change_everywhere(
    kube_lab: tuple[Lab, KubeStandin],
) -> None:
    lab, api = kube_lab
    write_net_conf(lab, {"Type": "host-gw"}, {"Mode": "Block"})
    for node in ("n1", "n3"):
        wait_until(lambda n=node: status_json(lab, n)["blocked"], REACT, what=f"{node} blocked")
    forced_before = len(api.events)
    write_net_conf(lab, {"Type": "host-gw"}, {"Mode": "Allow"})
    for node in NODES:
        try:
            wait_until(lambda n=node: status_json(lab, n)["backend"] == "host-gw", REACT,
                       what=f"{node} on host-gw")  # fmt: skip
        except AssertionError as e:  # say why: the agent's own account of it
            tail = "".join(agent_log(lab, node).splitlines(keepends=True)[-25:])
            raise AssertionError(f"{e}; last lines of {node}'s agent log:\n{tail}") from e
        wait_until(lambda n=node: node_annotation(api, n, f"{PREFIX}/backend-type") == "host-gw",
                   10, what=f"{node}'s Node to advertise host-gw")  # fmt: skip
    # No peer is vxlan any more: every VTEP goes, every route is direct.
    for node in NODES:
        wait_until(lambda n=node: not vxlan_links(lab, n), REACT, what=f"{node}'s VTEP to go")
        wait_until(lambda n=node: not status_json(lab, n)["vtep"], REACT, what=f"{node} vtep off")
        doc = status_json(lab, node)
        assert doc["blocked"] == [], doc
        assert routes(lab, node) and set(routes(lab, node).values()) == {"eth0"}
        # No VTEP advertised any more: host-gw's BackendData, "null" as flanneld writes it.
        assert node_annotation(api, node, f"{PREFIX}/backend-data") == "null"
    assert all_pods_reach_each_other(lab)
    assert len(api.events) == forced_before  # an allowed change is not an override

    # Removing the override returns n2 to the config's Backend: host-gw, nothing to do.
    annotate(api, "n2", None)
    wait_until(lambda: status_json(lab, "n2")["applied_generation"] is None, REACT,
               what="n2 to drop the removed override")  # fmt: skip
    assert status_json(lab, "n2")["backend"] == "host-gw"
    assert len(api.events) == forced_before
    assert all_pods_reach_each_other(lab)


@lab_test
def test_restart_keeps_the_backend_the_annotation_asks_for(
    kube_lab: tuple[Lab, KubeStandin],
) -> None:
    """The override on the Node at start-up counts from the first decision: an agent
    must not fall back to the config's Backend until its node watch happens to send
    it a MODIFIED event of its own Node."""
    lab, api = kube_lab
    write_net_conf(lab, {"Type": "host-gw"}, {"Mode": "Allow"})
    annotate(api, "n2", json.dumps({"Backend": {"Type": "vxlan"}, "Generation": 2}))
    wait_until(lambda: (d := status_json(lab, "n2"))["applied_generation"] == 2
               and d["backend"] == "vxlan", REACT, what="n2 to apply the override")  # fmt: skip
    lab.kill_agent("n2")
    log_size = len(agent_log(lab, "n2"))
    restarted_at = time.time()
    lab.start_agent("n2")
    lab.wait_ready("n2")
    n2 = lab.node("n2")
    # The new agent's first decision is made and acted on (counts start at 0 with the
    # process; the last run's status.json does not count), and its timers ran after
    # it: a wrong first decision would show by now.
    doc = wait_until_processed(n2, "control", after=0, timeout=REACT, since=restarted_at)
    assert doc["applied_generation"] == 2, doc
    wait_until_processed(n2, "tick", after=processed_mark(n2, "tick"), timeout=REACT)
    since_restart = agent_log(lab, "n2")[log_size:]
    assert "backend changed" not in since_restart, since_restart
    assert status_json(lab, "n2")["backend"] == "vxlan"
    assert node_annotation(api, "n2", f"{PREFIX}/backend-type") == "vxlan"
    assert all_pods_reach_each_other(lab)


# --- the stand-in's Node PATCH and Event create, with the real client --------------------


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[KubeStandin]:
    # The client honours proxy variables; stand-in traffic must stay on loopback.
    for name in ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY",
                 "ALL_PROXY"):  # fmt: skip
        monkeypatch.delenv(name, raising=False)
    with KubeStandin(bookmark_interval=0.5) as server:
        yield server


def test_node_patch_and_event_create_with_the_real_client(
    standin: KubeStandin, tmp_path: Path
) -> None:
    standin.add_node("n1", pod_cidr="10.244.1.0/24")
    net_conf = tmp_path / "net-conf.json"
    net_conf.write_text('{"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan"}}')
    settings = AgentSettings(kube_subnet_mgr=True, kube_api_url=standin.url,
                             net_config_path=str(net_conf), node_name="n1")  # fmt: skip
    manager = KubeSubnetManager(settings, environ={}, watch_timeout=5)
    core: Any = core_api(standin.url)  # the generated models' Optional fields: read as Any
    stop = manager_watch(manager)
    try:
        wait_until(lambda: standin.active_watches, 5, interval=0.02, what="the node watch")
        rv = standin.resource_version
        # kubectl annotate: a merge patch of the Node; status in a Node PATCH is ignored.
        patch = {"metadata": {"annotations": {OVERRIDE_ANNOTATION: "{}"}},
                 "status": {"addresses": []}}  # fmt: skip
        node = core.patch_node("n1", patch, _content_type=MERGE)
        assert node.metadata.annotations[OVERRIDE_ANNOTATION] == "{}"
        assert node.metadata.resource_version == str(rv + 1)
        assert node.status.conditions[0].type == "Ready"
        wait_until(lambda: manager.own_override == "{}", 5, interval=0.02,
                   what="the node watch to deliver the annotation")  # fmt: skip
        # The same patch again changes nothing: no new resourceVersion, no event.
        again = core.patch_node("n1", {"metadata": {"annotations": {OVERRIDE_ANNOTATION: "{}"}}},
                                _content_type=MERGE)  # fmt: skip
        assert again.metadata.resource_version == str(rv + 1)
        with pytest.raises(ApiException) as conflict:
            stale = {"metadata": {"resourceVersion": str(rv), "annotations": {"a": "b"}}}
            core.patch_node("n1", stale, _content_type=MERGE)
        assert conflict.value.status == 409
        core.patch_node("n1", {"metadata": {"annotations": {OVERRIDE_ANNOTATION: None}}},
                        _content_type=MERGE)  # fmt: skip
        wait_until(lambda: manager.own_override is None, 5, interval=0.02,
                   what="the node watch to deliver the removal")  # fmt: skip

        # The product's Event: 201, a generated name, one more resourceVersion.
        rv = standin.resource_version
        manager.create_node_event("DisruptionPolicyOverridden", "forced: a test")
        (event,) = standin.events
        assert event["metadata"]["name"].startswith("n1.flannelpy-")
        assert len(event["metadata"]["name"]) == len("n1.flannelpy-") + 5
        assert event["metadata"]["namespace"] == "default"
        assert event["metadata"]["resourceVersion"] == str(rv + 1)
        assert standin.resource_version == rv + 1
        assert (event["type"], event["reason"]) == ("Warning", "DisruptionPolicyOverridden")
        assert event["involvedObject"]["kind"] == "Node" and event["involvedObject"]["name"] == "n1"
        # The typed client reads the 201 answer back as a CoreV1Event.
        body: dict[str, Any] = {
            "metadata": {"generateName": "n1."}, "reason": "Test", "message": "typed",
            "involvedObject": {"kind": "Node", "name": "n1"},
        }  # fmt: skip
        created = core.create_namespaced_event("default", body)
        assert created.metadata.name.startswith("n1.") and created.metadata.uid
        assert isinstance(created, kclient.CoreV1Event) and created.message == "typed"
        # An event about a cluster-scoped object belongs in "default"; a body's
        # namespace must be the path's.
        with pytest.raises(ApiException) as invalid:
            core.create_namespaced_event("kube-system", body)
        assert invalid.value.status == 422
        with pytest.raises(ApiException) as mismatch:
            other = {**body, "metadata": {"name": "x", "namespace": "other"}}
            core.create_namespaced_event("default", other)
        assert mismatch.value.status == 400
        assert len(standin.events) == 2
        # A node watch started before the events still streams, from the node's history.
        assert standin.active_watches == 1
        assert {("", "events", "create"), ("", "nodes", "patch")} <= standin.rbac_usage()
    finally:
        stop()
        core.api_client.close()
        manager.close()


def manager_watch(manager: KubeSubnetManager) -> Callable[[], None]:
    """Run the manager's node watch in a thread; the returned function stops it."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            manager.watch_leases(lambda leases, rv: None, stop)
        except BaseException as e:
            errors.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def done() -> None:
        stop.set()
        thread.join(10)
        assert not thread.is_alive(), "the node watch did not stop"
        assert not errors, errors

    return done
