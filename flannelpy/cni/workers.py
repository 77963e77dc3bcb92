"""Threads kept for the next task instead of one started per task.

The CNI server serves each connection on a thread of its own (a DEL waits ~20 ms for
the kernel, and a runtime sends many at once), and ADD writes its record beside the
plumbing on another. Starting a Python thread costs ~0.1 ms of CPU (the stack, the
clone, the interpreter's thread state), twice per ADD: in a 100-pod burst, where the
agent's one core is the bound, that was ~5 % of the CPU. :class:`Workers` runs each task
at once on an idle thread if there is one, else on a new thread, which then waits up to
``idle_seconds`` for the next task before it ends: as many threads as tasks at the
busiest moment, none once the node is quiet.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)

IDLE_SECONDS = 30.0  # an idle thread ends after this long without a task


class Workers:
    """Run tasks at once, each on a thread of its own, reusing idle threads."""

    def __init__(self, name: str, idle_seconds: float = IDLE_SECONDS) -> None:
        self.name = name
        self.idle_seconds = idle_seconds
        self._tasks: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._idle = 0  # threads waiting for a task
        self._queued = 0  # tasks handed to the queue, not yet taken
        self.started = 0  # threads started (tests, benches)

    def submit(self, task: Callable[[], None]) -> None:
        """Run ``task`` now on an idle thread or a new one; raises RuntimeError when no
        thread can be started (the caller runs it itself). ``task`` must not raise."""
        with self._lock:
            if self._idle > self._queued:
                self._queued += 1
                self._tasks.put(task)
                return
            self.started += 1
        thread = threading.Thread(target=self._run, args=(task,), name=self.name, daemon=True)
        try:
            thread.start()
        except RuntimeError:
            with self._lock:
                self.started -= 1
            raise

    def _run(self, task: Callable[[], None]) -> None:
        while True:
            try:
                task()
            except Exception:  # a task should not raise; the thread stays for the next one
                log.exception("a worker's task failed workers=%s", self.name)
            with self._lock:
                self._idle += 1
            try:
                task = self._tasks.get(timeout=self.idle_seconds)
            except queue.Empty:
                with self._lock:
                    if self._queued == 0 or self._idle > self._queued:
                        self._idle -= 1
                        return
                task = self._tasks.get()  # one was handed to us as we timed out
            with self._lock:
                self._idle -= 1
                self._queued -= 1
