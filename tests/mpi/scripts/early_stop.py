"""An early stop under real ranks: 2 VWs x 2 stages + 1 PS, Nm = 2, D = 1, evaluation every 2 waves;
a callback asks to stop at the first evaluation point (after wave 1), so every VW trains waves 0..3
(1 + D + 1) of the 10 the data holds, and every process ends. Rank 0 prints ``RESULT {json}``."""

import json
import sys

from mpi4py import MPI

from common import cross_entropy, mlp, sgd, synthetic, two_vw_plan
from hetpipe.run.trainer import Trainer
from hetpipe.run.config import Reporting, Runtime


class StopAtFirstEval:
    def on_eval(self, info):
        return True


def main() -> int:
    plan = two_vw_plan(([3], [2]), (0.002, 0.004), nm=2, d=1)
    run = Trainer(mlp(), cross_entropy, sgd(), synthetic(n=640), plan=plan,
                  reporting=Reporting(progress=False, eval_data=synthetic(seed=9), eval_every=2, callbacks=[StopAtFirstEval()]),
                  runtime=Runtime(emulate=True)).fit()
    if MPI.COMM_WORLD.Get_rank() == 0:
        print("RESULT " + json.dumps({"stopped": run.stopped, "ps_plane": run.ps_plane,
                                      "losses": {str(v): sorted(l) for v, l in run.losses.items()},
                                      "evals": run.evals,
                                      "clocks": [log.clocks[-1] for log in run.shard_logs.values()]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
