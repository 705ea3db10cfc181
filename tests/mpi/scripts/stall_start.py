"""A rank slow or stuck before MPI start-up. Usage: stall_start.py MODE RANK [SECONDS], run by `hetpipe launch`.

Before anything imports MPI, the process whose MPI rank (``PMI_RANK``, set by mpiexec) is RANK
``sleep``s forever, or ``stop``s itself (SIGSTOP), or for SECONDS ``compute``s (a busy loop, as a
dataset load does) or waits while it calls ``hetpipe.heartbeat()`` (``heartbeat``: a load that waits
on storage); the other ranks go on to MPI start-up (``hetpipe.job.world.world``, which registers them
with the launcher) and wait there for it. A rank that gets through prints ``STARTED``."""

import os
import signal
import sys
import time

if os.environ.get("PMI_RANK") == sys.argv[2]:
    mode = sys.argv[1]
    if mode == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    if mode in ("sleep", "stop"):
        time.sleep(10_000)
    until = time.monotonic() + float(sys.argv[3])
    if mode == "compute":
        n = 0
        while time.monotonic() < until:
            n += 1
    elif mode == "heartbeat":
        import hetpipe

        while time.monotonic() < until:
            time.sleep(0.5)
            hetpipe.heartbeat()

from hetpipe.job.world import world  # noqa: E402

world().Barrier()
print("STARTED", flush=True)
