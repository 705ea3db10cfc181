"""Data a user hands the Trainer: in-memory minibatches (Batches) and the demo's digits set."""

from __future__ import annotations

from typing import Iterator, Optional, Tuple

import torch

from hetpipe.util.arguments import flag
from hetpipe.util.errors import ArgumentError
from hetpipe.util.numbers import whole


class Batches:
    """Minibatches of in-memory tensors, reshuffled each epoch with a seed (identical on every rank).

    x, y: tensors of one row per sample, as many of each; batch_size: a whole number >= 1 (an epoch
    is the full minibatches); seed: a whole number >= 0. A bad argument is refused here, naming it."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, *, shuffle: bool = True,
                 seed: int = 0) -> None:
        for name, t in (("x", x), ("y", y)):
            if not isinstance(t, torch.Tensor) or t.dim() < 1:
                got = "a 0-d tensor" if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"
                raise ArgumentError(f"hetpipe: Batches({name}) must be a tensor with one row per sample, got {got}")
        if len(x) != len(y):
            raise ArgumentError(f"hetpipe: Batches got {len(x)} inputs (x) but {len(y)} labels (y)")
        whole("Batches(batch_size)", batch_size)
        flag("Batches(shuffle)", shuffle)
        whole("Batches(seed)", seed, 0)
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
