"""torch.distributed.pipelining (1F1B), one pipeline over the emulated devices, trained for a wall-clock budget.

Rank r is stage r on device r (cluster order) with bench/e2e's uniform layer split; each micro-batch
is one minibatch, padded to the stage's profiled time on its device type; one step is ``job.micro``
micro-batches and a flush (so the global batch equals DDP's). Every rank passes ``loss_fn`` to the
schedule (shape inference needs it on all of them). After each step rank 0 decides and broadcasts
whether the budget is spent and whether a snapshot is due (``gloo_runs.StepClock``); every stage then
records its own layers under the same snapshot index, and rank 0 joins them at the end.
"""

from __future__ import annotations

import sys
import time
from typing import Optional

import torch
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import gloo_runs
import snapshots
from devices import DeviceModel
from emulate import Emulated, pacer_report
from hetpipe.model.weights import initial_weights
from hetpipe.stage.pacer import Pacer
from job import Job
from mpi_env import gather_results
from split import uniform_split
from task import MinibatchStream, build_layers, corpus, loss_fn, optimizer


def train(job: Job, rank: int, world: int, dm: DeviceModel) -> Optional[dict]:
    """One run; returns its result on rank 0 (None elsewhere) after writing its snapshots."""
    text, _, _ = corpus(job.task)
    stream = MinibatchStream(text, job.task, job.seed, count=0)
    layers_all = build_layers(job.task, job.seed)
    start, stop = uniform_split(len(layers_all), world)[rank]
    dtype = dm.devices[rank][1]
    pacer = Pacer(1.0)
    mine = layers_all[start:stop]
    module = Emulated(nn.Sequential(*mine), *dm.scaled_times(dtype, range(start, stop), job.task.minibatch), pacer)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = Schedule1F1B(stage, job.micro, loss_fn=loss_fn)
    opt = optimizer(module.parameters(), job.lr)
    snaps = {0: (0.0, initial_weights(mine, start))}
    snap_steps = [0]                    # optimizer steps taken at each snapshot (its index), alike on every stage
    steps = 0
    losses: list = []
    timer = gloo_runs.StepClock(job, rank)
    timer.start()
    while True:
        x, y = stream.concat(steps * job.micro, job.micro)
        opt.zero_grad(set_to_none=True)
        losses.clear()
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        opt.step()
        steps += 1
        now, stop, snap = timer.after_step()
        if snap:
            snaps[len(snaps)] = (now, initial_weights(mine, start))
            snap_steps.append(steps)
        if stop:
            break
    wall = time.perf_counter() - timer.t0
    pad, over = pacer_report(pacer, wall)
    loss = float(torch.stack(losses).mean()) if losses else None
    ranks = gather_results({"rank": rank, "device": dm.devices[rank][0], "type": dtype, "wall_s": wall,
                            "layers": [start, stop], "pad_frac": pad, "overrun_s": over, "loss": loss,
                            "snapshots": snaps})
    if rank != 0:
        return None
    snapshots.save(job.snapshots, snapshots.merge(r.pop("snapshots") for r in ranks))
    return {"system": "pipelining-1f1b", "steps": steps, "samples": steps * job.micro * job.task.minibatch,
            "snapshot_steps": snap_steps,
            "wall_s": max(r["wall_s"] for r in ranks), "ranks": ranks,
            "note": f"uniform split {[r['layers'] for r in ranks]}, {job.micro} x {job.task.minibatch}"}


if __name__ == "__main__":
    gloo_runs.main(train, "pipelining", sys.argv[1], sys.argv[2])
