"""The physical limit: each device type trains the whole model alone; the limit sums over devices.

Runs in one process (no other rank competes for the host): for each device type of the device
model, train the whole model on minibatches padded layer by layer to that type's times, time the
steady-state steps, and report samples/s per type and the sum over the cluster's devices.
"""

from __future__ import annotations

import sys
import time

import torch
from torch import nn

from config import RunConfig, write_result
from devices import DeviceModel
from emulate import Emulated, pacer_report
from hetpipe.stage.pacer import Pacer
from model import build_layers, loss_fn, synthetic_batches


def measure_type(cfg: RunConfig, dm: DeviceModel, dtype: str) -> dict:
    mb = cfg.spec.minibatch
    pacer = Pacer(1.0)
    model = nn.Sequential(*[Emulated(layer, *dm.scaled_times(dtype, [i], mb), pacer)
                            for i, layer in enumerate(build_layers(cfg.spec))])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    data = synthetic_batches(cfg.spec, 2, mb)

    def step(k: int) -> None:
        x, y = data[k % len(data)]
        opt.zero_grad(set_to_none=True)
        loss_fn(model(x), y).backward()
        opt.step()

    for k in range(cfg.warmup):
        step(k)
    pacer.padded_s = pacer.overrun_s = 0.0
    t0 = time.perf_counter()
    for k in range(cfg.steps):
        step(k)
    wall = time.perf_counter() - t0
    pad, over = pacer_report(pacer, wall)
    return {"type": dtype, "samples_per_s": cfg.steps * mb / wall, "model_samples_per_s": dm.standalone_throughput(dtype),
            "wall_s": wall, "pad_frac": pad, "overrun_s": over}


def main(cfg_path: str, out_path: str) -> None:
    cfg = RunConfig.load(cfg_path)
    torch.set_num_threads(1)
    dm = DeviceModel.load(cfg.device_model)
    per_type = {t: measure_type(cfg, dm, t) for t in dm.types}
    total = sum(per_type[t]["samples_per_s"] for _, t in dm.devices)
    write_result(out_path, {"system": "limit", "samples_per_s": total, "per_type": per_type,
                            "note": " + ".join(f"{sum(1 for _, u in dm.devices if u == t)}x{t}" for t in dm.types)})


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
