"""Every flag flanneld v0.28.9 takes is taken, in Go's spellings too, with its
FLANNELD_* variable; those that mean nothing for us yet say so in one sentence."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from flannelpy.cli import build_parser
from flannelpy.config.settings import (
    AgentSettings,
    go_style_argv,
    settings_from_args,
    start_notes,
)
from flannelpy.errors import ConfigError


def agent(argv: list[str], env: dict[str, str] | None = None) -> AgentSettings:
    """What `flannelpy agent ARGV` parses to (the path cli.main takes)."""
    ns = build_parser().parse_args(["agent", *go_style_argv(argv)])
    return settings_from_args(ns, {"NODE_NAME": "n1", **(env or {})})


@pytest.mark.parametrize(
    ("argv", "env", "field", "expected"),
    [
        (["--public-ipv6", "2001:db8::1"], {}, "public_ipv6", "2001:db8::1"),
        ([], {"FLANNELD_PUBLIC_IPV6": "2001:DB8::2"}, "public_ipv6", "2001:db8::2"),
        (["--ip-masq-fully-random-disable"], {}, "ip_masq_fully_random_disable", True),
        (
            [],
            {"FLANNELD_IP_MASQ_FULLY_RANDOM_DISABLE": "true"},
            "ip_masq_fully_random_disable",
            True,
        ),
        ([], {}, "ip_masq_fully_random_disable", False),
        (["--set-node-network-unavailable=false"], {}, "set_node_network_unavailable", False),
        (
            [],
            {"FLANNELD_SET_NODE_NETWORK_UNAVAILABLE": "false"},
            "set_node_network_unavailable",
            False,
        ),
        ([], {}, "set_node_network_unavailable", True),
        (["--ip-blackhole-route=false"], {}, "ip_blackhole_route", False),
        (
            ["--etcd-endpoints", "unix:///run/etcd.sock"],
            {},
            "etcd_endpoints",
            ("unix:///run/etcd.sock",),
        ),
        (
            ["--etcd-endpoints", "unix:etcd.sock,10.0.0.1:2379"],
            {},
            "etcd_endpoints",
            ("unix:etcd.sock", "http://10.0.0.1:2379"),
        ),
        (["--ip-blackhole-route"], {}, "ip_blackhole_route", True),
        ([], {"FLANNELD_IP_BLACKHOLE_ROUTE": "true"}, "ip_blackhole_route", True),
        (["-v", "2"], {}, "v", 2),
        (["-v=3"], {}, "v", 3),
        (["--v=1"], {}, "v", 1),
        ([], {"FLANNELD_V": "4"}, "v", 4),
        (["-v", "2"], {}, "log_level", "debug"),
        (["-v", "2", "--log-level", "warning"], {}, "log_level", "warning"),
        (["-v", "0"], {}, "log_level", "info"),
        # Go's flag package: one dash or two, "=value" or a separate value.
        (["-etcd-endpoints=http://10.0.0.1:2379"], {}, "etcd_endpoints", ("http://10.0.0.1:2379",)),
        (["-etcd-prefix", "/other/network"], {}, "etcd_prefix", "/other/network"),
        (["-ip-masq"], {}, "ip_masq", True),
        (["-ip-masq=false"], {}, "ip_masq", False),
        (["-iface", "eth1", "-iface=eth2"], {}, "iface", ("eth1", "eth2")),
        (["--kube-subnet-mgr=true"], {}, "kube_subnet_mgr", True),
        # Flannel's prefixes with a slash and an underscore.
        (
            ["--kube-annotation-prefix", "example.com/flannel_"],
            {},
            "kube_annotation_prefix",
            "example.com/flannel_",
        ),
        (
            ["--kube-annotation-prefix", "example.com/"],
            {},
            "kube_annotation_prefix",
            "example.com/",
        ),
        (
            ["--kube-annotation-prefix", "example.com/my_net-"],
            {},
            "kube_annotation_prefix",
            "example.com/my_net-",
        ),
        # etcd's Go client takes a bare host:port; TLS files make it https.
        (
            ["--etcd-endpoints", "10.0.0.1:2379,etcd-1:2379"],
            {},
            "etcd_endpoints",
            ("http://10.0.0.1:2379", "http://etcd-1:2379"),
        ),
        (
            ["--etcd-endpoints", "etcd-0:2379", "--etcd-cafile", "/ca.pem"],
            {},
            "etcd_endpoints",
            ("https://etcd-0:2379",),
        ),
    ],
)
def test_flanneld_flags_are_taken(
    argv: list[str], env: dict[str, str], field: str, expected: Any
) -> None:
    assert getattr(agent(argv, env), field) == expected


def test_other_text_is_left_for_the_parser_to_refuse() -> None:
    assert go_style_argv(["-x", "-etcd-endpoints", "u", "--", "-ip-masq"]) == [
        "-x",
        "--etcd-endpoints",
        "u",
        "--",
        "-ip-masq",
    ]
    with pytest.raises(SystemExit):
        agent(["-no-such-flag=1"])


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--public-ipv6", "10.0.0.1"], "'10.0.0.1' is not an IPv6 address"),
        (["-v", "lots"], "'lots' is not a whole number"),
        (["--etcd-endpoints", "unixs:///run/etcd.sock"], "is TLS over a unix socket"),
        (["--etcd-endpoints", "unix://"], "names no socket"),
        (["--kube-annotation-prefix", "a.b/c/d"], "has more than one slash"),
        (["--kube-annotation-prefix", "my_domain.com/x"], "is not an annotation prefix"),
        (["--kube-annotation-prefix", "nodots"], "is not an annotation prefix"),
    ],
)
def test_what_cannot_work_is_refused_in_one_sentence(argv: list[str], expected: str) -> None:
    with pytest.raises(ConfigError) as exc:
        agent(argv)
    message = str(exc.value)
    assert expected in message
    assert "\n" not in message and ". " not in message


def test_public_ipv6_is_used_so_no_note_says_otherwise() -> None:
    assert start_notes(agent(["--public-ipv6", "2001:db8::1"])) == []


def test_cli_main_takes_go_spellings(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """The whole path: `flannelpy agent -etcd-endpoints=... -v 2 --public-ipv6 ...`."""
    from flannelpy import cli

    seen: list[AgentSettings] = []
    monkeypatch.setattr("flannelpy.agent.compose.run_agent", lambda s: seen.append(s) or 0)
    monkeypatch.setattr("flannelpy.log.setup_logging", lambda *a: None)
    monkeypatch.setenv("NODE_NAME", "n1")
    caplog.set_level(logging.INFO, logger="flannelpy.agent")
    rc = cli.main(
        ["agent", "-etcd-endpoints=http://10.0.0.9:2379", "-v", "2", "--public-ipv6", "2001:db8::9"]
    )
    assert rc == 0
    (s,) = seen
    assert s.etcd_endpoints == ("http://10.0.0.9:2379",) and s.v == 2
    assert s.public_ipv6 == "2001:db8::9"


class RecordingFirewall:
    """IptablesFirewall's surface: an iptables that has --random-fully; keeps each sync."""

    random_fully = True

    def __init__(self) -> None:
        self.synced: list[list[Any]] = []

    def sync(self, rules: Any) -> Any:
        from flannelpy.dataplane.firewall import SyncResult

        self.synced.append(list(rules))
        return SyncResult(False)


@pytest.mark.parametrize(
    ("argv", "random_fully"), [([], True), (["--ip-masq-fully-random-disable"], False)]
)
def test_fully_random_disable_drops_random_fully_from_the_masquerade_rules(
    argv: list[str], random_fully: bool
) -> None:
    from ipaddress import IPv4Network

    from flannelpy.agent.firewall_sync import firewall_factory
    from flannelpy.observe.metrics import AgentMetrics

    fw = RecordingFirewall()
    factory = firewall_factory(agent(["--ip-masq", *argv]), AgentMetrics(), fw)  # type: ignore[arg-type]
    assert factory is not None
    factory.for_networks([IPv4Network("10.244.0.0/16")], [IPv4Network("10.244.3.0/24")])()
    masq = [r for rules in fw.synced for r in rules if "MASQUERADE" in str(r)]
    assert masq, "the masquerade rules were synced"
    assert all(("--random-fully" in str(r)) == random_fully for r in masq)
