"""Which rank died first: the launcher's run directory and a watcher of the ranks' processes.

mpiexec names one pid when a job ends badly, and not reliably the one that failed: after a rank is
killed it kills the others with the same signal and may report any of them. So each rank records
itself in the launcher's run directory (``HETPIPE_RUN_DIR``): ``rank-R.txt`` holds its pid and role
(first ``rank R`` when it joins the world, then its role once the plan assigns one), ``exited-PID``
marks a normal interpreter exit and ``aborted-PID`` (holding the rank's message) a failure the rank
reported itself before aborting. The launcher watches every recorded pid through a pidfd and keeps
the order in which they vanished; the first to vanish without a mark is the one that died.
"""

from __future__ import annotations

import atexit
import os
import select
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

RUN_DIR_ENV = "HETPIPE_RUN_DIR"


_exit_marked = False


def register_rank(rank: int, describe: str) -> None:
    """Record this rank's pid and role (when started by ``hetpipe launch``), and mark a normal exit.

    May be called again with a better description; the record is replaced atomically (readers never
    see half a file). Also starts the guard that ends this rank if the launcher dies."""
    global _exit_marked
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    from hetpipe.launch.guard import watch_launcher

    watch_launcher()
    pid = os.getpid()
    tmp = Path(run_dir, f".rank-{rank}.{pid}.tmp")
    tmp.write_text(f"{pid}\n{describe}\n")
    os.replace(tmp, Path(run_dir, f"rank-{rank}.txt"))
    if not _exit_marked:
        _exit_marked = True
        atexit.register(_mark, run_dir, f"exited-{pid}")


def mark_aborted(message: str = "") -> None:
    """Record that this process reported its own failure (``message``) and is aborting the job."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir:
        _mark(run_dir, f"aborted-{os.getpid()}", message)


def _mark(run_dir: str, name: str, text: str = "") -> None:
    try:
        Path(run_dir, name).write_text(text)
    except OSError:
        pass  # the launcher's directory is gone: nobody is left to read the mark


def ranks_by_pid(run_dir: str) -> Dict[int, str]:
    """pid -> role of every rank recorded in ``run_dir``."""
    return {pid: role for pid, (_, role) in recorded_ranks(run_dir).items()}


def recorded_ranks(run_dir: str) -> Dict[int, Tuple[int, str]]:
    """pid -> (rank, role) of every rank recorded in ``run_dir``."""
    out = {}
    for f in Path(run_dir).glob("rank-*.txt"):
        lines = f.read_text().splitlines()
        if len(lines) >= 2:
            out[int(lines[0])] = (int(f.stem.split("-", 1)[1]), lines[1])
    return out


def marked(run_dir: str, kind: str) -> Set[int]:
    """pids with an ``exited`` or ``aborted`` mark."""
    return {int(f.name.split("-", 1)[1]) for f in Path(run_dir).glob(f"{kind}-*")}


class DeathWatcher:
    """Watches the pids recorded in a run directory and keeps the order in which they vanished.

    Thread role: one daemon thread polls the pidfds (blocking in ``poll`` with a short timeout so it
    also picks up ranks that register later); ``vanished`` (and ``vanished_at``, the wall-clock time
    the thread saw each go, comparable with file mtimes) is appended only by that thread and read
    after :meth:`stop`, which joins it. Without pidfd support (not Linux, or a kernel before 5.3)
    :attr:`supported` is False and the order stays empty.
    """

    POLL_MS = 20

    def __init__(self, run_dir: str, ranks: int) -> None:
        self.run_dir, self.ranks = run_dir, ranks
        self.supported = hasattr(os, "pidfd_open") and hasattr(select, "poll")
        self.vanished: List[int] = []
        self.vanished_at: Dict[int, float] = {}
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
        try:
            while not self._stop.is_set():
                for pid in ranks_by_pid(self.run_dir) if len(seen) < self.ranks else ():
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
