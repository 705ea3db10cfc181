"""Shared pieces of the MPI test scripts: a small seeded model, data, and hand-built plans."""

from __future__ import annotations

import dataclasses

from typing import Any, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan
from hetpipe.run.data import Batches


def mlp(seed: int = 0, width: int = 32) -> nn.Sequential:
    """A 6-layer MLP for 64 features and 10 classes, identical on every rank for one seed."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(64, width), nn.ReLU(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, width), nn.Linear(width, 10))


def synthetic(n: int = 128, batch: int = 16, seed: int = 1) -> Batches:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 64, generator=g)
    y = torch.randint(0, 10, (n,), generator=g)
    return Batches(x, y, batch, seed=seed)


def one_vw_plan(cuts: Sequence[int], nm: int, d: int, num_layers: int = 6, shards: int = 1,
                device: str = "cpu") -> Plan:
    """One VW whose stages split the layers at ``cuts``; ``shards`` PS shards own layers round-robin."""
    bounds = [0, *cuts, num_layers]
    stages = tuple(StagePlan(device, "cpu", a, b, 0.0, 0.0) for a, b in zip(bounds, bounds[1:]))
    return Plan(num_layers, nm, d, "manual", (VirtualWorkerPlan(0, stages),), _shards(num_layers, shards))


def two_vw_plan(cuts: Tuple[Sequence[int], Sequence[int]], times: Tuple[float, float], nm: int, d: int,
                num_layers: int = 6, shards: int = 1) -> Plan:
    """Two VWs of emulated devices; VW ``v``'s stages take ``times[v]`` s per forward (2x per backward)."""
    vws = []
    for v in range(2):
        bounds = [0, *cuts[v], num_layers]
        stages = tuple(StagePlan(f"n{v}.g{k}", f"emulated{v}", a, b, times[v], 2 * times[v])
                       for k, (a, b) in enumerate(zip(bounds, bounds[1:])))
        vws.append(VirtualWorkerPlan(v, stages))
    return Plan(num_layers, nm, d, "manual", tuple(vws), _shards(num_layers, shards))


def with_recompute(plan: Plan, layers_by_stage: Sequence[Sequence[int]]) -> Plan:
    """``plan`` with VW 0's stage ``s`` recomputing ``layers_by_stage[s]``."""
    vw = plan.virtual_workers[0]
    stages = tuple(dataclasses.replace(st, recompute=tuple(r)) for st, r in zip(vw.stages, layers_by_stage))
    return dataclasses.replace(plan, virtual_workers=(dataclasses.replace(vw, stages=stages),
                                                      *plan.virtual_workers[1:]))


def _shards(num_layers: int, shards: int) -> Tuple[ShardPlan, ...]:
    return tuple(ShardPlan(k, "n0", tuple(range(k, num_layers, shards))) for k in range(shards))


class Tagged:
    """Minibatches that are their own (epoch, index), reshuffled per epoch like a real loader; ``order(e)``
    is epoch ``e``'s item order."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, e: int) -> None:
        self.epoch = e

    def __len__(self) -> int:
        return self.n

    def order(self, epoch: int):
        import random

        order = list(range(self.n))
        random.Random(epoch).shuffle(order)
        return order

    def __iter__(self):
        return iter([((self.epoch, i), None) for i in self.order(self.epoch)])


def sgd(lr: float = 0.05, momentum: float = 0.9):
    return lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum)


def cross_entropy(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def split_world(n: int, comm=None) -> Optional[object]:
    """A communicator of the first ``n`` world ranks (None on the others); collective on the world."""
    from mpi4py import MPI

    world = comm or MPI.COMM_WORLD
    sub = world.Split(0 if world.Get_rank() < n else MPI.UNDEFINED, world.Get_rank())
    return None if sub == MPI.COMM_NULL else sub


def same_outcome(a: Any, b: Any) -> bool:
    """Bitwise equal losses, final weights and synced buffers of two runs (TrainResult/ReplayResult)."""
    return (a.losses == b.losses and sorted(a.weights) == sorted(b.weights)
            and all(np.array_equal(a.weights[l], b.weights[l]) for l in a.weights)
            and all(np.array_equal(a.buffers[l], b.buffers[l]) for l in a.buffers))


def save_run(out, run) -> None:
    """Rank 0's record of a run for the checkpoint tests: OUT/weights.npz (final global weights) and
    OUT/result.json (losses, samples, VWs, plan, and what it resumed from)."""
    import json
    from pathlib import Path

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / "weights.npz", **{str(l): w for l, w in run.weights.items()})
    by_vw = lambda losses: {str(vw): {str(p): v for p, v in per.items()} for vw, per in losses.items()}  # noqa: E731
    resumed = {**{k: v for k, v in run.resumed.items() if k != "losses"}, "losses": by_vw(run.resumed.get("losses", {}))}
    (out / "result.json").write_text(json.dumps({"losses": by_vw(run.losses), "samples": run.samples,
                                                 "vws": len(run.plan.virtual_workers), "plan": run.plan.to_dict(),
                                                 "resumed": resumed}))
