"""``flannelpy doctor``: gather a node's facts, diagnose them, print one line per finding.

It takes the agent's flags (and FLANNELD_* variables), so it finds what the agent uses;
without them it reads the agent's effective settings from ``<run-dir>/settings.json``
(the run dir from ``--run-dir``, FLANNELD_RUN_DIR or the default), so on a node or in
the agent's pod no flag is needed. The facts come from :mod:`flannelpy.doctor.gather`,
the findings from :mod:`flannelpy.doctor.checks`. It looks at the network namespace it
runs in. In the netns lab, ``flannelpy-lab run NAME --node n1 -- flannelpy doctor``
runs it inside node n1 with n1's agent's settings.

The store clients and netlink are imported when the command runs, not when the
``flannelpy`` parser is built.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import Any

from flannelpy.config.settings import add_agent_arguments

STORE_TIMEOUT = 3.0  # seconds per etcd request: the doctor is run by a person waiting


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``doctor``: it takes the agent's flags, so it finds what the agent uses."""
    doctor: argparse.ArgumentParser = subparsers.add_parser(
        "doctor",
        help="check this node's overlay: links, MTUs, routes, rules, lease, drops, peers",
        description="Check this node against what the agent should have made of it: links "
        "up and MTUs consistent, routes/neighbours/FDB complete and none stale, firewall "
        "rules in order, no overlap, the lease, drop counters, peer reachability. One line "
        "per finding; exit 0 when healthy, 1 when not. It uses the settings the running agent "
        "left in its run dir (settings.json); flags (or FLANNELD_* variables) given here "
        "win over them.",
    )
    doctor.add_argument("--json", action="store_true", help="print the findings as JSON")
    add_agent_arguments(doctor)
    doctor.set_defaults(run=run)
    return doctor


def run(args: argparse.Namespace) -> int:
    from flannelpy.config.effective import with_agent_defaults
    from flannelpy.config.settings import settings_from_args
    from flannelpy.doctor.checks import diagnose
    from flannelpy.doctor.gather import SNAPSHOT_FILE, gather, save_snapshot
    from flannelpy.doctor.report import exit_code, render_json, render_text
    from flannelpy.doctor.traffic_checks import snapshot_json
    from flannelpy.errors import FlannelpyError
    from flannelpy.store.open_store import open_store

    try:
        run_dir = settings_from_args(args, os.environ).run_dir
        chose_iface = bool(args.iface or args.iface_regex or args.iface_can_reach)
        environ = with_agent_defaults(run_dir, os.environ, chose_iface)
        settings = settings_from_args(args, environ)
        facts = gather(settings, functools.partial(open_store, timeout=STORE_TIMEOUT))
    except FlannelpyError as e:
        print(f"flannelpy doctor: {e}", file=sys.stderr)
        return e.exit_code
    findings = diagnose(facts)
    if facts.kernel_error is None:  # keep the old baseline rather than record nothing
        try:
            save_snapshot(settings.run_dir, snapshot_json(facts))
        except OSError as e:
            path = os.path.join(settings.run_dir, SNAPSHOT_FILE)
            print(f"flannelpy doctor: cannot save drop counters to {path}: {e}", file=sys.stderr)
    node = settings.node_name or "this node"
    sys.stdout.write(render_json(node, findings) if args.json else render_text(node, findings))
    return exit_code(findings)
