"""NetworkPolicy test objects shared by the unit and integration tiers: builders for Pods
and policies as the API returns them, and random clusters compiled to a policy table."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from flannelpy.netpol.compile import compile_node
from flannelpy.netpol.model import Namespace, Pod, Policy, parse_namespace, parse_pod, parse_policy
from flannelpy.netpol.nft import Ruleset, render

NODE = "n1"
NAMESPACES = [
    parse_namespace({"metadata": {"name": "shop", "labels": {"team": "a"}}}),
    parse_namespace({"metadata": {"name": "bank", "labels": {"team": "b"}}}),
]
PORTS = [
    {"name": "http", "containerPort": 8080},
    {"name": "dns", "containerPort": 53, "protocol": "UDP"},
]


def pod(name: str, app: str, *ips: str, node: str = NODE, namespace: str = "shop") -> Pod:
    """A running Pod with label ``app``, container ports http (8080/TCP) and dns (53/UDP)."""
    return parse_pod(
        {
            "metadata": {"namespace": namespace, "name": name, "labels": {"app": app}},
            "spec": {"nodeName": node, "containers": [{"ports": PORTS}]},
            "status": {"podIPs": [{"ip": ip} for ip in ips], "phase": "Running"},
        }
    )


def policy(name: str, spec: dict[str, Any], namespace: str = "shop") -> Policy:
    return parse_policy({"metadata": {"namespace": namespace, "name": name}, "spec": spec})


def table(
    policies: list[Policy], pods: list[Pod], namespaces: list[Namespace] = NAMESPACES
) -> Ruleset:
    """The policy table of NODE."""
    return render(compile_node(policies, pods, namespaces, NODE))


DB_POLICY = policy(
    "db",
    {
        "podSelector": {"matchLabels": {"app": "db"}},
        "ingress": [
            {
                "from": [
                    {"podSelector": {"matchLabels": {"app": "api"}}},
                    {"ipBlock": {"cidr": "192.168.0.0/16", "except": ["192.168.1.0/24"]}},
                ],
                "ports": [{"port": 5432}, {"port": "http"}],
            }
        ],
    },
)
POLICY_POOL = [
    DB_POLICY,
    policy("deny", {"podSelector": {"matchLabels": {"app": "web"}}}),
    policy("out", {
        "podSelector": {"matchExpressions": [{"key": "app", "operator": "NotIn",
                                              "values": ["db"]}]},
        "egress": [{"to": [{"podSelector": {"matchLabels": {"app": "db"}}},
                           {"ipBlock": {"cidr": "fd00::/48", "except": ["fd00::/64"]}}],
                    "ports": [{"port": "http"}, {"port": 5432}, {"protocol": "UDP", "port": 53,
                                                                 "endPort": 60}]},
                   {"to": [{"namespaceSelector": {"matchLabels": {"team": "b"}}}],
                    "ports": [{"port": "dns", "protocol": "UDP"}, {"protocol": "SCTP"}]}],
    }),
]  # fmt: skip
APPS = ("db", "api", "web")


def random_table(data: st.DataObject) -> Ruleset:
    """A random cluster of up to 8 pods (some dual-stack, some local, two namespaces)
    and a random choice of POLICY_POOL, compiled and rendered for NODE."""
    pods = []
    for i in range(data.draw(st.integers(0, 8))):
        ips = [f"10.244.{i % 3}.{i + 2}"] + ([f"fd00::{i + 2}"] if i % 2 else [])
        pods.append(
            pod(
                f"p{i}",
                data.draw(st.sampled_from(APPS)),
                *ips,
                node=data.draw(st.sampled_from([NODE, "n2"])),
                namespace=data.draw(st.sampled_from(["shop", "bank"])),
            )
        )
    chosen = data.draw(st.lists(st.sampled_from(POLICY_POOL), unique_by=lambda p: p.name))
    return table(chosen, pods)
