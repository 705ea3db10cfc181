"""A run for the checkpoint tests, started with `hetpipe launch`. Usage: ckpt_run.py OUT CONFIG_JSON

CONFIG keys: ``vws`` (1 or 2 VWs; VW v is stages on emulated devices n<v>.g<k> split at ``cuts``),
``nm``, ``d``, ``waves`` (each VW's minibatches per wave; 0: ``nm``), ``epochs``, ``minibatches`` (per epoch), ``shuffle``, ``momentum``, ``time`` (emulated
seconds per forward, twice per backward: slow enough to be killed mid-run), ``metrics``, ``tensorboard``, ``lr_step``
(a StepLR halving the learning rate every ``lr_step`` minibatches: its state must survive a resume), ``groups``
(AdamW with two parameter groups built by the model's parameter names, weight decay on the weights only,
instead of SGD: their state must come back to the right parameters), ``one_cycle`` (a OneCycleLR over the
whole run, whose state is nested dicts), ``waves_log`` (a file a callback appends each WaveInfo's wave, global
clock and step to, as JSON lines), ``outer``
(the PSRule's outer optimizer fields, e.g. {"outer": "nesterov"}: its state must survive a resume). Checkpoints
and resuming come from the launcher (--checkpoint-dir, --resume, --max-restarts). Rank 0 writes
OUT/result.json (losses, samples, what it resumed from) and OUT/weights.npz (final global weights)."""

import json
import sys
from pathlib import Path

import torch

from common import cross_entropy, mlp, save_run, sgd
from hetpipe import named_params
from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan
from hetpipe.run.data import Batches
from hetpipe.run.trainer import Trainer
from hetpipe.run.config import Numerics, PSRule, Reporting, Runtime


def plan_of(cfg) -> Plan:
    vws = []
    for v in range(cfg.get("vws", 1)):
        bounds = [0, *cfg.get("cuts", []), 6]
        t = cfg.get("time", 0.0)
        stages = tuple(StagePlan(f"n{v}.g{k}", "emulated", a, b, t, 2 * t) for k, (a, b) in enumerate(zip(bounds, bounds[1:])))
        vws.append(VirtualWorkerPlan(v, stages, nm=cfg.get("waves", [0] * cfg.get("vws", 1))[v]))
    return Plan(6, cfg["nm"], cfg["d"], "manual", tuple(vws), (ShardPlan(0, "n0", tuple(range(6))),))


def data_of(cfg) -> Batches:
    g = torch.Generator().manual_seed(1)
    n = 16 * cfg["minibatches"]
    x = torch.randn(n, 64, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return Batches(x, y, 16, seed=1, shuffle=cfg.get("shuffle", True))


def optimizer_of(cfg):
    if not cfg.get("groups"):
        return sgd(momentum=cfg.get("momentum", 0.9))

    @named_params
    def adamw(named):
        named = list(named)
        return torch.optim.AdamW([{"params": [p for n, p in named if n.endswith("weight")], "weight_decay": 0.1},
                                  {"params": [p for n, p in named if not n.endswith("weight")], "weight_decay": 0.0}],
                                 lr=0.01)
    return adamw


def scheduler_of(cfg):
    step = cfg.get("lr_step")
    if step:
        return lambda opt: torch.optim.lr_scheduler.StepLR(opt, step, gamma=0.5)
    if cfg.get("one_cycle"):
        steps = cfg["epochs"] * cfg["minibatches"] // cfg.get("vws", 1)
        return lambda opt: torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.02, total_steps=steps + 1)
    return None


class WavesLog:
    """A callback writing what it is told at each wave's end: a resumed run must count on from the cut."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_wave_end(self, info) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps({"wave": info.wave, "global_clock": info.global_clock, "step": info.step}) + "\n")


def main() -> int:
    out, cfg = Path(sys.argv[1]), json.loads(sys.argv[2])
    torch.manual_seed(0)
    scheduler = scheduler_of(cfg)
    run = Trainer(mlp(), cross_entropy, optimizer_of(cfg), data_of(cfg), plan=plan_of(cfg),
                  epochs=cfg["epochs"], numerics=Numerics(lr_scheduler=scheduler),
                  reporting=Reporting(progress=False, metrics=cfg.get("metrics"), tensorboard=cfg.get("tensorboard"),
                                      callbacks=[WavesLog(cfg["waves_log"])] if cfg.get("waves_log") else []),
                  runtime=Runtime(emulate=True), ps=PSRule(**cfg.get("outer", {}))).fit()
    if run.rank == 0:
        save_run(out, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
