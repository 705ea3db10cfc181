"""hetpipe: the planned Plan run by ``hetpipe.run.trainer.Trainer`` under mpiexec, emulated devices.

Started as ``mpiexec -n <plan ranks> python hetpipe_worker.py cfg.json result.json``; the plan file
and D come from ``cfg.extra`` ("plan", "d", "waves", "skip_waves"). Steady-state samples/s is taken
from the run's own trace: the window starts when every VW has finished its first ``skip_waves``
waves (stage 0's backward of the wave's last minibatch) and ends when the first VW finishes its last
minibatch; every VW's minibatches completing inside the window count.
Each stage's padding and overrun come from the runtime's own Pacer objects (recorded by a
subclass installed in this process only; the runtime's behaviour is unchanged).
"""

from __future__ import annotations

import dataclasses
import sys
import tempfile
from pathlib import Path
from typing import Dict, List

import torch
from mpi4py import MPI

import hetpipe.run.build as runtime_build
from config import RunConfig, write_result
from hetpipe.job.roles import role_of
from hetpipe.plan.types import Plan
from hetpipe.run.data import Batches
from hetpipe.stage.pacer import Pacer
from hetpipe.run.trainer import Trainer
from model import build_layers, loss_fn, synthetic_batches
from hetpipe import Reporting, Runtime


class RecordingPacer(Pacer):
    """The runtime's Pacer, remembering every instance built in this process."""

    instances: List["RecordingPacer"] = []

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        RecordingPacer.instances.append(self)


def steady_rate(trace, plan: Plan, skip_waves: int) -> Dict[str, float]:
    """Samples/s over the steady window (see the module docstring) from stage-0 backward events."""
    ends: Dict[int, List[float]] = {}
    for e in trace:
        if e.stage == 0 and e.kind == "B":
            ends.setdefault(e.vw, []).append(e.start_s + e.dur_s)
    for v in ends:
        ends[v].sort()
    skip = skip_waves * plan.nm
    if any(len(x) <= skip + 1 for x in ends.values()):
        raise ValueError(f"hetpipe: too few minibatches to skip {skip_waves} waves")
    t_a = max(x[skip - 1] for x in ends.values()) if skip else 0.0
    t_b = min(x[-1] for x in ends.values())
    count = sum(1 for x in ends.values() for t in x if t_a < t <= t_b)
    return {"samples_per_s": count * plan.minibatch_size / (t_b - t_a), "window_s": t_b - t_a,
            "window_minibatches": count}


def main(cfg_path: str, out_path: str) -> None:
    cfg = RunConfig.load(cfg_path)
    torch.set_num_threads(1)
    runtime_build.Pacer = RecordingPacer
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    plan = Plan.load(cfg.extra["plan"])
    plan = dataclasses.replace(plan, d=int(cfg.extra["d"]))
    nvw, mb = len(plan.virtual_workers), cfg.spec.minibatch
    count = nvw * plan.nm * int(cfg.extra["waves"])
    x = torch.cat([b[0] for b in synthetic_batches(cfg.spec, count, mb)])
    y = torch.cat([b[1] for b in synthetic_batches(cfg.spec, count, mb)])
    data = Batches(x, y, mb, shuffle=False)
    trace_file = Path(tempfile.mkdtemp()) / "trace.json"
    result = Trainer(build_layers(cfg.spec), loss_fn, lambda p: torch.optim.SGD(p, lr=0.01), data, plan=plan,
                     reporting=Reporting(trace=trace_file, progress=False), runtime=Runtime(emulate=True)).fit()
    pacers = RecordingPacer.instances
    role = role_of(plan, rank)
    if role.kind == "stage":
        st = plan.virtual_workers[role.vw].stages[role.stage]
        where = {"device": st.device, "type": st.device_type, "layers": [st.start, st.stop]}
    else:
        where = {"device": f"ps{role.shard}", "type": "host (PS)"}
    mine = {"rank": rank, "role": result.role, **where, "elapsed_s": result.elapsed_s,
            "pad_frac": sum(c.padded_s for c in pacers) / result.elapsed_s,
            "overrun_s": sum(c.overrun_s for c in pacers), "padded": any(c.enabled for c in pacers)}
    ranks = comm.gather(mine, root=0)
    if rank == 0:
        steady = steady_rate(result.trace, plan, int(cfg.extra["skip_waves"]))
        write_result(out_path, {"system": f"hetpipe D={plan.d}", **steady, "whole_run_samples_per_s": result.samples_per_s,
                                "wall_s": result.elapsed_s, "ranks": ranks, "emulated": result.emulated,
                                "final_loss": result.final_loss(),
                                "note": f"{nvw} VWs x {[len(v.stages) for v in plan.virtual_workers]} stages, "
                                        f"Nm={plan.nm}, {len(plan.ps_shards)} PS"})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
