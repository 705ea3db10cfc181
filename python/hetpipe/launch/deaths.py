"""Which rank died first: a watcher of the processes recorded in the run directory (:mod:`hetpipe.job.rundir`)."""

from __future__ import annotations

import os
import select
import threading
import time
from typing import Dict, List, Optional, Set

from hetpipe.job.rundir import marked, ranks_by_pid


class DeathWatcher:
    """Watches the pids recorded in a run directory by ranks on ``host`` (the launcher's; a pid of
    another host means nothing here) and keeps the order in which they vanished.

    Thread role: one daemon thread polls the pidfds (blocking in ``poll`` with a short timeout so it
    also picks up ranks that register later); ``vanished`` (and ``vanished_at``, the wall-clock time
    the thread saw each go, comparable with file mtimes) is appended only by that thread and read
    after :meth:`stop`, which joins it. Without pidfd support (not Linux, or a kernel before 5.3)
    :attr:`supported` is False and the order stays empty.
    """

    POLL_MS = 20

    def __init__(self, run_dir: str, ranks: int, host: str = "") -> None:
        self.run_dir, self.ranks, self.host = run_dir, ranks, host
        self.supported = hasattr(os, "pidfd_open") and hasattr(select, "poll")
        self.vanished: List[int] = []
        self.vanished_at: Dict[int, float] = {}
        self._extra: Set[int] = set()           # rank processes seen before they registered (watch())
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "DeathWatcher":
        if self.supported:
            self._thread = threading.Thread(target=self._run, name="hetpipe-death-watcher", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def watch(self, pid: int) -> None:
        """Watch ``pid`` too: a rank process seen before it registered, so that its death is ordered
        with the others'. Thread role: any thread (the watcher picks it up at its next poll)."""
        with self._lock:
            self._extra.add(pid)

    def first_unmarked(self) -> Optional[int]:
        """The first pid that vanished with neither an ``exited`` nor an ``aborted`` mark."""
        done = marked(self.run_dir, "exited") | marked(self.run_dir, "aborted")
        return next((pid for pid in self.vanished if pid not in done), None)

    def _gone(self, pid: int) -> None:
        self.vanished_at[pid] = time.time()
        self.vanished.append(pid)

    def _run(self) -> None:
        poller = select.poll()
        fds: Dict[int, int] = {}        # fd -> pid
        seen: Set[int] = set()
        recorded: Set[int] = set()
        try:
            while not self._stop.is_set():
                fresh = [pid for pid in ranks_by_pid(self.run_dir, self.host)] if len(recorded) < self.ranks else []
                recorded.update(fresh)
                with self._lock:
                    fresh += list(self._extra)
                for pid in fresh:
                    if pid in seen:
                        continue
                    seen.add(pid)
                    try:
                        fd = os.pidfd_open(pid)
                    except ProcessLookupError:
                        self._gone(pid)
                        continue
                    except OSError:
                        self.supported = False
                        return
                    fds[fd] = pid
                    poller.register(fd, select.POLLIN)
                for fd, _ in poller.poll(self.POLL_MS):
                    self._gone(fds.pop(fd))
                    poller.unregister(fd)
                    os.close(fd)
        finally:
            for fd in fds:
                os.close(fd)
