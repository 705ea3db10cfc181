"""The run directory a launcher and its ranks share: which rank is which process, and how each ended.

mpiexec names one pid when a job ends badly, and not reliably the one that failed: after a rank is
killed it kills the others with the same signal and may report any of them. So each rank records
itself in the launcher's run directory (``HETPIPE_RUN_DIR``): ``rank-R.txt`` holds its pid and role
(first ``rank R`` when it joins the world, then its role once the plan assigns one), ``exited-PID``
marks a normal interpreter exit, ``aborted-PID`` (holding the rank's message) a failure the rank
reported itself before aborting, and ``terminated-PID`` an end on SIGTERM after its handler wrote its
checkpoint (holding what it wrote). The launcher watches every recorded pid through a pidfd and keeps
the order in which they vanished (:mod:`hetpipe.launch.deaths`); the first to vanish without a mark is
the one that died. This module is the ranks' side and the readers both sides use.
"""

from __future__ import annotations

import atexit
import os
from pathlib import Path
from typing import Dict, Set, Tuple

RUN_DIR_ENV = "HETPIPE_RUN_DIR"
WORLD_RANKS_FILE = "world_ranks.json"   # plan rank -> world rank, when a run renumbered its ranks (discovery)
_exit_marked = False
_host = ""


def register_rank(rank: int, describe: str, host: str = "") -> None:
    """Record this rank's pid, role and host (when started by ``hetpipe launch``), and mark a normal exit.

    May be called again with a better description; the record is replaced atomically (readers never
    see half a file). Also starts the guard that ends this rank if the launcher dies (on the
    launcher's host only: a pid means nothing on another host). The host is remembered from the
    first call."""
    global _exit_marked
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    from hetpipe.job.guard import watch_launcher

    global _host
    _host = host or _host
    watch_launcher(_host)
    pid = os.getpid()
    tmp = Path(run_dir, f".rank-{rank}.{pid}.tmp")
    tmp.write_text(f"{pid}\n{describe}\n{_host}\n")
    os.replace(tmp, Path(run_dir, f"rank-{rank}.txt"))
    if not _exit_marked:
        _exit_marked = True
        atexit.register(_mark, run_dir, f"exited-{pid}")


LAUNCHER_RANK_ENVS = ("PMI_RANK", "PMIX_RANK", "OMPI_COMM_WORLD_RANK")    # set by MPI launchers before MPI_Init


def mark_starting() -> None:
    """Record, before MPI start-up, that this rank (by its MPI launcher's rank number) reached it: a rank
    without this mark when start-up stalls is the one that never got there (the others wait in MPI_Init)."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    rank = next((os.environ[k] for k in LAUNCHER_RANK_ENVS if k in os.environ), None)
    if run_dir and rank is not None and rank.isdigit():
        _mark(run_dir, f"starting-{int(rank)}", f"{os.getpid()}\n")


def mark_spawned(host: str = "") -> None:
    """Record, at a rank process's first line (:mod:`hetpipe.job.bootstrap`), its pid, its MPI launcher's
    rank number and its host (``spawned-PID``). A rank that dies within moments of its start, before
    the launcher's scan of the process table ever saw it, is still one the launcher can name."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    rank = next((os.environ[k] for k in LAUNCHER_RANK_ENVS if k in os.environ), None)
    if run_dir and rank is not None and rank.isdigit():
        _mark(run_dir, f"spawned-{os.getpid()}", f"{int(rank)}\n{host}\n")


def spawned_ranks(run_dir: str, host: str = "") -> Dict[int, int]:
    """pid -> MPI rank of every rank process that recorded its start (:func:`mark_spawned`); with
    ``host``, only those on that host (or that did not say where they run)."""
    out = {}
    for f in Path(run_dir).glob("spawned-*"):
        try:
            lines = f.read_text().splitlines()
            if lines and (not host or len(lines) < 2 or lines[1] in (host, "")):
                out[int(f.name.split("-", 1)[1])] = int(lines[0])
        except (OSError, ValueError):
            continue
    return out


def starting_ranks(run_dir: str) -> Set[int]:
    """The MPI ranks that reached MPI start-up (:func:`mark_starting`)."""
    return {int(f.name.split("-", 1)[1]) for f in Path(run_dir).glob("starting-*")}


_phase = "start-up"


def current_phase() -> str:
    """The phase this process last recorded (:func:`mark_phase`)."""
    return _phase


def mark_phase(phase: str) -> None:
    """Record the phase this rank is in (``phase-PID`` holds it): "start-up: ..." and "shutdown: ..."
    phases are where the launcher watches a rank's progress itself (its CPU time), "training" where the
    runtime's peer timeouts do. Replaced atomically: the launcher never reads half a phase."""
    global _phase
    _phase = phase
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    pid = os.getpid()
    try:
        tmp = Path(run_dir, f".phase-{pid}.tmp")
        tmp.write_text(phase + "\n")
        os.replace(tmp, Path(run_dir, f"phase-{pid}"))
    except OSError:
        pass    # the launcher's directory is gone: nobody is left to read it


def phases(run_dir: str) -> Dict[int, str]:
    """pid -> the phase each rank last recorded (:func:`mark_phase`)."""
    out = {}
    for f in Path(run_dir).glob("phase-*"):
        try:
            out[int(f.name.split("-", 1)[1])] = f.read_text().strip()
        except (OSError, ValueError):
            continue
    return out


def log_signals() -> None:
    """Have the interpreter's C-level signal handler write the number of every signal this process gets
    that Python handles (SIGINT, and the run's SIGTERM handler) into ``signals-PID``, at once: even
    while the main thread is blocked in C (an MPI collective), before any Python handler can run.
    The launcher reads whom a SIGINT or SIGTERM reached: every rank at once is a signal to mpiexec or
    to the whole job, not a fault of one rank. Main thread only (``signal.set_wakeup_fd``); a no-op
    outside ``hetpipe launch`` or where the wakeup fd is taken already."""
    import signal as _signal

    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    try:
        fd = os.open(Path(run_dir, f"signals-{os.getpid()}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NONBLOCK,
                     0o644)
    except OSError:
        return
    try:
        old = _signal.set_wakeup_fd(fd, warn_on_full_buffer=False)
    except ValueError:                  # not the main thread
        os.close(fd)
        return
    if old != -1:                       # someone else's (an event loop): theirs stays
        _signal.set_wakeup_fd(old)
        os.close(fd)


def signals_got(run_dir: str) -> Dict[int, Set[int]]:
    """pid -> the signal numbers each rank logged (:func:`log_signals`)."""
    out = {}
    for f in Path(run_dir).glob("signals-*"):
        try:
            out[int(f.name.split("-", 1)[1])] = set(f.read_bytes())
        except (OSError, ValueError):
            continue
    return out


def mark_aborted(message: str = "") -> None:
    """Record that this process reported its own failure (``message``) and is aborting the job."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir:
        _mark(run_dir, f"aborted-{os.getpid()}", message)


def mark_blames(rank: int) -> None:
    """Record that this process's failure was caused by world rank ``rank`` (the transport source of a
    message that broke the protocol): the launcher names that rank, not this one, as the culprit."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir:
        _mark(run_dir, f"blames-{os.getpid()}", str(rank))


def blamed_ranks(run_dir: str) -> Dict[int, int]:
    """pid -> the world rank that process's failure report blames (:func:`mark_blames`)."""
    out = {}
    for f in Path(run_dir).glob("blames-*"):
        try:
            out[int(f.name.split("-", 1)[1])] = int(f.read_text().strip())
        except (OSError, ValueError):
            continue
    return out


def mark_interrupted() -> None:
    """Record that SIGINT (a Ctrl-C) reached this process: when it reached every rank and not the
    launcher, it was sent to mpiexec or to the whole job, and the launcher blames no rank for it."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir:
        _mark(run_dir, f"interrupted-{os.getpid()}")


def mark_terminated(message: str = "") -> None:
    """Record that this process ended on SIGTERM after writing what its handler had to (``message``): a
    rank stopped from outside (a preemption, a scheduler), not a fault of the program or its device."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if run_dir:
        _mark(run_dir, f"terminated-{os.getpid()}", message)


def _mark(run_dir: str, name: str, text: str = "") -> None:
    try:
        Path(run_dir, name).write_text(text)
    except OSError:
        pass  # the launcher's directory is gone: nobody is left to read the mark


def ranks_by_pid(run_dir: str, host: str = "") -> Dict[int, str]:
    """pid -> role of every rank recorded in ``run_dir``; with ``host``, only of the ranks on that host
    (or that did not say where they run): pids of other hosts cannot be watched from here."""
    return {pid: role for pid, (_, role, where) in _records(run_dir).items() if not host or where in (host, "")}


def rank_hosts(run_dir: str) -> Dict[int, str]:
    """pid -> the host each recorded rank said it runs on ("" when it did not say)."""
    return {pid: where for pid, (_, _, where) in _records(run_dir).items()}


def recorded_ranks(run_dir: str) -> Dict[int, Tuple[int, str]]:
    """pid -> (rank, role) of every rank recorded in ``run_dir``."""
    return {pid: (rank, role) for pid, (rank, role, _) in _records(run_dir).items()}


def _records(run_dir: str) -> Dict[int, Tuple[int, str, str]]:
    """pid -> (rank, role, host) of every ``rank-R.txt`` (host "" when the rank did not say), one read each."""
    out = {}
    for f in Path(run_dir).glob("rank-*.txt"):
        lines = f.read_text().splitlines()
        if len(lines) >= 2:
            out[int(lines[0])] = (int(f.stem.split("-", 1)[1]), lines[1], lines[2] if len(lines) >= 3 else "")
    return out


def marked(run_dir: str, kind: str) -> Set[int]:
    """pids with an ``exited``, ``aborted``, ``terminated`` or ``interrupted`` mark (``kind``)."""
    return {int(f.name.split("-", 1)[1]) for f in Path(run_dir).glob(f"{kind}-*")}


INTERRUPTING_FILE = "interrupting"      # the launcher, interrupted, is ending the run (it holds the signal's name)


def mark_interrupting(run_dir: str, signal_name: str) -> None:
    """Launcher side: record, before the ranks get SIGTERM, that the launcher was interrupted and says so
    for the whole run, in one line (:func:`launcher_interrupting`)."""
    _mark(run_dir, INTERRUPTING_FILE, f"{signal_name}\n")


ENDING_FILE = "ending"      # the launcher is ending the run after a fault it has already named


def mark_ending(run_dir: str) -> None:
    """Launcher side: record, before the ranks get SIGTERM after a fault, that the launcher is ending the
    run and has said why: a rank with nothing to write on SIGTERM then ends without a word."""
    _mark(run_dir, ENDING_FILE)


def launcher_ending() -> bool:
    """Rank side: whether this rank's launcher is ending the run after a fault (:func:`mark_ending`)."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    return bool(run_dir) and Path(run_dir, ENDING_FILE).exists()


def launcher_interrupting() -> bool:
    """Rank side: whether this rank's launcher was interrupted and is ending the run; the rank then
    leaves what it would say about its SIGTERM to the launcher's one line for the run."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    return bool(run_dir) and Path(run_dir, INTERRUPTING_FILE).exists()


def reached_clock(run_dir: str) -> int:
    """The highest wave-boundary clock any rank of the run recorded (``clock-of-rank-R``, written by a
    rank's checkpointer at each boundary); -1: none recorded (no checkpoints, or none reached yet)."""
    clocks = []
    for f in Path(run_dir).glob("clock-of-rank-*"):
        try:
            clocks.append(int(f.read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            pass
    return max(clocks, default=-1)


def heartbeat() -> None:
    """Tell the launcher this rank is alive and progressing although it uses no CPU (a start-up that
    waits on storage or the network): outside training, a rank that neither computes nor beats for the
    start-up timeout (before MPI start-up) or the peer timeout (in start-up's and shutdown's
    collectives) is ended as stuck. Cheap (one file's timestamp); a no-op outside ``hetpipe launch``."""
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    path = Path(run_dir, f"phase-{os.getpid()}")
    try:
        if path.exists():
            os.utime(path)
        else:
            mark_phase("start-up: before the run")
    except OSError:
        pass
