"""Baseline (a): data parallelism with PyTorch DDP over gloo, one rank per emulated device.

Every rank holds the whole model and processes an equal share ``global_batch / world`` of each step
(DDP's standard split), each layer padded to its device type's time for that share. DDP's gradient
buckets all-reduce during the backward padding. The slowest device type gates every step.
Rank 0 writes samples/s over the timed steps and each rank's padding fraction and overrun.
"""

from __future__ import annotations

import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from config import RunConfig, write_result
from devices import DeviceModel
from emulate import Emulated, pacer_report
from hetpipe.stage.pacer import Pacer
from model import build_layers, loss_fn, synthetic_batches
from mpi_env import gather_results, run_gloo


def main(cfg_path: str, out_path: str) -> None:
    cfg = RunConfig.load(cfg_path)
    run_gloo(lambda rank, world: run(cfg, out_path, rank, world))


def run(cfg: RunConfig, out_path: str, rank: int, world: int) -> None:
    dm = DeviceModel.load(cfg.device_model)
    if world != len(dm.devices):
        raise SystemExit(f"ddp: {world} ranks for {len(dm.devices)} devices")
    if cfg.global_batch % world:
        raise SystemExit(f"ddp: global batch {cfg.global_batch} does not split evenly over {world} ranks")
    share = cfg.global_batch // world
    dtype = dm.devices[rank][1]
    pacer = Pacer(1.0)
    layers = [Emulated(layer, *dm.scaled_times(dtype, [i], share), pacer)
              for i, layer in enumerate(build_layers(cfg.spec))]
    model = DDP(nn.Sequential(*layers))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = synthetic_batches(cfg.spec, 4, share, seed=100 + rank)

    def step(k: int) -> float:
        x, y = data[k % len(data)]
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(model(x), y)
        loss.backward()
        opt.step()
        return loss.item()

    for k in range(cfg.warmup):
        step(k)
    dist.barrier()
    pacer.padded_s = pacer.overrun_s = 0.0
    t0 = time.perf_counter()
    for k in range(cfg.steps):
        loss = step(cfg.warmup + k)
    dist.barrier()
    wall = time.perf_counter() - t0
    pad, over = pacer_report(pacer, wall)
    ranks = gather_results({"rank": rank, "device": dm.devices[rank][0], "type": dtype, "wall_s": wall,
                            "pad_frac": pad, "overrun_s": over, "loss": loss})
    if rank == 0:
        wall = max(r["wall_s"] for r in ranks)
        write_result(out_path, {"system": "ddp", "samples_per_s": cfg.steps * cfg.global_batch / wall,
                                "wall_s": wall, "ranks": ranks,
                                "note": f"{world} ranks x {share} samples/step"})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
