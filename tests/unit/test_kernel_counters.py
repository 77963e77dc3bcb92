"""Kernel counters: /proc/net/snmp, netstat and stat tables parsed; totals accumulated
from deltas stay monotonic as pods come and go; the lab's rules file keeps the
manifest's expressions with shorter windows."""

from __future__ import annotations

import os
import subprocess
from typing import Any

import pytest
import yaml
from flannelpy_lab import prometheus as lab_prometheus
from prometheus_client.parser import text_string_to_metric_families

from flannelpy.observe import kernel_counters as kc
from flannelpy.observe.metrics import AgentMetrics

SNMP = """\
Ip: Forwarding DefaultTTL InReceives InHdrErrors InAddrErrors ForwDatagrams InUnknownProtos InDiscards InDelivers OutRequests OutDiscards OutNoRoutes ReasmTimeout ReasmReqds ReasmOKs ReasmFails FragOKs FragFails FragCreates
Ip: 1 64 1000 0 0 10 0 0 990 900 0 3 0 0 0 0 0 7 0
Icmp: InMsgs InErrors InCsumErrors InDestUnreachs InTimeExcds InParmProbs InSrcQuenchs InRedirects InEchos InEchoReps InTimestamps InTimestampReps InAddrMasks InAddrMaskReps OutMsgs OutErrors OutRateLimitGlobal OutRateLimitHost OutDestUnreachs OutTimeExcds OutParmProbs OutSrcQuenchs OutRedirects OutEchos OutEchoReps OutTimestamps OutTimestampReps OutAddrMasks OutAddrMaskReps
Icmp: 5 0 0 1 0 0 0 0 2 2 0 0 0 0 12 0 0 0 9 0 0 0 0 2 1 0 0 0 0
IcmpMsg: InType0 OutType3
IcmpMsg: 2 9
Tcp: RtoAlgorithm RtoMin RtoMax MaxConn ActiveOpens PassiveOpens AttemptFails EstabResets CurrEstab InSegs OutSegs RetransSegs InErrs OutRsts InCsumErrors
Tcp: 1 200 120000 -1 4 2 0 0 1 500 480 6 0 1 0
Udp: InDatagrams NoPorts InErrors OutDatagrams RcvbufErrors SndbufErrors InCsumErrors IgnoredMulti MemErrors
Udp: 10 1 0 10 0 0 0 0 0
"""  # noqa: E501

NETSTAT = """\
TcpExt: SyncookiesSent SyncookiesRecv IPReversePathFilter TCPTimeouts
TcpExt: 0 0 4 2
IpExt: InNoRoutes InTruncatedPkts
IpExt: 0 0
"""

ARP_CACHE = """\
entries  allocs   destroys hash_grows lookups  hits     res_failed rcv_probes_mcast rcv_probes_ucast periodic_gc_runs forced_gc_runs unresolved_discards table_fulls
00000002 0001da5e 0001d0e9 00000009   0002ebb1 000080bb 00000171   00000000         00000000         00000372         00000000       0000000a            00000000
00000002 0001dcad 0001e620 00000002   0002f8aa 000097bc 000001b3   00000000         00000000         00000000         00000000       00000005            00000000
"""  # noqa: E501

CONNTRACK = """\
entries  clashres found new invalid ignore delete chainlength insert insert_failed drop early_drop icmp_error  expect_new expect_create expect_delete search_restart
00000010  00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000003 00000000 00000000 00000000  00000000 00000000 00000000 00000000
00000010  00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000000 00000001 00000000 00000000 00000000  00000000 00000000 00000000 00000000
"""  # noqa: E501


# --- parsing ---------------------------------------------------------------------------


def test_snmp_pairs_of_lines_become_tables() -> None:
    t = kc.parse_proc_table(SNMP)
    assert t["Tcp"]["RetransSegs"] == 6 and t["Tcp"]["OutSegs"] == 480
    assert t["Tcp"]["MaxConn"] == -1
    assert t["Ip"]["FragFails"] == 7 and t["IcmpMsg"]["OutType3"] == 9


def test_torn_or_odd_tables_are_skipped_not_raised() -> None:
    text = "Tcp: A B C\nTcp: 1 2\nIp: X\nIp: notanumber\nUdp: Q\ngarbage\nUdp: 3\n"
    assert kc.parse_proc_table(text) == {"Ip": {}}
    assert kc.parse_proc_table("") == {}
    # A header without values, then a new proto: the new pair still parses.
    assert kc.parse_proc_table("Tcp: A\nIp: B\nIp: 5\n") == {"Ip": {"B": 5}}


def test_stat_tables_sum_the_cpus_in_hex_without_the_entries_gauge() -> None:
    arp = kc.parse_stat_table(ARP_CACHE)
    assert arp["unresolved_discards"] == 15
    assert "entries" not in arp
    assert kc.parse_stat_table(CONNTRACK)["insert_failed"] == 4
    assert kc.parse_stat_table("a b\n1 zz\n1\n") == {"a": 0, "b": 0}


def test_namespace_counters_map_kernel_fields_to_reasons() -> None:
    c = kc.node_counters(SNMP, NETSTAT, ARP_CACHE, CONNTRACK)
    assert c == {
        "tcp_sent": 480,
        "tcp_retransmitted": 6,
        "frag_needed": 7,
        "icmp_unreachable_sent": 9,
        "no_route": 3,
        "rp_filter": 4,
        "neighbour_unresolved": 15,
        "conntrack_insert_failed": 4,
    }


def test_missing_conntrack_module_leaves_the_reason_absent_not_zero() -> None:
    c = kc.node_counters(SNMP, NETSTAT, ARP_CACHE, None)
    assert "conntrack_insert_failed" not in c
    assert "rp_filter" not in kc.namespace_counters(SNMP)  # a pod: snmp only


def test_no_route_adds_in_and_out_no_routes() -> None:
    snmp = "Ip: InNoRoutes OutNoRoutes\nIp: 2 5\n"
    assert kc.namespace_counters(snmp)["no_route"] == 7


def test_pods_fast_reader_agrees_with_the_line_by_line_parser() -> None:
    assert kc.pod_counters(SNMP) == kc.namespace_counters(SNMP)
    with open("/proc/net/snmp", encoding="ascii") as f:
        live = f.read()
    assert kc.pod_counters(live) == kc.namespace_counters(live)
    # Out of step (a stray first line): still the right values, not misread columns.
    assert kc.pod_counters("junk\n" + SNMP) == kc.namespace_counters(SNMP)
    # A values line of the wrong width is skipped, not misread.
    torn = SNMP.replace("Tcp: 1 200 120000 -1 4 2 0 0 1 500 480 6 0 1 0", "Tcp: 1 200")
    assert "tcp_sent" not in kc.pod_counters(torn)


# --- delta accumulation ----------------------------------------------------------------


def test_totals_stay_monotonic_when_pods_go_and_namespaces_are_replaced() -> None:
    acc = kc.DeltaAccumulator()
    assert acc.update({"a": {"x": 5}, "b": {"x": 10}}) == {"x": 15}
    assert acc.update({"a": {"x": 7}, "b": {"x": 10}}) == {"x": 17}
    # b is deleted: what it counted stays.
    assert acc.update({"a": {"x": 8}}) == {"x": 18}
    assert acc.sources == 1
    # a's namespace is replaced under the same key (its counter starts again at 2).
    assert acc.update({"a": {"x": 2}}) == {"x": 20}
    # a new pod counts all it counted since it was made.
    assert acc.update({"a": {"x": 2}, "c": {"x": 4, "y": 1}}) == {"x": 24, "y": 1}
    assert acc.update({}) == {"x": 24, "y": 1}


# --- pods read through their namespaces ------------------------------------------------


class FakeKernel:
    """Namespaces by path: (dev, inode) and the snmp text each descriptor reads."""

    def __init__(self, tmp: Any) -> None:
        self.tmp = tmp
        self.text: dict[int, str] = {}
        self.opened: list[str] = []

    def ns(self, name: str) -> str:
        path = os.path.join(self.tmp, name)
        with open(path, "w"):
            pass
        return path

    def open_snmp(self, path: str | int) -> int:
        self.opened.append(str(path))
        fd = os.dup(path) if isinstance(path, int) else os.open(path, os.O_RDONLY)
        self.text[fd] = self.text.get(-1, "")
        return fd

    def read_fd(self, fd: int) -> str:
        return self.text[fd]


def tcp(sent: int, retrans: int) -> str:
    return f"Tcp: OutSegs RetransSegs\nTcp: {sent} {retrans}\n"


def test_pod_counters_open_once_read_each_scrape_and_close_at_del(tmp_path: Any) -> None:
    k = FakeKernel(str(tmp_path))
    pods = {"p1": k.ns("p1"), "p2": k.ns("p2")}
    reader = kc.PodCounters(lambda: list(pods.items()), k.open_snmp, k.read_fd)
    k.text[-1] = tcp(100, 1)
    assert reader.read() == {"tcp_sent": 200, "tcp_retransmitted": 2}
    fds = {key: held.fd for key, held in reader._open.items()}
    for fd in fds.values():
        k.text[fd] = tcp(150, 1)
    assert reader.read() == {"tcp_sent": 300, "tcp_retransmitted": 2}
    assert len(k.opened) == 2  # not re-opened
    del pods["p2"]  # DEL: its descriptor is closed, its counts stay
    assert reader.read() == {"tcp_sent": 300, "tcp_retransmitted": 2}
    assert set(reader._open) == {"p1"}
    with pytest.raises(OSError):
        os.fstat(fds["p2"])
    reader.close()


def test_a_replaced_or_vanished_namespace_path_is_not_held(tmp_path: Any) -> None:
    k = FakeKernel(str(tmp_path))
    path = k.ns("p1")
    reader = kc.PodCounters(lambda: [("p1", path)], k.open_snmp, k.read_fd)
    k.text[-1] = tcp(10, 0)
    reader.read()
    os.unlink(path)  # the runtime removed the namespace without a DEL
    assert reader.read() == {"tcp_sent": 10, "tcp_retransmitted": 0}
    assert reader._open == {} and reader.unreadable == 1
    k.ns("p1")  # a new namespace at the same path: opened anew, counted from its start
    k.text[-1] = tcp(3, 0)
    assert reader.read() == {"tcp_sent": 13, "tcp_retransmitted": 0}
    assert len(k.opened) == 2 and reader.read_namespaces == 1
    reader.close()


def test_a_namespace_adopted_at_add_reads_without_its_path_until_del(tmp_path: Any) -> None:
    k = FakeKernel(str(tmp_path))
    invisible = os.path.join(str(tmp_path), "not-mounted-here")
    records = [("net/c1/eth0", invisible)]
    counters = kc.KernelCounters(
        kc.PodCounters(lambda: list(records), k.open_snmp, k.read_fd), read_node=dict
    )
    netns = os.open(k.ns("runtime-side"), os.O_RDONLY)
    env = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c1", "CNI_IFNAME": "eth0"}
    k.text[-1] = tcp(40, 2)
    counters.on_cni(env, b'{"name": "net", "cniVersion": "1.0.0"}', netns)
    os.close(netns)  # the server closes the passed descriptor after the request
    reading = counters()
    assert reading.pods == {"tcp_sent": 40, "tcp_retransmitted": 2}
    assert (reading.pod_namespaces, reading.pod_namespaces_unreadable) == (1, 0)
    pods = counters._pods
    assert pods is not None and set(pods._open) == {"net/c1/eth0"}
    counters.on_cni({**env, "CNI_COMMAND": "DEL"}, b'{"name": "net"}', None)
    assert pods._open == {}
    # Still listed (the record outlives DEL for a moment): unreadable, totals kept.
    reading = counters()
    assert reading.pods == {"tcp_sent": 40, "tcp_retransmitted": 2}
    assert reading.pod_namespaces_unreadable == 1


def test_requests_without_a_key_are_ignored() -> None:
    assert kc.attachment_key({"CNI_CONTAINERID": "c", "CNI_IFNAME": "eth0"}, b"nope") is None
    assert kc.attachment_key({"CNI_CONTAINERID": "c"}, b'{"name": "n"}') is None
    assert kc.attachment_key({"CNI_CONTAINERID": "c", "CNI_IFNAME": "e"}, b"[1]") is None
    assert kc.attachment_key({"CNI_CONTAINERID": "c", "CNI_IFNAME": "e"}, b'{"name": "n"}') == (
        "n/c/e"
    )


def test_an_unreadable_pod_never_fails_the_scrape(tmp_path: Any) -> None:
    k = FakeKernel(str(tmp_path))

    def refuse(path: str | int) -> int:
        raise OSError(1, "Operation not permitted")

    reader = kc.PodCounters(lambda: [("p1", k.ns("p1"))], refuse, k.read_fd)
    assert reader.read() == {} and reader.unreadable == 1


def test_agent_metrics_export_the_families_and_count_a_failed_reading() -> None:
    m = AgentMetrics()
    reading = kc.KernelReading(
        {"tcp_sent": 5, "tcp_retransmitted": 1, "frag_needed": 2},
        {"tcp_sent": 9, "no_route": 1},
        3,
        1,
    )
    m.set_kernel_provider(lambda: reading)
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(m.exposition().decode())
        for s in f.samples
    }
    assert samples[("flannelpy_node_tcp_sent_segments_total", ())] == 5
    assert samples[("flannelpy_pod_tcp_sent_segments_total", ())] == 9
    assert ("flannelpy_pod_tcp_retransmitted_segments_total", ()) not in samples
    drops = (("reason", "frag_needed"), ("scope", "node"))
    assert samples[("flannelpy_kernel_drops_total", drops)] == 2
    assert samples[("flannelpy_kernel_drops_total", (("reason", "no_route"), ("scope", "pods")))]
    assert samples[("flannelpy_pod_namespaces_counted", (("readable", "false"),))] == 1

    def broken() -> kc.KernelReading:
        raise OSError("no /proc")

    m.set_kernel_provider(broken)
    text = m.exposition().decode()
    assert "flannelpy_kernel_drops_total{" not in text
    assert 'flannelpy_scrape_errors_total{provider="kernel"} 1.0' in text


def test_node_namespace_of_this_machine_reads() -> None:
    c = kc.read_node()
    assert c["tcp_sent"] >= 0 and "no_route" in c and "frag_needed" in c


# --- the lab's rules file --------------------------------------------------------------


def test_lab_rules_keep_expressions_and_shorten_windows_and_for() -> None:
    manifest = lab_prometheus.load_manifest()
    rules = lab_prometheus.rules_file(manifest)
    original = {r["alert"]: r for g in manifest["spec"]["groups"] for r in g["rules"]}
    lab = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    assert lab.keys() == original.keys()
    for name, rule in lab.items():
        assert rule["expr"] == lab_prometheus.lab_expr(original[name]["expr"])
        assert "[5m]" not in rule["expr"] and "[1h]" not in rule["expr"]
        if "for" in original[name]:
            assert lab_prometheus.seconds(rule["for"]) <= 10
        assert rule["labels"] == original[name]["labels"]
    assert lab["FlannelpyLeaseRenewalsFailing"]["expr"].count("[30s]") == 1


def test_lab_rules_file_passes_promtool(tmp_path: Any) -> None:
    path = tmp_path / "rules.yml"
    path.write_text(yaml.safe_dump(lab_prometheus.rules_file(lab_prometheus.load_manifest())))
    proc = subprocess.run(
        ["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_range_rewrite_keeps_subquery_resolution_and_other_brackets() -> None:
    assert lab_prometheus.lab_expr("rate(x[5m]) + max_over_time(y[1h:1m])") == (
        "rate(x[30s]) + max_over_time(y[30s:1m])"
    )


def test_rules_file_refuses_what_is_not_a_prometheusrule() -> None:
    with pytest.raises(ValueError, match="not a PrometheusRule"):
        lab_prometheus.rules_file({"kind": "ConfigMap"})
    with pytest.raises(ValueError, match=r"no spec\.groups"):
        lab_prometheus.rules_file({"kind": "PrometheusRule", "spec": {}})
    with pytest.raises(ValueError, match="not of the form"):
        lab_prometheus.seconds("1h30m")


def test_a_lab_with_prometheus_binds_agents_on_their_lab_address_and_scrapes_them(
    tmp_path: Any,
) -> None:
    from ipaddress import IPv4Network

    from flannelpy_lab import agents, plan

    state = plan.plan_lab(
        "unit",
        3,
        "vxlan",
        direct_routing=False,
        segments=1,
        network="10.244.0.0/16",
        etcd_prefix="/coreos.com/network",
        subnets=[IPv4Network("100.64.9.0/24")],
        overlay_bridge=False,
        lab_root=str(tmp_path),
        flanneld_nodes=1,
    )
    n1 = state.nodes[0]
    assert not any(a.startswith("--metrics-addr") for a in agents.agent_argv(state, n1))
    lab_prometheus.record(state)
    assert f"--metrics-addr={n1.ip}:9403" in agents.agent_argv(state, n1)
    config = lab_prometheus.scrape_config(state, "/x/rules.yml")
    static = config["scrape_configs"][0]["static_configs"]
    # The flanneld node exports no flannelpy metrics: not a target.
    assert [(s["targets"], s["labels"]) for s in static] == [
        ([f"{n.ip}:9403"], {"node": n.name}) for n in state.nodes[:2]
    ]
    assert config["rule_files"] == ["/x/rules.yml"]
    host = state.host_address.split("/")[0]
    assert lab_prometheus.url(state) == f"http://{host}:9090"


def test_lab_status_names_the_prometheus_address() -> None:
    from flannelpy_lab import status

    doc = {
        "name": "demo",
        "backend": "vxlan",
        "network": "10.244.0.0/16",
        "etcd_endpoints": [],
        "nodes": [],
        "leases": [],
        "matrix": {},
        "prometheus": {"url": "http://100.64.0.254:9090", "running": True},
    }
    text = status.render_text(doc)
    assert "prometheus http://100.64.0.254:9090 (running)" in text
    assert "prometheus" not in status.render_text({**doc, "prometheus": None})
