"""Heterogeneity-aware data parallelism over real gloo: each rank takes its share of a step's windows,
backpropagates ``baselines.weighted_loss`` through DDP, and prints (rank 0) the largest difference
between DDP's averaged gradients and the gradient of the mean loss over all the step's windows computed
in one process. ``RESULT {"max_abs_diff": ..., "windows": [...]}``."""

import json
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[3] / "bench"
sys.path[:0] = [str(BENCH / "convergence"), str(BENCH / "e2e")]

import torch  # noqa: E402
from torch import nn  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from baselines import weighted_loss  # noqa: E402
from mpi_env import run_gloo  # noqa: E402
from task import MinibatchStream, TaskSpec, build_layers, corpus, loss_fn  # noqa: E402

TINY = TaskSpec(context=16, width=16, heads=2, blocks=1, minibatch=4, train_bytes=1 << 18, val_windows=8)
WINDOWS = {2: [5, 3], 3: [6, 1, 1]}          # per world size: unequal shares of 8 windows (2 minibatches)
STEP = 3                                     # any step: its windows are total * STEP onwards


def check(rank: int, world: int) -> None:
    windows = WINDOWS[world]
    total = sum(windows)
    text, _, _ = corpus(TINY)
    stream = MinibatchStream(text, TINY, seed=1, count=0)
    model = DDP(nn.Sequential(*build_layers(TINY, 1)))
    x, y = stream.windows(STEP * total + sum(windows[:rank]), windows[rank])
    weighted_loss(loss_fn(model(x), y), windows[rank], total, world).backward()
    if rank == 0:
        report(stream, model, windows)
    torch.distributed.barrier()


def report(stream, model, windows) -> None:
    """Rank 0: the largest difference between DDP's averaged gradients and those of the mean loss over
    the step's windows in one process."""
    total = sum(windows)
    ref = nn.Sequential(*build_layers(TINY, 1))
    xa, ya = stream.concat(STEP * total // TINY.minibatch, total // TINY.minibatch)
    loss_fn(ref(xa), ya).backward()
    diff = max(float((p.grad - q.grad).abs().max()) for p, q in zip(model.module.parameters(), ref.parameters()))
    scale = max(float(q.grad.abs().max()) for q in ref.parameters())
    print("RESULT " + json.dumps({"max_abs_diff": diff, "max_abs_grad": scale, "windows": windows}), flush=True)


if __name__ == "__main__":
    run_gloo(check)
