"""``flannelpy agent``: run the node agent (one per node) with the agent's flags."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from flannelpy.config.settings import add_agent_arguments


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    agent: argparse.ArgumentParser = subparsers.add_parser(
        "agent", help="run the node agent (one per node)"
    )
    add_agent_arguments(agent)
    agent.set_defaults(run=run)
    return agent


def run(args: argparse.Namespace) -> int:
    # The agent (and through it the store client) loads only when it runs.
    from flannelpy.agent.compose import run_agent
    from flannelpy.config.settings import settings_from_args, start_notes
    from flannelpy.errors import FlannelpyError
    from flannelpy.log import setup_logging

    try:
        settings = settings_from_args(args, os.environ)
    except FlannelpyError as e:
        print(f"flannelpy: {e}", file=sys.stderr)
        return e.exit_code
    setup_logging(settings.log_format, settings.log_level)
    for note in start_notes(settings):
        logging.getLogger("flannelpy.agent").info(note)
    return run_agent(settings)
