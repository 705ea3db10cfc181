"""DDP (gloo), one rank per emulated device, trained for a wall-clock budget; rank 0 records the weights.

Every rank holds the whole model and takes one minibatch per step (the per-device batch of the
HetPipe paper's data-parallel baseline), each layer padded to its device type's profiled time
(bench/e2e's ``Emulated``). After each step rank 0 decides — and broadcasts — whether the budget is
spent and whether the weights are due for a snapshot (``gloo_runs.StepClock``); that broadcast of two
numbers is the only addition to DDP's own per-step synchronisation.
"""

from __future__ import annotations

import sys
import time
from typing import Optional

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gloo_runs
import snapshots
from devices import DeviceModel
from emulate import Emulated, pacer_report
from hetpipe.model.weights import initial_weights
from hetpipe.stage.pacer import Pacer
from job import Job
from mpi_env import gather_results
from task import MinibatchStream, build_layers, corpus, loss_fn, optimizer


def train(job: Job, rank: int, world: int, dm: DeviceModel) -> Optional[dict]:
    """One run; returns its result on rank 0 (None elsewhere) after writing its snapshots."""
    text, _, _ = corpus(job.task)
    stream = MinibatchStream(text, job.task, job.seed, count=0)
    dtype = dm.devices[rank][1]
    pacer = Pacer(1.0)
    layers = build_layers(job.task, job.seed)
    model = DDP(nn.Sequential(*[Emulated(layer, *dm.scaled_times(dtype, [i], job.task.minibatch), pacer)
                                for i, layer in enumerate(layers)]))
    opt = optimizer(model.parameters(), job.lr)
    snaps = {0: (0.0, initial_weights(layers, 0))}
    steps = 0
    timer = gloo_runs.StepClock(job, rank)
    timer.start()
    while True:
        x, y = stream[steps * world + rank]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        steps += 1
        now, stop, snap = timer.after_step()
        if snap and rank == 0:
            snaps[len(snaps)] = (now, initial_weights(layers, 0))
        if stop:
            break
    wall = time.perf_counter() - timer.t0
    pad, over = pacer_report(pacer, wall)
    ranks = gather_results({"rank": rank, "device": dm.devices[rank][0], "type": dtype, "wall_s": wall,
                            "pad_frac": pad, "overrun_s": over, "loss": float(loss)})
    if rank != 0:
        return None
    snapshots.save(job.snapshots, snapshots.merge([snaps]))
    return {"system": "ddp", "steps": steps, "samples": steps * world * job.task.minibatch,
            "wall_s": max(r["wall_s"] for r in ranks), "ranks": ranks,
            "note": f"{world} ranks x 1 minibatch of {job.task.minibatch} per step"}


if __name__ == "__main__":
    gloo_runs.main(train, "ddp", sys.argv[1], sys.argv[2])
