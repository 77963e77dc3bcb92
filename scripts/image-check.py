"""Run in the flannelpy image's root filesystem while the image is built (manifests/Dockerfile,
under chroot): the build fails when the agent could not run there, before a node pulls it.

- every module of flannelpy and cni_plugin imports, and so does every module they import
  anywhere, inside a function too (the Kubernetes and etcd clients load lazily);
- every native extension in the virtualenv finds its shared libraries (`ld.so --list`);
- every program the agent and the DaemonSet's init containers run is on PATH.

Importing also writes the byte-code of the standard library's modules the agent imports,
so a new pod does not compile them at start; the rest of it stays source only.
"""

from __future__ import annotations

import ast
import importlib
import os
import pkgutil
import shutil
import subprocess
import sys

PACKAGES = ("flannelpy", "cni_plugin")
PROGRAMS = (
    # the agent: the firewall rules in iptables or nftables mode, NetworkPolicy, links
    "iptables",
    "iptables-save",
    "iptables-restore",
    "ip6tables",
    "ip6tables-save",
    "ip6tables-restore",
    "nft",
    "ip",
    # the wireguard backend without the kernel module: wireguard-go, started in a mount
    # namespace of its own by a shell script (flannelpy/dataplane/wireguard.py)
    "wireguard-go",
    "unshare",
    "sh",
    "mount",
    "mkdir",
    # the install-cni-plugin init container's atomic copy (manifests/kube-flannelpy.yml)
    "cp",
    "chmod",
    "mv",
)
LOADER = "/lib64/ld-linux-x86-64.so.2"


def imported_by(path: str) -> set[str]:
    """The absolute imports of one source file, wherever they stand in it."""
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def import_problems() -> list[str]:
    problems: list[str] = []
    wanted: set[str] = set()
    for package in PACKAGES:
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, f"{package}."):
            if info.name.endswith(".__main__"):
                continue  # running it is the CLI itself
            module = importlib.import_module(info.name)
            wanted |= imported_by(module.__file__ or "")
    for name in sorted(wanted):
        try:
            importlib.import_module(name)
        except ImportError as e:
            problems.append(f"import {name}: {e}")
    return problems


def library_problems() -> list[str]:
    problems: list[str] = []
    for top, _, files in os.walk(sys.prefix):
        for name in files:
            if not name.endswith(".so"):
                continue
            path = os.path.join(top, name)
            proc = subprocess.run([LOADER, "--list", path], capture_output=True, text=True)
            missing = [line.strip() for line in proc.stdout.splitlines() if "not found" in line]
            if proc.returncode or missing:
                problems.append(f"{path}: {', '.join(missing) or proc.stderr.strip()}")
    return problems


def main() -> int:
    sys.dont_write_bytecode = False
    problems = import_problems() + library_problems()
    problems += [f"{p} is not on PATH" for p in PROGRAMS if shutil.which(p) is None]
    for problem in problems:
        print(f"image-check: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
