"""Start torch.distributed (gloo) under mpiexec: rank and world from mpi4py, a free port from rank 0.

Contract: every rank of the mpiexec job calls ``init_gloo()`` once, in the same order relative to
other collective calls; it returns (rank, world). One thread per rank for torch (nothing busy-waits).
"""

from __future__ import annotations

import gc
import os
import socket
from typing import Callable, Tuple, TypeVar

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


T = TypeVar("T")


def run_gloo(work: Callable[[int, int], T]) -> T:
    """``init_gloo()``, then ``work(rank, world)``, then the process group ended; returns what ``work``
    returned.

    Why not end the group at the bottom of ``work``: a DDP module or a pipeline stage holds the group,
    so ``destroy_process_group()`` called beside them only unregisters it, and its gloo threads live on
    into interpreter finalization. There a thread that drops a finished work item (whose thread-local
    state holds a Python object) cannot take the GIL, the thread is unwound, and std::terminate aborts
    the rank after its result. Here every object ``work`` built is gone (returned, then collected)
    before the group is destroyed, so the destroy drops the last reference and joins gloo's threads
    while the interpreter is whole. ``work`` must not return anything that holds the group."""
    init_gloo()
    result = work(dist.get_rank(), dist.get_world_size())
    gc.collect()
    dist.destroy_process_group()
    return result


def gather_results(local: dict) -> list:
    """Every rank's result dict, on rank 0 (None elsewhere); a barrier for all."""
    return MPI.COMM_WORLD.gather(local, root=0)
