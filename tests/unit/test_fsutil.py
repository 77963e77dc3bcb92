"""atomic_write: whole or not at all, unique temp names, durable when asked."""

from __future__ import annotations

import os
import stat
import threading
from pathlib import Path

import pytest

from flannelpy import fsutil
from flannelpy.fsutil import atomic_write, fsync_dir


def test_writes_bytes_or_text_with_the_mode(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    atomic_write(path, b"one", mode=0o600)
    assert path.read_bytes() == b"one"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    atomic_write(str(path), "two")
    assert path.read_text() == "two"
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert os.listdir(tmp_path) == ["a.json"]


def test_replaces_by_rename_so_readers_never_see_a_partial_file(tmp_path: Path) -> None:
    path = tmp_path / "a"
    atomic_write(path, b"old")
    inode = path.stat().st_ino
    atomic_write(path, b"new")
    assert path.stat().st_ino != inode


def test_creates_the_missing_directory_with_its_mode(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        atomic_write(tmp_path / "state" / "x", b"1", dir_mode=0o700)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "state").stat().st_mode) == 0o700


def test_a_crash_before_the_rename_leaves_the_old_content_and_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "a"
    atomic_write(path, b"old")

    def crash(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", crash)
    with pytest.raises(OSError, match="No space"):
        atomic_write(path, b"new")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["a"]


def test_an_interrupt_mid_write_leaves_the_old_content(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "a"
    atomic_write(path, b"old")

    def interrupted(src: str, dst: str) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        atomic_write(path, b"new")
    assert path.read_bytes() == b"old"
    assert os.listdir(tmp_path) == ["a"]


def test_not_durable_skips_every_fsync(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(os, "fsync", calls.append)
    atomic_write(tmp_path / "a", b"x", durable=False)
    assert calls == []
    atomic_write(tmp_path / "a", b"y")
    assert len(calls) == 2  # the file, then its directory


def test_concurrent_writers_never_fail_and_one_whole_version_wins(tmp_path: Path) -> None:
    # One shared temp name would make all but one writer's rename fail.
    path = tmp_path / "shared"
    versions = [bytes([65 + n]) * 4096 for n in range(8)]
    errors: list[BaseException] = []
    start = threading.Barrier(len(versions))

    def writer(data: bytes) -> None:
        start.wait()
        try:
            for _ in range(25):
                atomic_write(path, data, durable=False)
        except BaseException as e:  # collected and asserted below
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(v,)) for v in versions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert path.read_bytes() in versions
    assert os.listdir(tmp_path) == ["shared"]


def test_fsync_dir_tolerates_a_filesystem_that_cannot_sync_directories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def unsupported(fd: int) -> None:
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(fsutil.os, "fsync", unsupported)
    fsync_dir(tmp_path)

    def failing(fd: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(fsutil.os, "fsync", failing)
    with pytest.raises(OSError, match="Input/output"):
        fsync_dir(tmp_path)


def test_group_sync_makes_each_change_durable_before_returning_with_few_fsyncs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """20 writers rename at once and each waits for the directory's fsync: each returns
    only after an fsync that began once its file was there has ended, and the fsyncs
    are shared (group commit), not one per writer."""
    durable: list[set[str]] = []  # what each finished fsync covered, in order
    lock = threading.Lock()

    def slow_fsync_dir(directory: str | os.PathLike[str]) -> None:
        seen = set(os.listdir(directory))  # what this fsync makes durable
        threading.Event().wait(0.02)
        with lock:
            durable.append(seen)

    monkeypatch.setattr(fsutil, "fsync_dir", slow_fsync_dir)
    group = fsutil.GroupSync(tmp_path)
    start = threading.Barrier(20)
    late: list[str] = []

    def writer(n: int) -> None:
        start.wait()
        atomic_write(tmp_path / f"f{n}", b"x", sync_dir=False)
        group.sync()
        with lock:
            if not any(f"f{n}" in seen for seen in durable):
                late.append(f"f{n}")

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert late == []
    assert 1 <= group.fsyncs == len(durable) <= 10


def test_a_failed_group_fsync_raises_and_the_next_waiter_runs_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []

    def failing_once(directory: str | os.PathLike[str]) -> None:
        calls.append("fsync")
        if len(calls) == 1:
            raise OSError(5, "Input/output error")

    monkeypatch.setattr(fsutil, "fsync_dir", failing_once)
    group = fsutil.GroupSync(tmp_path)
    first = group.ticket()
    with pytest.raises(OSError, match="Input/output"):
        group.wait(first)
    group.wait(first)  # not covered by the failed one: runs its own
    assert calls == ["fsync", "fsync"] and group.fsyncs == 1
    group.wait(first)  # covered now: no fsync
    assert calls == ["fsync", "fsync"]


def test_sync_dir_false_leaves_the_directory_to_the_caller(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(os, "fsync", calls.append)
    atomic_write(tmp_path / "a", b"x", sync_dir=False)
    assert len(calls) == 1  # the file only


class Lost(Exception):
    def __init__(self, covers: int) -> None:
        super().__init__(f"batch up to {covers} lost")
        self.covers = covers


def test_a_flush_covers_what_its_batch_held_though_ticketed_after_it_began() -> None:
    """A change ticketed after a flush began but before it took its batch is in that
    batch: reported durable with it, or failed with it (never run again as if kept)."""
    flushes: list[int] = []

    def flush() -> int:
        flushes.append(group.ticket())  # another request's change lands before the snapshot
        if len(flushes) == 1:  # the first batch fails, the next ones are written
            raise Lost(group.taken)
        return group.taken

    group = fsutil.GroupCommit(flush, failures_cover=True)
    first = group.ticket()
    with pytest.raises(Lost):
        group.wait(first)
    with pytest.raises(Lost):
        group.wait(flushes[0])  # dropped with the batch that held it
    third = group.ticket()
    group.wait(third)
    group.wait(flushes[1])  # in third's batch: durable, without a flush of its own
    assert len(flushes) == 2 and group.flushes == 1


def test_rewrite_replaces_the_file_whole_with_its_mode_and_leaves_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    target = tmp_path / "run" / "status.json"  # the directory made on the first write
    fsync_calls: list[int] = []
    monkeypatch.setattr(os, "fsync", fsync_calls.append)
    fsutil.rewrite(target, '{"a": 1}', mode=0o640)
    before = target.stat().st_ino
    fsutil.rewrite(target, '{"b": 2}' * 10_000, mode=0o640)
    assert target.read_text() == '{"b": 2}' * 10_000
    assert target.stat().st_ino != before  # a rename, not an overwrite in place
    assert stat.S_IMODE(target.stat().st_mode) == 0o640
    assert sorted(p.name for p in target.parent.iterdir()) == ["status.json"]
    assert fsync_calls == []
