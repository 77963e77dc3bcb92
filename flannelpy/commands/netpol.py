"""``flannelpy netpol explain``: which NetworkPolicy lets one connection through, or
denies it, and why (see :mod:`flannelpy.netpol.explain`).

It lists every NetworkPolicy, Pod and Namespace once, as the agents read them (the same
parsing: an object the agents refuse is left out here too, and said), compiles each
end's node as its agent does, and judges the connection against those chains. Run it
in an agent's pod (``kubectl exec``: its service account can list what it needs) or
with a kubeconfig. The command is ``netpol``, not ``policy``: ``flannelpy policy`` is
the disruption policy of etcd mode.

Exit status: 0 when the connection is allowed, 1 when it is denied, 2 when the
question cannot be answered (a pod that does not exist, the API unreachable).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import asdict
from typing import Any

from flannelpy.commands.store import add_agent_flags
from flannelpy.errors import ConfigError, FlannelpyError

KUBE_FLAGS = ("kube_api_url", "kubeconfig_file")
PORT = re.compile(r"(\d{1,5})(?:/(TCP|UDP|SCTP))?", re.IGNORECASE)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    netpol: argparse.ArgumentParser = subparsers.add_parser(
        "netpol",
        help="explain which NetworkPolicy allows or denies a connection",
        description="Questions about NetworkPolicy (--enable-network-policy), answered from "
        "the cluster's policies, pods and namespaces as the agents compile them.",
    )
    verbs = netpol.add_subparsers(dest="netpol_command", required=True)
    explain = verbs.add_parser(
        "explain",
        help="which policy and rule allow a new connection, or which policies deny it",
        description="Judge one new connection as the nodes' tables do: the sender's egress "
        "on its node, then the receiver's ingress on its node. Exit 0 when allowed, 1 when "
        "denied, 2 when it cannot be answered.",
    )
    explain.add_argument(
        "--from", dest="source", required=True, metavar="NS/POD|IP", help="the client"
    )
    explain.add_argument(
        "--to",
        dest="destination",
        required=True,
        metavar="NS/POD|IP",
        help="the server: a pod (for a Service, the backend pod it reaches) or an address",
    )
    explain.add_argument(
        "--port", required=True, metavar="N[/PROTO]", help="e.g. 5432/TCP (TCP by default)"
    )
    explain.add_argument("--json", action="store_true", help="print the answer as JSON")
    add_agent_flags(
        explain, KUBE_FLAGS, "Kubernetes API", "as the agent reaches it (or FLANNELD_<NAME>)"
    )
    netpol.set_defaults(run=run)
    return netpol


def parse_port(text: str) -> tuple[int, str]:
    match = PORT.fullmatch(text.strip())
    if match is None or not 1 <= int(match.group(1)) <= 65535:
        raise ConfigError(f"--port {text!r}: give a port 1-65535 and TCP, UDP or SCTP, e.g. 80/TCP")
    return int(match.group(1)), (match.group(2) or "TCP").upper()


def run(args: argparse.Namespace) -> int:
    from flannelpy.config.settings import settings_from_args
    from flannelpy.netpol.explain import ExplainError, explain, find_endpoint
    from flannelpy.store.kube.client import build_api_client
    from flannelpy.store.kube.policy_watch import list_policy_inputs

    try:
        port, protocol = parse_port(args.port)
        settings = settings_from_args(args, os.environ)
        snapshot = list_policy_inputs(build_api_client(settings))
        source = find_endpoint(args.source, snapshot.pods)
        destination = find_endpoint(args.destination, snapshot.pods)
        answer = explain(
            snapshot.policies,
            snapshot.pods,
            snapshot.namespaces,
            source,
            destination,
            port,
            protocol,
        )
    except (FlannelpyError, ExplainError) as e:
        print(f"flannelpy netpol explain: {e}", file=sys.stderr)
        return 2
    for refusal in snapshot.refused:  # what no agent enforces either
        print(f"note: {refusal}", file=sys.stderr)
    if args.json:
        doc = {**asdict(answer), "allowed": answer.allowed}
        print(json.dumps(doc, indent=2))
    else:
        print("\n".join(answer.lines()))
    return 0 if answer.allowed else 1
