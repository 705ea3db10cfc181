"""Data for virtual workers: per-VW deterministic shards of each epoch's minibatches, and a digits set.

Sharding contract: the user's data is an iterable of ``(inputs, labels)`` minibatches that yields the
same sequence on every rank (re-iterable; if it has ``set_epoch(e)`` it is called before epoch ``e``).
In every epoch, minibatch ``i`` goes to VW ``i % num_vws``; each VW takes ``len(data) // num_vws`` of
them, so all VWs run the same number of minibatches and the tail is dropped. Stage 0 reads the inputs,
the last stage the labels of the same minibatch.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Optional, Tuple

import torch


def minibatches_per_epoch(data: Iterable) -> int:
    """Number of minibatches one epoch of ``data`` yields (``len`` if it has one, else by counting)."""
    try:
        return len(data)  # type: ignore[arg-type]
    except TypeError:
        if hasattr(data, "set_epoch"):
            data.set_epoch(0)
        return sum(1 for _ in data)


def first_minibatch(data: Iterable) -> Tuple[torch.Tensor, torch.Tensor]:
    if hasattr(data, "set_epoch"):
        data.set_epoch(0)
    for batch in data:
        return batch
    raise ValueError("hetpipe: the data yields no minibatch")


def vw_minibatches(data: Iterable, vw: int, num_vws: int, epochs: int, start_epoch: int = 0,
                   start_index: int = 0) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
    """VW ``vw``'s share of ``epochs`` epochs of ``data``, in order (see the module docstring).

    A resumed run starts at minibatch ``start_index`` of epoch ``start_epoch``: the rest of that epoch
    (up to the usual tail) is dealt round-robin from there, each VW taking as many; later epochs as usual."""
    per_vw = minibatches_per_epoch(data) // num_vws
    if per_vw == 0:
        raise ValueError(f"hetpipe: one epoch has fewer minibatches than the {num_vws} virtual workers")
    for epoch in range(start_epoch, epochs):
        if hasattr(data, "set_epoch"):
            data.set_epoch(epoch)
        first = start_index if epoch == start_epoch else 0
        end = first + (per_vw * num_vws - first) // num_vws * num_vws
        for i, batch in enumerate(data):
            if i >= end:
                break
            if i >= first and (i - first) % num_vws == vw:
                yield batch


def select(it: Iterator[Tuple[torch.Tensor, torch.Tensor]], field: int) -> Iterator[torch.Tensor]:
    """The inputs (``field = 0``) or labels (``field = 1``) of a minibatch stream."""
    for batch in it:
        yield batch[field]


class Batches:
    """Minibatches of in-memory tensors, reshuffled each epoch with a seed (identical on every rank)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, *, shuffle: bool = True,
                 seed: int = 0) -> None:
        if len(x) != len(y):
            raise ValueError(f"Batches: {len(x)} inputs but {len(y)} labels")
        self.x, self.y, self.batch_size = x, y, batch_size
        self.shuffle, self.seed = shuffle, seed
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.x) // self.batch_size

    def __iter__(self) -> Iterator[Tuple[torch.Tensor, torch.Tensor]]:
        n = len(self) * self.batch_size
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(len(self.x), generator=g)[:n]
        else:
            order = torch.arange(n)
        for i in range(0, n, self.batch_size):
            idx = order[i:i + self.batch_size]
            yield self.x[idx], self.y[idx]


def digits(test_fraction: float = 0.25, seed: int = 0,
           dtype: Optional[torch.dtype] = torch.float32
           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """scikit-learn's 8x8 digits (bundled, no download): standardised ``x_train, y_train, x_test, y_test``."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x_tr, x_te, y_tr, y_te = train_test_split(data.data, data.target, test_size=test_fraction,
                                              random_state=seed, stratify=data.target)
    mean, std = x_tr.mean(axis=0), x_tr.std(axis=0) + 1e-6
    to_x = lambda a: torch.tensor((a - mean) / std, dtype=dtype)  # noqa: E731
    return to_x(x_tr), torch.tensor(y_tr), to_x(x_te), torch.tensor(y_te)
