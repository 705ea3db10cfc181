"""Two VWs of different emulated speeds under WSP, for several D; checks the PS logs on rank 0.

Prints one ``RESULT {json}`` line per run. Usage: mpiexec -n 5 python wsp_two_vws.py '[0, 0, 1, 3]'
"""

import json
import sys

import numpy as np
from mpi4py import MPI

from common import cross_entropy, mlp, sgd, synthetic, two_vw_plan
from hetpipe.model.weights import initial_weights
from hetpipe.run.trainer import Trainer
from hetpipe.run.config import PSRule, Reporting


def check(run, d: int) -> dict:
    plan = run.plan
    w0 = initial_weights(list(mlp()), 0)
    waves = -(-len(run.losses[0]) // plan.nm)
    out = {"d": d, "waves": waves, "bound_ok": True, "max_gap": 0, "pushes_once": True, "sum_ok": True,
           "pulls_ok": True}
    for k, log in run.shard_logs.items():
        for vw, cv, g in log.clocks:
            out["bound_ok"] &= 0 <= cv - g <= d + 1
            out["max_gap"] = max(out["max_gap"], cv - g)
        expected = {(vw.index, s, c) for vw in plan.virtual_workers for s in range(len(vw.stages))
                    for c in range(waves)}
        out["pushes_once"] &= len(log.pushes) == len(set(log.pushes)) and set(log.pushes) == expected
        out["pulls_ok"] &= all(w - d <= g for _, _, w, g in log.pulls)
        out["sum_ok"] &= bool(log.pushed_sum)          # the audit ran
        for l, pushed in log.pushed_sum.items():
            moved = run.weights[l].astype(np.float64) - w0[l].astype(np.float64)
            out["sum_ok"] &= bool(np.allclose(moved, pushed, rtol=1e-4, atol=1e-5))
    out["final_global"] = run.shard_logs[0].clocks[-1][2]
    out["ps_plane"] = run.ps_plane
    return out


def main() -> int:
    ok, previous = True, {}
    for d in json.loads(sys.argv[1]):
        plan = two_vw_plan(([3], [2]), (0.002, 0.006), nm=2, d=d)
        run = Trainer(mlp(), cross_entropy, sgd(), synthetic(n=192), plan=plan, epochs=2, ps=PSRule(audit=True),
                      reporting=Reporting(progress=False)).fit()
        if MPI.COMM_WORLD.Get_rank() == 0:
            res = check(run, d)
            if d in previous:
                res["reproducible"] = previous[d].losses == run.losses and all(
                    np.array_equal(previous[d].weights[l], run.weights[l]) for l in run.weights)
                ok &= res["reproducible"]
            previous[d] = run
            ok &= res["bound_ok"] and res["pushes_once"] and res["sum_ok"] and res["pulls_ok"]
            print("RESULT " + json.dumps(res), flush=True)
        MPI.COMM_WORLD.Barrier()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
