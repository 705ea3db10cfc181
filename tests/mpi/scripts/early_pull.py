"""When the shard receives a stage's pull requests, against when that stage pushed (see
tests/mpi/test_early_pull_mpi.py): one VW of two emulated stages (Nm = 4, D = 1) and one PS shard on
the core plane, traced. Rank 0 prints, per wave w >= 2 of the last stage, the shard's arrival times of
its Push(w - 1) header and of its Pull(w) request (both on the shard's clock), and the seconds each of
its Pull instructions waited. ``HETPIPE_PULL_AHEAD`` chooses when requests leave.

Usage: early_pull.py OUT_DIR
"""

import json
import re
import sys
from pathlib import Path

from mpi4py import MPI

from common import cross_entropy, mlp, sgd, synthetic
from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan
from hetpipe.run.config import Reporting
from hetpipe.run.trainer import Trainer
from hetpipe.schedule.trace import PS_VW

WAVES, NM = 6, 4
stages = (StagePlan("n0.g0", "emulated", 0, 3, 0.002, 0.004), StagePlan("n0.g1", "emulated", 3, 6, 0.002, 0.004))
plan = Plan(6, NM, 1, "manual", (VirtualWorkerPlan(0, stages),), (ShardPlan(0, "n0", tuple(range(6))),))
run = Trainer(mlp(), cross_entropy, sgd(), synthetic(n=16 * NM * WAVES), plan=plan, epochs=1,
              reporting=Reporting(progress=False, trace=Path(sys.argv[1]) / "trace.json")).fit()
if MPI.COMM_WORLD.Get_rank() == 0:
    pushed, asked = {}, {}
    for e in run.trace:
        if e.vw != PS_VW:
            continue
        m = re.match(r"(push|pull) w(\d+) VW 0\.1\b", e.label or "")
        if m:
            (pushed if m.group(1) == "push" else asked)[int(m.group(2))] = e.start_s
    waits = {e.wave: e.dur_s for e in run.trace if e.vw == 0 and e.stage == 1 and e.kind == "WAIT"}
    rows = [{"wave": w, "push_before": pushed[w - 1], "request": asked[w], "wait": waits.get(w, 0.0)}
            for w in range(2, WAVES)]
    print("RESULT " + json.dumps({"ps_plane": run.ps_plane, "rows": rows}), flush=True)
