"""``flannelpy rollout plan|start|status|pause|resume|abort``: the command line over
:mod:`flannelpy.rollout.driver`.

``start`` and ``resume`` drive the rollout in the foreground, one line per event, and
end with a summary; ``pause`` and ``abort`` only change the record, which the driver
polls. The store is found as the agent finds it: its ``--etcd-*`` flags and FLANNELD_*
variables; with ``--kube-subnet-mgr`` (FLANNELD_KUBE_SUBNET_MGR), the Kubernetes API
through ``--kubeconfig-file`` (an operator's, which may patch Nodes and the flannelpy
ConfigMaps: not the agents' ServiceAccount). The clients and the driver are imported
in :func:`run`, not when the ``flannelpy`` parser is built.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any

from flannelpy.commands.store import STORE_TIMEOUT, add_agent_flags, store_parent
from flannelpy.config.settings import settings_from_args
from flannelpy.control.records import ForceRecord
from flannelpy.errors import ConfigError, FlannelpyError
from flannelpy.rollout.flanneld import flanneld_nodes
from flannelpy.rollout.plan import DEFAULT_STEP_TIMEOUT
from flannelpy.rollout.show import describe_state, how_to_go_back, status_rows, summary

if TYPE_CHECKING:
    from flannelpy.rollout.driver import WallClock
    from flannelpy.rollout.storage import RolloutStorage

KUBE_FLAGS = ("kube_subnet_mgr", "kube_api_url", "kubeconfig_file", "kube_annotation_prefix")
DEFAULT_KUBE_NAMESPACE = "kube-flannelpy"  # the manifests'
DEFAULT_KUBE_CONFIG_MAP = "kube-flannelpy-cfg"


def _kube_parent() -> argparse.ArgumentParser:
    """The agent's Kubernetes flags (same names and FLANNELD_* variables), and where
    flannelpy's namespace and ConfigMap are."""
    parent = argparse.ArgumentParser(add_help=False)
    group = add_agent_flags(
        parent,
        KUBE_FLAGS,
        "kubernetes",
        "Kubernetes mode (each agent flag also read from FLANNELD_<NAME>)",
    )
    group.add_argument(
        "--kube-namespace",
        default=DEFAULT_KUBE_NAMESPACE,
        help="the namespace of flannelpy's ConfigMap and status Leases "
        f"(default {DEFAULT_KUBE_NAMESPACE})",
    )
    group.add_argument(
        "--kube-config-map",
        default=DEFAULT_KUBE_CONFIG_MAP,
        help=f"the ConfigMap holding net-conf.json (default {DEFAULT_KUBE_CONFIG_MAP})",
    )
    return parent


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False, parents=[store_parent(), _kube_parent()])

    target = argparse.ArgumentParser(add_help=False)
    target.add_argument("--backend", required=True, metavar="TYPE", help="vxlan or host-gw")
    target.add_argument(
        "--direct-routing",
        action="store_true",
        help="vxlan: route peers on the same L2 segment directly",
    )
    target.add_argument("--vni", type=int, help="VXLAN ID (default: the config's)")
    target.add_argument("--port", type=int, help="VXLAN UDP port (default: the config's)")
    target.add_argument("--mtu", type=int, help="underlay MTU to assume (default: the config's)")
    target.add_argument(
        "--nodes", metavar="N1,N2,...", help="the order to switch nodes in (default: by name)"
    )
    force = argparse.ArgumentParser(add_help=False)
    force.add_argument(
        "--force", action="store_true", help="skip the disruption policy (an emergency; recorded)"
    )
    force.add_argument("--reason", help="why the policy is skipped (with --force)")

    driving = argparse.ArgumentParser(add_help=False)
    driving.add_argument(
        "--wait",
        action="store_true",
        help="outside the maintenance window, wait for it instead of exiting",
    )
    driving.add_argument(
        "--step-timeout",
        type=float,
        metavar="SECONDS",
        help=f"seconds each step may take (default {DEFAULT_STEP_TIMEOUT:g})",
    )
    # For tests of maintenance windows: the rollout's clock starts at this instant.
    driving.add_argument("--clock-start", metavar="ISO8601", help=argparse.SUPPRESS)

    rollout = subparsers.add_parser(
        "rollout",
        help="switch the backend node by node, verified, under the disruption policy",
        description="Switch the cluster's backend one node at a time: set the node's target, "
        "wait until it applied and is Ready, verify that it and every peer reach each other "
        "(full-MTU probes included), then the next node. A failed step rolls that node "
        "back and stops. The state lives in etcd (Kubernetes mode: a ConfigMap), so a "
        "killed rollout resumes. In Kubernetes mode each node is cordoned and out of "
        "external load balancers while it changes.",
    )
    actions = rollout.add_subparsers(dest="rollout_command", required=True)
    actions.add_parser(
        "plan",
        parents=[target, force, common],
        help="show the plan and what would stop it; change nothing",
    )
    begin = actions.add_parser(
        "start", parents=[target, force, driving, common], help="start a rollout and drive it"
    )
    begin.add_argument(
        "--no-cordon",
        action="store_true",
        help="Kubernetes mode: leave nodes schedulable and in external load "
        "balancers while they change",
    )
    status = actions.add_parser("status", parents=[common], help="show the rollout and nodes")
    status.add_argument("--json", action="store_true", help="print the record as JSON")
    actions.add_parser("pause", parents=[common], help="stop after the current step")
    actions.add_parser("resume", parents=[driving, common], help="continue driving a rollout")
    actions.add_parser(
        "abort", parents=[common], help="stop after the current step for good (switched nodes stay)"
    )
    rollout.set_defaults(run=run)
    return rollout


def run(args: argparse.Namespace) -> int:
    from flannelpy.store.open_store import open_rollout_store

    try:
        settings = settings_from_args(args, os.environ)
        store, close = open_rollout_store(
            settings, args.kube_namespace, args.kube_config_map, STORE_TIMEOUT
        )
        try:
            return _command(args, store)
        finally:
            close()
    except FlannelpyError as e:
        print(f"flannelpy rollout: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(
            "flannelpy rollout: interrupted; the rollout record keeps its state: run "
            "flannelpy rollout resume to continue",
            file=sys.stderr,
        )
        return 130


def _wall_clock(args: argparse.Namespace) -> WallClock:
    text = getattr(args, "clock_start", None)
    if not text:
        return lambda: datetime.now(UTC)
    try:
        start_at = datetime.fromisoformat(text)
    except ValueError as e:
        raise ConfigError(f"--clock-start {text!r} is not an ISO-8601 time: {e}") from e
    if start_at.tzinfo is None:
        raise ConfigError(f"--clock-start {text!r} needs a UTC offset, like +00:00")
    began = time.monotonic()
    return lambda: start_at + timedelta(seconds=time.monotonic() - began)


def _print(text: str) -> None:
    print(text, flush=True)


def _command(args: argparse.Namespace, store: RolloutStorage) -> int:
    from flannelpy.rollout.driver import make_plan, operator, prepare_resume, request_stop, start

    clock = _wall_clock(args)
    command = args.rollout_command
    if command in ("plan", "start"):
        if args.reason is not None and not args.force:
            raise ConfigError("--reason goes with --force; add --force or drop --reason")
        if args.force and not (args.reason or "").strip():
            raise ConfigError('--force needs --reason "..." saying why the policy is skipped')
        order = [n.strip() for n in args.nodes.split(",") if n.strip()] if args.nodes else None
        plan = make_plan(
            store,
            args.backend,
            clock(),
            args.direct_routing,
            args.vni,
            args.port,
            args.mtu,
            order,
            args.reason if args.force else None,
        )
        for line in plan.lines():
            _print(line)
        refusal = list(plan.problems) or ([plan.blocked] if plan.blocked and not args.force else [])
        if refusal:
            for sentence in refusal:
                print(f"flannelpy rollout: {sentence}", file=sys.stderr)
            return 2
        if command == "plan":
            return 0
        force = None
        if args.force:
            force = ForceRecord(
                args.reason.strip(), operator(), clock().astimezone(UTC).isoformat()
            )
            print(
                f"flannelpy rollout: WARNING: the disruption policy is skipped (--force): "
                f"{force.reason}; every override and an event per node record it",
                file=sys.stderr,
            )
        record = start(
            store,
            plan,
            clock(),
            args.step_timeout or DEFAULT_STEP_TIMEOUT,
            force,
            cordon=not args.no_cordon,
        )
        _print(f"rollout {record.id} started")
        return _drive(args, store, record.id, clock)
    if command == "resume":
        record = prepare_resume(store, clock(), args.step_timeout)
        _print(f"resuming rollout {record.id} ({describe_state(record)})")
        return _drive(args, store, record.id, clock)
    if command in ("pause", "abort"):
        record = request_stop(store, command, clock())
        if record.request is not None:
            entry = record.current()
            at = f" ({entry.node} {entry.state})" if entry else ""
            _print(
                f"rollout {record.id}: {command} requested; the driver stops after the "
                f"current step{at}"
            )
        else:
            _print(f"rollout {record.id} {record.state}")
        if command == "abort":
            back = how_to_go_back(record)
            if back:
                _print(back)
        return 0
    return _status(args, store)


def _drive(
    args: argparse.Namespace, store: RolloutStorage, record_id: str, clock: WallClock
) -> int:
    from flannelpy.rollout.driver import drive

    record = drive(store, record_id, clock, time.sleep, _print, wait_for_window=args.wait)
    _print(summary(record))
    if record.state == "paused-window":
        _print(
            f"the next window opens {record.next_window}; run flannelpy rollout resume "
            "then (or resume --wait to wait for it)"
        )
    elif record.state == "paused":
        _print("run flannelpy rollout resume to continue")
    elif record.state in ("aborted", "failed"):
        back = how_to_go_back(record)
        if back:
            _print(back)
    return 1 if record.state in ("failed", "aborted") else 0


def _status(args: argparse.Namespace, store: RolloutStorage) -> int:
    record, _ = store.read_record()
    nodes = store.read_nodes()
    if args.json:
        _print(record.to_json() if record else "null")
        return 0
    if record is None:
        _print("no rollout recorded")
    else:
        _print(summary(record))
        _print(
            f"started {record.created_at}, last change {record.updated_at}, "
            f"step timeout {record.step_timeout:g} s, driver {record.driver or '-'}"
        )
        if record.force is not None:
            _print(
                f"forced past the policy by {record.force.by} at {record.force.at}: "
                f"{record.force.reason}"
            )
    flanneld = flanneld_nodes(store.read_leases(), nodes.statuses)
    rows = status_rows(record, nodes.statuses, flanneld, store.read_config().config.backend)
    header = ("node", "rollout", "backend", "generation", "ready", "blocked")
    table = [header] + [
        (
            r.node,
            r.rollout_state,
            r.backend,
            "-" if r.applied_generation is None else str(r.applied_generation),
            "-" if r.ready is None else ("yes" if r.ready else "no"),
            r.blocked or "-",
        )
        for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header) - 1)]
    for row in table:
        _print(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1]
        )
    for key, why in sorted(nodes.errors.items()):
        _print(f"{key}: {why}")
    return 0
