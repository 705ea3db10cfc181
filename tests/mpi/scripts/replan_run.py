"""A run the Trainer plans itself, on an emulated node of three devices (one VW of three stages), for
the restart-by-re-planning test. Usage: replan_run.py OUT (under `hetpipe launch`); rank 0 writes
OUT/result.json (losses, what it resumed from, its plan) and OUT/weights.npz (final global weights)."""

import sys
from pathlib import Path

import torch

from common import cross_entropy, mlp, save_run, sgd
from hetpipe.run.data import Batches
from hetpipe.run.trainer import Trainer
from hetpipe.run.config import Planning, Reporting, Runtime

CLUSTER = {"name": "three", "emulated": True, "device_types": {"emu": {"memory_bytes": 1 << 26, "speed": 0.002}},
           "nodes": [{"name": "n0", "type": "emu", "count": 3}],
           "intra_node": {"bandwidth": 2e9, "latency": 2e-5}, "inter_node": {"bandwidth": 2.5e8, "latency": 1e-4}}


def data(minibatches: int = 32) -> Batches:
    g = torch.Generator().manual_seed(1)
    n = 16 * minibatches
    return Batches(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g), 16, shuffle=False)


def main() -> int:
    out = Path(sys.argv[1])
    metrics = sys.argv[2] if len(sys.argv) > 2 else None
    from hetpipe.plan.cluster import cluster_from_dict

    run = Trainer(mlp(), cross_entropy, sgd(momentum=0.0), data(),
                  planning=Planning(cluster=cluster_from_dict(CLUSTER), policy="NP", nm=2, d=0),
                  reporting=Reporting(progress=False, metrics=metrics), runtime=Runtime(emulate=True)).fit()
    if run.rank == 0:
        save_run(out, run)
    return 0


if __name__ == "__main__":
    sys.exit(main())
