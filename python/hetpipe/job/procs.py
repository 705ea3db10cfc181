"""Processes of a run as Linux sees them: scheduler state, membership by environment, signals by pidfd.

A run's processes are found by their environment, not by parentage: MPICH's proxies put every rank
in a session of its own (so no process group holds the job), and a rank's parent may die first. Every
process the launcher starts inherits ``HETPIPE_RUN_DIR=<run dir>``, which names the run uniquely;
``/proc/<pid>/environ`` shows it for processes of the same user, whatever their parent or session.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Dict, Iterable, List, Optional

GONE_STATES = ("Z", "X", "x")       # zombie or dead: the process no longer runs
STOPPED_STATES = ("T",)             # stopped by a signal (SIGSTOP, SIGTSTP); "t" (a debugger's stop) is not


def state(pid: int) -> Optional[str]:
    """The scheduler state letter of ``pid`` (``R``, ``S``, ``T``, ``Z``, ...), or None if there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    except OSError:
        return None
    # The command name (field 2) is parenthesised and may hold spaces or parentheses: the state follows the last ")".
    return text[text.rfind(")") + 2:].split(" ", 1)[0]


def cpu_ticks(pid: int) -> Optional[int]:
    """CPU time ``pid`` has used, all its threads, user and system, in clock ticks (``/proc/<pid>/stat``
    fields 14 and 15); None if there is no such process. A process that computes advances it; one
    blocked (a read, a lock, a sleep, a stop) does not."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rfind(")") + 2:].split()
    try:
        return int(fields[11]) + int(fields[12])
    except (IndexError, ValueError):
        return None


def command_name(pid: int) -> str:
    """The process's command name (``/proc/<pid>/comm``), or "" if it is gone."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (a zombie has ended; only its exit status is left)."""
    s = state(pid)
    return s is not None and s not in GONE_STATES


def stopped(pid: int) -> bool:
    return state(pid) in STOPPED_STATES


def environment_marker(name: str, value: str) -> bytes:
    """The ``NAME=value`` entry, as it appears in ``/proc/<pid>/environ``."""
    return f"{name}={value}".encode() + b"\0"


def processes_with(marker: bytes, exclude: Iterable[int] = ()) -> List[int]:
    """Running pids whose environment holds ``marker`` (see :func:`environment_marker`), ``exclude`` aside."""
    skip = set(exclude)
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if pid in skip:
            continue
        try:
            env = Path(entry.path, "environ").read_bytes()
        except OSError:
            continue        # gone meanwhile, or another user's
        if (env.startswith(marker) or b"\0" + marker in env) and running(pid):
            found.append(pid)
    return found


RANK_ENVS = (b"PMI_RANK=", b"PMIX_RANK=", b"OMPI_COMM_WORLD_RANK=")   # what MPI launchers tell a rank


def rank_processes(marker: bytes, exclude: Iterable[int] = (),
                   among: Optional[Iterable[int]] = None) -> Dict[int, int]:
    """pid -> MPI rank of the running processes whose environment holds ``marker`` and a rank number
    from the MPI launcher (``PMI_RANK`` and kin): the ranks, found before they have done anything.
    ``among``: the run's processes already found (:func:`processes_with`), so /proc is not scanned twice."""
    out = {}
    for pid in (processes_with(marker, exclude) if among is None else among):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        for entry in env.split(b"\0"):
            if entry.startswith(RANK_ENVS):
                try:
                    out[pid] = int(entry.split(b"=", 1)[1])
                except ValueError:
                    pass
                break
    return out


def send(pid: int, sig: int, pidfds: Optional[Dict[int, int]] = None) -> None:
    """Send ``sig`` to ``pid``, through its pidfd when one is held (immune to pid reuse); ignores the vanished."""
    fd = (pidfds or {}).get(pid)
    try:
        if fd is not None and hasattr(signal, "pidfd_send_signal"):
            signal.pidfd_send_signal(fd, sig)
        else:
            os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def signal_name(sig: int) -> str:
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"
