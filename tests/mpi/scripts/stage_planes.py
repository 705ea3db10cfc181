"""The stage ranks' two data planes (the core's StageEndpoint, mpi4py) against the single-process replay.

Per configuration: the same plan trained under mpiexec once per plane (``HETPIPE_STAGE_PLANE``) and
replayed in one process; prints one ``RESULT {json}`` line per configuration (from the plan's rank 0)
with whether the losses, final weights and synced buffers are bitwise equal, and the transport reason
each run's metrics summary gives.

Usage: mpiexec -n N python stage_planes.py RUNDIR '[{"model": "mlp", "cuts": [3], "nm": 2}, ...]'
"""

import json
import os
import sys
from pathlib import Path

from mpi4py import MPI

from common import same_outcome, sgd, split_world
from hetpipe.run.trainer import Trainer
from hetpipe.transport.core import STAGE_PLANE_ENV
from transport_equal import MODELS, plan_of
from hetpipe.run.config import Reporting, Runtime


def main() -> int:
    ok = True
    run_dir = Path(sys.argv[1])
    for i, cfg in enumerate(json.loads(sys.argv[2])):
        make, data, loss = MODELS[cfg["model"]]
        plan = plan_of(cfg, len(make()))
        sub = split_world(plan.num_ranks)
        if sub is None:
            MPI.COMM_WORLD.Barrier()
            continue
        runs, summaries = {}, {}
        for plane in ("core", "python"):
            os.environ[STAGE_PLANE_ENV] = plane
            metrics = run_dir / f"metrics-{i}-{plane}.jsonl"
            runs[plane] = Trainer(make(), loss, sgd(), data(), plan=plan, epochs=2,
                                  reporting=Reporting(progress=False, metrics=metrics),
                                  runtime=Runtime(comm=sub, copy_stream=cfg.get("copy_stream"))).fit()
            sub.Barrier()                                # the last stage has written its summary
            if sub.Get_rank() == 0:
                summaries[plane] = json.loads(metrics.read_text().splitlines()[-1])
        if sub.Get_rank() == 0:
            ref = Trainer(make(), loss, sgd(), data(), plan=plan, epochs=2).replay()
            res = {**cfg, "core_equals_replay": same_outcome(runs["core"], ref),
                   "python_equals_replay": same_outcome(runs["python"], ref),
                   "reasons": {p: s["transport_reason"] for p, s in summaries.items()}}
            ok = ok and res["core_equals_replay"] and res["python_equals_replay"]
            print("RESULT " + json.dumps(res), flush=True)
        sub.Free()
        MPI.COMM_WORLD.Barrier()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
