"""requirements.lock is the one dependency set: it pins every range of pyproject.toml, holds
everything the runtime pulls in, and the image, the bootstrap and CI install from it with
hashes checked. A dependency changed in pyproject.toml without scripts/lock.sh fails here."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "requirements.lock"
SECTIONS = ("runtime", "build", "dev")
RUNTIME_EXTRAS: tuple[str, ...] = ()  # the runtime is the dependencies alone
IMAGE_CUT = "# --- dev:"  # where the image and `bootstrap --lab` stop reading the lock
REFRESH = "run scripts/lock.sh and commit requirements.lock"


@dataclass(frozen=True)
class Pin:
    version: str
    section: str
    hashes: int


def locked() -> dict[str, Pin]:
    pins: dict[str, Pin] = {}
    section = ""
    name = version = ""
    for line in LOCK.read_text(encoding="utf-8").splitlines():
        mark = re.match(r"# --- (\w+):", line)
        pin = re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if mark:
            section = mark.group(1)
        elif pin:
            name, version = canonicalize_name(pin.group(1)), pin.group(2)
            assert name not in pins, f"{name} is pinned twice in requirements.lock"
            pins[name] = Pin(version, section, 0)
        elif line.strip().startswith("--hash=sha256:") and name:
            pins[name] = Pin(version, section, pins[name].hashes + 1)
    return pins


def pyproject() -> dict:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)


def test_every_pin_sits_in_a_section_with_its_hashes() -> None:
    pins = locked()
    assert pins, "requirements.lock pins nothing"
    for name, pin in pins.items():
        assert pin.section in SECTIONS, f"{name} is outside the sections {SECTIONS}"
        assert pin.hashes, f"{name} has no --hash in requirements.lock"
    text = LOCK.read_text(encoding="utf-8")
    marks = [m for s in SECTIONS for m in re.findall(rf"^# --- {s}:", text, re.M)]
    assert len(marks) == len(SECTIONS)
    assert text.index("# --- runtime:") < text.index("# --- build:") < text.index(IMAGE_CUT)


def test_every_range_of_pyproject_is_pinned_in_its_section_within_the_range() -> None:
    project = pyproject()
    runtime = list(project["project"]["dependencies"])
    for extra in RUNTIME_EXTRAS:
        runtime += project["project"]["optional-dependencies"][extra]
    dev = [
        r
        for extra, reqs in project["project"]["optional-dependencies"].items()
        if extra not in RUNTIME_EXTRAS
        for r in reqs
    ]
    wanted = [(r, ("runtime",)) for r in runtime]
    wanted += [(r, ("build",)) for r in project["build-system"]["requires"]]
    wanted += [(r, SECTIONS) for r in dev]  # a test tool may share a runtime package
    pins = locked()
    for text, sections in wanted:
        req = Requirement(text)
        pin = pins.get(canonicalize_name(req.name))
        assert pin, f"{req.name} ({text}) is not in requirements.lock; {REFRESH}"
        assert pin.section in sections, f"{req.name} is in the {pin.section} section; {REFRESH}"
        assert req.specifier.contains(pin.version, prereleases=True), (
            f"requirements.lock pins {req.name}=={pin.version}, outside {text}; {REFRESH}"
        )


def test_the_image_sections_hold_everything_the_runtime_pulls_in() -> None:
    """Read from the installed packages' metadata: the venv the bootstrap made from the lock."""
    pins = locked()
    for name, pin in pins.items():
        if pin.section == "dev":
            continue
        try:
            installed = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            installed = None
        assert installed == pin.version, (
            f"{name} is {installed} here, {pin.version} in the lock: run scripts/bootstrap.sh"
        )
        for text in importlib.metadata.requires(name) or []:
            req = Requirement(text)
            if req.marker and not req.marker.evaluate({"extra": ""}):
                continue
            dep = pins.get(canonicalize_name(req.name))
            assert dep and dep.section != "dev", (
                f"{name} needs {req.name}, which the image would not install; {REFRESH}"
            )


def commands(path: str) -> str:
    """A script's or Dockerfile's text without comments, continuation lines joined."""
    text = (REPO / path).read_text(encoding="utf-8")
    lines = [line for line in text.splitlines() if not line.lstrip().startswith("#")]
    return "\n".join(lines).replace("\\\n", " ")


def pip_installs(text: str) -> list[str]:
    return re.findall(r"pip install [^\n&|]*", text)


def test_the_image_and_the_bootstrap_install_only_from_the_lock() -> None:
    for path in ("manifests/Dockerfile", "scripts/bootstrap.sh"):
        installs = pip_installs(commands(path))
        from_lock = [i for i in installs if "--require-hashes" in i]
        assert from_lock, f"{path} does not install requirements.lock with --require-hashes"
        for install in installs:
            # Anything else installs only the project itself, with the lock's build backend.
            assert install in from_lock or (
                "--no-deps" in install and "--no-build-isolation" in install
            ), f"{path}: `{install}` installs outside the lock"
    dockerfile = commands("manifests/Dockerfile")
    assert "requirements.lock" in dockerfile
    assert f"sed '/^{IMAGE_CUT}/,$d' requirements.lock" in dockerfile
    # The image's cache key covers the lock, so a new lock builds a new image.
    image_key = re.search(r"key=\$\( \{.*?sha256sum", commands("scripts/build-images.sh"), re.S)
    assert image_key and "requirements.lock" in image_key.group(0)
    # CI runs the test command, which runs the bootstrap that installs the lock.
    assert "scripts/test.sh" in commands(".ci/run")
    assert "scripts/bootstrap.sh" in commands("scripts/test.sh")


def test_the_installer_is_pinned_with_hashes_and_installs_the_lock() -> None:
    """uv, which the bootstrap installs the lock with, is itself pinned by hash."""
    text = (REPO / "requirements-installer.lock").read_text(encoding="utf-8")
    (pin,) = re.findall(r"^uv==(\S+) ", text, re.M)
    assert re.fullmatch(r"\d+\.\d+\.\d+", pin), pin
    assert len(re.findall(r"--hash=sha256:[0-9a-f]{64}", text)) >= 1
    installs = pip_installs(commands("scripts/bootstrap.sh"))
    assert any("--require-hashes -r requirements-installer.lock" in i for i in installs)
    assert any("--require-hashes -r requirements.lock" in i for i in installs), installs
