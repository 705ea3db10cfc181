"""The MPI world: mpi4py import with a clear error, host/device inventory, and the mpiexec path."""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

from hetpipe.launch.deaths import RUN_DIR_ENV, register_rank


# hetpipe sends host memory only over MPI (pinned slots; device-to-device traffic has its own
# backends), so MPI's GPU layer is switched off before MPI_Init: an MPICH built with it would query,
# and may open a context on, every visible GPU from every rank, parameter servers included. A value
# the user set is kept.
MPI_GPU_ENV = {"MPIR_CVAR_ENABLE_GPU": "0"}


class MPIUnavailable(RuntimeError):
    """mpi4py (or an MPI library) is missing."""


def disable_mpi_gpu() -> None:
    """Set :data:`MPI_GPU_ENV` in this process's environment where unset (before MPI_Init: here, or
    in the ranks a launcher starts, which inherit it)."""
    for key, value in MPI_GPU_ENV.items():
        os.environ.setdefault(key, value)


def world():
    """``MPI.COMM_WORLD``; raises :class:`MPIUnavailable` naming the fix when mpi4py cannot be imported.

    Under ``hetpipe launch`` the rank records itself in the run directory at once (its role follows
    once known), so that the launcher can name it even if it fails before its role is assigned.
    MPI is initialised here (mpi4py's import), after :data:`MPI_GPU_ENV` is set where unset, unless
    the program imported mpi4py.MPI earlier."""
    disable_mpi_gpu()
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise MPIUnavailable(
            f"hetpipe: mpi4py is not importable ({e}); install it (pip install mpi4py mpich) and start the "
            "program with mpiexec -n N or `hetpipe launch -n N`") from None
    if os.environ.get(RUN_DIR_ENV):
        rank = MPI.COMM_WORLD.Get_rank()
        if not Path(os.environ[RUN_DIR_ENV], f"rank-{rank}.txt").exists():
            register_rank(rank, f"rank {rank}")
    return MPI.COMM_WORLD


def host_info() -> Dict[str, Any]:
    """This rank's host name, pid, number of visible CUDA devices and emulated type (HETPIPE_EMULATE).

    Contract: no CUDA context and no torch CUDA state. Every rank runs this before it knows its role,
    so it only counts devices (``torch.cuda.device_count()``: NVML where available, else
    ``cudaGetDeviceCount``, neither of which creates a context). Device properties are left out: a
    stage rank that needs them reads its own device's after binding it (``torch.cuda.set_device``)."""
    count = 0
    try:
        import torch
        count = torch.cuda.device_count()
    except ImportError:
        pass
    return {"host": socket.gethostname(), "pid": os.getpid(), "cuda_count": count,
            "emulate": os.environ.get("HETPIPE_EMULATE", "")}


def gather_hosts(comm) -> List[Dict[str, Any]]:
    """Every rank's :func:`host_info`, indexed by rank (a collective: every rank calls it)."""
    return comm.allgather(host_info())


def mpiexec_path() -> str:
    """The mpiexec beside this Python (a virtual environment's), else the one on PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec") or shutil.which("mpirun")
    if not found:
        raise MPIUnavailable("hetpipe: no mpiexec beside the Python interpreter nor on PATH; pip install mpich")
    return found


def mpiexec_command(n: int, argv: List[str]) -> List[str]:
    """The command line that runs ``argv`` (a Python script and its arguments) on ``n`` ranks."""
    if n < 1:
        raise ValueError(f"hetpipe launch: -n must be >= 1, got {n}")
    return [mpiexec_path(), "-n", str(n), sys.executable, *argv]


def launch(n: int, argv: List[str], run_dir: Optional[str] = None) -> int:
    """Run ``argv`` on ``n`` ranks under mpiexec, relaying its output; return the run's exit status.

    Supervised by :class:`hetpipe.launch.supervisor.Supervisor`: on any fault every process of the run
    ends and the failed rank is named, on stderr and in ``<run_dir>/outcome.json``. ``run_dir`` (made
    if missing, must hold no earlier run) is kept; by default a temporary one is used, removed after a
    successful run and kept after a failure."""
    import tempfile

    from hetpipe.launch.failure import timeout_s
    from hetpipe.launch.supervisor import OUTCOME_FILE, Supervisor

    command = mpiexec_command(n, argv)
    keep = run_dir is not None
    if run_dir is None:
        run_dir = tempfile.mkdtemp(prefix="hetpipe-run-")
    else:
        run_dir = os.path.abspath(run_dir)
        os.makedirs(run_dir, exist_ok=True)
        if any(Path(run_dir).iterdir()):
            raise ValueError(f"hetpipe launch: the run directory {run_dir} is not empty (it holds an earlier run?)")
    disable_mpi_gpu()
    outcome = Supervisor(command, n, run_dir, timeout_s()).run()
    if outcome.status != "ok":
        if outcome.cause not in ("reported", ""):
            sys.stderr.write(outcome.message + "\n")
        sys.stderr.write(f"hetpipe: the run ended ({outcome.status}); details in {Path(run_dir, OUTCOME_FILE)}\n")
    elif not keep:
        shutil.rmtree(run_dir, ignore_errors=True)
    return outcome.exit_status
