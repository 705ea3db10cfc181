"""A rank that never reaches MPI start-up. Usage: stall_start.py MODE RANK, run by `hetpipe launch`.

Before anything imports MPI, the process whose MPI rank (``PMI_RANK``, set by mpiexec) is RANK
``sleep``s forever, or ``stop``s itself (SIGSTOP); the other ranks go on to MPI start-up
(``hetpipe.job.world.world``, which registers them with the launcher) and wait there for it."""

import os
import signal
import sys
import time

if os.environ.get("PMI_RANK") == sys.argv[2]:
    if sys.argv[1] == "stop":
        os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(10_000)

from hetpipe.job.world import world  # noqa: E402

world().Barrier()
