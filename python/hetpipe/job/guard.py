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
_POLL_S = 0.5       # only without pidfd support
_started = False
_lock = threading.Lock()


def watch_launcher() -> None:
    """Start (once per process) a daemon thread that SIGKILLs this process when the launcher exits.

    Thread role: the thread only waits (on the launcher's pidfd, else by polling /proc) and then kills
    its own process; it touches no state of the rank. Does nothing outside ``hetpipe launch``."""
    global _started
    pid = os.environ.get(LAUNCHER_PID_ENV)
    if not pid:
        return
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
