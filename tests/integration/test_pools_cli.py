"""`flannelpy pools` and the pool store against a real etcd.

The command runs in-process through ``flannelpy.cli.main`` (its real parser,
settings and etcd client); the test reads and writes keys behind its back with
its own connection. One test runs the real executable to see that a refusal is
one line and no traceback.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from ipaddress import IPv4Network
from types import SimpleNamespace
from typing import Any, cast

import pytest
from flannelpy_lab.cli import main as lab_main

from flannelpy.cli import main
from flannelpy.config.netconf import parse_network_config
from flannelpy.store.etcd.client import EtcdStore
from flannelpy.store.etcd.config import put_network_config
from flannelpy.store.etcd.kv import Store
from flannelpy.store.etcd.pools import PoolStore
from flannelpy.subnet.keys import pool_key
from tests.support.etcd_server import EtcdServer, free_port
from tests.support.lab_util import lab_run_args, lab_run_argv

NETCONF = '{"Network": "10.244.0.0/16", "Backend": {"Type": "vxlan"}}'
LEASE_VALUE = '{"PublicIP":"192.168.64.3","PublicIPv6":null,"BackendType":"vxlan"}'
ROLE = "flannelpy.io/role"


@dataclass
class Cluster:
    endpoint: str
    prefix: str
    store: EtcdStore  # the test's own connection
    capsys: pytest.CaptureFixture[str]

    def pools(self, *argv: str) -> tuple[int, str, str]:
        """Run ``flannelpy pools VERB ...`` on this etcd; exit code, stdout, stderr."""
        self.capsys.readouterr()
        verb, *rest = argv
        code = main(
            ["pools", verb, "--etcd-endpoints", self.endpoint, "--etcd-prefix", self.prefix, *rest]
        )
        out, err = self.capsys.readouterr()
        return code, out, err

    def listing(self, *argv: str) -> dict[str, Any]:
        code, out, err = self.pools("list", "--json", *argv)
        assert (code, err) == (0, ""), err
        return cast(dict[str, Any], json.loads(out))

    def record(self, cidr: str) -> dict[str, Any] | None:
        kv = self.store.get(pool_key(self.prefix, IPv4Network(cidr)))
        return None if kv is None else cast(dict[str, Any], json.loads(kv.value))

    def put_lease(self, subnet: str) -> None:
        key = subnet.replace("/", "-")
        self.store.put(f"{self.prefix}/subnets/{key}", LEASE_VALUE.encode())


@pytest.fixture
def cluster(
    etcd_server: EtcdServer,
    etcd_prefix: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> Iterator[Cluster]:
    for name in ("FLANNELD_KUBE_SUBNET_MGR", "FLANNELD_ETCD_ENDPOINTS", "FLANNELD_ETCD_PREFIX"):
        monkeypatch.delenv(name, raising=False)
    store = EtcdStore([etcd_server.endpoint])
    try:
        put_network_config(store, etcd_prefix, NETCONF)
        yield Cluster(etcd_server.endpoint, etcd_prefix, store, capsys)
    finally:
        store.close()


def summary(doc: dict[str, Any]) -> list[tuple[str, bool, dict[str, str], bool]]:
    return [(p["network"], p["primary"], p["tags"], p["create_leases"]) for p in doc["pools"]]


def one_line_refusal(err: str, by: str = "flannelpy pools") -> str:
    assert err.startswith(f"{by}: ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    return err


# --- the life of a pool ------------------------------------------------------------------------


def test_add_tag_untag_remove_and_list(cluster: Cluster) -> None:
    assert summary(cluster.listing()) == [("10.244.0.0/16", True, {}, True)]

    code, out, _ = cluster.pools("add", "10.250.0.0/16")
    assert code == 0
    assert "no new lease lands there yet" in out
    assert f"flannelpy pools tag 10.250.0.0/16 {ROLE}=1" in out
    assert cluster.record("10.250.0.0/16") == {
        "Network": "10.250.0.0/16",
        "SubnetLen": 24,
        "Tags": {},
    }
    # Untagged: listed, but no new leases (creation fails closed).
    assert summary(cluster.listing()) == [
        ("10.244.0.0/16", True, {}, True),
        ("10.250.0.0/16", False, {}, False),
    ]

    code, out, _ = cluster.pools("tag", "10.250.0.0/16", f"{ROLE}=1")
    assert code == 0 and out.startswith(f"tagged 10.250.0.0/16 {ROLE}=1")
    code, _, _ = cluster.pools("tag", "10.250.0.0/16", "flannelpy.io/cluster/prod=true")
    assert code == 0
    assert cluster.record("10.250.0.0/16") == {
        "Network": "10.250.0.0/16",
        "SubnetLen": 24,
        "Tags": {ROLE: "1", "flannelpy.io/cluster/prod": "true"},
    }
    # Scoped to cluster prod: only its agents may lease there.
    assert [p["create_leases"] for p in cluster.listing("--cluster-name", "prod")["pools"]] == [
        True,
        True,
    ]
    assert [p["create_leases"] for p in cluster.listing("--cluster-name", "dev")["pools"]] == [
        True,
        False,
    ]
    assert cluster.listing()["pools"][1]["create_leases"] is False  # no cluster name

    # Tagging again changes nothing; untag a tag that is not there is success too.
    before = cluster.store.get(pool_key(cluster.prefix, IPv4Network("10.250.0.0/16")))
    code, out, _ = cluster.pools("tag", "10.250.0.0/16", f"{ROLE}=1")
    assert code == 0 and "nothing changed" in out
    after = cluster.store.get(pool_key(cluster.prefix, IPv4Network("10.250.0.0/16")))
    assert before is not None and after is not None
    assert after.mod_revision == before.mod_revision

    code, out, _ = cluster.pools("untag", "10.250.0.0/16", ROLE)
    assert code == 0 and f"to drain it, tag it {ROLE}=0" in out
    code, out, _ = cluster.pools("untag", "10.250.0.0/16", ROLE)
    assert code == 0 and "nothing changed" in out
    assert cluster.record("10.250.0.0/16") == {
        "Network": "10.250.0.0/16",
        "SubnetLen": 24,
        "Tags": {"flannelpy.io/cluster/prod": "true"},
    }

    code, out, _ = cluster.pools("remove", "10.250.0.0/16")
    assert (code, out) == (0, "removed pool 10.250.0.0/16\n")
    assert cluster.record("10.250.0.0/16") is None
    assert summary(cluster.listing()) == [("10.244.0.0/16", True, {}, True)]


def test_the_primary_pool_gets_a_record_only_while_tagged(cluster: Cluster) -> None:
    assert cluster.record("10.244.0.0/16") is None
    code, out, _ = cluster.pools("tag", "10.244.0.0/16", f"{ROLE}=0")
    assert code == 0 and "draining" in out
    assert cluster.record("10.244.0.0/16") == {
        "Network": "10.244.0.0/16",
        "SubnetLen": 24,
        "Tags": {ROLE: "0"},
    }
    assert summary(cluster.listing()) == [("10.244.0.0/16", True, {ROLE: "0"}, False)]
    code, _, _ = cluster.pools("untag", "10.244.0.0/16", ROLE)
    assert code == 0
    assert cluster.record("10.244.0.0/16") is None
    assert summary(cluster.listing()) == [("10.244.0.0/16", True, {}, True)]


# --- refusals: one sentence, the error's exit code, nothing written -------------------------


@pytest.mark.parametrize(
    ("argv", "code", "says"),
    [
        (("add", "10.244.128.0/17"), 2, "overlaps the primary pool"),
        (("add", "10.244.0.0/16"), 2, "is the primary pool"),
        (("add", "10.250.0.0/16"), 2, "is a pool already"),
        (("add", "10.250.0.0/15"), 2, "overlaps pool 10.250.0.0/16"),
        (("add", "10.251.0.0/24"), 2, "too small for SubnetLen 24"),
        (("add", "10.251.0.1/16"), 2, "host bits set"),
        (("add", "fd00::/48"), 2, "net-conf.json runs no IPv6; set EnableIPv6 and IPv6Network"),
        (("tag", "10.250.0.0/16", f"{ROLE}=2"), 2, "is not a role"),
        (("tag", "10.250.0.0/16", "team=net"), 2, "is not a pool tag"),
        (("tag", "10.250.0.0/16", "flannelpy.io/cluster/=x"), 2, "is not a cluster name"),
        (("tag", "10.99.0.0/16", f"{ROLE}=1"), 2, "there is no pool 10.99.0.0/16"),
        (("untag", "10.99.0.0/16", ROLE), 2, "there is no pool 10.99.0.0/16"),
        (("remove", "10.244.0.0/16"), 2, "primary pool"),
        (("remove", "10.99.0.0/16"), 2, "there is no pool 10.99.0.0/16"),
        (("remove", "10.252.0.0/16"), 2, f"in service ({ROLE}=1); tag it {ROLE}=0"),
        (("list", "--cluster-name", "bad_"), 2, "is not a cluster name"),
    ],
)
def test_refusals_are_one_sentence_with_the_error_exit_code(
    cluster: Cluster, argv: tuple[str, ...], code: int, says: str
) -> None:
    for cidr in ("10.250.0.0/16", "10.252.0.0/16"):
        assert cluster.pools("add", cidr)[0] == 0
    assert cluster.pools("tag", "10.252.0.0/16", f"{ROLE}=1")[0] == 0
    items_before, _ = cluster.store.get_prefix(cluster.prefix + "/")
    got, out, err = cluster.pools(*argv)
    assert (got, out) == (code, "")
    assert says in one_line_refusal(err)
    items_after, _ = cluster.store.get_prefix(cluster.prefix + "/")
    assert items_after == items_before


def test_remove_is_refused_while_leases_remain_in_the_pool(cluster: Cluster) -> None:
    assert cluster.pools("add", "10.250.0.0/16")[0] == 0
    assert cluster.pools("tag", "10.250.0.0/16", f"{ROLE}=0")[0] == 0
    cluster.put_lease("10.250.7.0/24")
    cluster.put_lease("10.250.0.0/24")  # in the pool though not leasable: still counts
    cluster.put_lease("10.244.3.0/24")  # in the primary: irrelevant
    code, _, err = cluster.pools("remove", "10.250.0.0/16")
    assert code == 2
    assert "10.250.0.0/16 still holds 2 lease(s) (10.250.0.0/24, 10.250.7.0/24)" in (
        one_line_refusal(err)
    )
    assert cluster.record("10.250.0.0/16") is not None
    for key in ("10.250.7.0-24", "10.250.0.0-24"):
        kv = cluster.store.get(f"{cluster.prefix}/subnets/{key}")
        assert kv is not None
        assert cluster.store.delete_if_mod_revision(kv.key, kv.mod_revision)
    assert cluster.pools("remove", "10.250.0.0/16")[0] == 0
    assert cluster.record("10.250.0.0/16") is None


# --- capacity --------------------------------------------------------------------------------


def test_list_shows_capacity_and_warns_past_half_used(cluster: Cluster) -> None:
    put_network_config(
        cluster.store, cluster.prefix, '{"Network": "10.244.0.0/22", "Backend": {"Type": "vxlan"}}'
    )
    assert cluster.pools("add", "10.250.0.0/20")[0] == 0
    assert cluster.pools("tag", "10.250.0.0/20", f"{ROLE}=1")[0] == 0
    for subnet in ("10.244.1.0/24", "10.244.2.0/24", "10.250.4.0/24"):
        cluster.put_lease(subnet)
    doc = cluster.listing()
    primary, extra = doc["pools"]
    assert (primary["size"], primary["taken"], primary["free"], primary["leases"]) == (3, 2, 1, 2)
    assert (extra["size"], extra["taken"], extra["free"], extra["leases"]) == (15, 1, 14, 1)
    assert primary["utilisation"] == pytest.approx(0.6667)
    assert primary["warning"].startswith("10.244.0.0/22 is 67% used (2 of 3 /24 subnets)")
    assert extra["warning"] is None

    code, out, _ = cluster.pools("list")
    assert code == 0
    lines = out.splitlines()
    assert lines[0] == "pools as agents without a cluster name see them"
    assert lines[1].split() == ["POOL", "SUBNETS", "TAKEN", "FREE", "USED", "NEW", "LEASES", "TAGS"]
    assert lines[2].split() == [
        "10.244.0.0/22",
        "(primary)",
        "3",
        "x",
        "/24",
        "2",
        "1",
        "67%",
        "yes",
        "-",
    ]
    assert lines[3].split() == [
        "10.250.0.0/20",
        "15",
        "x",
        "/24",
        "1",
        "14",
        "7%",
        "yes",
        f"{ROLE}=1",
    ]
    warnings = [line for line in lines if line.startswith("warning: ")]
    assert warnings == [f"warning: {primary['warning']}"]


# --- concurrent edits ----------------------------------------------------------------------


class RacingStore:
    """The real store, but a rival edit lands between our read and our first write."""

    def __init__(self, inner: Store, rival: Callable[[], None]) -> None:
        self._inner = inner
        self._rival: Callable[[], None] | None = rival
        self.writes: list[object] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def _race(self) -> None:
        if self._rival is not None:
            rival, self._rival = self._rival, None
            rival()

    def put_if_mod_revision(self, *args: Any, **kwargs: Any) -> int | None:
        self._race()
        result = self._inner.put_if_mod_revision(*args, **kwargs)
        self.writes.append(result)
        return result

    def create(self, *args: Any, **kwargs: Any) -> int:
        self._race()
        try:
            result = self._inner.create(*args, **kwargs)
        except Exception as e:
            self.writes.append(type(e).__name__)
            raise
        self.writes.append(result)
        return result


@pytest.mark.parametrize("cidr", ["10.250.0.0/16", "10.244.0.0/16"])  # a pool, the primary
def test_a_concurrent_tag_edit_is_never_lost(cluster: Cluster, cidr: str) -> None:
    assert cluster.pools("add", "10.250.0.0/16")[0] == 0
    config = parse_network_config(NETCONF)
    network = IPv4Network(cidr)
    rival_store = EtcdStore([cluster.endpoint])
    ours = EtcdStore([cluster.endpoint])
    try:
        rival = PoolStore(rival_store, cluster.prefix)
        racing = RacingStore(
            ours, lambda: rival.tag(config, network, "flannelpy.io/cluster/a", "x")
        )
        edit = PoolStore(cast(Store, racing), cluster.prefix).tag(config, network, ROLE, "1")
    finally:
        rival_store.close()
        ours.close()
    assert edit.changed
    # Our first write lost to the rival's (stale revision, or the key existed already),
    # the retry kept both edits.
    assert racing.writes[0] in (None, "KeyExists") and isinstance(racing.writes[-1], int)
    assert len(racing.writes) == 2
    record = cluster.record(cidr)
    assert record is not None and record["Tags"] == {ROLE: "1", "flannelpy.io/cluster/a": "x"}


def test_many_people_tagging_one_pool_at_once_lose_nothing(cluster: Cluster) -> None:
    assert cluster.pools("add", "10.250.0.0/16")[0] == 0
    config = parse_network_config(NETCONF)
    network = IPv4Network("10.250.0.0/16")
    names = [f"c{i}" for i in range(8)]
    start = threading.Barrier(len(names))
    failures: list[BaseException] = []

    def tag(name: str) -> None:
        store = EtcdStore([cluster.endpoint])
        try:
            start.wait()
            PoolStore(store, cluster.prefix).tag(
                config, network, f"flannelpy.io/cluster/{name}", "true"
            )
        except BaseException as e:  # reported below
            failures.append(e)
        finally:
            store.close()

    threads = [threading.Thread(target=tag, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert failures == []
    record = cluster.record("10.250.0.0/16")
    assert record is not None
    assert record["Tags"] == {f"flannelpy.io/cluster/{n}": "true" for n in names}


# --- where the store is, and where pools do not apply -----------------------------------------


def test_kubernetes_mode_is_refused_and_help_says_etcd_only(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLANNELD_KUBE_SUBNET_MGR", "true")
    code, _, err = cluster.pools("list")
    assert code == 2
    assert "pools apply to etcd mode only" in one_line_refusal(err)
    with pytest.raises(SystemExit):
        main(["pools", "list", "--help"])
    out = " ".join(cluster.capsys.readouterr().out.split())
    assert "Pools apply to etcd mode only: in Kubernetes mode" in out


def test_unreachable_etcd_and_missing_config_are_one_sentence(cluster: Cluster) -> None:
    code = main(
        [
            "pools",
            "list",
            "--etcd-endpoints",
            f"http://127.0.0.1:{free_port()}",
            "--etcd-prefix",
            cluster.prefix,
        ]
    )
    err = cluster.capsys.readouterr().err
    assert code == 3
    one_line_refusal(err)
    code = main(
        [
            "pools",
            "list",
            "--etcd-endpoints",
            cluster.endpoint,
            "--etcd-prefix",
            cluster.prefix + "/elsewhere",
        ]
    )
    err = cluster.capsys.readouterr().err
    assert code == 2
    assert "network config not found" in one_line_refusal(err)


def test_lab_takes_the_etcd_endpoint_and_prefix_of_the_lab(
    cluster: Cluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    from flannelpy_lab.lab import Lab

    asked: list[str] = []

    def load(name: str) -> Any:
        asked.append(name)
        return SimpleNamespace(
            state=SimpleNamespace(
                etcd_endpoint=cluster.endpoint,
                etcd_prefix=cluster.prefix,
                etcd_endpoints=[cluster.endpoint],
            )
        )

    monkeypatch.setattr(Lab, "load", staticmethod(load))
    assert lab_main(lab_run_args("lab1", "pools", "add", "10.250.0.0/16")) == 0
    assert asked == ["lab1"]
    assert cluster.record("10.250.0.0/16") is not None
    cluster.capsys.readouterr()
    code = lab_main(lab_run_args("lab1", "pools", "list", "--etcd-prefix", "/x"))
    assert code == 2
    assert "brings its own etcd; leave out --etcd-prefix" in one_line_refusal(
        cluster.capsys.readouterr().err, by="flannelpy-lab run"
    )


def test_no_such_lab_is_one_sentence() -> None:
    proc = subprocess.run(
        lab_run_argv("nolab9", "pools", "list"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (proc.returncode, proc.stdout) == (1, "")
    assert "there is no lab 'nolab9'" in one_line_refusal(proc.stderr, by="flannelpy-lab run")


def test_the_real_command_refuses_without_a_traceback(cluster: Cluster) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flannelpy",
            "pools",
            "remove",
            "10.244.0.0/16",
            "--etcd-endpoints",
            cluster.endpoint,
            "--etcd-prefix",
            cluster.prefix,
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (proc.returncode, proc.stdout) == (2, "")
    assert "primary pool" in one_line_refusal(proc.stderr)
