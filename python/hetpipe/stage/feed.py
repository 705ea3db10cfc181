"""A stage's data feed: its VW's minibatches (inputs or labels, from :mod:`hetpipe.loader`), read by
micro-batch."""

from __future__ import annotations

from typing import Any, Dict, Iterator, Optional

from torch.utils import _pytree as pytree

from hetpipe.model.tree import batch_of, halves
from hetpipe.schedule.ir import Schedule
from hetpipe.transport.protocol import StageError


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
