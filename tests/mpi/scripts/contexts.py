"""One VW of two stages on ``cuda:0`` plus one PS shard; after training, each rank reports which CUDA
devices it holds a context on. Prints one ``RESULT {json}`` line (rank 0).

Usage: mpiexec -n 3 python contexts.py
"""

import json
import sys

import hetpipe_core
from common import cross_entropy, mlp, one_vw_plan, sgd, synthetic
from hetpipe.runtime.trainer import Trainer


def main() -> int:
    from mpi4py import MPI

    plan = one_vw_plan([3], nm=2, d=0, device="cuda:0")
    run = Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=plan, epochs=1, progress=False).fit()
    n = hetpipe_core.build_info()["cuda_device_count"]
    mine = {"role": run.role.split("(")[-1].rstrip(")"), "rank": run.rank,
            "active": [hetpipe_core.cuda_context_active(d) for d in range(n)]}
    everyone = MPI.COMM_WORLD.gather(mine, root=0)
    if run.rank == 0:
        print("RESULT " + json.dumps({"ranks": everyone}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
