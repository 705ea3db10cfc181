"""Every rank starts MPI, meets the others, then waits SECONDS and exits normally.
Usage: finish_then_exit.py SECONDS, run by `hetpipe launch`."""

import sys
import time

from hetpipe.job.world import world

world().Barrier()
time.sleep(float(sys.argv[1]))
