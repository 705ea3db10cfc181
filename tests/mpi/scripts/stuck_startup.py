"""A rank that blocks in its own data while the Trainer starts up: its peers wait for it in a start-up
collective. Usage: stuck_startup.py RANK, run by `hetpipe launch -n 3`.

The dataset's items block (a sleep: no CPU time, as a read from a hung filesystem) on MPI rank RANK,
once MPI has started (before, the Trainer reads a sample while it is built, which is not the case
under test)."""

import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

from common import cross_entropy, mlp, one_vw_plan, sgd
from hetpipe.run.config import Reporting
from hetpipe.run.trainer import Trainer


class Blocking(Dataset):
    def __init__(self):
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(256, 64, generator=g), torch.randint(0, 10, (256,), generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        mpi = sys.modules.get("mpi4py.MPI")
        if os.environ.get("PMI_RANK") == sys.argv[1] and mpi is not None and mpi.Is_initialized():
            time.sleep(10_000)
        return self.x[i], self.y[i]


Trainer(mlp(), cross_entropy, sgd(), DataLoader(Blocking(), batch_size=16), plan=one_vw_plan([3], 2, 0),
        reporting=Reporting(progress=False)).fit()
print("FINISHED", flush=True)
