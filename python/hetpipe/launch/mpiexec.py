"""Running mpiexec: its path and command line, and one supervised job."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import List, Optional, Sequence

from hetpipe.job.launch_file import LaunchSettings
from hetpipe.job.world import MPIUnavailable, disable_mpi_gpu
from hetpipe.launch.hosts import Placement


def mpiexec_path() -> str:
    """The mpiexec beside this Python (a virtual environment's), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise MPIUnavailable("hetpipe: no mpiexec beside the Python interpreter nor on PATH; pip install mpich")
    return found


def mpiexec_command(n: int, argv: List[str], options: Sequence[str] = ()) -> List[str]:
    """The command line that runs ``argv`` (a Python script and its arguments) on ``n`` ranks, with
    mpiexec ``options`` (host placement, and what the user passed through) before ``-n``. Each rank
    starts in :mod:`hetpipe.job.bootstrap`, which runs the script as Python would after making the
    rank one the launcher can read from its first line (its signals logged, one line on SIGINT/SIGTERM)."""
    if n < 1:
        raise ValueError(f"hetpipe launch: -n must be >= 1, got {n}")
    return [mpiexec_path(), *options, "-n", str(n), sys.executable, "-m", "hetpipe.job.bootstrap", *argv]


def launch(n: int, argv: List[str], run_dir: Optional[str] = None, placement: Optional[Placement] = None,
           mpi_args: Sequence[str] = (), settings: Optional[LaunchSettings] = None) -> int:
    """Run ``argv`` on ``n`` ranks under mpiexec, relaying its output; return the run's exit status.

    Supervised by :class:`hetpipe.launch.supervisor.Supervisor`: on any fault every process of the run
    ends and the failed rank is named, on stderr and in ``<run_dir>/outcome.json``. ``run_dir`` (made
    if missing, must hold no earlier run) is kept; by default a temporary one is used, removed after a
    successful run and kept after a failure. ``placement``: the hosts the ranks run on
    (:mod:`hetpipe.launch.hosts`); ``mpi_args``: options passed to mpiexec as they are; ``settings``: what
    the launch asks of the ranks, written to the run directory as their run file before they start
    (:mod:`hetpipe.job.launch_file`)."""
    import tempfile

    from hetpipe.job.failure import timeout_s
    from hetpipe.launch.supervisor import OUTCOME_FILE, Supervisor

    keep = run_dir is not None
    if run_dir is None:
        run_dir = tempfile.mkdtemp(prefix="hetpipe-run-")
        made = True
    else:
        run_dir = os.path.abspath(run_dir)
        made = not os.path.exists(run_dir)
        try:
            os.makedirs(run_dir, exist_ok=True)
        except OSError as e:
            raise ValueError(f"hetpipe launch: --run-dir {run_dir}: cannot make it: {e.strerror or e}") from None
        if any(Path(run_dir).iterdir()):
            raise ValueError(f"hetpipe launch: the run directory {run_dir} is not empty (it holds an earlier run?)")
    try:
        settings = settings if settings is not None else LaunchSettings()
        settings.write(run_dir)
        options = list(mpi_args)
        if placement is not None:
            options += placement.apply(n, run_dir, mpiexec_path(), os.environ)
        command = mpiexec_command(n, argv, options)
        disable_mpi_gpu()
        supervisor = Supervisor(command, n, run_dir, timeout_s(settings.timeout))
    except BaseException:
        # Refused before any process started: no half-written run directory is left behind.
        if made:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise
    outcome = supervisor.run()
    if outcome.status == "interrupted":
        # One line for the run: the signal, how far it got and its last checkpoint (the ranks said nothing).
        sys.stderr.write(f"{outcome.message}; details in {Path(run_dir, OUTCOME_FILE)}\n")
    elif outcome.status != "ok":
        if outcome.cause not in ("reported", ""):
            sys.stderr.write(outcome.message + "\n")
        sys.stderr.write(f"hetpipe: the run ended ({outcome.status}); details in {Path(run_dir, OUTCOME_FILE)}\n")
    elif not keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return outcome.exit_status
