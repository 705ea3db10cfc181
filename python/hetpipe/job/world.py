"""The MPI world of a rank: mpi4py import with a clear error, MPI settings, and the host/device inventory."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Any, Dict, List

from hetpipe.job.inventory import host_name
from hetpipe.job.rundir import LAUNCHER_RANK_ENVS, RUN_DIR_ENV, mark_starting, register_rank
from hetpipe.util.errors import HetpipeError

# hetpipe sends host memory only over MPI (pinned slots; device-to-device traffic has its own
# backends), so MPI's GPU layer is switched off before MPI_Init: an MPICH built with it would query,
# and may open a context on, every visible GPU from every rank, parameter servers included. A value
# the user set is kept.
MPI_GPU_ENV = {"MPIR_CVAR_ENABLE_GPU": "0"}


class MPIUnavailable(HetpipeError, RuntimeError):
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
    mark_starting()
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise MPIUnavailable(
            f"hetpipe: mpi4py is not importable ({e}); install it (pip install mpi4py mpich) and start the "
            "program with mpiexec -n N or `hetpipe launch -n N`") from None
    if os.environ.get(RUN_DIR_ENV):
        rank, size = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
        if not Path(os.environ[RUN_DIR_ENV], f"rank-{rank}.txt").exists():
            register_rank(rank, f"rank {rank}", _host(rank, size))
    return MPI.COMM_WORLD


def host_info(rank: int = 0, size: int = 1) -> Dict[str, Any]:
    """This rank's host name (``HETPIPE_HOST`` overrides it, :mod:`hetpipe.job.inventory`), pid, number
    of visible CUDA devices and emulated type (HETPIPE_EMULATE).

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
    return {"host": _host(rank, size), "pid": os.getpid(), "cuda_count": count,
            "emulate": os.environ.get("HETPIPE_EMULATE", "")}


def _host(rank: int, size: int) -> str:
    """This rank's host (torch-free); a malformed HETPIPE_HOST is reported by discovery, naming the rank."""
    try:
        return host_name(rank, size)
    except ValueError:
        return socket.gethostname()


LAUNCHER_SIZE_ENVS = ("PMI_SIZE", "PMIX_SIZE", "OMPI_COMM_WORLD_SIZE")     # set by MPI launchers before MPI_Init


def host_before_start_up() -> str:
    """This rank's host before MPI start-up (from the rank number and world size its MPI launcher set
    in the environment), as :func:`world` will record it; the machine's name when they are not set."""
    rank = next((os.environ[k] for k in LAUNCHER_RANK_ENVS if k in os.environ), "")
    size = next((os.environ[k] for k in LAUNCHER_SIZE_ENVS if k in os.environ), "")
    if not (rank.isdigit() and size.isdigit()):
        return socket.gethostname()
    return _host(int(rank), int(size))


def gather_hosts(comm) -> List[Dict[str, Any]]:
    """Every rank's :func:`host_info`, indexed by rank (a collective: every rank calls it)."""
    return comm.allgather(host_info(comm.Get_rank(), comm.Get_size()))


