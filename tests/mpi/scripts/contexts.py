"""One VW of two stages on ``cuda:0`` plus one PS shard: what each rank holds of CUDA, read from the
driver and from torch, at the moment a stage rank binds its device and after training; and which
pids the driver lists as compute processes while every rank is still alive. Prints one
``RESULT {json}`` line (rank 0).

The script leaves start-up to hetpipe (``Trainer.fit`` initialises MPI) and only observes: the
binding call is wrapped to record the state just before it, then made as usual.

Usage: mpiexec -n 3 python contexts.py
"""

import json
import os
import shutil
import subprocess
import sys

import torch

import hetpipe_core
from common import cross_entropy, mlp, one_vw_plan, sgd, synthetic
from hetpipe.run.trainer import Trainer
from hetpipe.run.config import Reporting


def cuda_state() -> dict:
    n = hetpipe_core.build_info()["cuda_device_count"]
    return {"torch_initialized": torch.cuda.is_initialized(),
            "contexts": [hetpipe_core.cuda_context_active(d) for d in range(n)]}


def compute_pids():
    """The pids the driver lists as compute processes (None without nvidia-smi)."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    out = subprocess.run([smi, "--query-compute-apps=pid", "--format=csv,noheader"], capture_output=True,
                         text=True, timeout=60)
    return sorted(int(x) for x in out.stdout.split() if x.strip().isdigit()) if out.returncode == 0 else None


def main() -> int:
    bindings = []
    bind = torch.cuda.set_device

    def observed_set_device(device):
        bindings.append({"device": str(device), **cuda_state()})
        bind(device)

    torch.cuda.set_device = observed_set_device
    plan = one_vw_plan([3], nm=2, d=0, device="cuda:0")
    run = Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=plan, epochs=1,
                  reporting=Reporting(progress=False)).fit()
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    mine = {"role": run.role.split("(")[-1].rstrip(")"), "rank": run.rank, "pid": os.getpid(),
            "bindings": bindings, **cuda_state()}
    everyone = comm.gather(mine, root=0)
    pids = compute_pids() if run.rank == 0 else None      # every rank is alive until the barrier
    comm.Barrier()
    if run.rank == 0:
        print("RESULT " + json.dumps({"ranks": everyone, "compute_pids": pids}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
