"""Baseline (b): torch.distributed.pipelining (1F1B or GPipe), one pipeline, uniform layer split.

Rank r is stage r on device r of the device model (cluster order) and owns layers
``uniform_split(depth, world)[r]``. Each micro-batch is one minibatch, so the stage pads forward and
backward to the stage's profiled minibatch times on its device type. One step = ``microbatches``
micro-batches with the schedule's flush at the end. Rank 0 writes samples/s over the timed steps.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from config import RunConfig, write_result
from devices import DeviceModel
from emulate import Emulated, pacer_report
from hetpipe.stage.pacer import Pacer
from model import build_layers, loss_fn, synthetic_batches
from mpi_env import gather_results, run_gloo
from split import uniform_split

SCHEDULES = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}


def main(cfg_path: str, out_path: str) -> None:
    cfg = RunConfig.load(cfg_path)
    run_gloo(lambda rank, world: run(cfg, out_path, rank, world))


def run(cfg: RunConfig, out_path: str, rank: int, world: int) -> None:
    dm = DeviceModel.load(cfg.device_model)
    if world != len(dm.devices):
        raise SystemExit(f"pipelining: {world} ranks for {len(dm.devices)} devices")
    mb = cfg.spec.minibatch
    start, stop = uniform_split(cfg.spec.depth, world)[rank]
    dtype = dm.devices[rank][1]
    pacer = Pacer(1.0)
    layers = build_layers(cfg.spec)[start:stop]
    module = Emulated(nn.Sequential(*layers), *dm.scaled_times(dtype, range(start, stop), mb), pacer)
    stage = PipelineStage(module, rank, world, torch.device("cpu"))
    schedule = SCHEDULES[cfg.pp_schedule](stage, cfg.microbatches, loss_fn=loss_fn)
    opt = torch.optim.SGD(module.parameters(), lr=0.01)
    data = synthetic_batches(cfg.spec, 2, mb * cfg.microbatches)

    def step(k: int) -> None:
        x, y = data[k % len(data)]
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            schedule.step(target=y)
        else:
            schedule.step()
        opt.step()

    for k in range(cfg.warmup):
        step(k)
    dist.barrier()
    pacer.padded_s = pacer.overrun_s = 0.0
    t0 = time.perf_counter()
    for k in range(cfg.steps):
        step(cfg.warmup + k)
    dist.barrier()
    wall = time.perf_counter() - t0
    pad, over = pacer_report(pacer, wall)
    ranks = gather_results({"rank": rank, "device": dm.devices[rank][0], "type": dtype, "wall_s": wall,
                            "layers": [start, stop], "pad_frac": pad, "overrun_s": over})
    if rank == 0:
        wall = max(r["wall_s"] for r in ranks)
        write_result(out_path, {"system": f"pipelining-{cfg.pp_schedule}",
                                "samples_per_s": cfg.steps * cfg.microbatches * mb / wall,
                                "wall_s": wall, "ranks": ranks,
                                "note": f"uniform split {[r['layers'] for r in ranks]}, {cfg.microbatches} x {mb}"})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
