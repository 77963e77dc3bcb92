"""The `flannelpy` command: `agent` runs the node agent; the operator commands inspect and
change a cluster (doctor, policy, pools, rollout, netpol).

This module builds the root parser and hands each parsed command to its module in
``flannelpy.commands``. Building the parser imports no store client (etcd's gRPC or the
Kubernetes client): each command imports what it needs when it runs.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from flannelpy import __version__

DESCRIPTION = "A Flannel-compatible overlay agent for Kubernetes, and its operator commands."
Run = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    from flannelpy.commands import agent, doctor, install_cni, netpol, policy, pools, rollout

    parser = argparse.ArgumentParser(prog="flannelpy", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"flannelpy {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (agent, doctor, policy, pools, rollout, netpol, install_cni):
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    given = list(sys.argv[1:] if argv is None else argv)
    if given[:1] == ["agent"]:
        # flanneld's manifests spell the agent's flags Go's way (-etcd-endpoints=...).
        from flannelpy.config.settings import go_style_argv

        given = ["agent", *go_style_argv(given[1:])]
    args = build_parser().parse_args(given)
    run: Run = args.run
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
