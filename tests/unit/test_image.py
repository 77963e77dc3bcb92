"""The image holds what the agent runs and leaves out only what it never imports.

manifests/Dockerfile builds the final stage from scratch with the files of a list of Debian
packages, trims the virtualenv (scripts/image-venv.sh) and runs scripts/image-check.py in
the result, which fails the build when an import, a shared library or a program is missing.
These tests keep the lists those scripts work from true to the code."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from tests.unit.test_dependency_lock import locked
from tests.unit.test_external_programs import NOT_RUN, resolve, scanned

REPO = Path(__file__).resolve().parents[2]
PRODUCT = ("flannelpy", "cni_plugin")
# Programs the agent runs whose names the scan cannot see: built by an f-string (the
# iptables family in flannelpy/dataplane/firewall.py), held in a constant (wireguard-go), or
# run by the shell script that starts wireguard-go (flannelpy/dataplane/wireguard.py).
UNSEEN = {
    *(f"{tool}{suffix}" for tool in ("iptables", "ip6tables") for suffix in ("", "-restore")),
    "wireguard-go",
    "mount",
    "mkdir",
}
# Words of the product that the scan takes for programs and that are data where they stand.
DATA_WORDS = {"true", "false", "link"}
# The Debian package each program the image needs comes from; busybox serves the rest.
PACKAGE_OF = {
    "ip": "iproute2",
    "nft": "nftables",
    "mount": "mount",
    "wireguard-go": "wireguard-go",
    **{f"{t}{s}": "iptables" for t in ("iptables", "ip6tables") for s in ("", "-save", "-restore")},
}


def bash_array(path: str, name: str) -> list[str]:
    text = (REPO / path).read_text(encoding="utf-8")
    match = re.search(rf"^{name}=\((.*?)\)", text, re.S | re.M)
    assert match, f"{path} has no {name}=(...)"
    return match.group(1).split()


def image_programs() -> set[str]:
    tree = ast.parse((REPO / "scripts" / "image-check.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "PROGRAMS":
            return set(ast.literal_eval(node.value))
    raise AssertionError("scripts/image-check.py has no PROGRAMS")


def image_packages() -> list[str]:
    match = re.search(r'^ARG PACKAGES="([^"]+)"', (REPO / "manifests/Dockerfile").read_text(), re.M)
    assert match, "manifests/Dockerfile has no ARG PACKAGES"
    return match.group(1).split()


def init_container_programs() -> set[str]:
    manifest = yaml.safe_load_all((REPO / "manifests" / "kube-flannelpy.yml").read_text())
    (daemonset,) = [d for d in manifest if d and d["kind"] == "DaemonSet"]
    programs: set[str] = set()
    for container in daemonset["spec"]["template"]["spec"]["initContainers"]:
        command = container["command"]
        if command[:2] != ["/bin/sh", "-c"]:
            programs.add(command[0])
            continue
        for line in container["args"][0].splitlines():
            words = shlex.split(line)
            if words and words[0] != "set":
                programs.add(words[0])
    return programs


def test_the_image_has_every_program_the_agent_and_its_init_containers_run() -> None:
    seen = {
        word
        for word, places in scanned().items()
        if word not in DATA_WORDS
        and resolve(word)
        and any(
            p.startswith(tuple(f"{d}/" for d in PRODUCT)) and (word, p.split(":")[0]) not in NOT_RUN
            for p in places
        )
    }
    needed = seen | UNSEEN | (init_container_programs() - {"flannelpy"})
    missing = needed - image_programs()
    assert not missing, f"add {sorted(missing)} to PROGRAMS in scripts/image-check.py"
    packages = image_packages()
    for program in image_programs():
        package = PACKAGE_OF.get(program, "busybox")
        assert package in packages, f"{program}: add {package} to the Dockerfile's PACKAGES"
    from_busybox = {p for p in image_programs() if p not in PACKAGE_OF}
    unlinked = from_busybox - set(bash_array("scripts/image-rootfs.sh", "APPLETS"))
    assert not unlinked, f"link {sorted(unlinked)} in APPLETS of scripts/image-rootfs.sh"


def import_names(distribution: str) -> set[str]:
    """The top-level modules a distribution installs, from its installed metadata."""
    dist = importlib.metadata.distribution(distribution)
    names = set()
    for file in dist.files or []:
        top = file.parts[0]
        if not top.endswith((".dist-info", ".pth")) and top != "__pycache__":
            names.add(top.removesuffix(".py"))
    return names


def test_the_product_imports_only_what_the_image_installs() -> None:
    """Every module of the product imports with the lock's dev section hidden (the image
    installs up to it): the kubernetes package, a test tool now, among what is hidden."""
    dev_only = {
        name
        for distribution, pin in locked().items()
        if pin.section == "dev"
        for name in import_names(distribution)
    }
    assert "kubernetes" in dev_only and "aiohttp" in dev_only
    probe = f"""
import importlib, importlib.abc, json, pkgutil, sys
class HideDev(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {sorted(dev_only)!r}:
            raise ImportError(name)
sys.meta_path.insert(0, HideDev())
failed = {{}}
for package in {PRODUCT!r}:
    root = importlib.import_module(package)
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        if info.name.endswith(".__main__"):
            continue  # runs the command line
        try:
            importlib.import_module(info.name)
        except ImportError as e:
            failed[info.name] = str(e)
print(json.dumps([failed, sorted(sys.modules)]))
"""
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    ).stdout
    failed, loaded = json.loads(out.splitlines()[-1])
    assert not failed, f"the image could not import {failed}"
    assert "flannelpy.store.kube.client" in loaded and "urllib3" in loaded
