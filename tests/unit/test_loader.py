"""The data path (hetpipe.loader): per-VW sharding with DistributedSampler's order, each rank loading
only its share, a shuffled DataLoader trained on its own labels, and ranks that read different data
stopped at start-up. References: plain PyTorch loops over DistributedSampler and the global order."""

import multiprocessing
import os
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import (DataLoader, Dataset, DistributedSampler, RandomSampler, Subset, TensorDataset,
                              get_worker_info)

sys.path.insert(0, str(Path(__file__).parents[1] / "mpi" / "scripts"))

from common import cross_entropy, mlp, one_vw_plan, sgd  # noqa: E402

from hetpipe.loader import DatasetSource, PerVWSource, StreamSource, as_source  # noqa: E402
from hetpipe.run.data import Batches  # noqa: E402
from hetpipe.loader.check import DataMismatch, Reading, compare  # noqa: E402
from hetpipe.loader.source import BOTH, INPUTS, LABELS  # noqa: E402
from hetpipe.run.trainer import Trainer  # noqa: E402
from hetpipe.run.config import Numerics, Reporting  # noqa: E402


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


# A DataLoader's settings under hetpipe: each carries over to the rebuilt per-VW loaders, or is refused.

class Probe(Dataset):
    """Samples that tell where and how they were loaded: ``[index, loading pid, worker_init_fn calls in
    that process]``, label ``index % 10``; sample ``slow`` sleeps 1.5 s when loaded in a worker."""

    def __init__(self, n=48, slow=None):
        self.n, self.inits, self.slow = n, 0, slow

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.slow and get_worker_info() is not None:
            time.sleep(1.5)
        return torch.tensor([i, os.getpid(), self.inits]), i % 10


class Noisy(Dataset):
    """A random transform: the inputs and the label are drawn from the loading process's generator."""

    def __len__(self):
        return 96

    def __getitem__(self, i):
        return torch.rand(3), torch.rand(())


class ProbeStream(torch.utils.data.IterableDataset):
    """Probe's samples as a stream."""

    def __init__(self):
        self.inits = 0

    def __iter__(self):
        return ((torch.tensor([i, os.getpid(), self.inits]), i % 10) for i in range(48))


def _count_init(worker_id):
    get_worker_info().dataset.inits += 1


def _in_forked_worker(worker_id):
    get_worker_info().dataset.inits = int(isinstance(multiprocessing.current_process(),
                                                     multiprocessing.context.ForkProcess))


def _inputs(src, epochs=1, vw=0, num_vws=1):
    return torch.cat([x for x in src.vw_stream(vw, num_vws, epochs, part=INPUTS)])


def test_a_dataloaders_loading_settings_reach_every_loader_hetpipe_builds():
    ctx = multiprocessing.get_context("fork")
    settings = dict(num_workers=2, pin_memory=True, pin_memory_device="cuda:0", timeout=7.5,
                    worker_init_fn=_count_init, multiprocessing_context=ctx, prefetch_factor=3,
                    persistent_workers=True)
    for shuffle in (True, False):
        src = as_source(DataLoader(_dataset(96), batch_size=8, shuffle=shuffle, **settings), seed=3)
        assert isinstance(src, DatasetSource)
        built = [src._loader()]
        src = StreamSource(ProbeStream(), 8, **settings)
        built.append(src._loader())
        for loader in built:
            for name, value in settings.items():
                got = getattr(loader, name)
                assert got is value if name in ("worker_init_fn", "multiprocessing_context") else got == value, name


def test_worker_init_fn_runs_in_the_per_vw_loaders_workers_and_persistent_workers_persist_across_epochs():
    for persistent in (True, False):
        loader = DataLoader(Probe(), batch_size=8, shuffle=True, num_workers=1, worker_init_fn=_count_init,
                            persistent_workers=persistent)
        for src in (as_source(loader, seed=1),
                    StreamSource(ProbeStream(), 8, num_workers=1, worker_init_fn=_count_init,
                                 persistent_workers=persistent)):
            got = _inputs(src, epochs=3)
            assert len(got) == 3 * 48 and set(got[:, 2].tolist()) == {1}, "worker_init_fn did not run in the worker"
            pids = set(got[:, 1].tolist())
            assert os.getpid() not in pids
            # A stream keeps one loader for all its epochs: persistent workers serve them all, else
            # each epoch starts its own.
            assert len(pids) == (1 if persistent else 3), (persistent, type(src).__name__, pids)


def test_multiprocessing_context_starts_the_workers():
    ctx = multiprocessing.get_context("fork")
    for context, forked in ((ctx, 1), (None, 0)):
        loader = DataLoader(Probe(), batch_size=8, num_workers=1, worker_init_fn=_in_forked_worker,
                            multiprocessing_context=context)
        assert set(_inputs(as_source(loader))[:, 2].tolist()) == {forked}
        src = StreamSource(ProbeStream(), 8, num_workers=1, worker_init_fn=_in_forked_worker,
                           multiprocessing_context=context)
        assert set(_inputs(src)[:, 2].tolist()) == {forked}


def test_timeout_stops_a_per_vw_loader_whose_worker_is_late():
    loader = DataLoader(Probe(slow=0), batch_size=8, num_workers=1, timeout=0.25)
    with pytest.raises(RuntimeError, match=r"DataLoader timed out after 0.25 seconds"):
        _inputs(as_source(loader))


def test_pin_memory_pins_the_inputs_and_the_labels_read_by_index():
    loader = DataLoader(_dataset(96), batch_size=8, num_workers=1, pin_memory=True)
    src = as_source(loader)
    if torch.accelerator.is_available():
        x = next(src.vw_stream(0, 2, 1, part=INPUTS))
        y = next(src.vw_stream(0, 2, 1, part=LABELS))
        assert x.is_pinned() and y.is_pinned()
    else:
        # A CPU-only torch pins nothing and says so, on the per-VW loader's first pass.
        with pytest.warns(UserWarning, match="'pin_memory' argument is set as true but no accelerator"):
            next(src.vw_stream(0, 2, 1, part=INPUTS))


def test_workers_are_seeded_from_the_sources_seed_so_both_ranks_of_a_vw_draw_the_same_transforms():
    """Stage 0 and the last stage read VW 1's minibatches on different ranks, whose global generators
    differ: their workers' random transforms agree all the same, and depend on the seed, the epoch and
    the VW only (a run resumed at epoch 1 draws epoch 1's)."""
    src = as_source(DataLoader(Noisy(), batch_size=8, shuffle=True, num_workers=1), seed=4)
    torch.manual_seed(1)
    both = list(src.vw_stream(1, 2, 2, part=BOTH))
    torch.manual_seed(2)
    labels = list(src.vw_stream(1, 2, 2, part=LABELS))
    assert len(both) == len(labels) == 12
    assert all(torch.equal(y, z) for (_, y), z in zip(both, labels))
    resumed = list(src.vw_stream(1, 2, 2, start_epoch=1, part=LABELS))
    assert all(torch.equal(y, z) for (_, y), z in zip(both[6:], resumed))
    assert not torch.equal(both[0][0], both[6][0]), "epochs 0 and 1 drew the same transforms"
    assert not torch.equal(both[0][0], next(src.vw_stream(0, 2, 1))[0]), "VWs 0 and 1 drew the same transforms"
    stream = StreamSource(ProbeNoise(), 8, num_workers=1, seed=4)
    torch.manual_seed(1)
    a = _inputs(stream, epochs=2, vw=0, num_vws=2)
    torch.manual_seed(2)
    assert torch.equal(a, _inputs(stream, epochs=2, vw=0, num_vws=2))
    assert torch.equal(a[len(a) // 2:], torch.cat([x for x, _ in stream.vw_stream(0, 2, 2, start_epoch=1)]))
    assert not torch.equal(a, _inputs(StreamSource(ProbeNoise(), 8, num_workers=1, seed=5), 2, 0, 2))


class ProbeNoise(torch.utils.data.IterableDataset):
    def __iter__(self):
        return ((torch.rand(3), i % 10) for i in range(48))


@pytest.mark.parametrize("make, match", [
    (lambda ds: DataLoader(ds, batch_size=8, shuffle=True, generator=torch.Generator().manual_seed(1)),
     r"DataLoader\(generator=\.\.\.\) is refused: .* pass seed= to the Trainer"),
    (lambda ds: DataLoader(ds, batch_size=8, generator=torch.Generator()),
     r"DataLoader\(generator=\.\.\.\) is refused"),
    (lambda ds: DataLoader(ds, batch_size=8, sampler=RandomSampler(ds, generator=torch.Generator())),
     r"RandomSampler\(generator=\.\.\.\) is refused: .* pass seed= to the Trainer"),
    (lambda ds: DataLoader(ds, batch_size=8, num_workers=1, in_order=False),
     r"DataLoader\(in_order=False\) .* drop in_order=False"),
    (lambda ds: DataLoader(ds, batch_size=8, num_workers=1, in_order=False,
                           sampler=RandomSampler(ds, replacement=True)),
     r"DataLoader\(in_order=False\)"),
])
def test_a_setting_hetpipe_cannot_honour_is_refused_naming_it(make, match):
    with pytest.raises(ValueError, match=match):
        as_source(make(_dataset(96)), seed=0)


@pytest.mark.parametrize("bad, match", [
    (lambda: DatasetSource(_dataset(96), 8, persistent_workers=True),
     r"hetpipe: persistent_workers option needs num_workers > 0"),
    (lambda: DatasetSource(_dataset(96), 8, prefetch_factor=2), r"hetpipe: prefetch_factor option could only"),
    (lambda: DatasetSource(_dataset(96), 8, num_workers=-1), r"num_workers must be an int >= 0"),
    (lambda: StreamSource(ProbeStream(), 8, timeout=-1), r"hetpipe: timeout option should be non-negative"),
    (lambda: StreamSource([], num_workers=2, pin_memory=True),
     r"StreamSource without batch_size= .* so num_workers, pin_memory would do nothing"),
    (lambda: StreamSource(Batches(torch.zeros(8, 2), torch.zeros(8), 4), 2, num_workers=1,
                          persistent_workers=True), r"persistent_workers=True\) over data with set_epoch"),
])
def test_bad_loader_settings_are_named_when_the_source_is_built(bad, match):
    with pytest.raises(ValueError, match=match):
        bad()


def test_a_dataloader_with_workers_and_persistent_workers_trains_like_plain_pytorch():
    ds = _dataset(96)
    loader = DataLoader(ds, batch_size=16, shuffle=True, num_workers=1, persistent_workers=True, prefetch_factor=4)
    model, got = _replay(loader, epochs=2, seed=7)
    ref = mlp()
    want = _plain(ref, _sampler_loader(ds, 16, 7), 2)
    assert max(abs(a - b) for a, b in zip(got, want)) <= 1e-6 and _max_diff(model, ref) <= 1e-6
