"""Dynamic loss scaling for "fp16": one scale per VW, the same on every one of its stages.

The rule is ``torch.amp.GradScaler``'s: the last stage back-propagates ``loss * scale``; at each Apply
the VW's stages learn, through the gradient-norm shares they exchange (:mod:`hetpipe.stage.grad_norm`),
whether any gradient of the minibatch overflowed. If one did, every stage skips the step (the LR
scheduler still steps, as in PyTorch's recipe) and the scale is multiplied by ``backoff_factor``;
otherwise the gradients are multiplied by ``1 / scale`` and stepped, and after ``growth_interval``
steps in a row without overflow the scale grows by ``growth_factor``. Every stage sees the same
verdicts in minibatch order, so each stage's copy of this state is the same; the last stage checks
at each Apply that the scale it multiplied the loss by is the one the verdicts give
(:class:`LossScaleVerdict`, the executor's side).
Thread role: the stage's executor thread.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from hetpipe.transport.protocol import StageError

TINY = 2.0 ** -24           # the smallest float16 subnormal: a scale below it cannot make any gradient finite


@dataclass
class LossScale:
    init_scale: float = 2.0 ** 16
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    growth_interval: int = 2000
    scale: float = field(init=False)
    good_steps: int = field(init=False, default=0)
    skipped: List[int] = field(init=False, default_factory=list)     # minibatches whose step was skipped

    def __post_init__(self) -> None:
        if not (self.init_scale > 0 and self.growth_factor > 1 and 0 < self.backoff_factor < 1
                and isinstance(self.growth_interval, int) and self.growth_interval >= 1):
            raise ValueError(f"hetpipe: loss_scale needs init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 "
                             f"and an int growth_interval >= 1, got {self.options()}")
        self.scale = float(self.init_scale)

    def options(self) -> Dict[str, Any]:
        return {"init_scale": self.init_scale, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval}

    def update(self, p: int, finite: bool) -> None:
        """The verdict of minibatch ``p``."""
        if finite:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale *= self.growth_factor
                self.good_steps = 0
        else:
            self.skipped.append(p)
            self.scale *= self.backoff_factor
            self.good_steps = 0

    def state(self) -> Dict[str, Any]:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": len(self.skipped)}

    def load(self, state: Dict[str, Any]) -> None:
        self.scale, self.good_steps = float(state["scale"]), int(state["good_steps"])


class LossScaleVerdict:
    """A stage's verdicts on its VW's loss scale ``scale``, applied to ``model`` (a
    :class:`~hetpipe.stage.params.StageModel`); ``ctx`` names the stage (a ``StageContext``)."""

    def __init__(self, scale: LossScale, model: Any, ctx: Any) -> None:
        self.scale, self.model, self.ctx = scale, model, ctx
        self._scaled_by: Dict[int, float] = {}     # last stage: minibatch -> the scale its loss was multiplied by

    def scaled(self, p: int) -> float:
        """The scale the last stage multiplies minibatch ``p``'s loss by (checked at its verdict)."""
        self._scaled_by[p] = self.scale.scale
        return self.scale.scale

    def verdict(self, p: int, wave: int, norm: float) -> Optional[float]:
        """Minibatch ``p``'s verdict from the VW's (scaled) gradient norm. Overflow: the step of ``wave``
        is skipped (None); else the gradients are unscaled and the scale they had is returned. Either
        way the scale then follows GradScaler's rule."""
        scale = self.scale.scale
        used = self._scaled_by.pop(p, scale)
        if used != scale:
            raise StageError(f"hetpipe: {self.ctx.who()}: minibatch {p}'s loss was scaled by {used}, but the VW's "
                             f"verdicts give {scale}")
        finite = math.isfinite(norm)
        self.scale.update(p, finite)
        if finite:
            self.model.scale_grads(1.0 / scale)
            return scale
        self.model.skip_step(wave)
        if self.scale.scale < TINY:
            raise StageError(f"hetpipe: {self.ctx.who()}: VW {self.ctx.vw}'s gradients overflowed at every loss "
                             f"scale down to {self.scale.scale} (minibatch {p}, wave {wave}, "
                             f"{len(self.scale.skipped)} steps skipped): the model diverged, not only fp16's range")
        return None
