"""A stage's data feed: per-VW deterministic shards of each epoch's minibatches, read by micro-batch.

Sharding contract: the user's data is an iterable of ``(inputs, labels)`` minibatches that yields the
same sequence on every rank (re-iterable; if it has ``set_epoch(e)`` it is called before epoch ``e``).
In every epoch, minibatch ``i`` goes to VW ``i % num_vws``; each VW takes ``len(data) // num_vws`` of
them, so all VWs run the same number of minibatches and the tail is dropped. Stage 0 reads the inputs,
the last stage the labels of the same minibatch.
"""

from __future__ import annotations

from typing import Any, Dict, Iterable, Iterator, Optional, Tuple

import torch
from torch.utils import _pytree as pytree

from hetpipe.model.tree import batch_of, halves
from hetpipe.schedule.ir import Schedule
from hetpipe.transport.codec import StageError


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


class MinibatchFeed:
    """Sequential access to this VW's minibatches by micro-batch: ``get(j)`` for the micro-batches of
    minibatches p = 0, 1, 2, ... in order.

    ``layout`` (a :class:`Schedule`) maps micro-batches to minibatches; with split start-up, the two
    halves of minibatch p carry its first ``ceil(n / 2)`` and its remaining ``floor(n / 2)`` samples,
    and ``share(j)`` is the fraction of p's samples micro-batch ``j`` carries (1 when unsplit). A
    minibatch may be any pytree of tensors (a dict of inputs): every leaf is halved on dim 0."""

    def __init__(self, source: Iterator[Any], layout: Optional[Schedule] = None) -> None:
        self.source = source
        self.layout = layout
        self.next_index = 0
        self._second: Any = None                        # the pending second half of a split minibatch
        self._shares: Dict[int, float] = {}

    def _next(self, p: int) -> Any:
        if p != self.next_index:
            raise StageError(f"hetpipe: minibatch {p} requested out of order (expected {self.next_index})")
        self.next_index += 1
        try:
            return next(self.source)
        except StopIteration:
            raise StageError(f"hetpipe: the data ran out at minibatch {p}") from None

    def get(self, mb: int) -> Any:
        if self.layout is None or self.layout.fraction_of(mb) == 1.0:
            p = self.layout.minibatch_of(mb) if self.layout is not None else mb
            return self._next(p)
        p = self.layout.minibatch_of(mb)
        if mb == self.layout.micros_of(p)[0]:
            whole = self._next(p)
            if batch_of(whole) < 2 or all(t.dim() == 0 for t in pytree.tree_leaves(whole)):
                raise StageError(f"hetpipe: minibatch {p} has fewer than 2 samples and cannot be split in halves")
            part, second = halves(whole)
            self._second = (second, batch_of(second) / batch_of(whole))
            self._shares[mb] = batch_of(part) / batch_of(whole)
            return part
        if self._second is None:
            raise StageError(f"hetpipe: the second half of minibatch {p} was requested before its first")
        (part, self._shares[mb]), self._second = self._second, None
        return part

    def share(self, mb: int) -> float:
        """The fraction of its minibatch's samples micro-batch ``mb`` carries (after ``get(mb)``)."""
        return self._shares.pop(mb, 1.0)
