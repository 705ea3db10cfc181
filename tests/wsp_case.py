"""The small WSP case that tests/wsp_oracle.py is checked on: two VWs (two stages and one), Nm = 1, a
6-layer MLP, SGD, D >= 1; the same model, data and plan in the unit tests (the replay), in an mpiexec
run (tests/mpi/scripts/wsp_oracle_run.py) and in the record of such a run kept in tests/unit/golden."""

from __future__ import annotations

from typing import Any, Dict, Iterable, List, Mapping, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan
from hetpipe.run.trainer import Trainer
from wsp_oracle import PullKey, flat, wsp_oracle
from hetpipe.run.config import Reporting, Runtime

NUM_LAYERS = 6
WAVES = 8
LR = 0.1
VW_CUTS = ([3], [])                     # VW 0: layers 0-2 and 3-5; VW 1: one stage
# Per VW, an emulated stage's forward time (its backward takes twice as long) in the mpiexec run:
# VW 1 takes three times as long per wave, so VW 0 runs ahead to the staleness bound and pulls stale versions.
FWD_S = (0.002, 0.012)
# The configurations checked, by name: staleness bound, PS shards, aggregation, SGD momentum.
CONFIGS = {
    "d1": {"d": 1, "shards": 1, "aggregate": "sum", "momentum": 0.0},
    "d2": {"d": 2, "shards": 2, "aggregate": "mean", "momentum": 0.9},
}

# The runtime against the oracle: float32 computed in another order (fused steps, flat vectors).
TOL = 1e-5

Batch = Tuple[torch.Tensor, torch.Tensor]


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Linear(8, 4))


def batches() -> List[List[Batch]]:
    """Per VW, one minibatch per wave (Nm = 1)."""
    g = torch.Generator().manual_seed(1)
    return [[(torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)) for _ in range(WAVES)]
            for _ in VW_CUTS]


def vw_bounds() -> List[List[Tuple[int, int]]]:
    """Per VW, its stages' (start, stop) layer ranges."""
    out = []
    for cuts in VW_CUTS:
        bounds = [0, *cuts, NUM_LAYERS]
        out.append(list(zip(bounds, bounds[1:])))
    return out


def shard_of(shards: int) -> Dict[int, int]:
    """Layer -> PS shard: the layers dealt round-robin."""
    return {layer: layer % shards for layer in range(NUM_LAYERS)}


def plan(d: int, shards: int, aggregate: str) -> Plan:
    vws = tuple(VirtualWorkerPlan(v, tuple(StagePlan("cpu", "cpu", a, b, FWD_S[v], 2 * FWD_S[v]) for a, b in stages))
                for v, stages in enumerate(vw_bounds()))
    owners = shard_of(shards)
    ps = tuple(ShardPlan(k, "n0", tuple(layer for layer in range(NUM_LAYERS) if owners[layer] == k))
               for k in range(shards))
    return Plan(NUM_LAYERS, 1, d, "manual", vws, ps, aggregate=aggregate)


def trainer(net: nn.Module, data: Sequence[Sequence[Batch]], run_plan: Plan, momentum: float, *,
            emulate: bool, comm: Any = None, record: Any = None) -> Trainer:
    """The one place these tests construct a Trainer: ``data[v]`` is VW ``v``'s minibatches (one epoch);
    ``emulate``, ``comm``, ``record``: how to run it."""
    return Trainer(net, nn.functional.cross_entropy,
                   lambda params: torch.optim.SGD(params, lr=LR, momentum=momentum),
                   lambda vw, num_vws, epoch: data[vw], plan=run_plan, epochs=1,
                   reporting=Reporting(progress=False, record=record), runtime=Runtime(emulate=emulate, comm=comm))


def versions(pulls: Iterable[Tuple[int, Tuple[int, ...]]]) -> Dict[PullKey, int]:
    """``(vw, stage, wave, shard) -> g`` from ``(shard, (vw, stage, wave, g, ...))`` pairs: the pulls a
    record (``ShardRecord.pulls``) or a shard log (``ShardLog.pulls``) lists."""
    out: Dict[PullKey, int] = {}
    for shard, (vw, stage, wave, g, *_) in pulls:
        key = (vw, stage, wave, shard)
        assert key not in out, f"the pull {key} was answered twice"
        out[key] = g
    return out


def check_against_spec(name: str, losses: Mapping[int, Mapping[int, float]], weights: Mapping[int, np.ndarray],
                       got: Mapping[PullKey, int], staleness: int) -> None:
    """The runtime's losses (every minibatch, each at its forward) and final global weights of
    configuration ``name`` equal the oracle's given the versions ``got`` its pulls got; the check is
    one that a run ignoring those versions fails. Some pull got a version ``staleness`` or more waves
    old (a live run's timing decides how far up to D it went)."""
    cfg = CONFIGS[name]
    data, owners = batches(), shard_of(cfg["shards"])

    def oracle(pull_versions: Mapping[PullKey, int]):
        return wsp_oracle(model(), vw_bounds(), owners, data, cfg["d"], cfg["aggregate"], LR, cfg["momentum"],
                          pull_versions)

    # Every stage pulled every wave >= 1 from each shard holding its parameters, no other.
    net = model()
    holders = {(v, s, owners[layer]) for v, stages in enumerate(vw_bounds()) for s, (a, b) in enumerate(stages)
               for layer in range(a, b) if list(net[layer].parameters())}
    assert sorted(got) == sorted((v, s, w, k) for v, s, k in holders for w in range(1, WAVES)), sorted(got)
    assert max(w - g for (_, _, w, _), g in got.items()) >= staleness, got
    want = oracle(got)
    assert sorted(losses) == sorted(want.losses) and all(sorted(losses[v]) == sorted(want.losses[v]) for v in losses)
    for v in want.losses:
        for p, loss in want.losses[v].items():
            assert abs(losses[v][p] - loss) <= TOL, (name, v, p, losses[v][p], loss)
    expected = flat(want.weights)
    assert sorted(weights) == list(range(NUM_LAYERS))
    for layer, w in enumerate(expected):
        np.testing.assert_allclose(weights[layer], w.numpy(), rtol=0, atol=TOL, err_msg=f"{name}: layer {layer}")
    # The versions matter: had every pull got the newest version (g = w), the weights would be far off.
    newest = flat(oracle({key: key[2] for key in got}).weights)
    assert max(float(np.abs(weights[layer] - w.numpy()).max(initial=0.0)) for layer, w in enumerate(newest)) \
        > 50 * TOL, name
