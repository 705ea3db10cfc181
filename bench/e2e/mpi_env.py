"""Start torch.distributed (gloo) under mpiexec: rank and world from mpi4py, a free port from rank 0.

Contract: every rank of the mpiexec job calls ``init_gloo()`` once, in the same order relative to
other collective calls; it returns (rank, world). One thread per rank for torch (nothing busy-waits).
"""

from __future__ import annotations

import os
import socket
from typing import Tuple

import torch
import torch.distributed as dist
from mpi4py import MPI


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo() -> Tuple[int, int]:
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    port = comm.bcast(_free_port() if rank == 0 else None, root=0)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    return rank, world


def gather_results(local: dict) -> list:
    """Every rank's result dict, on rank 0 (None elsewhere); a barrier for all."""
    return MPI.COMM_WORLD.gather(local, root=0)
