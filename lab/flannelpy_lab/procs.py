"""Detached processes the lab starts (etcd, agents) and stops, possibly from another process.

Processes are started with ``posix_spawn`` in a new session: they survive the
``lab up`` command, a terminal's Ctrl-C does not reach them, and no
``subprocess.Popen`` object is left to warn when it is garbage collected. A
process is identified by its pid *and* its start time from ``/proc``, so a
recycled pid is never signalled. Zombies count as dead: when the starter has
exited, nobody may reap them on a minimal container init.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from flannelpy_lab.errors import LabError

TERM_GRACE = 5.0  # seconds between SIGTERM and SIGKILL
POLL = 0.05


@dataclass(frozen=True)
class ProcessRef:
    pid: int
    start_ticks: int


def _stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks) of a process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may contain spaces or parentheses: split after the last ')'.
    rest = raw[raw.rfind(")") + 2 :].split()
    return rest[0], int(rest[19])


def spawn_detached(argv: list[str], log_path: str, env: dict[str, str] | None = None) -> ProcessRef:
    """Start ``argv`` in a new session with stdin from /dev/null and output appended to a log."""
    file_actions = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644),
        (os.POSIX_SPAWN_DUP2, 1, 2),
    ]
    try:
        pid = os.posix_spawnp(
            argv[0],
            argv,
            dict(os.environ if env is None else env),
            file_actions=file_actions,
            setsid=True,
        )
    except OSError as e:
        raise LabError(f"cannot start {argv[0]}: {e.strerror}; is it installed?") from e
    st = _stat(pid)
    return ProcessRef(pid, st[1] if st else 0)


def alive(ref: ProcessRef | None) -> bool:
    if ref is None:
        return False
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(ref.pid, os.WNOHANG)
        if done == ref.pid:  # our own child, now reaped
            return False
    st = _stat(ref.pid)
    if st is None or st[1] != ref.start_ticks:
        return False
    # A killed multi-threaded process's leader turns zombie first; its other threads,
    # which still hold its files and sockets, take a few more milliseconds to exit.
    return st[0] not in ("Z", "X") or _thread_count(ref.pid) > 1


def _thread_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except (FileNotFoundError, ProcessLookupError):
        return 0


def ref_of(pid: int | None, start_ticks: int | None) -> ProcessRef | None:
    return ProcessRef(pid, start_ticks or 0) if pid else None


def signal_process(ref: ProcessRef, sig: int) -> bool:
    """Send ``sig`` if the process is still the one we started; False if it is gone."""
    if not alive(ref):
        return False
    try:
        os.kill(ref.pid, sig)
    except ProcessLookupError:
        return False
    return True


def wait_gone(refs: Iterable[ProcessRef], timeout: float) -> list[ProcessRef]:
    """Wait until every process has exited; return those still alive at the deadline."""
    pending = [r for r in refs if alive(r)]
    deadline = time.monotonic() + timeout
    while pending and time.monotonic() < deadline:
        time.sleep(POLL)
        pending = [r for r in pending if alive(r)]
    return pending


def stop(refs: Iterable[ProcessRef], grace: float = TERM_GRACE) -> None:
    """SIGTERM, then SIGKILL (to the whole session's group) whatever is left after ``grace``."""
    targets = [r for r in refs if signal_process(r, signal.SIGTERM)]
    for ref in wait_gone(targets, grace):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(ref.pid, signal.SIGKILL)
        signal_process(ref, signal.SIGKILL)
    left = wait_gone(targets, 2.0)
    if left:
        raise LabError(f"processes {[r.pid for r in left]} survived SIGKILL; check them with ps")


def current_ref(pid: int) -> ProcessRef | None:
    st = _stat(pid)
    return ProcessRef(pid, st[1]) if st and st[0] not in ("Z", "X") else None


def pids_in_netns(netns_path: str) -> list[int]:
    """Live processes whose network namespace is the one bound at ``netns_path``."""
    try:
        target = os.stat(netns_path)
    except FileNotFoundError:
        return []
    found = []
    for pid in _all_pids():
        try:
            st = os.stat(f"/proc/{pid}/ns/net")
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
            found.append(pid)
    return found


# Flags through which etcd and agents name a lab's files. Matching on them (not on
# any argument) spares a user's `tail -f <lab dir>/...` from being killed.
LAB_FILE_FLAGS = (b"--data-dir", b"--subnet-file", b"--state-dir", b"--run-dir")


def pids_with_files_under(directory: str) -> list[int]:
    """Live lab processes (etcd, agents) whose data flags point inside ``directory``."""
    needle = directory.rstrip("/").encode() + b"/"
    return [
        pid
        for pid, args in _command_lines()
        if any(
            flag in LAB_FILE_FLAGS and value.startswith(needle)
            for flag, value in itertools.pairwise(args)
        )
    ]


def pids_of_programs_under(programs: Iterable[str], directory: str) -> list[tuple[str, int]]:
    """Live processes running one of ``programs`` (the basename of argv[0], or a Python
    module run with ``-m``) with an argument naming ``directory`` or a file in it: the lab's
    Kubernetes processes, found when no state file records them. (program, pid) pairs."""
    needle = directory.rstrip("/").encode() + b"/"
    wanted = {p.encode() for p in programs}
    found = []
    for pid, args in _command_lines():
        names = [os.path.basename(args[0])] + [m for f, m in itertools.pairwise(args) if f == b"-m"]
        program = next((n for n in names if n in wanted), None)
        if program is None:
            continue
        values = [a.split(b"=", 1)[-1] for a in args[1:]]
        if any(v.startswith(needle) or v == needle[:-1] for v in values):
            found.append((program.decode(), pid))
    return found


def _command_lines() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, argv) of every live process but this one."""
    for pid in _all_pids():
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                raw = f.read()
        except (FileNotFoundError, ProcessLookupError):
            continue
        yield pid, raw.split(b"\0")


def _all_pids() -> list[int]:
    me = os.getpid()
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != me]


# The line a process's log gets before each start: what follows the last one is its run.
START_MARK = "--- lab: "


def mark_start(path: str, what: str) -> None:
    """Append the start line of ``what`` to its log."""
    with open(path, "a", encoding="utf-8") as log:
        log.write(f"{START_MARK}{what} starting at {time.strftime('%Y-%m-%dT%H:%M:%S')}\n")


def latest_run(path: str) -> str:
    """The log of the latest start (the whole log if it has no start line); "" if none."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read().rsplit(START_MARK, 1)[-1]
    except FileNotFoundError:
        return ""


def log_tail(path: str, lines: int = 10) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            tail = f.readlines()[-lines:]
    except FileNotFoundError:
        return "(no log)"
    return "".join(tail).rstrip() or "(log is empty)"


def wait_started(
    what: str, ref: ProcessRef, log: str, check: Callable[[], bool], timeout: float
) -> None:
    """Poll ``check`` until a process just started answers; raises LabError as soon as
    it exits (no point waiting out the timeout) or when ``timeout`` passes, with the
    end of its ``log``, where the reason is."""
    deadline = time.monotonic() + timeout
    while not check():
        if not alive(ref):
            raise LabError(f"{what} exited at start; last lines of {log}:\n{log_tail(log)}")
        if time.monotonic() > deadline:
            raise LabError(
                f"{what} was not ready within {timeout:g} s; last lines of {log}:\n{log_tail(log)}"
            )
        time.sleep(0.2)
