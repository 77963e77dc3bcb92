"""Every program the product, the lab, the tests and the benchmarks run comes from
somewhere a fresh machine gets it, so the README's test command cannot fail for a
program that only the developer's machine had.

The set of programs is found by scanning the source, not listed by hand: in Python,
the first word of every list or tuple literal of strings (an argv), the program after
a wrapper (``nsenter``, ``unshare``, ``ip netns exec NS``, ...), the commands of an
``sh -c`` script, the names given to ``which()``, absolute paths under a ``bin``
directory and CNI plugin types (``{"type": ...}``, looked up in the CNI directories);
in the shell scripts, the first word of every command. A word is a program when it is
on PATH (or in ``PROGRAMS``, which also serves a machine where it is missing). Each program must be
built by the repo (the venv's executables, ``build/flannelpy-cni``, the pinned
flanneld), come from Debian's required set, or come from a package that
``scripts/bootstrap.sh`` installs (or one of its dependencies), checked with
``dpkg -S`` at test time.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PYTHON_ROOTS = ("flannelpy", "lab", "tests", "bench", "cni_plugin")
SHELL_SCRIPTS = ("scripts", "bench")  # vagrant/ provisions its own VM
SEARCH_PATH = os.pathsep.join(
    [
        os.environ.get("PATH", ""),
        "/usr/local/sbin",
        "/usr/local/bin",
        "/usr/sbin",
        "/usr/bin",
        "/sbin",
        "/bin",
    ]
)

# Every program outside Debian's required set that the scan finds, with the package
# that ships it: checked against dpkg -S where installed, and telling a machine where it
# is missing which package the bootstrap lacks.
PROGRAMS = {
    "busybox": "busybox-static",
    "conmon": "conmon",
    "containerd": "containerd",
    "containerd-shim-runc-v2": "containerd",
    "ctr": "containerd",
    "etcd": "etcd-server",
    "ethtool": "ethtool",
    "gcc": "gcc",
    "git": "git",
    "ip": "iproute2",
    "iptables": "iptables",
    "iptables-restore": "iptables",
    "iptables-save": "iptables",
    "ip6tables": "iptables",
    "nft": "nftables",
    "openssl": "openssl",
    "patch": "patch",  # scripts/build-peers.sh patches kube-network-policies
    "ping": "iputils-ping",
    "podman": "podman",
    "prometheus": "prometheus",
    "promtool": "prometheus",
    "debootstrap": "debootstrap",
    "etcdctl": "etcd-client",
    "tcpdump": "tcpdump",
    "iperf3": "iperf3",
    "wg": "wireguard-tools",
    "wireguard-go": "wireguard-go",
    "runc": "runc",
    "sysctl": "procps",
    "bridge": "iproute2",
    "cni:bridge": "containernetworking-plugins",
    "cni:host-local": "containernetworking-plugins",
    "cni:portmap": "containernetworking-plugins",
    "cni:tuning": "containernetworking-plugins",
}
# Built by the repo, with the script that builds it.
REPO_BUILT = {
    "flannelpy-cni": "scripts/build-cni.sh",
    "flanneld": "scripts/build-peers.sh",
    **{
        name: "scripts/build-kube.sh"
        for name in (
            "kube-apiserver",
            "kube-controller-manager",
            "kube-scheduler",
            "kubelet",
            "kubectl",
        )
    },
}
# Not a Debian package, with why.
OUTSIDE_DEBIAN = {
    "go": "the Go toolchain from go.dev builds the pinned flanneld and Kubernetes "
    "(scripts/build-peers.sh, scripts/build-kube.sh); Debian 12's is too old for them",
}
# Words the scan takes for programs that are data where they stand (word, file): why.
NOT_RUN = {
    ("free", "tests/unit/test_choose.py"): "a subnet choice's reason",
    ("w", "tests/unit/test_policy.py"): "a parameter name",
    ("node", "flannelpy/commands/rollout.py"): "a table header",
    ("node", "bench/propagation.py"): "a table header",
    ("node", "tests/e2e/test_blackhole_route.py"): "a parameter name",
    ("patch", "flannelpy/store/kube/api.py"): "an RBAC verb",
    ("patch", "tests/unit/test_manifests.py"): "an RBAC verb",
    ("patch", "tests/e2e/test_kube_real.py"): "an RBAC verb",
    ("patch", "flannelpy/store/kube/node_status.py"): "an RBAC verb",
    ("patch", "lab/flannelpy_lab/kube_netpol.py"): "an RBAC verb",
    ("patch", "tests/unit/test_kube_event_series.py"): "an Event series action",
    ("node", "flannelpy/observe/kernel_counters.py"): "a label value",
    ("node", "tests/unit/test_exposition.py"): "a label value",
    ("/usr/bin/python3.11", "tests/integration/test_cni_client.py"): "a shebang written",
}
# Words that run a program named later in the same argv.
WRAPPERS = frozenset(
    {
        "nsenter",
        "unshare",
        "env",
        "timeout",
        "xargs",
        "setsid",
        "chroot",
        "nohup",
        "sudo",
        "exec",
        "command",
    }
)
SHELL_WORDS = frozenset(
    [
        "if",
        "then",
        "else",
        "elif",
        "fi",
        "for",
        "while",
        "until",
        "do",
        "done",
        "case",
        "esac",
        "in",
        "function",
        "return",
        "local",
        "export",
        "set",
        "unset",
        "cd",
        "exit",
        "trap",
        "echo",
        "printf",
        "read",
        "shift",
        "source",
        ".",
        "[",
        "[[",
        "]]",
        "]",
        "{",
        "}",
        "!",
        "declare",
        "eval",
        "wait",
        "true",
        "false",
        "test",
        "break",
        "continue",
        "readonly",
    ]
)
CNI_PREFIX = "cni:"  # a plugin type, looked up in CNI_DIRS rather than PATH
CNI_DIRS = ("/usr/lib/cni", "/opt/cni/bin")
WORD = re.compile(r"[a-z][a-z0-9._+-]*")
BIN_PATH = re.compile(r"/(usr/)?(local/)?s?bin/[A-Za-z0-9._+-]+")


# -- the scan ---------------------------------------------------------------------------


def _const(node: ast.expr) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _text(node: ast.expr) -> str:
    """A string literal's text; an f-string's literal parts, its fields as a word."""
    if isinstance(node, ast.JoinedStr):
        return "".join(_const(v) or "X" for v in node.values)  # type: ignore[arg-type]
    return _const(node) or ""


def argv_words(elts: list[ast.expr]) -> Iterator[str]:
    """The program words of one list/tuple literal of strings."""
    words = [_const(e) for e in elts if not isinstance(e, ast.Starred)]
    if not words or words[0] is None:
        return
    yield words[0]
    if words[:3] == ["ip", "netns", "exec"] and len(words) > 4 and words[4]:
        yield words[4]
    if words[0] in WRAPPERS:
        yield from (w for w in words[1:] if w and not w.startswith("-"))
    for i, e in enumerate(elts[:-1]):
        if _const(e) == "-c" and i > 0 and _const(elts[i - 1]) in ("sh", "bash"):
            yield from shell_words(_text(elts[i + 1]))


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def python_words(path: Path) -> Iterator[tuple[str, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    where = str(path.relative_to(REPO))
    for node in ast.walk(tree):
        if isinstance(node, ast.For) and isinstance(node.iter, ast.List | ast.Tuple):
            # for tool in ("podman", "runc"): ... which(tool)
            looked_up = any(
                isinstance(n, ast.Call) and _callee(n) == "which" for n in ast.walk(node)
            )
            for element in node.iter.elts if looked_up else []:
                if (word := _const(element)) is not None:
                    yield word, f"{where}:{node.lineno}"
        if (
            isinstance(node, ast.Call)
            and node.args
            and _callee(node) == "which"
            and (word := _const(node.args[0])) is not None
        ):
            yield word, f"{where}:{node.lineno}"
        if isinstance(node, ast.List | ast.Tuple):
            for word in argv_words(node.elts):
                yield word, f"{where}:{node.lineno}"
        elif isinstance(node, ast.Dict):
            # {"type": "tuning", ...}: a CNI plugin a conflist makes the runtime run
            for key, value in zip(node.keys, node.values, strict=True):
                if key is not None and _const(key) == "type" and (kind := _const(value)):
                    yield CNI_PREFIX + kind, f"{where}:{node.lineno}"
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and BIN_PATH.fullmatch(node.value)
        ):
            yield node.value, f"{where}:{node.lineno}"


def shell_words(script: str) -> Iterator[str]:
    """The first word of every command in a shell script (approximately: enough for
    ours), and the program after ``command -v`` or a wrapper. Array assignments
    (``APT_PACKAGES=(...)``) hold data."""
    script = re.sub(r"\b\w+=\(.*?\)", "", script, flags=re.S)
    for raw in script.splitlines():
        line = re.sub(r"(^|\s)#.*", "", raw)
        for part in re.split(r"&&|\|\||[|;&`()]|\$\(", line):
            try:
                tokens = shlex.split(part, posix=True)
            except ValueError:
                tokens = part.split()
            while tokens and (
                re.fullmatch(r"\w+=.*", tokens[0])
                or tokens[0] in WRAPPERS
                or tokens[0] in ("then", "do", "else", "if", "while", "!")
            ):
                first = tokens.pop(0)
                if first == "command" and tokens[:1] == ["-v"]:
                    tokens.pop(0)
            if tokens and tokens[0] not in SHELL_WORDS:
                yield tokens[0]


@functools.cache
def scanned() -> dict[str, list[str]]:
    """Every program-like word of the source, with where it was seen."""
    found: dict[str, list[str]] = {}
    for root in PYTHON_ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue  # this file names programs as data
            for word, where in python_words(path):
                found.setdefault(word, []).append(where)
    for folder in SHELL_SCRIPTS:
        for path in sorted((REPO / folder).glob("*.sh")):
            for word in shell_words(path.read_text(encoding="utf-8")):
                found.setdefault(word, []).append(str(path.relative_to(REPO)))
    return {
        w: places
        for w, places in found.items()
        if WORD.fullmatch(w.removeprefix(CNI_PREFIX)) or BIN_PATH.fullmatch(w)
    }


# -- where a program comes from -----------------------------------------------------------


def bootstrap_packages() -> set[str]:
    """LAB_PACKAGES and TEST_PACKAGES of scripts/bootstrap.sh, and what a build script
    installs itself."""
    text = (REPO / "scripts" / "bootstrap.sh").read_text(encoding="utf-8")
    # Comments first: one may hold a parenthesis that is not the array's end.
    text = "\n".join(re.sub(r"(^|\s)#.*", "", line) for line in text.splitlines())
    packages: set[str] = set()
    for array in ("LAB_PACKAGES", "TEST_PACKAGES"):
        match = re.search(rf"^{array}=\((.*?)\)", text, re.S | re.M)
        assert match, f"scripts/bootstrap.sh has no {array}=(...) array"
        packages |= set(match.group(1).split())
    for path in (REPO / "scripts").glob("*.sh"):
        for line in path.read_text(encoding="utf-8").splitlines():
            if "apt-get install" in line:
                packages |= {
                    w
                    for w in line.split("apt-get install", 1)[1].split()
                    if re.fullmatch(r"[a-z0-9][a-z0-9.+-]+", w)
                }
    return packages


def dpkg_query(*args: str) -> str:
    return subprocess.run(["dpkg-query", *args], capture_output=True, text=True, check=False).stdout


@functools.cache
def required_packages() -> frozenset[str]:
    """Debian's required and Essential packages, as installed here."""
    rows = dpkg_query("-W", "-f=${Package} ${Priority} ${Essential}\n").splitlines()
    return frozenset(
        r.split()[0] for r in rows if r.split()[1:2] == ["required"] or r.endswith(" yes")
    )


@functools.cache
def installed_closure() -> frozenset[str]:
    """The bootstrap's packages and everything they depend on (as installed here)."""
    depends: dict[str, list[str]] = {}
    for row in dpkg_query("-W", "-f=${Package}\t${Depends}, ${Pre-Depends}\n").splitlines():
        name, _, deps = row.partition("\t")
        depends[name] = [
            dep.strip().split(" ")[0].split(":")[0]
            for alternative in deps.split(",")
            for dep in alternative.split("|")
            if dep.strip()
        ]
    seen: set[str] = set()
    todo = list(bootstrap_packages())
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo += depends.get(name, [])
    return frozenset(seen)


def candidates(path: str) -> list[str]:
    """``path``, its target (an alternative is a symlink no package owns) and their
    /usr-merged twins."""
    out: list[str] = []
    for p in dict.fromkeys([path, os.path.realpath(path)]):
        out += [p, p[len("/usr") :] if p.startswith("/usr/") else "/usr" + p]
    return out


def owners(paths: list[str]) -> dict[str, str]:
    """The package that ships each of ``paths`` (one dpkg -S for all)."""
    every = sorted({c for p in paths for c in candidates(p)})
    out = subprocess.run(["dpkg", "-S", *every], capture_output=True, text=True, check=False)
    shipped: dict[str, str] = {}
    for line in out.stdout.splitlines():
        if line.startswith("diversion by "):  # dash diverts /bin/sh; the owner follows
            continue
        package, _, path = line.partition(": ")
        shipped.setdefault(path.strip(), package.split(",")[0].strip())
    return {
        p: next(shipped[c] for c in candidates(p) if c in shipped)
        for p in paths
        if any(c in shipped for c in candidates(p))
    }


def venv_executables() -> set[str]:
    names = {"python", "python3", "pip"}
    for pyproject in (REPO / "pyproject.toml", REPO / "lab" / "pyproject.toml"):
        section = pyproject.read_text(encoding="utf-8").split("[project.scripts]", 1)
        if len(section) == 2:
            names |= set(re.findall(r"^([\w-]+)\s*=", section[1].split("\n[", 1)[0], re.M))
    return names


def resolve(word: str) -> str | None:
    if word.startswith(CNI_PREFIX):
        path = shutil.which(word.removeprefix(CNI_PREFIX), path=os.pathsep.join(CNI_DIRS))
    else:
        path = word if word.startswith("/") else shutil.which(word, path=SEARCH_PATH)
    return path if path is not None and os.path.exists(path) else None


def where_from(word: str, shipped: dict[str, str]) -> str | None:
    """None when ``word`` comes from somewhere a fresh machine gets it, else why not."""
    name = os.path.basename(word.removeprefix(CNI_PREFIX))
    if name in venv_executables():
        return None
    if name in REPO_BUILT:
        script = REPO_BUILT[name]
        built = name in (REPO / script).read_text(encoding="utf-8")
        return None if built else f"{script} does not build {name}"
    if name in OUTSIDE_DEBIAN:
        return None
    path = resolve(word)
    key = word if word.startswith(CNI_PREFIX) else name
    wanted = PROGRAMS.get(key)
    if path is None:
        if wanted is None:
            return "skip"  # not a program on this machine, and not one we know of
        return f"not installed: scripts/bootstrap.sh must install {wanted}"
    package = shipped.get(path)
    if package is None:
        return f"{path} belongs to no Debian package: install it with apt, or build it here"
    if wanted is not None and wanted != package:
        return f"PROGRAMS says {wanted}, but {path} is in {package}: fix the table"
    if package in required_packages():
        return None
    if wanted is None:
        return f"{path} is in {package}: add {key!r}: {package!r} to PROGRAMS"
    if package not in installed_closure():
        return f"{package} is not installed by scripts/bootstrap.sh: add it to APT_PACKAGES"
    return None


# -- the tests ------------------------------------------------------------------------------


def test_the_scan_finds_the_programs_we_know_we_run() -> None:
    words = scanned()
    for program in (
        "ip",
        "iptables",
        "iptables-restore",
        "nft",
        "etcd",
        "ping",
        "podman",
        "runc",
        "conmon",
        "gcc",
        "go",
        "nsenter",
        "git",
        "openssl",
        "flanneld",
        "flannelpy-cni",
        "promtool",
        "cni:tuning",
        "cni:portmap",
    ):
        assert program in words, f"the scan no longer sees {program}"


@pytest.mark.skipif(shutil.which("dpkg") is None, reason="needs a Debian system (dpkg)")
def test_every_program_comes_from_the_bootstrap_the_base_system_or_the_repo() -> None:
    problems = []
    words = {
        word: places
        for word, seen in scanned().items()
        if (places := [p for p in seen if (word, p.split(":")[0]) not in NOT_RUN])
    }
    shipped = owners([path for word in words if (path := resolve(word)) is not None])
    for word, places in sorted(words.items()):
        why = where_from(word, shipped)
        if why not in (None, "skip"):
            problems.append(f"{word} (run at {places[0]}): {why}")
    assert not problems, "\n".join(problems)


def test_the_table_lists_only_programs_the_scan_finds() -> None:
    stale = set(PROGRAMS) - {os.path.basename(word) for word in scanned()}
    assert not stale, f"nothing runs {sorted(stale)} any more: remove them from PROGRAMS"


def test_every_known_program_has_its_package_in_the_bootstrap() -> None:
    """The table's packages are in APT_PACKAGES (or a build script's install), or are a
    dependency of one of them (podman brings conmon)."""
    packages = bootstrap_packages()
    missing = {
        p: pkg
        for p, pkg in PROGRAMS.items()
        if pkg not in packages and pkg not in installed_closure()
    }
    assert not missing, f"scripts/bootstrap.sh does not install {missing}"
