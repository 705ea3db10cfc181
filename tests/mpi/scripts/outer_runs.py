"""Runs with the PS's outer optimizer (hetpipe.plan.outer) under mpiexec, each against the single-process
replay: at D = 0 the replay without a record, at D >= 1 (seeded random delays, so pulls lag) the replay
of the run's record; both must be bitwise equal to the run. The same replay under the plain rule must
differ (the outer optimizer acted), and at D >= 1 a plain-rule replay of the record is refused naming
``run.outer``. Prints one ``RESULT {json}`` line per configuration (from the run's rank 0).

Usage: mpiexec -n 5 python outer_runs.py RUNDIR '[{"d": 0, "cuts": [[3], []], "shards": 2,
"slow": [0, 0], "aggregate": "mean", "outer": {"outer": "nesterov", ...}}, ...]'
"""

import dataclasses
import json
import sys
from pathlib import Path

from mpi4py import MPI

from common import cross_entropy, same_outcome, sgd, split_world, synthetic
from hetpipe.run.record import RecordMismatch, RunRecord
from hetpipe.run.trainer import Trainer
from recorded_replay import Jittered, model, plan_of
from hetpipe.run.config import PSRule, Reporting, Runtime


def trainer(plan, cfg: dict, outer=None, **kw) -> Trainer:
    return Trainer(model(), cross_entropy, sgd(), synthetic(n=cfg.get("n", 256)), plan=plan, epochs=2,
                   ps=PSRule(aggregate=cfg["aggregate"], **(outer or {})), **kw)


def equal_waves(plan):
    """``plan`` with every VW's wave the plan's Nm."""
    return dataclasses.replace(plan, virtual_workers=tuple(dataclasses.replace(vw, nm=0) for vw in plan.virtual_workers))


def check(cfg: dict, run, path: Path, plan) -> dict:
    """What the test asserts: the run against the replays with its outer optimizer and without."""
    Jittered.on = False
    record = RunRecord.load(path)
    pulls = [p for s in record.shards.values() for p in s.pulls]
    replayed = trainer(plan, cfg, cfg["outer"]).replay(record=path if cfg["d"] else None)
    # the plain rule; for a plan of unequal waves, the same plan with equal ones
    plain_plan = equal_waves(plan)
    plain = trainer(plain_plan, cfg).replay()
    out = {**cfg, "ps_plane": run.ps_plane, "equal": same_outcome(run, replayed),
           "reproduced": replayed.reproduced, "plain_differs": not same_outcome(run, plain),
           "max_pull_staleness": max(w - g for _, _, w, g, _ in pulls), "record_outer": record.run.get("outer"),
           "record_waves": record.run.get("waves")}
    if cfg["d"]:
        try:
            trainer(plain_plan, cfg).replay(record=path)
            out["plain_refused"] = ""
        except RecordMismatch as e:
            out["plain_refused"] = str(e)
    return out


def main() -> int:
    run_dir, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    ok = True
    for i, cfg in enumerate(configs):
        plan = plan_of(cfg)
        Jittered.scale = {plan.rank_of(v, s): cfg["slow"][v] for v, vw in enumerate(plan.virtual_workers)
                          for s in range(len(vw.stages))}
        Jittered.on = True
        sub = split_world(plan.num_ranks)
        if sub is None:
            MPI.COMM_WORLD.Barrier()
            continue
        path = run_dir / f"run{i}" / "record.json"
        run = trainer(plan, cfg, cfg["outer"], reporting=Reporting(progress=False, record=path),
                      runtime=Runtime(comm=sub)).fit()
        if sub.Get_rank() == 0:
            res = check(cfg, run, path, plan)
            ok = ok and res["equal"]
            print("RESULT " + json.dumps(res), flush=True)
        sub.Free()
        MPI.COMM_WORLD.Barrier()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
