"""WSP runs with D >= 1 under seeded random delays, recorded, then replayed in one process.

Several VWs of different speeds (random sleeps in the stages, drawn from a generator seeded per rank,
scaled per VW) reach real staleness. Rank 0 of each run replays it from its record and without, and
prints one ``RESULT {json}`` line per configuration.

Usage: mpiexec -n N python recorded_replay.py RUNDIR '[{"d": 1, "cuts": [[3], []], "shards": 2}, ...]'
(``cuts``: per VW, its stage boundaries; ``slow``: per VW, the largest sleep in s; optional ``nm``, ``epochs``, ``n``).
"""

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from mpi4py import MPI
from torch import nn

from common import cross_entropy, same_outcome, sgd, split_world, synthetic
from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan
from hetpipe.run.record import RunRecord
from hetpipe.run.trainer import Trainer
from hetpipe.run.config import Reporting, Runtime

NUM_LAYERS = 7


class Jittered(nn.Module):
    """``inner`` after a random sleep of up to ``scale[rank]`` seconds (only while ``on``)."""

    on = True
    scale: dict = {}

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.rng = np.random.default_rng(1234 + MPI.COMM_WORLD.Get_rank())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wait = self.scale.get(MPI.COMM_WORLD.Get_rank(), 0.0) if Jittered.on else 0.0
        if wait and x.device.type != "meta":
            time.sleep(float(self.rng.uniform(0.0, wait)))
        return self.inner(x)


def model() -> nn.Sequential:
    """7 layers, a BatchNorm among them (its running statistics are averaged at the PS); the two
    parameter-free activations sleep, so every stage of the cuts used below has one."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 32), Jittered(nn.ReLU()), nn.BatchNorm1d(32), nn.Linear(32, 32),
                         Jittered(nn.Tanh()), nn.Linear(32, 32), nn.Linear(32, 10))


def plan_of(cfg: dict) -> Plan:
    vws = []
    for v, cuts in enumerate(cfg["cuts"]):
        bounds = [0, *cuts, NUM_LAYERS]
        vws.append(VirtualWorkerPlan(v, tuple(StagePlan("cpu", "cpu", a, b, 0.0, 0.0)
                                              for a, b in zip(bounds, bounds[1:])),
                                     nm=cfg.get("waves", [0] * len(cfg["cuts"]))[v]))
    k = cfg.get("shards", 1)
    shards = tuple(ShardPlan(i, "n0", tuple(range(i, NUM_LAYERS, k))) for i in range(k))
    return Plan(NUM_LAYERS, cfg.get("nm", 2), cfg["d"], "manual", tuple(vws), shards)


def max_diff(a: Any, b: Any) -> float:
    diff = max(abs(a.losses[v][p] - b.losses[v][p]) for v in a.losses for p in a.losses[v])
    return max(diff, *(float(np.abs(a.weights[l] - b.weights[l]).max(initial=0.0)) for l in a.weights))


def check(cfg: dict, run: Any, record: RunRecord, replayed: Any, plain: Any) -> dict:
    """What the test asserts, from the run, its record, and the replays with and without it."""
    d = cfg["d"]
    pulls = [p for s in record.shards.values() for p in s.pulls]
    clocks = [c for s in record.shards.values() for c in s.clocks]
    waves = len(record.shards[0].applied)
    return {
        **cfg,
        "waves": waves,
        "pulls": len(pulls),
        # Every pull: 0 <= clock_vw - g <= D + 1 (the VW's clock at the shard against the version it
        # got), and the version obeys the staleness gate w - D <= g <= w.
        "pull_bound_ok": all(0 <= cv - g <= d + 1 and w - d <= g <= w for _, _, w, g, cv in pulls),
        "clock_bound_ok": all(0 <= cv - g <= d + 1 for _, cv, g in clocks),
        "max_clock_gap": max(cv - g for _, cv, g in clocks),
        "max_pull_staleness": max(w - g for _, _, w, g, _ in pulls),
        "recorded_equal": same_outcome(run, replayed),
        "reproduced_flag": replayed.reproduced,
        "recorded_versions_followed": sorted(p for log in replayed.shard_logs.values() for p in log.pulls)
        == sorted(p[:4] for p in pulls),
        "plain_equal": same_outcome(run, plain),
        "plain_max_diff": max_diff(run, plain),
        "plain_versions_differ": sorted(p for log in plain.shard_logs.values() for p in log.pulls)
        != sorted(p[:4] for p in pulls),
        "trained": all(np.isfinite(v) for per in run.losses.values() for v in per.values()),
    }


def main() -> int:
    run_dir, configs = Path(sys.argv[1]), json.loads(sys.argv[2])
    ok = True
    for i, cfg in enumerate(configs):
        plan = plan_of(cfg)
        slow = cfg["slow"]
        Jittered.scale = {plan.rank_of(v, s): slow[v] for v, vw in enumerate(plan.virtual_workers)
                          for s in range(len(vw.stages))}
        Jittered.on = True
        sub = split_world(plan.num_ranks)
        if sub is None:
            MPI.COMM_WORLD.Barrier()
            continue
        path = run_dir / f"run{i}" / "record.json"
        data = synthetic(n=cfg.get("n", 256))
        run = Trainer(model(), cross_entropy, sgd(), data, plan=plan, epochs=cfg.get("epochs", 2),
                      reporting=Reporting(progress=False, record=path), runtime=Runtime(comm=sub)).fit()
        if sub.Get_rank() == 0:
            Jittered.on = False
            record = RunRecord.load(path)
            again = lambda: Trainer(model(), cross_entropy, sgd(), synthetic(n=cfg.get("n", 256)),  # noqa: E731
                                    plan=plan, epochs=cfg.get("epochs", 2))
            res = check(cfg, run, record, again().replay(record=path), again().replay())
            ok = ok and res["recorded_equal"] and res["pull_bound_ok"] and res["clock_bound_ok"]
            print("RESULT " + json.dumps(res), flush=True)
        sub.Free()
        MPI.COMM_WORLD.Barrier()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
