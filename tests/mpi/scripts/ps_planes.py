"""The PS shard's two data planes under mpiexec: the compiled core's (the default over MPI) and the
Python one (HETPIPE_PS_PLANE=python), each against the single-process replay (Python shards over a
loopback), bitwise at D = 0; and a D >= 1 run of the core plane checked against the staleness bound
from the shard logs. Prints one ``RESULT {json}`` line per configuration (from the plan's rank 0).

Usage: mpiexec -n 4 python ps_planes.py '[{"model": "resnet", "aggregate": "sum", "plane": "core"}, ...]'
Keys: ``model`` (mlp, resnet: BatchNorm, tied), ``aggregate``, ``plane`` (core or python), ``d``.
"""

import json
import os
import sys

from mpi4py import MPI

import real_models as rm
from common import cross_entropy, mlp, same_outcome, sgd, split_world, synthetic, two_vw_plan
from hetpipe.ps.core_plane import PLANE_ENV
from hetpipe.run.trainer import Trainer
from hetpipe.run.config import PSRule, Reporting, Runtime

MODELS = {"mlp": (mlp, synthetic, cross_entropy), "resnet": (rm.resnet, rm.images, cross_entropy),
          "tied": (rm.tied_mlp, synthetic, rm.tied_loss)}


def main() -> int:
    ok = True
    for cfg in json.loads(sys.argv[1]):
        make, data, loss = MODELS[cfg["model"]]
        d = cfg.get("d", 0)
        # Two VWs (the second in one stage), so that the aggregate and the buffers' average matter.
        plan = two_vw_plan(([2], []), (0.0, 0.0), nm=2, d=d, num_layers=len(make()))
        sub = split_world(plan.num_ranks)
        if sub is None:
            MPI.COMM_WORLD.Barrier()
            continue
        os.environ[PLANE_ENV] = cfg["plane"]
        run = Trainer(make(), loss, sgd(), data(), plan=plan, epochs=2,
                      ps=PSRule(aggregate=cfg["aggregate"], audit=d > 0), reporting=Reporting(progress=False),
                      runtime=Runtime(comm=sub)).fit()
        del os.environ[PLANE_ENV]
        if sub.Get_rank() == 0:
            res = {**cfg, "ps_plane": run.ps_plane, "ps_plane_reason": run.ps_plane_reason}
            if d == 0:
                ref = Trainer(make(), loss, sgd(), data(), plan=plan, epochs=2,
                              ps=PSRule(aggregate=cfg["aggregate"])).replay()
                res["equal"] = same_outcome(run, ref)
                res["buffers"] = sum(b.size for b in run.buffers.values())
                ok = ok and res["equal"]
            else:
                res.update(_staleness(run, d))
                ok = ok and res["bound_ok"]
            print("RESULT " + json.dumps(res), flush=True)
        sub.Free()
        MPI.COMM_WORLD.Barrier()
    return 0 if ok else 1


def _staleness(run, d: int) -> dict:
    """The WSP invariants in the shard logs: every pull got g >= wave - D, 0 <= clock - global <= D + 1,
    each push applied once, the final weights moved by exactly the pushes (audit)."""
    out = {"bound_ok": True, "max_lag": 0, "pulls": 0}
    for log in run.shard_logs.values():
        for _vw, _stage, wave, g in log.pulls:
            out["bound_ok"] &= g >= wave - d
            out["max_lag"] = max(out["max_lag"], wave - g)
        out["pulls"] += len(log.pulls)
        out["bound_ok"] &= all(0 <= cv - g <= d + 1 for _, cv, g in log.clocks)
        out["bound_ok"] &= sorted(log.applied) == sorted(set(log.pushes)) and bool(log.pushed_sum)
    return out


if __name__ == "__main__":
    sys.exit(main())
