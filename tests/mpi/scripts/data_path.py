"""The data path under real ranks (1 VW x 2 stages + 1 PS, Nm = 1, D = 0, so the run is plain training).

Usage: mpiexec -n 3 python data_path.py MODE
  shuffled: a DataLoader(shuffle=True) as a user writes it. Rank 0 prints ``RESULT {json}``: the run's
      losses against plain PyTorch over DistributedSampler's order with the Trainer's seed, and whether
      every label the last stage read belongs to its sample (the dataset's label is a function of the
      sample, which the loss stage checks on the activations it receives: the first feature of the
      input rides through layer 0 unchanged to the label check).
  rank_dependent: an iterable whose order depends on the rank: every rank must stop at start-up
      with one error naming the ranks (no training, no peer timeout).
  weights_differ: rank 0 builds the model from another seed: every rank stops at start-up with one
      error naming the layer and the two ranks.
"""

import json
import sys

import torch
from mpi4py import MPI
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from common import one_vw_plan
from hetpipe.run.trainer import Trainer
from hetpipe.run.config import Numerics, Reporting

N, BATCH, SEED = 128, 16, 11


def dataset():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(N, 8, generator=g)
    x[:, 0] = torch.arange(N, dtype=torch.float32)      # the sample's index, carried as a feature
    return TensorDataset(x, (torch.arange(N) * 7) % 10)


class Carry(nn.Module):
    """Layer 0: a linear map of the features, and the sample index passed through."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 10)

    def forward(self, x):
        return torch.cat([self.lin(x), x[:, :1]], dim=1)


MISPAIRED = []


def loss_fn(out, y):
    logits, index = out[:, :10], out[:, 10].detach().round().long()
    MISPAIRED.append(int(((index * 7) % 10 != y).sum()))
    return nn.functional.cross_entropy(logits, y)


def model():
    torch.manual_seed(0)
    return nn.Sequential(Carry(), nn.Identity())


def plain(epochs):
    ds, m = dataset(), model()
    opt = torch.optim.SGD(m.parameters(), lr=0.05)
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=SEED, drop_last=False)
    losses = []
    for e in range(epochs):
        sampler.set_epoch(e)
        for x, y in DataLoader(ds, batch_size=BATCH, sampler=sampler):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(m(x)[:, :10], y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    return losses


class RankOrdered:
    def __init__(self, ds):
        self.ds = ds

    def __len__(self):
        return N // BATCH

    def __iter__(self):
        g = torch.Generator().manual_seed(MPI.COMM_WORLD.Get_rank())
        order = torch.randperm(N, generator=g)
        for i in range(len(self)):
            idx = order[i * BATCH:(i + 1) * BATCH]
            yield self.ds.tensors[0][idx], self.ds.tensors[1][idx]


def main() -> int:
    mode = sys.argv[1]
    plan = one_vw_plan([1], nm=1, d=0, num_layers=2)
    opt = lambda p: torch.optim.SGD(p, lr=0.05)  # noqa: E731
    if mode == "shuffled":
        data = DataLoader(dataset(), batch_size=BATCH, shuffle=True)
        # Each rank draws from the global RNG a different number of times before training.
        torch.manual_seed(MPI.COMM_WORLD.Get_rank())
        run = Trainer(model(), loss_fn, opt, data, plan=plan, epochs=2, numerics=Numerics(seed=SEED),
                      reporting=Reporting(progress=False)).fit()
        mispaired = MPI.COMM_WORLD.allgather(sum(MISPAIRED))
        if MPI.COMM_WORLD.Get_rank() == 0:
            got = [v for _, v in sorted(run.losses[0].items())]
            want = plain(2)
            print("RESULT " + json.dumps({"minibatches": len(got), "mispaired": sum(mispaired),
                                          "max_diff": max(abs(a - b) for a, b in zip(got, want)),
                                          "same_count": len(got) == len(want)}), flush=True)
        return 0
    if mode == "weights_differ":
        m = model()
        if MPI.COMM_WORLD.Get_rank() == 0:
            torch.manual_seed(123)
            m[0].lin.reset_parameters()
        Trainer(m, loss_fn, opt, DataLoader(dataset(), batch_size=BATCH), plan=plan, epochs=1,
                reporting=Reporting(progress=False)).fit()
        return 0
    Trainer(model(), loss_fn, opt, RankOrdered(dataset()), plan=plan, epochs=1,
                  reporting=Reporting(progress=False)).fit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
