"""The MPI world: mpi4py import with a clear error, host/device inventory, and the mpiexec path."""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path
from typing import Any, Dict, List


class MPIUnavailable(RuntimeError):
    """mpi4py (or an MPI library) is missing."""


def world():
    """``MPI.COMM_WORLD``; raises :class:`MPIUnavailable` naming the fix when mpi4py cannot be imported."""
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise MPIUnavailable(
            f"hetpipe: mpi4py is not importable ({e}); install it (pip install mpi4py mpich) and start the "
            "program with mpiexec -n N or `hetpipe launch -n N`") from None
    return MPI.COMM_WORLD


def host_info() -> Dict[str, Any]:
    """This rank's host name and devices (CUDA devices if any; the emulated type from HETPIPE_EMULATE)."""
    info: Dict[str, Any] = {"host": socket.gethostname(), "pid": os.getpid(), "cuda": [],
                            "emulate": os.environ.get("HETPIPE_EMULATE", "")}
    try:
        import torch
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                p = torch.cuda.get_device_properties(i)
                info["cuda"].append({"name": p.name, "memory": p.total_memory})
    except ImportError:
        pass
    return info


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
