"""A one-VW multi-process run whose stages live on ``cuda:0`` (every rank shares the one device), or
stage k on ``cuda:k`` with ``"gpu_per_stage": true``, against the single-process replay of the same plan
on the CPU. Prints one ``RESULT {json}`` line (with the transport the run reported).

Usage: mpiexec -n N python on_cuda.py '{"cuts": [3], "nm": 2, "d": 0, "copy_stream": true}'
(optional ``transport``: force a backend)
"""

import dataclasses
import json
import sys

import numpy as np
import torch

from common import cross_entropy, mlp, one_vw_plan, sgd, synthetic
from hetpipe.run.trainer import Trainer
from hetpipe.run.config import Reporting, Runtime


def main() -> int:
    cfg = json.loads(sys.argv[1])
    plan = one_vw_plan(cfg["cuts"], cfg["nm"], cfg["d"], shards=cfg.get("shards", 1), device="cuda:0")
    if cfg.get("gpu_per_stage"):
        vw = plan.virtual_workers[0]
        stages = tuple(dataclasses.replace(st, device=f"cuda:{k}") for k, st in enumerate(vw.stages))
        plan = dataclasses.replace(plan, virtual_workers=(dataclasses.replace(vw, stages=stages),))
    run = Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=plan, epochs=2,
                  reporting=Reporting(progress=False),
                  runtime=Runtime(copy_stream=cfg.get("copy_stream"), transport=cfg.get("transport"))).fit()
    if run.rank != 0:
        return 0
    cpu = one_vw_plan(cfg["cuts"], cfg["nm"], cfg["d"], shards=cfg.get("shards", 1))
    ref = Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=cpu, epochs=2).replay()
    loss_diff = max(abs(run.losses[0][p] - ref.losses[0][p]) for p in ref.losses[0])
    weight_diff = max(float(np.abs(run.weights[l] - w).max(initial=0.0)) for l, w in ref.weights.items())
    res = {**cfg, "minibatches": len(run.losses[0]), "expected": len(ref.losses[0]),
           "loss_diff": loss_diff, "weight_diff": weight_diff,
           "trained": ref.losses[0][0] != ref.losses[0][max(ref.losses[0])],
           "cuda": torch.cuda.is_available(), "transport": run.transport}
    print("RESULT " + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
