"""What a schedule factory may size itself by: the run's shape, known once the plan is.

A factory ``lr_scheduler(optimizer, run)`` (two required positional parameters) is given the run's
:class:`RunShape` as ``run``; a factory of one parameter is called as before. Steps are counted as
``Numerics.lr_scheduler_steps`` counts them: the run's (all VWs together, as one process training on
all the data takes them) or one VW's.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class RunShape:
    """num_vws: the plan's virtual workers. minibatches_per_epoch: what the data holds per epoch;
    trained_per_epoch: what the run deals of them (a multiple of ``num_vws``: docs/training.md, "Data").
    epochs; accumulate: minibatches per optimizer step. counts: "run" or "vw", what the scheduler's
    steps count (``Numerics.lr_scheduler_steps``)."""

    num_vws: int
    minibatches_per_epoch: int
    trained_per_epoch: int
    epochs: int
    accumulate: int = 1
    counts: str = "run"

    @property
    def total_steps(self) -> int:
        """The scheduler's steps over the whole run (what ``num_training_steps`` wants): each VW steps once
        per ``accumulate`` of the minibatches it trains (its stream runs on across epochs), and with
        "run" each VW's scheduler steps once for every VW's step."""
        vw_steps = self.trained_per_epoch // self.num_vws * self.epochs // self.accumulate
        return vw_steps * self.num_vws if self.counts == "run" else vw_steps

    @property
    def steps_per_epoch(self) -> int:
        """``total_steps`` per epoch, rounded down (what a warm-up of "one epoch" wants)."""
        return self.total_steps // self.epochs


def takes_shape(factory: Callable) -> bool:
    """Whether ``factory`` requires a second positional parameter (the run's shape): one without a
    default, so that ``lambda opt, step=3: ...`` and ``partial(StepLR, step_size=3)`` keep their own."""
    try:
        params = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):
        return False
    required = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    return len(required) >= 2


def sized(factory: Optional[Callable], shape: RunShape) -> Optional[Callable]:
    """``factory`` as a factory of the optimizer alone: given ``shape`` when it takes one."""
    if factory is None or not takes_shape(factory):
        return factory

    def build(optimizer: Any) -> Any:
        return factory(optimizer, shape)

    return build
