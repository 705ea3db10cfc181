"""A rank whose SIGTERM handler takes SECONDS (like writing a checkpoint part), writes DIR/done-<rank>,
then waits until every rank's done file exists before it exits (mpiexec ends all ranks once one exits,
as the trainer's SIGTERM checkpoint also waits for its peers' parts).

Usage: slow_sigterm.py DIR SECONDS. Writes DIR/ready-<rank> once the handler is installed.
"""

import os
import signal
import sys
import time
from pathlib import Path

from mpi4py import MPI

out, seconds = Path(sys.argv[1]), float(sys.argv[2])
comm = MPI.COMM_WORLD
rank, size = comm.Get_rank(), comm.Get_size()


def on_term(_sig, _frame) -> None:
    time.sleep(seconds * (1 + rank))          # ranks finish at different times
    (out / f"done-{rank}").write_text("written\n")
    while len(list(out.glob("done-*"))) < size:
        time.sleep(0.02)
    os._exit(128 + signal.SIGTERM)


signal.signal(signal.SIGTERM, on_term)
(out / f"ready-{rank}").write_text("ready\n")
while True:
    time.sleep(0.05)
