"""``flannelpy rollout`` run as an operator runs it against a Kubernetes lab: Kubernetes
mode, the cluster admin's kubeconfig, none of the agents' ``FLANNELD_`` settings."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from flannelpy_lab import Lab
from flannelpy_lab import kube as control_plane

REPO = Path(__file__).resolve().parents[2]


def operator_env(lab: Lab) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLANNELD_")}
    env.update(
        FLANNELD_KUBE_SUBNET_MGR="true",
        FLANNELD_KUBECONFIG_FILE=control_plane.admin_kubeconfig(lab.state),
    )
    return env


def rollout(lab: Lab, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "flannelpy", "rollout", *args]
    return subprocess.run(
        argv, cwd=REPO, env=operator_env(lab), capture_output=True, text=True, timeout=timeout
    )


def start_rollout(lab: Lab, *args: str) -> subprocess.Popen[str]:
    """The same in the background, its output and errors on one pipe."""
    argv = [sys.executable, "-m", "flannelpy", "rollout", *args]
    return subprocess.Popen(
        argv,
        cwd=REPO,
        env=operator_env(lab),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
