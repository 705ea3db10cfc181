"""Plain PyTorch beside hetpipe for the examples: the same model copy, data order and optimizer
trained in one process, and a table of both runs' losses at the same samples."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable, Dict, Iterable, List, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from hetpipe import Planning, Reporting, Runtime

StepLoss = Callable[[nn.Module, Any, Any], torch.Tensor]


def sample_order(losses: Dict[int, Dict[int, float]], per_epoch: int) -> List[float]:
    """hetpipe's per-minibatch losses in the data's order: VW ``v``'s ``k``-th minibatch is minibatch
    ``(k % per_vw) * V + v`` of epoch ``k // per_vw`` (hetpipe.stage.feed's sharding)."""
    num_vws = len(losses)
    per_vw = per_epoch // num_vws
    placed = {}
    for vw, per in losses.items():
        for k, loss in per.items():
            placed[(k // per_vw) * per_vw * num_vws + (k % per_vw) * num_vws + vw] = loss
    return [placed[i] for i in sorted(placed)]


def train_plain(model: nn.Module, step_loss: StepLoss, optimizer: Callable, data: Sequence[Tuple[Any, Any]],
                epochs: int, num_vws: int) -> Tuple[List[float], float]:
    """Per-minibatch losses and samples/s of plain PyTorch on the minibatches hetpipe trains (each
    epoch's first ``len(data) // num_vws * num_vws``), in the same order."""
    torch.set_num_threads(1)
    opt = optimizer(model.parameters())
    used = len(data) // num_vws * num_vws
    model.train()
    losses, samples, t0 = [], 0, time.perf_counter()
    for _ in range(epochs):
        for inputs, target in data[:used]:
            opt.zero_grad()
            loss = step_loss(model, inputs, target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            samples += len(target)
    return losses, samples / (time.perf_counter() - t0)


def held_out(model: nn.Module, step_loss: StepLoss, data: Iterable[Tuple[Any, Any]]) -> float:
    """Mean loss over held-out minibatches, in eval mode."""
    model.eval()
    with torch.no_grad():
        return float(np.mean([step_loss(model, x, y).item() for x, y in data]))


def table(rows: List[Tuple[str, str, str]]) -> str:
    width = max(len(r[0]) for r in rows)
    lines = [f"{'':{width}}  {'plain PyTorch':>14}  {'hetpipe':>14}"]
    lines += [f"{a:{width}}  {b:>14}  {c:>14}" for a, b, c in rows]
    return "\n".join(lines)


def report(name: str, plain: List[float], ours: List[float], batch: int, held: Tuple[float, float],
           rates: Tuple[float, float], emulated: bool, windows: int = 4) -> str:
    """The comparison table: mean training loss per window of samples, held-out loss, samples/s."""
    n = min(len(plain), len(ours))
    rows = []
    for w in range(windows):
        a, b = w * n // windows, (w + 1) * n // windows
        rows.append((f"train loss, samples {a * batch}-{b * batch}", f"{np.mean(plain[a:b]):.4f}",
                     f"{np.mean(ours[a:b]):.4f}"))
    rows.append(("held-out loss", f"{held[0]:.4f}", f"{held[1]:.4f}"))
    rows.append((f"samples/s ({'emulated devices' if emulated else 'real devices'} for hetpipe)",
                 f"{rates[0]:.0f}", f"{rates[1]:.0f}"))
    return f"{name}: {n * batch} samples each\n" + table(rows)


def result_line(plain: List[float], ours: List[float], held: Tuple[float, float]) -> dict:
    """The figures the end-to-end test reads (printed as ``RESULT {json}``)."""
    n = min(len(plain), len(ours))
    q = max(1, n // 4)
    return {"plain_last": float(np.mean(plain[n - q:n])), "hetpipe_last": float(np.mean(ours[n - q:n])),
            "plain_first": float(np.mean(plain[:q])), "hetpipe_first": float(np.mean(ours[:q])),
            "plain_held_out": held[0], "hetpipe_held_out": held[1], "minibatches": n,
            "plain": plain[:n], "hetpipe": ours[:n]}


def add_run_options(p: argparse.ArgumentParser, epochs: int) -> None:
    """The examples' common options: how hetpipe runs, and for how long."""
    p.add_argument("--epochs", type=int, default=epochs)
    p.add_argument("--nm", type=int, default=2, help="minibatches in flight per VW")
    p.add_argument("--d", type=int, default=0, help="WSP staleness bound")
    p.add_argument("--policy", default="auto", help="VW formation policy when planning")
    p.add_argument("--plan", help="a plan JSON to run instead of planning on the cpu-emulated preset")
    p.add_argument("--emulation-scale", type=float, default=1.0, help="multiply emulated device times")


def run_options(args: argparse.Namespace) -> Dict[str, Any]:
    """Trainer keyword arguments from :func:`add_run_options`' options."""
    return {"plan": args.plan, "epochs": args.epochs,
            "planning": Planning(cluster="cpu-emulated", policy=args.policy, nm=args.nm, d=args.d),
            "runtime": Runtime(emulation_scale=args.emulation_scale), "reporting": Reporting(progress=False)}


def finish(name: str, result: Any, model: nn.Module, plain_model: nn.Module, step_loss: StepLoss,
           optimizer: Callable, train: Sequence, test: Sequence, epochs: int, batch: int) -> None:
    """On rank 0, after hetpipe's run: train ``plain_model`` (the untouched copy) on the same
    minibatches, then print the table and a ``RESULT {json}`` line."""
    if result.rank != 0:
        return
    ours = sample_order(result.losses, len(train))
    plain, plain_rate = train_plain(plain_model, step_loss, optimizer, train, epochs, len(result.plan.virtual_workers))
    held = (held_out(plain_model, step_loss, test), held_out(model, step_loss, test))
    print(report(name, plain, ours, batch, held, (plain_rate, result.samples_per_s), result.emulated))
    print("RESULT " + json.dumps(result_line(plain, ours, held)), flush=True)
