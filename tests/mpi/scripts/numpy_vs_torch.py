"""One plan trained twice under WSP at D = 0: by torch stages (the Trainer), then by NumPy workers.

Usage: mpiexec -n 4 python numpy_vs_torch.py torch|numpy OUT_DIR

Plan: 2 VWs of one stage each (layers 0 and 1), 2 PS shards (one layer each), Nm = 2, "sum"
aggregation. The model is two element-wise scales, ``y = x * w0 * w1`` with the loss ``sum(y * t)``
and SGD at lr 2^-4, on minibatches of one sample: every gradient is a product of two or three
float32 numbers, which NumPy computes in the order torch's autograd does, and lr * g is exact, so the
two runs must agree bit for bit if the worker half (ledger, client, PS) is the same.

The torch run records each VW's minibatches (``OUT_DIR/data_vw{v}.npz``); the NumPy run trains on
them. Rank 0 writes ``OUT_DIR/{mode}.json``: final weights (hex of the float32 bytes) and the shard
logs' timing-free content. In NumPy mode ``import torch`` fails.
"""

import json
import sys
from pathlib import Path

MODE, OUT = sys.argv[1], Path(sys.argv[2])
if MODE == "numpy":
    sys.modules["torch"] = None         # the NumPy front end must not need torch

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from hetpipe.plan.types import Plan, ShardPlan, StagePlan, VirtualWorkerPlan  # noqa: E402
from hetpipe.run.config import PSRule, Reporting

N, LR, NM, SAMPLES = 16, 2.0 ** -4, 2, 24


def plan() -> Plan:
    vws = tuple(VirtualWorkerPlan(v, (StagePlan(f"n0.g{v}", "cpu", 0, 2, 0.0, 0.0),)) for v in range(2))
    return Plan(2, NM, 0, "manual", vws, (ShardPlan(0, "n0", (0,)), ShardPlan(1, "n0", (1,))), aggregate="sum")


def initial() -> list:
    return [np.linspace(0.5, 1.5, N, dtype=np.float32), np.linspace(-1.0, 1.0, N, dtype=np.float32)]


def log_content(log) -> dict:
    """What a D = 0 shard log holds independently of timing: sets of pushes and pulls, the apply order,
    the float64 sums of the pushed deltas (as bytes)."""
    return {"pushes": sorted(map(list, log.pushes)), "pulls": sorted(map(list, log.pulls)),
            "applied": [list(a) for a in log.applied],
            "pushed_sum": {str(l): s.tobytes().hex() for l, s in sorted(log.pushed_sum.items())}}


def run_torch(comm) -> dict:
    import torch
    from torch import nn

    from hetpipe.run.data import Batches
    from hetpipe.run.trainer import Trainer

    seen = {"x": [], "t": []}

    class Scale(nn.Module):
        def __init__(self, w: np.ndarray, record: bool) -> None:
            super().__init__()
            self.w, self.record = nn.Parameter(torch.from_numpy(w.copy())), record

        def forward(self, x):
            if self.record and x.device.type == "cpu":      # not the shape inference's meta tensors
                seen["x"].append(x.detach().numpy().copy())
            return x * self.w

    def loss(y, t):
        seen["t"].append(t.detach().numpy().copy())
        return (y * t).sum()

    g = torch.Generator().manual_seed(3)
    x = torch.rand(SAMPLES, N, generator=g) * 2 - 1
    t = torch.rand(SAMPLES, N, generator=g) * 2 - 1
    w = initial()
    model = nn.Sequential(Scale(w[0], True), Scale(w[1], False))
    run = Trainer(model, loss, lambda ps: torch.optim.SGD(ps, lr=LR), Batches(x, t, 1, seed=5), plan=plan(),
                  epochs=1, ps=PSRule(audit=True), reporting=Reporting(progress=False)).fit()
    kind, vw, _ = plan().role_of(comm.Get_rank())
    if kind == "stage":
        np.savez(OUT / f"data_vw{vw}.npz", x=np.stack(seen["x"]), t=np.stack(seen["t"]))
    return {"weights": {str(l): run.weights[l].tobytes().hex() for l in sorted(run.weights)},
            "logs": {str(k): log_content(log) for k, log in sorted(run.shard_logs.items())}}


def run_numpy(comm) -> dict:
    from hetpipe.numpy import aborting

    p = plan()
    kind, index, _ = p.role_of(comm.Get_rank())
    with aborting(comm):
        return _train_numpy(comm, p, kind, index)


def _train_numpy(comm, p, kind, index) -> dict:
    from hetpipe.numpy import WSPWorker, serve_shard

    mine = None
    if kind == "ps":
        mine = serve_shard(comm, p, initial(), audit=True)
    else:
        data = np.load(OUT / f"data_vw{index}.npz")
        worker = WSPWorker(comm, p, initial())
        n = len(data["x"])
        for mb in range(n):
            wave = mb // NM
            if mb % NM == 0 and wave > 0:
                worker.pull(wave)
            x, t = data["x"][mb], data["t"][mb]
            w0, w1 = worker.layer(0), worker.layer(1)
            h = x * w0                                  # forward: y = h * w1
            g1 = (t * h).sum(axis=0)                    # d/dw1 of sum(h * w1 * t), one sample
            g0 = ((t * w1) * x).sum(axis=0)             # d/dw0: (t * w1) is the gradient reaching h
            new = np.concatenate([w0 - np.float32(LR) * g0, w1 - np.float32(LR) * g1])
            worker.step(wave, new)
            if mb % NM == NM - 1 or mb == n - 1:
                worker.push(wave)
        worker.done()
    everyone = comm.gather(mine, root=0)
    if comm.Get_rank() != 0:
        return {}
    shards = [s for s in everyone if s is not None]
    return {"weights": {str(l): w.tobytes().hex() for s in shards for l, w in sorted(s.weights.items())},
            "logs": {str(s.index): log_content(s.log) for s in sorted(shards, key=lambda s: s.index)},
            "planes": sorted({s.plane for s in shards}), "torch_loaded": bool(sys.modules.get("torch"))}


def main() -> int:
    comm = MPI.COMM_WORLD
    out = run_torch(comm) if MODE == "torch" else run_numpy(comm)
    if comm.Get_rank() == 0:
        (OUT / f"{MODE}.json").write_text(json.dumps(out, sort_keys=True))
        print("RESULT " + json.dumps({"mode": MODE}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
