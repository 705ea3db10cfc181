"""A run planned on the world's own devices. Usage: discovered_run.py CLUSTER [PLAN_CACHE]: CLUSTER is
``auto`` or a cluster JSON; world rank 0 prints a ``RESULT`` per rank with its world rank, its role and host, and
rank 0 also the plan, the losses and whether they equal a one-process replay of the same plan."""

import json
import sys

import numpy as np
from mpi4py import MPI

from common import cross_entropy, mlp, sgd, synthetic
from hetpipe.job.inventory import host_name
from hetpipe.run.trainer import Trainer
from hetpipe.run.config import Planning, Reporting


def main() -> int:
    cluster = sys.argv[1]
    cache = sys.argv[2] if len(sys.argv) > 2 else None
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    run = Trainer(mlp(), cross_entropy, sgd(), synthetic(n=256),
                  planning=Planning(cluster=cluster, nm=2, d=0, plan_cache=cache),
                  reporting=Reporting(progress=False)).fit()
    out = {"world": rank, "role": run.role, "host": host_name(rank, comm.Get_size())}
    if run.rank == 0:
        replay = Trainer(mlp(), cross_entropy, sgd(), synthetic(n=256), plan=run.plan,
                         reporting=Reporting(progress=False)).replay()
        weights_equal = sorted(run.weights) == sorted(replay.weights) and all(
            np.array_equal(run.weights[l], replay.weights[l]) for l in replay.weights)
        out.update(plan=run.plan.to_dict(), losses={str(v): l for v, l in run.losses.items()},
                   replay_equal=(run.losses == replay.losses) and weights_equal)
    everyone = comm.gather(out, root=0)     # one writer: lines of several ranks would interleave
    if rank == 0:
        for entry in everyone:
            print("RESULT " + json.dumps(entry), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
