"""Write requirements.lock: every Python package flannelpy installs, pinned with hashes.

Run by scripts/lock.sh with pip-tools' pip-compile on PATH. Three sections, in the order
an installer can cut them:

- runtime: pyproject.toml's dependencies, with everything they pull in
  (what the image installs);
- build: pip and the build backend of build-system.requires (the image and the bootstrap
  install the project itself with --no-build-isolation from these);
- dev: the test extra's tools and what they pull in (scripts/bootstrap.sh --dev, CI).

Everything is resolved together first, then the runtime set alone under those pins, so a
package shared by two sections has one version.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WORK_DIR = Path("build/lock")  # pip-compile's inputs and outputs, relative to REPO
TOOLS_IN = WORK_DIR / "tools.in"
LOCK = REPO / "requirements.lock"
RUNTIME_EXTRAS: tuple[str, ...] = ()  # the runtime is the dependencies alone
DEV_EXTRAS = ("test",)
BUILD_TOOLS = ("pip",)  # beside build-system.requires
SECTION_MARK = "# --- "  # a section's first line; the image cuts the file at "# --- dev"
HEADER = """\
# Every Python package flannelpy installs, pinned with its hashes, for CPython 3.11 on
# Linux (Debian 12, the image's base). Made by scripts/lock.sh from pyproject.toml; do
# not edit by hand: change pyproject.toml and run scripts/lock.sh.
#   scripts/bootstrap.sh:  pip install --require-hashes -r requirements.lock (all of it)
#   manifests/Dockerfile:  the runtime and build sections (the file up to "# --- dev")
"""
SECTIONS = {
    "runtime": "the agent's dependencies (pyproject.toml's dependencies)",
    "build": "pip and the build backend (build-system.requires), for --no-build-isolation",
    "dev": "the test extra's tools, for scripts/bootstrap.sh --dev and CI",
}
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    return canonical(re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0])


def pip_compile(output: Path, extras: tuple[str, ...], *extra_args: str) -> None:
    argv = [
        "pip-compile",
        "--quiet",
        "--generate-hashes",
        "--allow-unsafe",
        "--strip-extras",
        "--no-header",
        "--no-emit-index-url",
        "--no-emit-find-links",
        "--no-emit-trusted-host",
        *(f"--extra={extra}" for extra in extras),
        *extra_args,
        f"--output-file={output}",
        "pyproject.toml",
    ]
    subprocess.run(argv, cwd=REPO, check=True)


def entries(path: Path) -> dict[str, list[str]]:
    """pip-compile's output as {package: its lines (pin, hashes, annotations)}."""
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in path.read_text(encoding="utf-8").splitlines():
        pin = PIN.match(line)
        if pin:
            current = found.setdefault(canonical(pin.group(1)), [])
        elif not line.startswith(" "):
            current = None  # pip-compile's own comments between entries
        if current is None:
            continue
        if line.strip() == f"# via -r {TOOLS_IN}":
            line = "    # via the build tools"
        elif str(WORK_DIR) in line:
            continue  # "-c build/lock/pins.txt": the runtime pass's constraints, not a reason
        current.append(line)
    return found


def lock_text(
    every: dict[str, list[str]], runtime: dict[str, list[str]], build_tools: list[str]
) -> str:
    build_names = {requirement_name(r) for r in build_tools}
    build = {name: every[name] for name in build_names if name not in runtime}
    dev = {
        name: lines for name, lines in every.items() if name not in runtime and name not in build
    }
    parts = [HEADER]
    for section, chosen in (("runtime", runtime), ("build", build), ("dev", dev)):
        parts.append(f"\n{SECTION_MARK}{section}: {SECTIONS[section]}\n")
        parts.extend("\n".join(lines) + "\n" for _, lines in sorted(chosen.items()))
    return "".join(parts)


def main() -> int:
    (REPO / WORK_DIR).mkdir(parents=True, exist_ok=True)
    with open(REPO / "pyproject.toml", "rb") as f:
        build_tools = [*BUILD_TOOLS, *tomllib.load(f)["build-system"]["requires"]]
    (REPO / TOOLS_IN).write_text("\n".join(build_tools) + "\n", encoding="utf-8")
    everything = REPO / WORK_DIR / "all.txt"
    pip_compile(everything, RUNTIME_EXTRAS + DEV_EXTRAS, str(TOOLS_IN))
    every = entries(everything)
    pins = WORK_DIR / "pins.txt"
    (REPO / pins).write_text(
        "".join(lines[0].rstrip(" \\") + "\n" for lines in every.values()), encoding="utf-8"
    )
    runtime_file = REPO / WORK_DIR / "runtime.txt"
    pip_compile(runtime_file, RUNTIME_EXTRAS, f"--constraint={pins}")
    runtime = entries(runtime_file)
    text = lock_text(every, runtime, build_tools)
    LOCK.write_text(text, encoding="utf-8")
    print(f"{LOCK.name}: {len(every)} packages, {len(runtime)} of them for the runtime")
    return 0


if __name__ == "__main__":
    sys.exit(main())
