"""The pinned Kubernetes build the lab's control plane runs: where it is, and building it on
first use (scripts/build-kube.sh). Apart from the control plane itself so that what only
finds binaries imports no process management."""

from __future__ import annotations

import os
import subprocess
import sys

from flannelpy_lab.errors import LabError
from flannelpy_lab.flanneld import repo_root

BUILD_SCRIPT = "scripts/build-kube.sh"


PIN_FILE = "tests/peers/kubernetes/go.mod"


BIN_DIR_ENV = "FLANNELPY_KUBE_BIN_DIR"


PEERS_DIR_ENV = "FLANNELPY_PEERS_DIR"


BINARIES = ("kube-apiserver", "kube-controller-manager", "kubectl", "kube-proxy")


def bin_dir(build: bool = False) -> str:
    """The directory holding the built control plane; LabError naming the build script.
    With ``build`` (a lab coming up), a missing pinned build is made first."""
    explicit = os.environ.get(BIN_DIR_ENV)
    directory = explicit or pinned_dir()
    missing = [b for b in BINARIES if not os.access(os.path.join(directory, b), os.X_OK)]
    if missing and build and not explicit:
        build_pinned(directory)
        missing = [b for b in BINARIES if not os.access(os.path.join(directory, b), os.X_OK)]
    if missing:
        raise LabError(
            f"the Kubernetes control plane is not built in {directory} (no "
            f"{', '.join(missing)}); run {BUILD_SCRIPT}"
            + (f" or unset {BIN_DIR_ENV}" if explicit else "")
        )
    return directory


def build_pinned(directory: str) -> None:
    """First use: build the pinned control plane; the script says what and how long."""
    script = os.path.join(repo_root(), BUILD_SCRIPT)
    if os.path.isfile(script):
        say = f"flannelpy-lab: Kubernetes is not built in {directory}; building it now with "
        print(say + f"{BUILD_SCRIPT} (the first build takes about 10 minutes)", file=sys.stderr)
        subprocess.run(["bash", script], stdout=subprocess.DEVNULL, check=False)


def required_version(line: str) -> str | None:
    """The version in "require k8s.io/kubernetes vX", alone or as a line of a require
    block; None for any other line (an indirect one has a comment after it)."""
    words = line.split()
    if words[:1] == ["require"]:
        words = words[1:]
    if len(words) == 2 and words[0] == "k8s.io/kubernetes" and words[1].startswith("v"):
        return words[1]
    return None


def pinned_dir() -> str:
    path = os.path.join(repo_root(), PIN_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            pin = next(filter(None, (required_version(line) for line in f)), None)
    except OSError as e:
        raise LabError(
            f"cannot read the Kubernetes pin {path} ({e.strerror}); "
            f"restore it and run {BUILD_SCRIPT}"
        ) from e
    if pin is None:
        raise LabError(
            f"{path} pins no k8s.io/kubernetes release; restore it and run {BUILD_SCRIPT}"
        )
    peers = os.environ.get(PEERS_DIR_ENV, "/var/cache/flannelpy/peers")
    return os.path.join(peers, f"kubernetes-{pin}")
