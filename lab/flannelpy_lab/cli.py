"""``flannelpy-lab up|status|pod|down|run|env``: the command line over :class:`Lab`."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import Sequence

from flannelpy.errors import FlannelpyError
from flannelpy_lab import plan
from flannelpy_lab.errors import LabError
from flannelpy_lab.state import LabState

# flannelpy_lab.lab and .status import etcd's gRPC client: imported when a lab
# command runs, not when the parser is built.


def build_parser() -> argparse.ArgumentParser:
    """``flannelpy-lab`` with its subcommands."""
    parser = argparse.ArgumentParser(
        prog="flannelpy-lab",
        description="Build, inspect and remove a netns lab: node namespaces on an underlay "
        "switch (optionally two segments and a router), etcd, and one agent per node; run "
        "commands against it.",
    )
    sub = parser.add_subparsers(
        dest="lab_command", required=True, metavar="{up,status,pod,migrate,down,run,env}"
    )

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
        "--flanneld-nodes",
        type=int,
        default=0,
        metavar="K",
        help="run the real upstream flanneld and Flannel's CNI plugin (built by "
        "scripts/build-peers.sh) on the last K nodes instead of our agent (default 0); with "
        "--kube it runs with --kube-subnet-mgr",
    )
    up.add_argument(
        "--etcd-members",
        type=int,
        choices=plan.ETCD_MEMBER_COUNTS,
        default=1,
        metavar="N",
        help="etcd members: 1 runs on the host; 3 or 5 form a static cluster, each member in "
        "a namespace of its own on the switch, every agent given all their URLs (default 1)",
    )
    up.add_argument(
        "--kube",
        action="store_true",
        help="Kubernetes mode against a real control plane on the host (built by "
        "scripts/build-kube.sh): etcd, kube-apiserver with RBAC, kube-controller-manager "
        "assigning the podCIDRs, manifests/ applied; agents use --kube-subnet-mgr",
    )
    up.add_argument(
        "--kubelet",
        action="store_true",
        help="implies --kube: kube-scheduler, and on every node a real kubelet, containerd "
        "and kube-proxy; "
        "the agents run as the manifests' DaemonSet (image built by scripts/build-images.sh), "
        "and a test Deployment spreads one busybox pod per node",
    )
    up.add_argument(
        "--network-agent",
        choices=plan.NETWORK_AGENTS,
        default=plan.NETWORK_AGENTS[0],
        help="with --kubelet: the network, the manifests' DaemonSet (flannelpy, the default) or "
        "Flannel as kube-flannel.yml deploys it: flanneld --kube-subnet-mgr on every node and "
        "Flannel's CNI plugin (built by scripts/build-peers.sh)",
    )
    up.add_argument(
        "--proxy-mode",
        choices=("iptables", "nftables"),
        default="iptables",
        help="with --kubelet: the mode of the kube-proxy every node runs (default iptables)",
    )
    up.add_argument(
        "--enable-network-policy",
        action="store_true",
        help="with --kube or --kubelet: the agents enforce NetworkPolicy "
        "(--enable-network-policy and the manifests' network-policy component); with --kube, "
        "flanneld nodes run kube-network-policies beside flanneld, as Flannel's chart does, "
        "and so does every node with --kubelet --network-agent flanneld",
    )
    up.add_argument(
        "--cluster-dns",
        action="store_true",
        help="with --kubelet: run CoreDNS (built by scripts/build-peers.sh --coredns) as the "
        "cluster DNS, every kubelet giving pods its Service address",
    )
    up.add_argument(
        "--host-pod-routes",
        action="store_true",
        help="with --kubelet: route each node's podCIDR from the host through the node, as a "
        "control-plane node in the overlay has (kube-apiserver's pods/proxy); give a --network "
        "no other lab on this host uses",
    )
    up.add_argument(
        "--image-archive",
        action="append",
        default=[],
        metavar="PATH",
        help="with --kubelet: also import the images of this `podman save` archive into every "
        "node's containerd (repeatable; scripts/conformance.sh passes the e2e images)",
    )
    up.add_argument(
        "--ip-family",
        choices=("ipv4", "dual", "ipv6"),
        default="ipv4",
        help="dual: an IPv6 ULA underlay on the lab switch beside IPv4 and EnableIPv6 with "
        "an IPv6 pod network; ipv6: EnableIPv4 false, the overlay and pods IPv6 only "
        "(etcd stays on the IPv4 lab addresses); vxlan or host-gw, etcd mode",
    )
    up.add_argument(
        "--enable-nftables",
        action="store_true",
        help='net-conf.json with "EnableNFTables": true (Flannel\'s nftables tables, not '
        "iptables chains)",
    )
    up.add_argument(
        "--no-agents", action="store_true", help="build the underlay and etcd only, start no agents"
    )
    up.add_argument(
        "--prometheus",
        action="store_true",
        help="run a real Prometheus on the host's lab address scraping every agent (bound on "
        "its node's lab address), with manifests/prometheusrule.yaml's alerts (for: and range "
        "windows shortened)",
    )
    up.add_argument(
        "--pods-per-node",
        type=int,
        default=2,
        help="pods created on each node through the CNI executable (default 2)",
    )
    up.add_argument(
        "--cni-exec",
        choices=("auto", "static", "python"),
        default="auto",
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

    mig = sub.add_parser(
        "migrate", help="switch one node between flanneld and our agent, pods running"
    )
    mig.add_argument("--name", required=True, help="the lab")
    mig.add_argument("--node", required=True, help="the node, e.g. n3")
    mig.add_argument("--to", required=True, choices=("flannelpy", "flanneld"))

    st = sub.add_parser("status", help="leases, overlay addresses and a node reachability matrix")
    st.add_argument("--name", required=True)
    st.add_argument("--json", action="store_true", help="print the status as JSON")

    dn = sub.add_parser("down", help="remove a lab and everything it added to the host")
    target = dn.add_mutually_exclusive_group(required=True)
    target.add_argument("--name")
    target.add_argument("--all", action="store_true", help="remove every lab on this host")

    run = sub.add_parser(
        "run",
        usage="flannelpy-lab run [-h] NAME [--node NODE] -- COMMAND ...",
        help="run a command with the lab's store settings (with --node: on that node)",
        description="Run COMMAND with the lab's etcd in FLANNELD_ETCD_ENDPOINTS and "
        "FLANNELD_ETCD_PREFIX (the host has a leg on the lab's switch); with --node, inside "
        "the node's network namespace with every setting of its agent as FLANNELD_* "
        "variables. A leading `flannelpy` is the flannelpy beside the lab. Exits with "
        "COMMAND's status. Example: flannelpy-lab run demo --node n1 -- flannelpy doctor",
    )
    run.add_argument("name", metavar="NAME", help="the lab")
    run.add_argument("--node", help="run inside this node's namespace with its agent's settings")

    env = sub.add_parser(
        "env",
        help="print the lab's store settings as FLANNELD_* lines, for eval",
        description="Print `export FLANNELD_...=...` lines: the lab's etcd, or with --node "
        'every setting of that node\'s agent. Use: eval "$(flannelpy-lab env demo)"',
    )
    env.add_argument("name", metavar="NAME", help="the lab")
    env.add_argument("--node", help="the settings of this node's agent")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run a parsed command; errors become one sentence on stderr and an exit code."""
    commands = {
        "up": _up,
        "status": _status,
        "pod": _pod,
        "down": _down,
        "run": _run,
        "env": _env,
        "migrate": _migrate,
    }
    try:
        return commands[args.lab_command](args)
    except FlannelpyError as e:
        print(f"flannelpy-lab {args.lab_command}: {e}", file=sys.stderr)
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
        flanneld_nodes=args.flanneld_nodes,
        etcd_members=args.etcd_members,
        net_conf_extra={
            **({"EnableNFTables": True} if args.enable_nftables else {}),
            **plan.ip_family_net_conf(args.ip_family),
        }
        or None,
        kube=args.kube,
        kubelets=args.kubelet,
        proxy_mode=args.proxy_mode,
        network_policy=args.enable_network_policy,
        image_archives=args.image_archive,
        cluster_dns=args.cluster_dns,
        host_pod_routes=args.host_pod_routes,
        network_agent=args.network_agent,
        with_prometheus=args.prometheus,
    )
    print(summary(lab.state))
    return 0


def summary(state: LabState) -> str:
    from flannelpy_lab import kube, kubelet

    mode = state.backend + (" (DirectRouting)" if state.direct_routing else "")
    lines = [
        f"lab {state.name} is up: {len(state.nodes)} nodes, {mode}, network "
        f"{plan.pod_networks(state)}",
        f"etcd {','.join(state.etcd_endpoints)} (prefix {state.etcd_prefix}), "
        f"files in {state.lab_dir}",
        "",
    ]
    prom = state.extra.get("prometheus")
    if prom:
        lines[-1:-1] = [
            f"Prometheus {prom['url']} scrapes every agent (rules: "
            f"{state.lab_dir}/prometheus/rules.yml)"
        ]
    if kube.STATE_KEY in state.extra:
        lines[-1:-1] = [
            f"Kubernetes API {kube.api_url(state)}: "
            f"kubectl --kubeconfig {kube.admin_kubeconfig(state)} get nodes"
        ]
    if kubelet.enabled(state):
        mode = kubelet.record(state).get("proxy_mode", "iptables")
        lines[-1:-1] = [f"kubelet, containerd and kube-proxy ({mode} mode) on every node"]
        if not kubelet.runs_daemonset(state):
            lines[-1:-1] = ["the network: flanneld --kube-subnet-mgr and Flannel's CNI plugin"]
    rows = [["NODE", "NAMESPACE", "UNDERLAY", "OVERLAY", "RUNS", "AGENT LOG"]]
    for n in state.nodes:
        rows.append(
            [
                n.name,
                n.namespace,
                n.underlay_address,
                n.overlay_address or "-",
                n.agent_kind,
                n.agent_log if n.agent_pid else "-",
            ]
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines += [
        "",
        f"next: flannelpy-lab status --name {state.name}; "
        f"flannelpy-lab run {state.name} [--node {state.nodes[0].name}] -- <command>; "
        f"flannelpy-lab down --name {state.name}",
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
        shown = " ".join(a for a in (pod.address, pod.address6) if a)
        print(f"pod {pod.name} on {pod.node}: {shown} (netns {pod.namespace})")
    else:
        lab.delete_pod(args.pod)
        print(f"pod {args.pod} deleted")
    return 0


def _migrate(args: argparse.Namespace) -> int:
    from flannelpy_lab.lab import Lab
    from flannelpy_lab.migrate import migrate

    done = migrate(Lab.load(args.name), args.node, args.to)
    print(
        f"node {done.node} runs {done.to_kind} (was {done.from_kind}), lease {done.subnet} "
        f"kept, ready after {done.seconds:.1f} s"
    )
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


def _settings(args: argparse.Namespace) -> tuple[LabState, dict[str, str]]:
    from flannelpy_lab import environ
    from flannelpy_lab.lab import Lab

    state = Lab.load(args.name).state
    if args.node is None:
        return state, environ.store_environ(state)
    return state, environ.node_environ(state, state.node(args.node))


def _run(args: argparse.Namespace) -> int:
    from flannelpy_lab import environ

    state, settings = _settings(args)
    node = state.node(args.node) if args.node is not None else None
    argv = environ.command_argv(args.name, node, args.command)
    # A child, not exec: tests drive this in-process, and Ctrl-C reaches the child too.
    try:
        proc = subprocess.Popen(argv, env=environ.child_environ(settings))
    except OSError as e:
        raise LabError(f"cannot run {argv[0]}: {e.strerror}; check the command after --") from e
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        code = proc.wait()
    return code if code >= 0 else 128 - code


def _env(args: argparse.Namespace) -> int:
    from flannelpy_lab import environ

    sys.stdout.write(environ.render(_settings(args)[1]))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``flannelpy-lab`` (and ``python -m flannelpy_lab``)."""
    words = list(sys.argv[1:] if argv is None else argv)
    # Everything after the first "--" is run's command, options and all: cut it off
    # before argparse, which would otherwise take the command's options for ours.
    command: list[str] = []
    if "--" in words:
        cut = words.index("--")
        words, command = words[:cut], words[cut + 1 :]
    parser = build_parser()
    args = parser.parse_args(words)
    if args.lab_command != "run" and command:
        parser.error(f"only run takes a command after --, not {args.lab_command}")
    args.command = command
    return run(args)
