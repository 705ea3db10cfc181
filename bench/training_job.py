"""The training-job features against plain PyTorch on one process: how far hetpipe's numbers are.

Each row trains the same 6-layer MLP (seeded) on the same data with one feature on, twice: hetpipe's
single-process replay of one VW of three stages (Nm = 1, D = 0, so the pipeline is plain training;
PS shard included unless the row says otherwise) and the plain PyTorch recipe for that feature. It
prints the largest difference of the per-minibatch losses and of the final weights, beside the same
gap with the feature switched off in hetpipe (which shows that the feature, not noise, is what the
small gap measures). Devices: the host CPU (real, no emulation); no timing is taken.

    python bench/training_job.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Callable, Dict, List, Tuple

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))

from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan  # noqa: E402
from hetpipe.run.trainer import Trainer  # noqa: E402
from hetpipe import Numerics, Reporting

EPOCHS, BATCH, N = 2, 16, 128


def mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 32),
                         nn.Linear(32, 10))


def dataset() -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(N, 64, generator=g), torch.randint(0, 10, (N,), generator=g))


def plan(ps: bool = True) -> Plan:
    bounds = [0, 2, 4, 6]
    stages = tuple(StagePlan("cpu", "cpu", a, b, 0.0, 0.0) for a, b in zip(bounds, bounds[1:]))
    p = Plan(6, 1, 0, "manual", (VirtualWorkerPlan(0, stages),), (ShardPlan(0, "n0", tuple(range(6))),))
    return p if ps else dataclasses.replace(p, ps_shards=())


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def loader(epoch: int, seed: int = 0):
    ds = dataset()
    s = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=seed, drop_last=True)
    s.set_epoch(epoch)
    return DataLoader(ds, batch_size=BATCH, sampler=s)


def plain(step: Callable, setup: Callable = lambda m: {}) -> Tuple[List[float], nn.Module]:
    model = mlp()
    state = setup(model)
    losses = []
    for e in range(EPOCHS):
        for i, (x, y) in enumerate(loader(e)):
            losses.append(step(model, state, x, y, len(losses)))
    return losses, model


def sgd_step(model, state, x, y, k, clip=None, sched=None, accumulate=1, scaler=None):
    opt = state["opt"]
    if scaler is not None:
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
    else:
        loss = nn.functional.cross_entropy(model(x), y)
        (loss / accumulate).backward()
    if (k + 1) % accumulate == 0:
        if scaler is not None and clip is not None:
            scaler.unscale_(opt)
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if sched is not None:
            state["sched"].step()
        opt.zero_grad()
    return float(loss.detach())


def hetpipe(ps: bool = True, **kw) -> Tuple[List[float], nn.Module]:
    model = mlp()
    data = kw.pop("data", DataLoader(dataset(), batch_size=BATCH, shuffle=True, drop_last=True))
    r = Trainer(model, nn.functional.cross_entropy, kw.pop("optimizer", sgd), data, plan=plan(ps), epochs=EPOCHS,
                numerics=Numerics(seed=0, **kw.pop("numerics", {})), reporting=Reporting(progress=False), **kw).replay()
    return [v for _, v in sorted(r.losses[0].items())], model


def gaps(a: Tuple[List[float], nn.Module], b: Tuple[List[float], nn.Module]) -> Tuple[float, float]:
    loss = max(abs(x - y) for x, y in zip(a[0], b[0]))
    weight = max(float((p - q).detach().abs().max()) for p, q in zip(a[1].parameters(), b[1].parameters()))
    return loss, weight


def main() -> int:
    torch.set_num_threads(1)
    step_lr = lambda o: torch.optim.lr_scheduler.StepLR(o, 3, 0.5)  # noqa: E731
    with_opt: Callable[[nn.Module], Dict] = lambda m: {"opt": sgd(m.parameters())}  # noqa: E731

    def with_sched(m):
        opt = sgd(m.parameters())
        return {"opt": opt, "sched": step_lr(opt)}

    scaler: Dict[str, torch.amp.GradScaler] = {}

    def fp16_setup(m):
        scaler["s"] = torch.amp.GradScaler("cpu", init_scale=2.0 ** 40, growth_interval=3)
        return {"opt": sgd(m.parameters())}

    rows = [
        ("shuffled DataLoader (data path)", "DistributedSampler loop",
         plain(lambda m, s, x, y, k: sgd_step(m, s, x, y, k), with_opt), {}, None),
        ("lr_scheduler=StepLR", "plain loop + scheduler.step()",
         plain(lambda m, s, x, y, k: sgd_step(m, s, x, y, k, sched=True), with_sched),
         {"numerics": {"lr_scheduler": step_lr}}, {}),
        ("clip_grad_norm=0.3 (3 stages)", "clip_grad_norm_ on the whole model",
         plain(lambda m, s, x, y, k: sgd_step(m, s, x, y, k, clip=0.3), with_opt),
         {"numerics": {"clip_grad_norm": 0.3}}, {}),
        ("accumulate=4", "loss / 4, step every 4",
         plain(lambda m, s, x, y, k: sgd_step(m, s, x, y, k, accumulate=4), with_opt),
         {"numerics": {"accumulate": 4}}, {}),
        ("fp16 + loss scaling (no PS)", "autocast fp16 + GradScaler",
         plain(lambda m, s, x, y, k: sgd_step(m, s, x, y, k, scaler=scaler["s"]), fp16_setup),
         {"numerics": {"precision": "fp16", "loss_scale": {"init_scale": 2.0 ** 40, "growth_interval": 3}},
          "ps": False},
         {"ps": False}),
    ]
    print("hetpipe's training-job features against plain PyTorch, one process (hetpipe: replay of 1 VW x 3 stages, "
          "Nm = 1, D = 0); devices: host CPU, real, no emulation; model: 6-layer MLP, 16 minibatches of 16")
    head = f"{'feature':<34} | {'plain PyTorch reference':<36} | {'max |loss diff|':>15} | {'max |weight diff|':>17} " \
           f"| {'feature off: weight diff':>24}"
    print(head)
    print("-" * len(head))
    for name, ref_name, ref, kw, off in rows:
        kw = dict(kw)
        ps = kw.pop("ps", True)
        loss_gap, weight_gap = gaps(hetpipe(ps=ps, **kw), ref)
        off_gap = "-" if off is None else f"{gaps(hetpipe(ps=off.get('ps', True)), ref)[1]:.2e}"
        print(f"{name:<34} | {ref_name:<36} | {loss_gap:>15.2e} | {weight_gap:>17.2e} | {off_gap:>24}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
