"""Dynamic loss scaling for "fp16": one scale per VW, the same on every one of its stages.

The rule is ``torch.amp.GradScaler``'s: the last stage back-propagates ``loss * scale``; at each Apply
the VW's stages learn, through the gradient-norm shares they exchange (:mod:`hetpipe.stage.grad_norm`),
whether any gradient of the minibatch overflowed. If one did, every stage skips the step (the LR
scheduler still steps, as in PyTorch's recipe) and the scale is multiplied by ``backoff_factor``;
otherwise the gradients are multiplied by ``1 / scale`` and stepped, and after ``growth_interval``
steps in a row without overflow the scale grows by ``growth_factor``. Every stage sees the same
verdicts in minibatch order, so each stage's copy of this state is the same; the last stage checks
at each Apply that the scale it multiplied the loss by is the one the verdicts give.
Thread role: the stage's executor thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List

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
