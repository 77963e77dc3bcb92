"""The `flannelpy` command: `agent` runs the node agent; `lab` drives the netns lab."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from flannelpy import __version__


def build_parser() -> argparse.ArgumentParser:
    from flannelpy_lab.cli import add_lab_parser

    from flannelpy.commands.doctor import add_doctor_parser
    from flannelpy.commands.policy import add_policy_parser
    from flannelpy.commands.pools import add_pools_parser
    from flannelpy.commands.rollout import add_rollout_parser
    from flannelpy.config.settings import add_agent_arguments

    parser = argparse.ArgumentParser(prog="flannelpy", description=__doc__)
    parser.add_argument("--version", action="version", version=f"flannelpy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    agent = sub.add_parser("agent", help="run the node agent (one per node)")
    add_agent_arguments(agent)
    add_lab_parser(sub)
    add_doctor_parser(sub)
    add_policy_parser(sub)
    add_pools_parser(sub)
    add_rollout_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "agent":
        import os

        from flannelpy.agent.node import run_agent
        from flannelpy.config.settings import settings_from_args
        from flannelpy.errors import FlannelpyError
        from flannelpy.log import setup_logging

        try:
            settings = settings_from_args(args, os.environ)
        except FlannelpyError as e:
            print(f"flannelpy: {e}", file=sys.stderr)
            return e.exit_code
        setup_logging(settings.log_format, settings.log_level)
        return run_agent(settings)
    if args.command == "doctor":
        from flannelpy.commands.doctor import run as run_doctor

        return run_doctor(args)
    if args.command == "policy":
        from flannelpy.commands.policy import run as run_policy

        return run_policy(args)
    if args.command == "pools":
        from flannelpy.commands.pools import run as run_pools

        return run_pools(args)
    if args.command == "rollout":
        from flannelpy.commands.rollout import run as run_rollout

        return run_rollout(args)
    if args.command == "lab":
        from flannelpy_lab.cli import run

        return run(args)
    raise AssertionError(f"unhandled command {args.command}")


if __name__ == "__main__":
    sys.exit(main())
