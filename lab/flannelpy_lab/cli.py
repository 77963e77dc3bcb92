"""``flannelpy lab up|status|down``: the command line over :mod:`flannelpy.lab.lab`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from flannelpy.errors import FlannelpyError
from flannelpy_lab import plan
from flannelpy_lab.state import LabState

# flannelpy.lab.lab and .status import etcd's gRPC client: imported when a lab
# command runs, not when the parser is built.


def add_lab_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``lab`` with its ``up``, ``status`` and ``down`` subcommands; returns the parser."""
    lab = subparsers.add_parser(
        "lab",
        help="a cluster of network namespaces on this host, with etcd and one agent per node",
        description="Build, inspect and remove a netns lab: node namespaces on an underlay "
        "switch (optionally two segments and a router), etcd, and one agent per node.",
    )
    lab.set_defaults(func=run)
    sub = lab.add_subparsers(dest="lab_command", required=True, metavar="{up,status,pod,down}")

    up = sub.add_parser("up", help="build a lab and wait until every agent is ready")
    up.add_argument("--name", required=True, help="lab name: 1-6 lower-case letters or digits")
    up.add_argument("--nodes", type=int, default=3, help="number of nodes (default 3)")
    up.add_argument("--backend", choices=plan.BACKENDS, default="vxlan")
    up.add_argument(
        "--direct-routing",
        action="store_true",
        help="vxlan with DirectRouting: host routes to peers on the same segment",
    )
    up.add_argument(
        "--segments",
        type=int,
        choices=(1, 2),
        default=1,
        help="underlay L2 segments; with 2, a router joins them (default 1)",
    )
    up.add_argument(
        "--network",
        default=plan.DEFAULT_NETWORK,
        help=f"overlay network (default {plan.DEFAULT_NETWORK})",
    )
    up.add_argument(
        "--etcd-prefix",
        default=plan.DEFAULT_ETCD_PREFIX,
        help=f"etcd key prefix (default {plan.DEFAULT_ETCD_PREFIX})",
    )
    up.add_argument(
        "--timeout",
        type=float,
        default=60.0,
        help="seconds to wait for all agents to be ready (default 60)",
    )
    up.add_argument(
        "--no-agents", action="store_true", help="build the underlay and etcd only, start no agents"
    )
    up.add_argument(
        "--pods-per-node", type=int, default=2,
        help="pods created on each node through the CNI executable (default 2)",
    )
    up.add_argument(
        "--cni-exec", choices=("auto", "static", "python"), default="auto",
        help="the CNI executable's form: the static build (no Python on the node) or the "
        "Python launcher; auto prefers the static build (default auto)",
    )

    pod = sub.add_parser("pod", help="add or delete a pod through the real CNI executable")
    pod_sub = pod.add_subparsers(dest="pod_command", required=True, metavar="{add,del}")
    pod_add = pod_sub.add_parser("add", help="create a pod on a node (CNI ADD)")
    pod_add.add_argument("--name", required=True, help="the lab")
    pod_add.add_argument("--node", required=True, help="the node, e.g. n1")
    pod_add.add_argument("--pod", help="pod name (default <node>-p<N>)")
    pod_del = pod_sub.add_parser("del", help="delete a pod (CNI DEL)")
    pod_del.add_argument("--name", required=True, help="the lab")
    pod_del.add_argument("--pod", required=True, help="pod name, e.g. n1-p1")

    st = sub.add_parser("status", help="leases, overlay addresses and a node reachability matrix")
    st.add_argument("--name", required=True)
    st.add_argument("--json", action="store_true", help="print the status as JSON")

    dn = sub.add_parser("down", help="remove a lab and everything it added to the host")
    target = dn.add_mutually_exclusive_group(required=True)
    target.add_argument("--name")
    target.add_argument("--all", action="store_true", help="remove every lab on this host")
    return lab


def run(args: argparse.Namespace) -> int:
    """Run a parsed ``lab`` command; errors become one sentence on stderr and an exit code."""
    try:
        if args.lab_command == "up":
            return _up(args)
        if args.lab_command == "status":
            return _status(args)
        if args.lab_command == "pod":
            return _pod(args)
        return _down(args)
    except FlannelpyError as e:
        print(f"flannelpy lab {args.lab_command}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _up(args: argparse.Namespace) -> int:
    from flannelpy_lab.lab import Lab

    lab = Lab.up(
        args.name,
        args.nodes,
        args.backend,
        direct_routing=args.direct_routing,
        segments=args.segments,
        network=args.network,
        etcd_prefix=args.etcd_prefix,
        start_agents=not args.no_agents,
        pods_per_node=0 if args.no_agents else args.pods_per_node,
        cni_exec=args.cni_exec,
        timeout=args.timeout,
        progress=_progress,
    )
    print(summary(lab.state))
    return 0


def summary(state: LabState) -> str:
    mode = state.backend + (" (DirectRouting)" if state.direct_routing else "")
    lines = [
        f"lab {state.name} is up: {len(state.nodes)} nodes, {mode}, network {state.network}",
        f"etcd {state.etcd_endpoint} (prefix {state.etcd_prefix}), files in {state.lab_dir}",
        "",
    ]
    rows = [["NODE", "NAMESPACE", "UNDERLAY", "OVERLAY", "AGENT LOG"]]
    for n in state.nodes:
        rows.append(
            [
                n.name,
                n.namespace,
                n.underlay_address,
                n.overlay_address or "-",
                n.agent_log if n.agent_pid else "-",
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines += [
        "",
        f"next: flannelpy lab status --name {state.name}; "
        f"ip netns exec {state.nodes[0].namespace} <command>; "
        f"flannelpy lab down --name {state.name}",
    ]
    return "\n".join(lines)


def _status(args: argparse.Namespace) -> int:
    from flannelpy_lab import status
    from flannelpy_lab.lab import Lab

    doc = Lab.load(args.name).status()
    print(json.dumps(doc, indent=2) if args.json else status.render_text(doc))
    return 0 if doc["ok"] else 1


def _pod(args: argparse.Namespace) -> int:
    from flannelpy_lab.lab import Lab

    lab = Lab.load(args.name)
    if args.pod_command == "add":
        pod = lab.add_pod(args.node, args.pod)
        print(f"pod {pod.name} on {pod.node}: {pod.address} (netns {pod.namespace})")
    else:
        lab.delete_pod(args.pod)
        print(f"pod {args.pod} deleted")
    return 0


def _down(args: argparse.Namespace) -> int:
    from flannelpy_lab.lab import down, down_all

    if args.all:
        names = down_all()
        print(f"removed {len(names)} lab(s){': ' + ', '.join(names) if names else ''}")
    else:
        down(args.name)
        print(f"lab {args.name} removed")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m flannelpy.lab``: the same commands without the main CLI."""
    parser = argparse.ArgumentParser(prog="flannelpy")
    add_lab_parser(parser.add_subparsers(dest="command", required=True))
    return run(parser.parse_args(["lab", *(sys.argv[1:] if argv is None else argv)]))
