"""Where a run's minibatches come from: the data-source contract and its three kinds.

Contract (docs/design.md, "Data path"). One epoch is a global sequence of minibatches, the same on
every rank; minibatch ``i`` belongs to VW ``i % num_vws``, each VW takes ``per_epoch // num_vws`` of
them (the tail is dropped). A rank reads only what its role needs: stage 0 (and a stage taking side
inputs) the inputs of its own VW's minibatches, the last stage their labels. The order depends on
the seed and the epoch only, never on how often, or on which rank, the data is read.

* :class:`DatasetSource` - a map-style ``Dataset`` of ``(inputs, label)`` samples: the epoch's order
  is ``DistributedSampler``'s with one replica (``randperm`` seeded by ``seed + epoch``, or the identity
  without shuffling), cut into ``batch_size`` minibatches; a VW's loader (``batch_sampler`` of its own
  minibatches, the user's ``collate_fn``, ``num_workers`` and other :data:`LOADER_SETTINGS`) loads only
  its samples, and the last stage reads only labels when the source can give them (``labels=``, or a
  ``TensorDataset``).
* :class:`StreamSource` - an ``IterableDataset`` (samples, batched here) or any re-iterable of
  ``(inputs, labels)`` minibatches (``set_epoch(e)`` called before epoch ``e`` when it has one): every
  reading rank iterates the whole epoch and keeps its VW's share. Its order is the user's to keep
  equal on every rank; :mod:`hetpipe.loader.check` verifies it at start-up.
* :class:`PerVWSource` - a factory ``(vw, num_vws, epoch) -> iterable`` of that VW's minibatches (e.g. a
  ``DataLoader`` over the VW's shard): the VW's ``j``-th minibatch is global minibatch
  ``j * num_vws + vw``.

:func:`as_source` turns what a user hands the Trainer into one of these; a ``DataLoader`` over a
map-style dataset with an ordinary sampler becomes a :class:`DatasetSource` of the same dataset,
batch size, collate function, workers and :data:`LOADER_SETTINGS` (shuffled, seeded by the Trainer's
seed, when its sampler is random), so a shuffled ``DataLoader`` is safe. Its ``generator`` is refused
(the Trainer's seed orders the data), and so is ``in_order=False`` with workers (see :func:`as_source`).

Loader workers. A loader hetpipe builds takes a ``generator`` seeded by :func:`worker_seed` before
each epoch, from which ``DataLoader`` draws its workers' base seed: a worker's ``torch``, ``random``
and ``numpy`` generators start from the source's seed, the epoch and (for a :class:`DatasetSource`)
the VW, never from the rank's global generator, so the two ranks reading one VW's minibatches (stage
0 and the last stage) run the same random transforms in their workers. A stream keeps one loader for
all its epochs: with ``persistent_workers`` its workers are started, and seeded, once, at its first
epoch, and keep their generators across epochs, as a ``DataLoader``'s persistent workers do. Each
evaluation pass is a stream of its own, and so starts its own workers.
"""

from __future__ import annotations

import hashlib
import itertools
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple

import numpy as np
import torch
from torch.utils import _pytree as pytree
from torch.utils.data import (BatchSampler, DataLoader, Dataset, IterableDataset, RandomSampler,
                              SequentialSampler, TensorDataset)

from hetpipe.util.arguments import flag
from hetpipe.util.errors import ArgumentError
from hetpipe.util.numbers import whole

INPUTS, LABELS, BOTH = "inputs", "labels", "both"
CHECKED = 2         # minibatches per reading rank whose digests the start-up check compares

# The DataLoader settings a source hands every loader it builds, with their defaults; they change how
# minibatches are loaded, never which ones or in what order.
LOADER_SETTINGS: Dict[str, Any] = {"pin_memory": False, "pin_memory_device": "", "timeout": 0,
                                   "worker_init_fn": None, "multiprocessing_context": None,
                                   "prefetch_factor": None, "persistent_workers": False}


def digest(what: Any) -> str:
    """A digest of a pytree of tensors and plain values (dtypes, shapes and bytes)."""
    h = hashlib.sha1()
    for leaf in pytree.tree_leaves(what):
        if isinstance(leaf, torch.Tensor):
            t = leaf.detach().to("cpu").contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        else:
            h.update(repr(leaf).encode())
    return h.hexdigest()[:16]


class DataSource:
    """The contract every source keeps (see the module docstring)."""

    def minibatches_per_epoch(self, num_vws: int = 1) -> int:
        """Minibatches of one epoch's global sequence (VW shares are this // ``num_vws``)."""
        raise NotImplementedError

    def sample(self) -> Any:
        """One ``(inputs, labels)`` minibatch of the first epoch (shapes, profiling); consumes no order."""
        raise NotImplementedError

    def vw_stream(self, vw: int, num_vws: int, epochs: int, start_epoch: int = 0, start_index: int = 0,
                  part: str = BOTH) -> "VWStream":
        """VW ``vw``'s minibatches of epochs ``start_epoch .. epochs - 1``: their inputs, labels or both.

        A resumed run starts at global minibatch ``start_index`` of epoch ``start_epoch``: the rest
        of that epoch is dealt round-robin from there, each VW taking as many (:func:`epoch_range`)."""
        raise NotImplementedError

    def identity(self) -> Optional[str]:
        """What makes two ranks' sources deal the same order (compared across every reading rank at
        start-up), or None when only the minibatches themselves can tell."""
        return None


def worker_seed(seed: int, epoch: int, vw: int = 0) -> int:
    """The seed of the generator from which a loader of epoch ``epoch`` (of VW ``vw``) draws its
    workers' base seed (see the module docstring)."""
    return int(np.random.SeedSequence([seed, epoch, vw, 0x10AD]).generate_state(1, np.uint64)[0] >> 1)


def _loader_settings(data: Any, num_workers: Any, settings: Dict[str, Any]) -> Dict[str, Any]:
    """``num_workers`` and ``settings`` (:data:`LOADER_SETTINGS`) as DataLoader keywords, checked now by
    DataLoader's own rules rather than at the first epoch."""
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 0:
        raise ValueError(f"hetpipe: num_workers must be an int >= 0, got {num_workers!r}")
    kw = {"num_workers": num_workers, **settings}
    try:
        DataLoader(data, batch_size=None, **kw)
    except (TypeError, ValueError) as e:
        raise type(e)(f"hetpipe: {e}") from None
    return kw


def _pins() -> bool:
    """Whether ``DataLoader(pin_memory=True)`` pins here: on an accelerator other than MPS (torch < 2.6,
    which has no ``torch.accelerator``: on CUDA)."""
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None:
        return torch.cuda.is_available()
    return accelerator.is_available() and accelerator.current_accelerator().type != "mps"


class _Minibatches:
    """A loader's ``batch_sampler``: the index lists of the epoch it reads next, set before each pass, so
    that one DataLoader (and with ``persistent_workers`` one set of workers) serves every epoch."""

    def __init__(self) -> None:
        self.batches: List[List[int]] = []

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[List[int]]:
        return iter(self.batches)


def epoch_range(per_epoch: int, num_vws: int, vw: int, first: int) -> range:
    """The global minibatch indices VW ``vw`` trains in an epoch whose first trained index is ``first``:
    minibatches ``first ..`` dealt round-robin, each VW taking ``(per_epoch - first) // num_vws``, so
    that fewer than ``num_vws`` are left over at the epoch's end. From ``first = 0`` that leaves the
    epoch's ``per_epoch % num_vws`` last ones; a run resumed mid-epoch into other VWs (``first`` not
    a multiple of ``num_vws``) deals the rest of that epoch from its cut the same way (before, it
    stopped at the multiple of ``num_vws`` counted from 0, dropping up to ``num_vws`` more)."""
    end = first + max(0, per_epoch - first) // num_vws * num_vws
    return range(first + vw, end, num_vws)


def unused(per_epoch: int, num_vws: int, epochs: int, start_epoch: int = 0, start_index: int = 0
           ) -> List[Tuple[int, range]]:
    """Per epoch of ``start_epoch .. epochs - 1`` (the first from ``start_index``), the minibatches that
    ``num_vws`` VWs leave unused (:func:`epoch_range`: those after the last one dealt); epochs that
    leave none are not listed."""
    out = []
    for epoch in range(start_epoch, epochs):
        first = start_index if epoch == start_epoch else 0
        end = first + max(0, per_epoch - first) // num_vws * num_vws
        if end < per_epoch:
            out.append((epoch, range(end, per_epoch)))
    return out


def dealt(per_epoch: int, num_vws: int, epochs: int, start_epoch: int = 0, start_index: int = 0) -> Tuple[int, int]:
    """(trained, dropped): of the minibatches of epochs ``start_epoch .. epochs - 1`` (the first from
    ``start_index``), how many ``num_vws`` VWs train (:func:`epoch_range`: an equal share each) and how
    many are left over, unused (:func:`unused`)."""
    todo = sum(max(0, per_epoch - (start_index if e == start_epoch else 0)) for e in range(start_epoch, epochs))
    dropped = sum(len(r) for _, r in unused(per_epoch, num_vws, epochs, start_epoch, start_index))
    return todo - dropped, dropped


def too_few(per_epoch: int, num_vws: int, nm: int) -> str:
    """The one-line refusal of an epoch with fewer minibatches than VWs (a VW would train nothing)."""
    return (f"hetpipe: the data has {per_epoch} minibatch(es) per epoch, fewer than the {num_vws} virtual workers, "
            f"each of which trains an equal share of an epoch (a wave is nm={nm} minibatches per VW, "
            f"{num_vws * nm} in all): give an epoch at least {num_vws} minibatches (a multiple of {num_vws * nm} "
            "for whole waves)")


def which(left: List[Tuple[int, range]]) -> str:
    """``left`` (:func:`unused`) in words, epochs with the same minibatches together: ``minibatch 39 of
    epoch 0; minibatches 38..39 of epochs 1..3``."""
    groups: List[Tuple[List[int], range]] = []
    for epoch, r in left:
        if groups and groups[-1][1] == r and groups[-1][0][-1] == epoch - 1:
            groups[-1][0].append(epoch)
        else:
            groups.append(([epoch], r))
    words = []
    for epochs, r in groups:
        mbs = f"minibatch {r.start}" if len(r) == 1 else f"minibatches {r.start}..{r.stop - 1}"
        eps = f"epoch {epochs[0]}" if len(epochs) == 1 else f"epochs {epochs[0]}..{epochs[-1]}"
        words.append(f"{mbs} of {eps}")
    return "; ".join(words)


def dropped_note(per_epoch: int, num_vws: int, nm: int, epochs: int, start_epoch: int = 0, start_index: int = 0
                 ) -> Optional[str]:
    """One line saying which minibatches a run leaves unused and what to change (None: it trains them
    all). Each VW trains the same number of an epoch's minibatches, ``per_epoch // num_vws`` (in waves
    of ``nm``; the run's last wave may be short), so an epoch's minibatches beyond a multiple of
    ``num_vws`` are dropped; a resumed run deals the rest of the epoch it resumed in from its cut, and
    drops fewer than ``num_vws`` of it. A resumed run's line names each minibatch it drops."""
    trained, dropped = dealt(per_epoch, num_vws, epochs, start_epoch, start_index)
    if not dropped:
        return None
    if (start_epoch, start_index) == (0, 0):
        return (f"hetpipe: the data has {per_epoch} minibatches per epoch; of the {trained + dropped} this run has "
                f"to train, {trained} are trained and {dropped} dropped: each of the {num_vws} virtual "
                f"workers trains the same number of an epoch's minibatches (in waves of nm={nm} per VW), so those "
                f"beyond a multiple of {num_vws} go unused; give an epoch a multiple of {num_vws} minibatches "
                f"(of {num_vws * nm} for whole waves)")
    left = which(unused(per_epoch, num_vws, epochs, start_epoch, start_index))
    return (f"hetpipe: the data has {per_epoch} minibatches per epoch; of the {trained + dropped} this run has to "
            f"train from minibatch {start_index} of epoch {start_epoch}, {trained} are trained and {dropped} dropped "
            f"({left}): each of the {num_vws} virtual workers trains the same number of an epoch's minibatches (in "
            f"waves of nm={nm} per VW; in the epoch resumed, of those from minibatch {start_index}), so those "
            f"beyond a multiple of {num_vws} go unused; give an epoch a multiple of {num_vws} minibatches "
            f"(of {num_vws * nm} for whole waves)")


def vw_epochs(per_epoch: int, num_vws: int, vw: int, epochs: int, start_epoch: int, start_index: int
              ) -> List[Tuple[int, range]]:
    """Per epoch from ``start_epoch`` on, the global minibatch indices VW ``vw`` trains in it (the first
    epoch from ``start_index``); a ValueError now when an epoch has fewer minibatches than VWs."""
    if per_epoch // num_vws == 0:
        raise ValueError(f"hetpipe: one epoch has {per_epoch} minibatch(es), fewer than the {num_vws} virtual workers")
    return [(epoch, epoch_range(per_epoch, num_vws, vw, start_index if epoch == start_epoch else 0))
            for epoch in range(start_epoch, epochs)]


class VWStream:
    """An iterator over one VW's minibatches which, for the start-up data check
    (:mod:`hetpipe.loader.check`), keeps a digest of the first :data:`CHECKED` it yielded, by
    ``(epoch, global minibatch index)``: of their sample indices where the source has them, else of
    their labels (labels, not inputs: a random augmentation of inputs is no mismatch)."""

    def __init__(self, items: Callable[["VWStream"], Iterator[Any]]) -> None:
        self.digests: Dict[Tuple[int, int], str] = {}
        self._peeked: List[Any] = []
        self._items = items(self)

    def note(self, epoch: int, index: int, what: Any) -> None:
        """Record the digest of global minibatch ``index`` of ``epoch`` (while fewer than CHECKED are)."""
        if len(self.digests) < CHECKED:
            self.digests[(epoch, index)] = digest(what)

    def peek(self, k: int) -> List[Any]:
        """The first ``k`` items (fewer if the stream is shorter), read ahead and yielded later in order."""
        while len(self._peeked) < k:
            try:
                self._peeked.append(next(self._items))
            except StopIteration:
                break
        return self._peeked[:k]

    def __iter__(self) -> "VWStream":
        return self

    def __next__(self) -> Any:
        if self._peeked:
            return self._peeked.pop(0)
        return next(self._items)


def as_pair(batch: Any) -> Tuple[Any, Any]:
    """A minibatch as ``(inputs, labels)``: a pair as it is, or a Hugging Face-style mapping whose
    ``"labels"`` entry is the labels and whose other entries are the inputs (a dict, as the model's
    ``forward(**inputs)`` takes them)."""
    if isinstance(batch, Mapping):
        if "labels" not in batch:
            raise ValueError(f"hetpipe: a minibatch given as a mapping needs a 'labels' entry; it has {sorted(batch)}")
        return {k: v for k, v in batch.items() if k != "labels"}, batch["labels"]
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise ValueError(f"hetpipe: a minibatch must be an (inputs, labels) pair or a mapping with 'labels', got a "
                         f"{type(batch).__name__}" + (f" of {len(batch)} items" if isinstance(batch, (tuple, list))
                                                       else ""))
    return batch[0], batch[1]


def _field(batch: Any, part: str) -> Any:
    inputs, labels = as_pair(batch)
    if part == BOTH:
        return inputs, labels
    return inputs if part == INPUTS else labels


class DatasetSource(DataSource):
    """A map-style dataset of ``(inputs, label)`` samples, sharded by VW with a seeded sampler.

    batch_size: samples per minibatch. shuffle/seed: the epoch's order is ``DistributedSampler(dataset,
    num_replicas=1, rank=0, shuffle=shuffle, seed=seed)`` after ``set_epoch(epoch)``; the seed also
    seeds the loader workers (:func:`worker_seed`; the source takes no ``generator``). drop_last: a last
    minibatch of fewer than ``batch_size`` samples is dropped (False: it is the epoch's last).
    collate_fn / num_workers / pin_memory / pin_memory_device / timeout / worker_init_fn /
    multiprocessing_context / prefetch_factor / persistent_workers: as ``DataLoader``'s, for each VW's
    loader (with ``pin_memory``, labels read by index are pinned too). labels: per-sample labels the
    last stage reads without loading the samples (a tensor or sequence indexed like the dataset; a
    ``TensorDataset``'s last tensor by default); ``None`` on another dataset: the last stage loads the
    samples."""

    def __init__(self, dataset: Dataset, batch_size: int, *, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True, collate_fn: Optional[Callable] = None, num_workers: int = 0,
                 labels: Any = None, pin_memory: bool = False, pin_memory_device: str = "", timeout: float = 0,
                 worker_init_fn: Optional[Callable[[int], None]] = None, multiprocessing_context: Any = None,
                 prefetch_factor: Optional[int] = None, persistent_workers: bool = False) -> None:
        if isinstance(dataset, IterableDataset):
            raise TypeError("hetpipe: DatasetSource takes a map-style dataset; an IterableDataset goes to StreamSource")
        if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
            raise ArgumentError(f"hetpipe: batch_size must be a positive int, got {batch_size!r}")
        whole("DatasetSource(seed)", seed, 0)
        flag("DatasetSource(shuffle)", shuffle)
        flag("DatasetSource(drop_last)", drop_last)
        self.loader_settings = _loader_settings(dataset, num_workers, dict(
            pin_memory=pin_memory, pin_memory_device=pin_memory_device, timeout=timeout,
            worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
            prefetch_factor=prefetch_factor, persistent_workers=persistent_workers))
        self.dataset, self.batch_size = dataset, batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, int(seed), drop_last
        self.collate_fn, self.num_workers = collate_fn, num_workers
        self._pin_labels = pin_memory and _pins()
        self.size = len(dataset)  # type: ignore[arg-type]
        if labels is None and isinstance(dataset, TensorDataset):
            labels = dataset.tensors[-1]
        if labels is not None and len(labels) != self.size:
            raise ValueError(f"hetpipe: labels= holds {len(labels)} labels for a dataset of {self.size} samples")
        self.labels = labels

    def minibatches_per_epoch(self, num_vws: int = 1) -> int:
        full, rest = divmod(self.size, self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def order(self, epoch: int) -> torch.Tensor:
        """The epoch's sample order (DistributedSampler's, one replica)."""
        if self.shuffle:
            g = torch.Generator()
            g.manual_seed(self.seed + epoch)
            return torch.randperm(self.size, generator=g)
        return torch.arange(self.size)

    def indices(self, epoch: int, minibatches: Iterable[int]) -> List[List[int]]:
        order = self.order(epoch)
        return [order[i * self.batch_size:(i + 1) * self.batch_size].tolist() for i in minibatches]

    def _loader(self) -> DataLoader:
        """A loader over the dataset with this source's settings; :meth:`_read` points it at an epoch."""
        kw = {} if self.collate_fn is None else {"collate_fn": self.collate_fn}
        return DataLoader(self.dataset, batch_sampler=_Minibatches(), generator=torch.Generator(),
                          **self.loader_settings, **kw)

    def _read(self, loader: DataLoader, epoch: int, vw: int, batches: List[List[int]]) -> DataLoader:
        """``loader`` set to load ``batches`` of epoch ``epoch``, VW ``vw``, at its next pass."""
        loader.batch_sampler.batches = batches  # type: ignore[union-attr]
        loader.generator.manual_seed(worker_seed(self.seed, epoch, vw))
        return loader

    def sample(self) -> Any:
        if self.minibatches_per_epoch() == 0:
            raise ValueError(f"hetpipe: the dataset of {self.size} samples yields no minibatch of {self.batch_size}")
        return as_pair(next(iter(self._read(self._loader(), 0, 0, self.indices(0, [0])))))

    def _labels_of(self, idx: List[int]) -> torch.Tensor:
        if isinstance(self.labels, torch.Tensor):
            labels = self.labels[torch.as_tensor(idx, dtype=torch.long)]
        else:
            labels = torch.as_tensor([self.labels[i] for i in idx])
        return labels.pin_memory() if self._pin_labels else labels

    def vw_stream(self, vw: int, num_vws: int, epochs: int, start_epoch: int = 0, start_index: int = 0,
                  part: str = BOTH) -> VWStream:
        shares = vw_epochs(self.minibatches_per_epoch(), num_vws, vw, epochs, start_epoch, start_index)

        def items(stream: VWStream) -> Iterator[Any]:
            loader: Optional[DataLoader] = None     # one for all epochs, built when first needed
            for epoch, mine in shares:
                batches = self.indices(epoch, mine)
                for i, idx in zip(mine, batches):
                    stream.note(epoch, i, torch.tensor(idx))
                if part == LABELS and self.labels is not None:
                    yield from (self._labels_of(idx) for idx in batches)
                elif batches:
                    loader = self._loader() if loader is None else loader
                    yield from (_field(b, part) for b in self._read(loader, epoch, vw, batches))

        return VWStream(items)

    def identity(self) -> Optional[str]:
        return (f"a dataset of {self.size} samples, minibatches of {self.batch_size}, "
                f"{'shuffled with seed ' + str(self.seed) if self.shuffle else 'in order'}")


def _set_epoch(data: Any, epoch: int) -> None:
    if hasattr(data, "set_epoch"):
        data.set_epoch(epoch)


class StreamSource(DataSource):
    """An ``IterableDataset`` of samples (batched here: ``batch_size``, full minibatches only) or a
    re-iterable of ``(inputs, labels)`` minibatches (``batch_size`` None: read as it yields them).

    collate_fn / num_workers / pin_memory / pin_memory_device / timeout / worker_init_fn /
    multiprocessing_context / prefetch_factor / persistent_workers: as ``DataLoader``'s, for the loader
    batching the samples (refused without ``batch_size``: set them on the iterable's own loader). seed:
    seeds that loader's workers (:func:`worker_seed`, the same on every VW: each reading rank iterates
    the whole epoch). ``persistent_workers`` is refused for data with ``set_epoch``: the workers keep
    the copy of the dataset they started with, which the ``set_epoch`` called here would not reach."""

    def __init__(self, data: Iterable, batch_size: Optional[int] = None, *, collate_fn: Optional[Callable] = None,
                 num_workers: int = 0, seed: int = 0, pin_memory: bool = False, pin_memory_device: str = "",
                 timeout: float = 0, worker_init_fn: Optional[Callable[[int], None]] = None,
                 multiprocessing_context: Any = None, prefetch_factor: Optional[int] = None,
                 persistent_workers: bool = False) -> None:
        if isinstance(data, IterableDataset) and batch_size is None:
            raise ValueError("hetpipe: an IterableDataset needs batch_size= (samples per minibatch)")
        if batch_size is not None:
            whole("StreamSource(batch_size)", batch_size)
        whole("StreamSource(seed)", seed, 0)
        settings = dict(pin_memory=pin_memory, pin_memory_device=pin_memory_device, timeout=timeout,
                        worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
                        prefetch_factor=prefetch_factor, persistent_workers=persistent_workers)
        if batch_size is None:
            given = [k for k, v in {"collate_fn": collate_fn, "num_workers": num_workers, **settings}.items()
                     if v != {"collate_fn": None, "num_workers": 0, **LOADER_SETTINGS}[k]]
            if given:
                raise ValueError(f"hetpipe: StreamSource without batch_size= reads the minibatches as the iterable "
                                 f"yields them, so {', '.join(given)} would do nothing: set them on the loader "
                                 f"that yields them")
            self.loader_settings: Dict[str, Any] = {}
        else:
            self.loader_settings = _loader_settings(data, num_workers, settings)
        if persistent_workers and hasattr(data, "set_epoch"):
            raise ValueError("hetpipe: StreamSource(persistent_workers=True) over data with set_epoch: the workers "
                             "would keep reading the first epoch's copy of the dataset; drop persistent_workers")
        self.data, self.batch_size = data, batch_size
        self.collate_fn, self.num_workers, self.seed = collate_fn, num_workers, int(seed)
        self._per_epoch: Optional[int] = None

    def _loader(self) -> Iterable:
        """What a pass reads: the data itself, or (``batch_size`` set) a loader batching it with this
        source's settings, which :meth:`_epoch` points at an epoch."""
        if self.batch_size is None:
            return self.data
        kw = {} if self.collate_fn is None else {"collate_fn": self.collate_fn}
        return DataLoader(self.data, batch_size=self.batch_size, drop_last=True, generator=torch.Generator(),
                          **self.loader_settings, **kw)

    def _epoch(self, epoch: int, loader: Optional[Iterable] = None) -> Iterable:
        """``loader`` (a new one when None) set to read epoch ``epoch`` at its next pass."""
        loader = self._loader() if loader is None else loader
        _set_epoch(self.data, epoch)
        if self.batch_size is not None:
            loader.generator.manual_seed(worker_seed(self.seed, epoch))  # type: ignore[attr-defined]
        return loader

    def minibatches_per_epoch(self, num_vws: int = 1) -> int:
        if self._per_epoch is None:
            try:
                self._per_epoch = len(self._epoch(0))  # type: ignore[arg-type]
            except TypeError:
                self._per_epoch = sum(1 for _ in self._epoch(0))
        return self._per_epoch

    def sample(self) -> Any:
        for batch in self._epoch(0):
            return as_pair(batch)
        raise ValueError("hetpipe: the data yields no minibatch")

    def vw_stream(self, vw: int, num_vws: int, epochs: int, start_epoch: int = 0, start_index: int = 0,
                  part: str = BOTH) -> VWStream:
        shares = vw_epochs(self.minibatches_per_epoch(), num_vws, vw, epochs, start_epoch, start_index)

        def items(stream: VWStream) -> Iterator[Any]:
            loader = self._loader()     # one for all epochs
            for epoch, mine in shares:
                if not mine:
                    continue
                wanted = iter(mine)
                nxt = next(wanted)
                for i, batch in enumerate(self._epoch(epoch, loader)):
                    if i == nxt:
                        stream.note(epoch, i, _field(batch, LABELS))
                        yield _field(batch, part)
                        nxt = next(wanted, None)
                        if nxt is None:
                            break

        return VWStream(items)


class PerVWSource(DataSource):
    """A factory ``(vw, num_vws, epoch) -> iterable of (inputs, labels)`` minibatches of VW ``vw`` in that
    epoch; each VW takes as many as the shortest VW's iterable has (it must have ``len``)."""

    def __init__(self, factory: Callable[[int, int, int], Iterable]) -> None:
        if not callable(factory):
            raise TypeError(f"hetpipe: PerVWSource takes a callable (vw, num_vws, epoch) -> iterable, got {factory!r}")
        self.factory = factory

    def _per_vw(self, num_vws: int) -> int:
        lengths = []
        for v in range(num_vws):
            it = self.factory(v, num_vws, 0)
            try:
                lengths.append(len(it))  # type: ignore[arg-type]
            except TypeError:
                raise TypeError(f"hetpipe: the per-VW data factory's iterable for VW {v} has no len()") from None
        return min(lengths)

    def minibatches_per_epoch(self, num_vws: int = 1) -> int:
        return self._per_vw(num_vws) * num_vws

    def sample(self) -> Any:
        for batch in self.factory(0, 1, 0):
            return as_pair(batch)
        raise ValueError("hetpipe: the per-VW data factory yields no minibatch for VW 0")

    def vw_stream(self, vw: int, num_vws: int, epochs: int, start_epoch: int = 0, start_index: int = 0,
                  part: str = BOTH) -> VWStream:
        shares = vw_epochs(self.minibatches_per_epoch(num_vws), num_vws, vw, epochs, start_epoch, start_index)

        def items(stream: VWStream) -> Iterator[Any]:
            for epoch, mine in shares:
                skip = mine.start // num_vws
                own = itertools.islice(self.factory(vw, num_vws, epoch), skip, skip + len(mine))
                for i, batch in zip(mine, own):
                    stream.note(epoch, i, _field(batch, LABELS))
                    yield _field(batch, part)

        return VWStream(items)


def as_source(data: Any, seed: int = 0) -> DataSource:
    """The :class:`DataSource` for what a user hands the Trainer (see the module docstring).

    A ``DataLoader``'s settings carry over (to the rebuilt :class:`DatasetSource`, or as the loader
    itself when it stays a stream), except two, refused with a ValueError naming them:
    ``in_order=False`` with workers (minibatches would come out as workers finish them, in an order
    that differs between ranks), and, on a loader rebuilt as a :class:`DatasetSource`, a ``generator``
    (the DataLoader's or its ``RandomSampler``'s): the order is dealt from the Trainer's ``seed`` so
    that every rank computes the same one whatever it read before, and the workers are seeded from it
    too; a generator's state may differ between ranks (and the order needs one seed, not two)."""
    if isinstance(data, DataSource):
        return data
    if isinstance(data, DataLoader):
        return _from_loader(data, seed)
    if isinstance(data, Dataset) and not isinstance(data, IterableDataset):
        raise TypeError("hetpipe: a Dataset needs a batch size: pass hetpipe.DatasetSource(dataset, batch_size, ...) "
                        "or a DataLoader over it")
    if isinstance(data, IterableDataset):
        raise TypeError("hetpipe: an IterableDataset needs a batch size: pass hetpipe.StreamSource(dataset, "
                        "batch_size, ...) or a DataLoader over it")
    if callable(data) and not hasattr(data, "__iter__"):
        return PerVWSource(data)
    if not hasattr(data, "__iter__"):
        raise TypeError(f"hetpipe: data must be a DataSource, a DataLoader, a per-VW factory or an iterable of "
                        f"(inputs, labels) minibatches, got {type(data).__name__}")
    return StreamSource(data)


def _from_loader(loader: DataLoader, seed: int) -> DataSource:
    """A DataLoader over a map-style dataset with a sequential or random sampler: the same data as a
    seeded :class:`DatasetSource` with the loader's settings; any other DataLoader (an IterableDataset,
    a custom sampler) is a stream whose order the start-up check verifies (see :func:`as_source`)."""
    if not getattr(loader, "in_order", True) and loader.num_workers > 0:
        raise ValueError("hetpipe: DataLoader(in_order=False) yields minibatches as its workers finish them, in an "
                         "order that differs between ranks; drop in_order=False")
    sampler = loader.sampler
    plain = (loader.batch_size is not None and isinstance(loader.batch_sampler, BatchSampler)
             and type(loader.batch_sampler) is BatchSampler
             and type(sampler) in (RandomSampler, SequentialSampler)
             and not isinstance(loader.dataset, IterableDataset))
    if plain and isinstance(sampler, RandomSampler) and (sampler.replacement or sampler._num_samples is not None):
        plain = False
    if not plain:
        return StreamSource(loader)
    for where, generator in (("DataLoader(generator=...)", loader.generator),
                             ("the DataLoader's RandomSampler(generator=...)", getattr(sampler, "generator", None))):
        if generator is not None:
            raise ValueError(f"hetpipe: {where} is refused: hetpipe deals the order from the Trainer's seed, the "
                             f"same on every rank, and seeds the loader workers from it; drop the generator and "
                             f"pass seed= to the Trainer")
    return DatasetSource(loader.dataset, loader.batch_size, shuffle=isinstance(sampler, RandomSampler), seed=seed,
                         drop_last=loader.drop_last, collate_fn=loader.collate_fn, num_workers=loader.num_workers,
                         **{k: getattr(loader, k) for k in LOADER_SETTINGS})
