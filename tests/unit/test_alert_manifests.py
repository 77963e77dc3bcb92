"""manifests/: the PrometheusRule passes promtool and its alerts fire when they should;
the rules and the Grafana dashboard use only metrics flannelpy.observe.metric_families lists;
the ServiceMonitor finds the DaemonSet's metrics port."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from flannelpy.dataplane import linkstats
from flannelpy.observe import metric_families

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests"
RULES = MANIFESTS / "prometheusrule.yaml"
DASHBOARD = MANIFESTS / "grafana-dashboard.json"
SERVICE_MONITOR = MANIFESTS / "servicemonitor.yaml"
DAEMONSET = MANIFESTS / "kube-flannelpy.yml"

# PromQL words that look like names but are not series.
_KEYWORDS = {
    "and",
    "or",
    "unless",
    "bool",
    "offset",
    "inf",
    "nan",
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
}
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NAME = re.compile(r"(?<![\w.$])[a-zA-Z_:][a-zA-Z0-9_:]*")


def metric_names(expr: str) -> set[str]:
    """Series names a PromQL expression reads (label names, functions, keywords removed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range selectors
    text = _GROUPING.sub("", text)
    names = set()
    for match in _NAME.finditer(text):
        word = match.group(0)
        if text[match.end() :].lstrip().startswith("(") or word.lower() in _KEYWORDS:
            continue  # a function call or a keyword
        names.add(word)
    return names


def role_values(expr: str) -> set[str]:
    return set(re.findall(r'role=~?"([^"]+)"', expr))


def rules_doc() -> dict[str, Any]:
    doc = yaml.safe_load(RULES.read_text())
    assert isinstance(doc, dict)
    return doc


def rules() -> list[dict[str, Any]]:
    return [rule for group in rules_doc()["spec"]["groups"] for rule in group["rules"]]


def dashboard_exprs(node: Any) -> Iterator[str]:
    """Every PromQL text in the dashboard: panel targets and template variable queries."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "expr" and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, str) and value.startswith("label_values("):
                # label_values(metric, label): the metric is the first argument.
                yield value[len("label_values(") :].split(",")[0]
            else:
                yield from dashboard_exprs(value)
    elif isinstance(node, list):
        for item in node:
            yield from dashboard_exprs(item)


def promtool() -> str:
    path = shutil.which("promtool")
    assert path, "promtool is missing: scripts/bootstrap.sh installs it (apt package prometheus)"
    return path


def test_metric_name_extraction_sees_what_an_expression_reads() -> None:
    expr = (
        'sum by (node, role) (rate(flannelpy_a_total{role="vxlan", x=~"a|b"}[5m])) > 1e3 '
        "and on (node) flannelpy_b unless ignoring(peer) up offset 5m"
    )
    assert metric_names(expr) == {"flannelpy_a_total", "flannelpy_b", "up"}
    assert metric_names(
        "histogram_quantile(0.99, sum by (le) (rate(x_bucket[$__rate_interval])))"
    ) == {"x_bucket"}


def test_prometheusrule_is_an_operator_resource_with_complete_alerts() -> None:
    doc = rules_doc()
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert doc["metadata"]["labels"]["app.kubernetes.io/name"] == "flannelpy"
    for rule in rules():
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]


def test_rule_groups_pass_promtool(tmp_path: Path) -> None:
    rule_file = tmp_path / "rules.yml"
    rule_file.write_text(yaml.safe_dump({"groups": rules_doc()["spec"]["groups"]}))
    proc = subprocess.run(
        [promtool(), "check", "rules", str(rule_file)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(rules())} rules found" in proc.stdout


def test_alerts_cover_what_the_issue_asks_for() -> None:
    by_name = {rule["alert"]: rule["expr"] for rule in rules()}
    wanted = {
        "FlannelpyDroppedPacketsRising": "flannelpy_interface_dropped_packets_total",
        "FlannelpyPeerUnreachable": "flannelpy_peer_reachable",
        "FlannelpyMTUMismatch": "flannelpy_peers_mtu_mismatch",
        "FlannelpyLeaseExpiringSoon": "flannelpy_lease_expiry_timestamp_seconds",
        "FlannelpyIPAMNearlyExhausted": "flannelpy_ipam_cooling_addresses",
        "FlannelpyReconcilerFailing": "flannelpy_reconciler_converged",
    }
    for alert, metric in wanted.items():
        assert metric in metric_names(by_name[alert]), alert


def test_rules_use_only_exported_metrics() -> None:
    exported = metric_families.sample_names()
    for rule in rules():
        unknown = metric_names(rule["expr"]) - exported
        assert not unknown, f"{rule['alert']} reads {unknown}, which flannelpy does not export"
        assert role_values(rule["expr"]) <= set(linkstats.ROLES)


def test_dashboard_is_valid_json_and_uses_only_exported_metrics() -> None:
    board = json.loads(DASHBOARD.read_text())
    exprs = list(dashboard_exprs(board))
    assert len(exprs) >= 20
    exported = metric_families.sample_names()
    for expr in exprs:
        unknown = metric_names(expr) - exported
        assert not unknown, f"dashboard query {expr!r} reads {unknown}, not exported"
        assert role_values(expr) <= set(linkstats.ROLES)
    panels = [p for p in board["panels"] if p["type"] != "row"]
    assert all(p["targets"] for p in panels)
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    used = set().union(*(metric_names(e) for e in exprs))
    # The families the issue calls out are all on the board.
    for family in (
        "flannelpy_interface_dropped_packets_total",
        "flannelpy_peer_reachable",
        "flannelpy_peer_path_mtu_verified",
        "flannelpy_peers_mtu_mismatch",
        "flannelpy_ipam_cooling_addresses",
        "flannelpy_cni_request_duration_seconds_bucket",
        "flannelpy_lease_expiry_timestamp_seconds",
        "flannelpy_reconciler_repairs_total",
    ):
        assert family in used, family


def test_service_monitor_scrapes_the_daemonsets_metrics_port() -> None:
    service, monitor = list(yaml.safe_load_all(SERVICE_MONITOR.read_text()))
    assert (monitor["apiVersion"], monitor["kind"]) == (
        "monitoring.coreos.com/v1",
        "ServiceMonitor",
    )
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert service["metadata"]["namespace"] in monitor["spec"]["namespaceSelector"]["matchNames"]
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = service["spec"]["ports"]
    assert endpoint["port"] == port["name"]
    assert any(r["targetLabel"] == "node" for r in endpoint["relabelings"])
    daemonset = next(
        d for d in yaml.safe_load_all(DAEMONSET.read_text()) if d and d["kind"] == "DaemonSet"
    )
    pod_labels = daemonset["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert service["metadata"]["namespace"] == daemonset["metadata"]["namespace"]
    container_ports = {
        p["name"]: p["containerPort"]
        for c in daemonset["spec"]["template"]["spec"]["containers"]
        for p in c.get("ports", [])
    }
    assert container_ports[port["targetPort"]] == port["port"]


# Alert behaviour under promtool's unit tests: series in, alerts out. Annotations are
# dropped from the copy under test (promtool compares them verbatim; `check rules`
# above validates their templates).
ALERT_TESTS = """
rule_files: [rules.yml]
evaluation_interval: 1m
tests:
- interval: 1m
  input_series:
  # n1: 200 assigned + 40 cooling of 253 -> 95% unavailable although 53 are not assigned
  - series: 'flannelpy_ipam_assigned_addresses{node="n1",subnet="10.244.1.0/24"}'
    values: '200x20'
  - series: 'flannelpy_ipam_cooling_addresses{node="n1",subnet="10.244.1.0/24"}'
    values: '40x20'
  - series: 'flannelpy_ipam_free_addresses{node="n1",subnet="10.244.1.0/24"}'
    values: '13x20'
  - series: 'flannelpy_ipam_capacity_addresses{node="n1",subnet="10.244.1.0/24"}'
    values: '253x20'
  # n2: the same pods, nothing cooling -> 79%: no alert
  - series: 'flannelpy_ipam_assigned_addresses{node="n2",subnet="10.244.2.0/24"}'
    values: '200x20'
  - series: 'flannelpy_ipam_cooling_addresses{node="n2",subnet="10.244.2.0/24"}'
    values: '0x20'
  - series: 'flannelpy_ipam_free_addresses{node="n2",subnet="10.244.2.0/24"}'
    values: '53x20'
  - series: 'flannelpy_ipam_capacity_addresses{node="n2",subnet="10.244.2.0/24"}'
    values: '253x20'
  # drops: 2/s on n1's vxlan device, 0.1/s on n2's
  - series: 'flannelpy_interface_dropped_packets_total{node="n1",role="vxlan",direction="tx"}'
    values: '0+120x30'
  - series: 'flannelpy_interface_dropped_packets_total{node="n2",role="vxlan",direction="tx"}'
    values: '0+6x30'
  # n1 stops answering n3 at minute 2
  - series: 'flannelpy_peer_reachable{node="n1",peer="10.244.3.0/24"}'
    values: '1 1 0x20'
  - series: 'flannelpy_peer_reachable{node="n2",peer="10.244.3.0/24"}'
    values: '1x20'
  - series: 'flannelpy_peers_mtu_mismatch{node="n2"}'
    values: '1x20'
  - series: 'flannelpy_peers_mtu_mismatch{node="n1"}'
    values: '0x20'
  # n1's lease expires at t=2400 s; n2's is a reservation (+Inf)
  - series: 'flannelpy_lease_expiry_timestamp_seconds{node="n1",subnet="10.244.1.0/24"}'
    values: '2400x40'
  - series: 'flannelpy_lease_expiry_timestamp_seconds{node="n2",subnet="10.244.2.0/24"}'
    values: '+Inf+0x40'
  - series: 'flannelpy_reconciler_converged{node="n1"}'
    values: '1 1 0x20'
  - series: 'flannelpy_reconciler_converged{node="n2"}'
    values: '1x20'
  # pools: 10.244.0.0/16 at 60 %, 10.250.0.0/16 at 10 % (two nodes report each)
  - series: 'flannelpy_pool_utilisation_ratio{node="n1",pool="10.244.0.0/16"}'
    values: '0.6x90'
  - series: 'flannelpy_pool_utilisation_ratio{node="n2",pool="10.244.0.0/16"}'
    values: '0.6x90'
  - series: 'flannelpy_pool_utilisation_ratio{node="n1",pool="10.250.0.0/16"}'
    values: '0.1x90'
  # n1 serves from its 2 allowed leases with 10 free; n2 from 1 of 2
  - series: 'flannelpy_leases{node="n1",state="serving"}'
    values: '2x30'
  - series: 'flannelpy_leases_max{node="n1"}'
    values: '2x30'
  - series: 'flannelpy_leases{node="n2",state="serving"}'
    values: '1x30'
  - series: 'flannelpy_leases_max{node="n2"}'
    values: '2x30'
  # n2 blocks one disruptive change at minute 5
  - series: 'flannelpy_blocked_operations_total{node="n2",kind="backend_change"}'
    values: '0x5 1x30'
  - series: 'flannelpy_blocked_operations_total{node="n1",kind="backend_change"}'
    values: '0x35'
  # n1's pods send 100 TCP segments/s, 5/s retransmitted (5%); n2's 1% ; n3 sends 0.5/s
  # with half of them retransmitted (idle: no alert)
  - series: 'flannelpy_pod_tcp_sent_segments_total{node="n1"}'
    values: '0+6000x30'
  - series: 'flannelpy_pod_tcp_retransmitted_segments_total{node="n1"}'
    values: '0+300x30'
  - series: 'flannelpy_pod_tcp_sent_segments_total{node="n2"}'
    values: '0+6000x30'
  - series: 'flannelpy_pod_tcp_retransmitted_segments_total{node="n2"}'
    values: '0+60x30'
  - series: 'flannelpy_pod_tcp_sent_segments_total{node="n3"}'
    values: '0+30x30'
  - series: 'flannelpy_pod_tcp_retransmitted_segments_total{node="n3"}'
    values: '0+15x30'
  # n1's node namespace: 3 frag_needed drops/s; no_route 0.1/s
  - series: 'flannelpy_kernel_drops_total{node="n1",scope="node",reason="frag_needed"}'
    values: '0+180x30'
  - series: 'flannelpy_kernel_drops_total{node="n1",scope="node",reason="no_route"}'
    values: '0+6x30'
  # a/db's isolated pods have 3 ingress packets/s denied (summed over nodes), a/web 0.5/s
  - series: 'flannelpy_policy_denied_packets_total{namespace="a",policy="db",direction="ingress"}'
    values: '0+180x30'
  - series: 'flannelpy_policy_denied_packets_total{namespace="a",policy="web",direction="egress"}'
    values: '0+30x30'
  alert_rule_test:
  - eval_time: 20m
    alertname: FlannelpyPolicyDenialsRising
    exp_alerts:
    - exp_labels: {severity: warning, namespace: a, policy: db, direction: ingress}
  - eval_time: 20m
    alertname: FlannelpyTCPRetransmissionsHigh
    exp_alerts:
    - exp_labels: {severity: warning, node: n1}
  - eval_time: 20m
    alertname: FlannelpyKernelDropsRising
    exp_alerts:
    - exp_labels: {severity: warning, node: n1, scope: node, reason: frag_needed}
  - eval_time: 70m
    alertname: FlannelpyAddressPoolHalfUsed
    exp_alerts:
    - exp_labels: {severity: warning, pool: 10.244.0.0/16}
  - eval_time: 20m
    alertname: FlannelpyNodeAtLeaseLimit
    exp_alerts:
    - exp_labels: {severity: warning, node: n1}
  - eval_time: 10m
    alertname: FlannelpyDisruptiveChangeBlocked
    exp_alerts:
    - exp_labels: {severity: warning, node: n2, kind: backend_change}
  - eval_time: 10m
    alertname: FlannelpyIPAMNearlyExhausted
    exp_alerts:
    - exp_labels: {severity: warning, node: n1, subnet: 10.244.1.0/24}
  - eval_time: 10m
    alertname: FlannelpyIPAMExhausted
    exp_alerts: []
  - eval_time: 20m
    alertname: FlannelpyDroppedPacketsRising
    exp_alerts:
    - exp_labels: {severity: warning, node: n1, role: vxlan, direction: tx}
  - eval_time: 6m
    alertname: FlannelpyPeerUnreachable
    exp_alerts:
    - exp_labels: {severity: critical, node: n1, peer: 10.244.3.0/24}
  - eval_time: 10m
    alertname: FlannelpyMTUMismatch
    exp_alerts:
    - exp_labels: {severity: warning, node: n2}
  - eval_time: 10m
    alertname: FlannelpyLeaseExpiringSoon
    exp_alerts:
    - exp_labels: {severity: warning, node: n1, subnet: 10.244.1.0/24}
  - eval_time: 10m
    alertname: FlannelpyLeaseExpiryImminent
    exp_alerts: []
  - eval_time: 38m
    alertname: FlannelpyLeaseExpiryImminent
    exp_alerts:
    - exp_labels: {severity: critical, node: n1, subnet: 10.244.1.0/24}
  - eval_time: 10m
    alertname: FlannelpyReconcilerFailing
    exp_alerts:
    - exp_labels: {severity: critical, node: n1}
"""


def test_alerts_fire_when_they_should_and_only_then(tmp_path: Path) -> None:
    groups = rules_doc()["spec"]["groups"]
    for group in groups:
        for rule in group["rules"]:
            rule.pop("annotations", None)
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": groups}))
    (tmp_path / "tests.yml").write_text(ALERT_TESTS)
    proc = subprocess.run(
        [promtool(), "test", "rules", "tests.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_a_rule_that_never_fires_fails_the_alert_tests(tmp_path: Path) -> None:
    """The promtool unit tests can fail: the same tests against a broken rule."""
    groups = rules_doc()["spec"]["groups"]
    for group in groups:
        for rule in group["rules"]:
            rule.pop("annotations", None)
            if rule["alert"] == "FlannelpyPeerUnreachable":
                rule["expr"] = "flannelpy_peer_reachable == 2"
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": groups}))
    (tmp_path / "tests.yml").write_text(ALERT_TESTS)
    proc = subprocess.run(
        [promtool(), "test", "rules", "tests.yml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0 and "FlannelpyPeerUnreachable" in proc.stdout + proc.stderr
