"""Multi-process runs against the single-process replay of the same schedule, several configurations
per launch. Prints one ``RESULT {json}`` line per configuration (from the plan's rank 0).

Usage: mpiexec -n N python equal_replay.py '[{"cuts": [3], "nm": 2, "d": 0}, ...]'

Optional keys: ``shards``, ``epochs``, ``plain`` (also compare with plain PyTorch), ``recompute``
(layers each stage recomputes) and ``split`` (split start-up minibatches); with either of the last
two the replay is also compared with the replay of the plain plan and schedule; ``copy_stream``
(stage-to-stage tensors through the copy stream in the multi-process run; the replay copies inline);
``precision`` ("bf16": autocast stages, bfloat16 on the wire, in both the run and the replay); ``clip``
(clip_grad_norm: the VW's stages exchange gradient-norm shares) and ``lr_step`` (a StepLR schedule).
"""

import json
import sys

import numpy as np
import torch
from mpi4py import MPI

from common import cross_entropy, mlp, one_vw_plan, sgd, split_world, synthetic, with_recompute
from hetpipe.run.trainer import Trainer
from hetpipe.run.config import Numerics, Planning, Reporting, Runtime


def main() -> int:
    configs = json.loads(sys.argv[1])
    ok = True
    for cfg in configs:
        base = one_vw_plan(cfg["cuts"], cfg["nm"], cfg["d"], shards=cfg.get("shards", 1))
        plan = with_recompute(base, cfg["recompute"]) if "recompute" in cfg else base
        split = cfg.get("split", 0)
        epochs = cfg.get("epochs", 2)
        sub = split_world(plan.num_ranks)
        if sub is None:
            MPI.COMM_WORLD.Barrier()
            continue
        options = {"clip_grad_norm": cfg.get("clip"),
                   "lr_scheduler": (lambda o, k=cfg["lr_step"]: torch.optim.lr_scheduler.StepLR(o, k, 0.5))
                   if cfg.get("lr_step") else None}
        run = Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=plan, epochs=epochs,
                      planning=Planning(split_startup=split), numerics=Numerics(precision=cfg.get("precision")),
                      reporting=Reporting(progress=False),
                      runtime=Runtime(copy_stream=cfg.get("copy_stream"), comm=sub), **options).fit()
        if sub.Get_rank() == 0:
            ref = Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=plan, epochs=epochs,
                          planning=Planning(split_startup=split), numerics=Numerics(precision=cfg.get("precision")),
                          **options).replay()
            same_losses = run.losses == ref.losses
            same_weights = sorted(run.weights) == sorted(ref.weights) and all(
                torch.equal(torch.from_numpy(run.weights[l]), torch.from_numpy(ref.weights[l])) for l in ref.weights)
            moved = any(not np.array_equal(run.weights[l], w0) for l, w0 in _initial().items())
            res = {**cfg, "losses_equal": same_losses, "weights_equal": same_weights, "trained": moved,
                   "minibatches": len(run.losses[0])}
            ok = ok and same_losses and same_weights and moved
            if plan is not base or split:
                unmodified = Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=base, epochs=epochs).replay()
                res["unmodified_max_diff"] = _max_diff(ref, unmodified)
                ok = ok and res["unmodified_max_diff"] <= (1e-6 if split else 0.0)
            if cfg.get("precision"):
                fp32 = Trainer(mlp(), cross_entropy, sgd(), synthetic(), plan=plan, epochs=epochs,
                               numerics=Numerics(precision="fp32")).replay()
                res["plan_precision"] = run.plan.precision
                res["fp32_max_diff"] = _max_diff(run, fp32)
            if cfg.get("plain"):
                res["plain_max_diff"] = _plain_max_diff(run, cfg.get("epochs", 2))
            print("RESULT " + json.dumps(res), flush=True)
        sub.Free()
        MPI.COMM_WORLD.Barrier()
    return 0 if ok else 1


def _max_diff(a, b) -> float:
    """Largest |difference| between two results' losses and final weights."""
    diff = max(abs(a.losses[0][p] - b.losses[0][p]) for p in b.losses[0])
    return max(diff, *(float(np.abs(a.weights[l] - b.weights[l]).max(initial=0.0)) for l in b.weights))


def _plain_max_diff(run, epochs: int) -> float:
    """Largest |difference| between the run's losses and weights and plain PyTorch training (one device)."""
    model = mlp()
    opt = sgd()(model.parameters())
    data = synthetic()
    losses = []
    for e in range(epochs):
        data.set_epoch(e)
        for x, y in data:
            opt.zero_grad()
            loss = cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss))
    diff = max(abs(a - b) for a, b in zip(losses, [v for _, v in sorted(run.losses[0].items())]))
    for l, layer in enumerate(model):
        ps = [p.detach().reshape(-1) for p in layer.parameters()]
        if ps:
            diff = max(diff, float((torch.cat(ps) - torch.from_numpy(run.weights[l])).abs().max()))
    return diff


def _initial():
    from hetpipe.model.weights import initial_weights
    layers = list(mlp())
    return initial_weights(layers, 0)


if __name__ == "__main__":
    sys.exit(main())
