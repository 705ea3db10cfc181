"""How `hetpipe launch` starts a rank's Python: ``python -m hetpipe.job.bootstrap SCRIPT ARGS...``.

Before the script's first line runs (its imports can take seconds, a dataset load minutes), the rank
is already one the launcher can read and that ends in one line:

* once the rest is in place, it records its pid and MPI rank in the run directory (``spawned-PID``,
  :func:`hetpipe.job.rundir.mark_spawned`): a rank that dies moments after its start, before the
  launcher's scan of the process table saw it, is still named;
* every SIGINT and SIGTERM it gets is logged in the run directory at once (``signals-PID``,
  :func:`hetpipe.job.rundir.log_signals`), so that a signal sent to mpiexec, which hands it to every
  rank, is told from a signal sent to one rank even before MPI start-up;
* SIGTERM ends it saying so (``terminated`` mark, its phase "start-up: before MPI start-up", exit
  status 143: :func:`hetpipe.job.failure.install_sigterm`);
* a Ctrl-C (KeyboardInterrupt reaching the top) ends it in one line, exit status 130, not a traceback
  of wherever the script was; any other uncaught exception is reported, with its traceback.

The script then runs as ``python SCRIPT ARGS...`` would run it: ``__main__``, ``sys.argv``, and its
directory first on ``sys.path``. Its Trainer installs the run's own handlers when it starts. Only the
standard library and hetpipe's torch-free job modules are imported here.
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

from hetpipe.job import failure
from hetpipe.job.rundir import current_phase, log_signals, mark_spawned
from hetpipe.job.world import host_before_start_up

PHASE = "start-up: before MPI start-up"


def describe() -> str:
    """The rank as mpiexec numbered it (its role is not known before the plan)."""
    rank = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK")
    return f"rank {rank}" if rank is not None else f"process {os.getpid()}"


def phase() -> str:
    """This process's phase: the Trainer's once it marks one, else :data:`PHASE`."""
    return PHASE if current_phase() == "start-up" else current_phase()


def prepare() -> None:
    """Install what the module docstring lists, for this process (its main thread)."""
    log_signals()
    failure.install_sigterm(describe, phase)
    signal.signal(signal.SIGINT, signal.default_int_handler)

    def hook(exc_type, exc, tb):
        if issubclass(exc_type, KeyboardInterrupt):
            failure.interrupted(None, f"hetpipe: {describe()} was interrupted (SIGINT) in {phase()}", describe())
        failure.report(describe(), exc)
        failure.abort(None)

    sys.excepthook = hook
    mark_spawned(host_before_start_up())        # last: the record also says the handlers are in place


def main(argv: list) -> None:
    if not argv:
        sys.stderr.write("usage: python -m hetpipe.job.bootstrap SCRIPT [ARGS...]\n")
        sys.exit(2)
    script = argv[0]
    prepare()
    sys.argv = list(argv)
    sys.path[0] = os.path.dirname(os.path.abspath(script))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
