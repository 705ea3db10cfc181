"""Rank side: a rank started by ``hetpipe launch`` ends itself as soon as its launcher is gone.

The launcher ends every process of its run when it fails or is interrupted (see
:mod:`hetpipe.launch.supervisor`); this guard covers the one case it cannot, its own sudden death
(SIGKILL, a crash), which would otherwise leave the ranks to wait on each other until their peer
timeouts, or forever in a collective. ``PR_SET_PDEATHSIG`` does not fit: a rank's parent is an MPI
proxy, not the launcher.
"""

from __future__ import annotations

import os
import select
import signal
import threading
import time

from hetpipe.job.procs import running

LAUNCHER_PID_ENV = "HETPIPE_LAUNCHER_PID"
LAUNCHER_HOST_ENV = "HETPIPE_LAUNCHER_HOST"      # the host the launcher counts as
_POLL_S = 0.5       # only without pidfd support
_started = False
_lock = threading.Lock()


def watches(host: str) -> bool:
    """Whether a rank on ``host`` can watch the launcher's pid: it runs under ``hetpipe launch`` on the
    launcher's host (``HETPIPE_LAUNCHER_HOST``; no host said counts as the same). On another host the
    pid names nothing (or another process): those ranks end with their MPI proxy, which ends when it
    loses mpiexec, which the launcher's death ends (PDEATHSIG)."""
    if not os.environ.get(LAUNCHER_PID_ENV):
        return False
    launcher_host = os.environ.get(LAUNCHER_HOST_ENV, "")
    return not (host and launcher_host and host != launcher_host)


def watch_launcher(host: str = "") -> None:
    """Start (once per process) a daemon thread that SIGKILLs this process when the launcher exits.

    Thread role: the thread only waits (on the launcher's pidfd, else by polling /proc) and then kills
    its own process; it touches no state of the rank. Does nothing outside ``hetpipe launch``, nor on
    another host than the launcher's (:func:`watches`)."""
    global _started
    if not watches(host):
        return
    pid = os.environ[LAUNCHER_PID_ENV]
    with _lock:
        if _started:
            return
        _started = True
    threading.Thread(target=_wait_then_die, args=(int(pid),), name="hetpipe-launcher-guard", daemon=True).start()


def _wait_then_die(launcher: int) -> None:
    try:
        fd = os.pidfd_open(launcher)
    except ProcessLookupError:
        fd = None           # already gone
    except (AttributeError, OSError):
        while running(launcher):
            time.sleep(_POLL_S)
        fd = None
    if fd is not None:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        poller.poll()       # readable once the launcher has exited
    os.kill(os.getpid(), signal.SIGKILL)
