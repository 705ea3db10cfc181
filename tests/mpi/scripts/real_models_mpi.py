"""Models with dropout, tied weights across stages, BatchNorm and pytree boundaries under mpiexec
against the single-process replay (bitwise at D = 0). Prints one ``RESULT {json}`` line per
configuration (from the plan's rank 0).

Usage: mpiexec -n 4 python real_models_mpi.py '[{"model": "dropout", "cuts": [3], "nm": 2}, ...]'
(``vws: 2`` runs two VWs, the second in one stage).
"""

import json
import sys

from mpi4py import MPI

import real_models as rm
from common import cross_entropy, one_vw_plan, same_outcome, sgd, split_world, synthetic, two_vw_plan
from hetpipe.run.trainer import Trainer
from hetpipe.run.config import Reporting, Runtime

MODELS = {"dropout": (rm.dropout_mlp, synthetic, cross_entropy), "tied": (rm.tied_mlp, synthetic, rm.tied_loss),
          "resnet": (rm.resnet, rm.images, cross_entropy), "pytree": (rm.pytree_model, rm.DictBatches, cross_entropy)}


def main() -> int:
    ok = True
    for cfg in json.loads(sys.argv[1]):
        make, data, loss = MODELS[cfg["model"]]
        n = len(make())
        if cfg.get("vws", 1) == 2:
            plan = two_vw_plan((cfg["cuts"], []), (0.0, 0.0), nm=cfg["nm"], d=0, num_layers=n)
        else:
            plan = one_vw_plan(cfg["cuts"], cfg["nm"], 0, num_layers=n)
        sub = split_world(plan.num_ranks)
        if sub is None:
            MPI.COMM_WORLD.Barrier()
            continue
        run = Trainer(make(), loss, sgd(), data(), plan=plan, epochs=2, reporting=Reporting(progress=False),
                      runtime=Runtime(comm=sub)).fit()
        if sub.Get_rank() == 0:
            ref = Trainer(make(), loss, sgd(), data(), plan=plan, epochs=2).replay()
            same = same_outcome(run, ref)
            ok = ok and same
            print("RESULT " + json.dumps({**cfg, "equal": same, "minibatches": len(run.losses[0])}), flush=True)
        sub.Free()
        MPI.COMM_WORLD.Barrier()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
