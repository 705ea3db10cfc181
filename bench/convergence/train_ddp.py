"""DDP (gloo) on emulated devices, trained for a wall-clock budget; rank 0 records the weights.

Three systems run here. Plain DDP: one rank per device, one minibatch per rank per step (the
per-device batch of the HetPipe paper's data-parallel baseline). DDP on the fastest devices: the
same on the ranks of ``job.devices`` only (rank ``r`` on device ``job.devices[r]``). Heterogeneity-aware
data parallelism: rank ``r`` takes ``job.windows[r]`` windows per step (proportional to its device's
speed) and is padded to its device type's time for that many windows (``DeviceModel.scaled_times``:
per-window linear); each rank backpropagates ``baselines.weighted_loss``, so the update is the
gradient of the mean loss over all the step's windows, whatever the shares.

A step takes the next ``sum(windows)`` windows of the stream in order (``sum(windows) / minibatch``
minibatches), rank ``r`` the ``r``-th share of them: with equal shares, rank ``r`` of step ``k`` takes
minibatch ``k * world + r``. Every layer is padded to its device type's time (bench/e2e's
``Emulated``). After each step rank 0 decides — and broadcasts — whether the budget is spent and
whether the weights are due for a snapshot (``gloo_runs.StepClock``); that broadcast of two numbers is
the only addition to DDP's own per-step synchronisation.
"""

from __future__ import annotations

import sys
import time
from typing import List, Optional

from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gloo_runs
import snapshots
from baselines import weighted_loss
from devices import DeviceModel
from emulate import Emulated, pacer_report
from hetpipe.model.weights import initial_weights
from hetpipe.stage.pacer import Pacer
from job import Job
from mpi_env import gather_results
from task import MinibatchStream, build_layers, corpus, loss_fn, optimizer


def shares(job: Job, world: int) -> List[int]:
    """Windows per rank per step: ``job.windows``, or one minibatch each."""
    windows = list(job.windows) or [job.task.minibatch] * world
    if len(windows) != world or min(windows) < 1 or sum(windows) % job.task.minibatch:
        raise ValueError(f"ddp: windows {windows} for {world} ranks (each >= 1, a whole number of minibatches "
                         f"of {job.task.minibatch} in all)")
    return windows


def train(job: Job, rank: int, world: int, dm: DeviceModel) -> Optional[dict]:
    """One run; returns its result on rank 0 (None elsewhere) after writing its snapshots."""
    text, _, _ = corpus(job.task)
    stream = MinibatchStream(text, job.task, job.seed, count=0)
    device = job.devices[rank] if job.devices else rank
    dtype = dm.devices[device][1]
    windows = shares(job, world)
    total = sum(windows)
    pacer = Pacer(1.0)
    layers = build_layers(job.task, job.seed)
    model = DDP(nn.Sequential(*[Emulated(layer, *dm.scaled_times(dtype, [i], windows[rank]), pacer)
                                for i, layer in enumerate(layers)]))
    opt = optimizer(model.parameters(), job.lr)
    snaps = {0: (0.0, initial_weights(layers, 0))}
    snap_steps = [0]                    # optimizer steps taken at each snapshot (its index)
    steps = 0
    timer = gloo_runs.StepClock(job, rank)
    timer.start()
    while True:
        x, y = stream.windows(steps * total + sum(windows[:rank]), windows[rank])
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        weighted_loss(loss, windows[rank], total, world).backward()
        opt.step()
        steps += 1
        now, stop, snap = timer.after_step()
        if snap and rank == 0:
            snaps[len(snaps)] = (now, initial_weights(layers, 0))
            snap_steps.append(steps)
        if stop:
            break
    wall = time.perf_counter() - timer.t0
    pad, over = pacer_report(pacer, wall)
    ranks = gather_results({"rank": rank, "device": dm.devices[device][0], "type": dtype, "wall_s": wall,
                            "windows": windows[rank], "pad_frac": pad, "overrun_s": over, "loss": float(loss)})
    if rank != 0:
        return None
    snapshots.save(job.snapshots, snapshots.merge([snaps]))
    note = (f"{world} ranks x 1 minibatch of {job.task.minibatch} per step" if not job.windows else
            f"{world} ranks, windows per step {windows} (loss weighted by share)")
    if job.devices:
        note += f" on devices {[dm.devices[d][0] for d in job.devices]}"
    return {"system": job.system, "steps": steps, "samples": steps * total, "snapshot_steps": snap_steps,
            "wall_s": max(r["wall_s"] for r in ranks), "ranks": ranks, "note": note}


if __name__ == "__main__":
    gloo_runs.main(train, "ddp", sys.argv[1], sys.argv[2])
