"""The data path (hetpipe.loader): per-VW sharding with DistributedSampler's order, each rank loading
only its share, a shuffled DataLoader trained on its own labels, and ranks that read different data
stopped at start-up. References: plain PyTorch loops over DistributedSampler and the global order."""

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, TensorDataset

sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))

from common import cross_entropy, mlp, one_vw_plan, sgd  # noqa: E402

from hetpipe.loader import DatasetSource, PerVWSource, StreamSource, as_source  # noqa: E402
from hetpipe.loader.check import DataMismatch, Reading, compare  # noqa: E402
from hetpipe.loader.source import BOTH, INPUTS, LABELS  # noqa: E402
from hetpipe.run.trainer import Trainer  # noqa: E402
from hetpipe.run.config import Numerics, Reporting
from hetpipe.run.config import Numerics


def _dataset(n=100, seed=1):
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(torch.randn(n, 64, generator=g), torch.randint(0, 10, (n,), generator=g))


class Counting(Dataset):
    """A map-style dataset that counts which samples were loaded."""

    def __init__(self, n):
        self.n, self.loads = n, Counter()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.loads[i] += 1
        return torch.full((4,), float(i)), i % 10


def _plain(model, data_per_epoch, epochs, opt_factory=sgd()):
    opt = opt_factory(model.parameters())
    losses = []
    for e in range(epochs):
        for x, y in data_per_epoch(e):
            opt.zero_grad()
            loss = cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    return losses


def _sampler_loader(ds, batch, seed):
    sampler = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=seed, drop_last=True)

    def per_epoch(e):
        sampler.set_epoch(e)
        return DataLoader(ds, batch_size=batch, sampler=sampler, drop_last=True)
    return per_epoch


def _replay(data, epochs=2, cuts=(2, 4), seed=0, **kw):
    model = mlp()
    result = Trainer(model, cross_entropy, sgd(), data, plan=one_vw_plan(list(cuts), nm=1, d=0), epochs=epochs,
                     numerics=Numerics(seed=seed), reporting=Reporting(progress=False), **kw).replay()
    return model, [v for _, v in sorted(result.losses[0].items())]


def _max_diff(a, b):
    return max(float((p - q).detach().abs().max()) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("num_vws, drop_last", [(1, True), (3, True), (3, False), (4, True)])
def test_vw_shares_partition_distributed_samplers_order(num_vws, drop_last):
    ds = _dataset(103)
    src = DatasetSource(ds, 8, seed=5, drop_last=drop_last)
    for epoch in range(2):
        order = list(DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=5, drop_last=False))
        if epoch:
            s = DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=5)
            s.set_epoch(epoch)
            order = list(s)
        per_epoch = src.minibatches_per_epoch()
        assert per_epoch == (103 // 8 if drop_last else 13)
        mine = [list(src.vw_stream(v, num_vws, epoch + 1, epoch, part=BOTH)) for v in range(num_vws)]
        share = per_epoch // num_vws
        assert all(len(m) == share for m in mine)
        for v, batches in enumerate(mine):
            for j, (x, y) in enumerate(batches):
                i = j * num_vws + v
                idx = order[i * 8:(i + 1) * 8]
                assert torch.equal(x, ds.tensors[0][idx]) and torch.equal(y, ds.tensors[1][idx])


def test_each_reading_rank_loads_only_its_vws_samples_and_the_label_stage_loads_none():
    ds = Counting(96)
    src = DatasetSource(ds, 8, seed=2, labels=[i % 10 for i in range(96)])
    inputs = [list(src.vw_stream(v, 3, 1, part=INPUTS)) for v in range(3)]
    loaded_by_inputs = dict(ds.loads)
    labels = [list(src.vw_stream(v, 3, 1, part=LABELS)) for v in range(3)]
    assert ds.loads == loaded_by_inputs, "the label streams loaded samples"
    assert set(loaded_by_inputs.values()) == {1} and len(loaded_by_inputs) == 96
    ds.loads.clear()
    list(src.vw_stream(1, 3, 1, part=INPUTS))
    assert sum(ds.loads.values()) == 32, "VW 1 loaded more than its 4 minibatches of 8"
    for v in range(3):
        for x, y in zip(inputs[v], labels[v]):
            assert torch.equal(x[:, 0].long() % 10, y), "labels are not the inputs' own"


def test_dataset_source_trains_like_plain_pytorch_over_distributed_sampler():
    ds = _dataset(96)
    model, got = _replay(DatasetSource(ds, 16, seed=3), epochs=3)
    ref = mlp()
    want = _plain(ref, _sampler_loader(ds, 16, 3), 3)
    assert len(got) == len(want) == 18
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-6 and _max_diff(model, ref) <= 1e-6
    assert want[0] != want[-1]


def test_a_shuffled_dataloader_trains_on_its_own_labels():
    """A DataLoader(shuffle=True) reshuffles from torch's global RNG at every pass; hetpipe deals its
    dataset with the Trainer's seed instead, so the run is plain training over that order."""
    ds = _dataset(96)
    loader = DataLoader(ds, batch_size=16, shuffle=True)
    model, got = _replay(loader, epochs=2, seed=7)
    ref = mlp()
    want = _plain(ref, _sampler_loader(ds, 16, 7), 2)
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-6 and _max_diff(model, ref) <= 1e-6
    src = as_source(loader, seed=7)
    assert isinstance(src, DatasetSource) and src.shuffle and src.seed == 7


def test_a_sequential_dataloader_keeps_its_order_and_its_short_last_batch():
    ds = _dataset(90)
    src = as_source(DataLoader(ds, batch_size=16), seed=1)
    assert isinstance(src, DatasetSource) and not src.shuffle and src.minibatches_per_epoch() == 6
    model, got = _replay(DataLoader(ds, batch_size=16), epochs=1)
    ref = mlp()
    want = _plain(ref, lambda e: DataLoader(ds, batch_size=16), 1)
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-6 and _max_diff(model, ref) <= 1e-6


class Reshuffling:
    """An iterable that draws a new order from the global RNG at every pass (what a DataLoader with a
    custom sampler, or a hand-written generator, does)."""

    def __init__(self, ds, batch):
        self.ds, self.batch = ds, batch

    def __len__(self):
        return len(self.ds) // self.batch

    def __iter__(self):
        order = torch.randperm(len(self.ds))
        for i in range(len(self)):
            idx = order[i * self.batch:(i + 1) * self.batch]
            yield self.ds.tensors[0][idx], self.ds.tensors[1][idx]


def test_an_iterable_that_reshuffles_per_pass_is_stopped_naming_the_stages():
    with pytest.raises(DataMismatch, match=r"minibatch 0 of epoch 0 is not the same on VW 0 stage 0 and VW 0 "
                                           r"stage 2"):
        _replay(Reshuffling(_dataset(96), 16))


def test_a_reiterable_that_repeats_its_order_trains_like_plain_pytorch():
    ds = _dataset(96)
    fixed = [(ds.tensors[0][i:i + 16], ds.tensors[1][i:i + 16]) for i in range(0, 96, 16)]
    model, got = _replay(fixed, epochs=2)
    ref = mlp()
    want = _plain(ref, lambda e: fixed, 2)
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-6 and _max_diff(model, ref) <= 1e-6
    assert isinstance(as_source(fixed), StreamSource)


def test_an_iterable_dataset_is_batched_here():
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            ds = _dataset(96)
            return iter(zip(ds.tensors[0], ds.tensors[1]))

    model, got = _replay(StreamSource(Stream(), 16), epochs=1)
    ref = mlp()
    ds = _dataset(96)
    want = _plain(ref, lambda e: DataLoader(ds, batch_size=16), 1)
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-6 and _max_diff(model, ref) <= 1e-6
    with pytest.raises(TypeError, match="IterableDataset needs a batch size"):
        as_source(Stream())


def test_a_per_vw_factory_gives_each_vw_its_own_loader():
    ds = _dataset(96)
    calls = []

    def factory(vw, num_vws, epoch):
        calls.append((vw, num_vws, epoch))
        return DataLoader(Subset(ds, range(vw, 96, num_vws)), batch_size=16)

    model, got = _replay(PerVWSource(factory), epochs=2)
    ref = mlp()
    want = _plain(ref, lambda e: DataLoader(ds, batch_size=16), 2)
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-6 and _max_diff(model, ref) <= 1e-6
    assert (0, 1, 1) in calls
    src = PerVWSource(factory)
    two = [list(src.vw_stream(v, 2, 1)) for v in range(2)]
    assert [len(t) for t in two] == [3, 3]
    assert torch.equal(two[1][0][0], ds.tensors[0][1:32:2])


def test_readings_that_disagree_name_the_ranks():
    a = Reading("rank 0 (VW 0 stage 0)", 6, "a dataset of 96 samples", {(0, 0): "x", (0, 1): "y"})
    b = Reading("rank 1 (VW 0 stage 1)", 6, "a dataset of 96 samples", {(0, 0): "x", (0, 1): "z"})
    with pytest.raises(DataMismatch, match=r"minibatch 1 of epoch 0 is not the same on rank 0 \(VW 0 stage 0\) "
                                           r"and rank 1"):
        compare([a, b])
    c = Reading("rank 2 (PS shard 0)", 7)
    with pytest.raises(DataMismatch, match=r"6 minibatch\(es\) on rank 0 .* but 7 on rank 2"):
        compare([a, c])
    d = Reading("rank 3", 6, "a dataset of 97 samples")
    with pytest.raises(DataMismatch, match="reads a dataset of 96 samples, rank 3 reads a dataset of 97"):
        compare([a, d])
    compare([a, Reading("rank 4 (VW 1 stage 0)", 6, "a dataset of 96 samples", {(0, 2): "q"})])


@pytest.mark.parametrize("bad, match", [
    (lambda ds: DatasetSource(ds, 0), "batch_size must be a positive int"),
    (lambda ds: DatasetSource(ds, 8, labels=[0] * 3), "labels= holds 3 labels for a dataset of 96"),
    (lambda ds: as_source(ds), "a Dataset needs a batch size"),
    (lambda ds: as_source(5), "data must be a DataSource"),
])
def test_bad_data_arguments_are_named(bad, match):
    with pytest.raises((TypeError, ValueError), match=match):
        bad(_dataset(96))


def test_too_few_minibatches_for_the_vws_is_named():
    src = DatasetSource(_dataset(16), 8)
    with pytest.raises(ValueError, match="one epoch has 2 minibatch.*fewer than the 3 virtual workers"):
        src.vw_stream(0, 3, 1)
