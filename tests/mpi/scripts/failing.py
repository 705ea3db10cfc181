"""A run in which one rank fails on purpose. Usage: mpiexec -n 3 python failing.py MODE RANK

MODE: ``raise`` (the rank raises in its forward), ``kill`` (it SIGKILLs itself mid-run), ``hang``
(it stops responding), ``shape`` (rank 0's copy of the model narrows an activation, so stage 1
receives the wrong shape), ``cuda`` (the plan asks for cuda:3), ``forge`` (the rank sends the PS shard,
rank 2, a push header claiming the other stage), ``farpull`` (it sends the shard a pull of wave 50 in
its own name), ``none``.
"""

import os
import signal
import sys
import time

import torch
from mpi4py import MPI
from torch import nn

from common import cross_entropy, mlp, one_vw_plan, sgd, synthetic
from hetpipe.run.trainer import Trainer
from hetpipe.run.config import Reporting
from hetpipe.transport.protocol import PULL, PUSH, Header


class Tripwire(nn.Module):
    """Identity, except on rank ``rank`` at its ``after``-th call, where it fails in the given ``mode``."""

    def __init__(self, mode: str, rank: int, after: int = 3) -> None:
        super().__init__()
        self.mode, self.rank, self.after, self.calls = mode, rank, after, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if MPI.COMM_WORLD.Get_rank() != self.rank:
            return x
        if self.mode == "shape":
            return x[:, : x.shape[1] // 2]
        self.calls += 1
        if self.calls == self.after:
            if self.mode == "raise":
                raise RuntimeError("deliberate failure in the forward pass")
            if self.mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if self.mode == "hang":
                time.sleep(3600)
            if self.mode in ("forge", "farpull"):
                stage = self.rank if self.mode == "farpull" else 1 - self.rank
                kind, wave = (PULL, 50) if self.mode == "farpull" else (PUSH, 0)
                header = Header(kind, 0, stage, -1, wave, "float32", (0,), 0)
                MPI.COMM_WORLD.Send([header.encode(), MPI.INT64_T], dest=2, tag=2 * kind)
        return x


def main() -> int:
    mode, rank = sys.argv[1], int(sys.argv[2])
    base = list(mlp())
    layers = [base[0], base[1], Tripwire(mode, rank), *base[2:]]
    # The tripwire ends stage 0 for "shape" (it narrows what stage 0 sends) and starts stage 1 otherwise.
    plan = one_vw_plan([3] if mode == "shape" else [2], nm=2, d=0, num_layers=len(layers),
                       device="cuda:3" if mode == "cuda" else "cpu")
    Trainer(layers, cross_entropy, sgd(), synthetic(), plan=plan, epochs=3, reporting=Reporting(progress=False)).fit()
    print("FINISHED", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
